"""The stallfree serving engine: Sarathi-style stall-free batching on a paged KV cache.

from stallfree.engine import LLM, SamplingParams
llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stallfree.engine.llm import LLM
    from stallfree.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import stallfree.engine.scheduler` never pulls in torch.
    if name == "LLM":
        from stallfree.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from stallfree.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
