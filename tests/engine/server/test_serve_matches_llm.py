"""`stallfree serve` and `LLM()` give the same greedy tokens for the same model and prompt by default: both
resolve `auto` (device, dtype, quantization) through stallfree.engine.placement. A real `stallfree serve`
process on the bundled model, with no model flags, answers over HTTP; the offline API runs in this process
with no arguments. The prompt is one on which the exact fp32 engine answers differently, so an offline API
that drifted back to another default would be caught.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from stallfree.engine import LLM, SamplingParams
from stallfree.ports import free_port

PROMPT = "Write a haiku about the sea."
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server_url():
    """`stallfree serve` with its defaults (a small KV cache, which changes no numbers, to spare memory)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "stallfree", "serve", "--port", str(port), "--num-kv-blocks", "64",
         "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        else:
            pytest.fail("stallfree serve did not become ready in 180 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _greedy(llm: LLM) -> tuple[str, int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    return out.text, len(out.token_ids)


@pytest.mark.slow
def test_serve_and_llm_give_the_same_greedy_tokens_by_default(server_url, default_model):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    served = (r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"])

    llm = LLM()
    placement = llm.engine.placement
    assert (str(placement.dtype), placement.quantization) == ("torch.bfloat16", "int4")
    assert _greedy(llm) == served
    del llm
    # Sharpness: the exact fp32 engine (the offline API's former CPU default) answers otherwise here.
    fp32 = _greedy(LLM(loaded_model=default_model))
    assert fp32 != served, "the prompt no longer tells the two defaults apart: pick another"
