"""Kernel tests run the compiled kernels on CUDA, and Triton's interpreter on CPU tensors elsewhere.

NOTE: TRITON_INTERPRET must be set before the kernels are decorated. fused.py decorates them at their first
launch, so setting it here (at collection, before any test runs) is early enough.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _interpreter_rounds_bf16_to_nearest_even():
    """Make the interpreter round fp32 -> bf16 to nearest even, as compiled kernels (and torch) do.

    Triton's interpreter (3.9) truncates toward zero on `.to(tl.bfloat16)` (`_convert_float` with no
    rounding mode), one bf16 ulp off the GPU. Without this the CPU tests could only check bf16 within a few
    ulps, not the one rounding the kernels promise.
    """
    if not INTERPRETED:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            fp32 = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return fp32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_convert_float", convert_float)
        yield
