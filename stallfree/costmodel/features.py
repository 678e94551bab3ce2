"""An iteration's features, the terms the cost model is linear in:

    T = a + b * prefill_tokens + c * decode_tokens + d * prefill_attn + e * decode_attn + f * prefill_chunks

  prefill_tokens   tokens of prefill chunks in the batch (the linear layers' work)
  decode_tokens    running decodes (one token each; includes sampling one token)
  prefill_attn     query-key pairs of the prefill chunks: sum over chunks of n * (start + (n + 1) / 2)
  decode_attn      key positions the decodes attend to as the CPU engine does: each decode's history through
                   the cpu backend's paged kernel, or, for iterations too big for it, padding included (the
                   groups pad to their longest history; stallfree.engine.decode_groups)
  prefill_chunks   number of prefill chunks (per-chunk attention calls and metadata)

Two more terms for GPU fits (not in FEATURES, so CPU profiles fit as before):

  decode_kv              key positions the decodes attend to, no padding: the CUDA paged decode kernel reads
                         each decode's own history (decode_attn counts the torch backend's padding)
  gemm_tokens_over_knee  max(0, prefill_tokens + decode_tokens - knee), derived by the model from the two
                         token counts (`gemm_excess`): a GEMM reads every weight however few rows it
                         multiplies, so below the knee (the GPU's ridge point) extra rows cost ~nothing and
                         past it each row costs its FLOPs; the constant term carries the weight read

Three ways to get them: `iteration_features` from the scheduler's chunks (what ran: the profiler and the
simulator), `synthetic_features` for one hypothetical chunk at a known offset (tune), and
`planning_features` for the controller's aggregate view (token counts and a mean context).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from stallfree.engine.decode_groups import attended_decode_area

FEATURES = ("const", "prefill_tokens", "decode_tokens", "prefill_attn", "decode_attn", "prefill_chunks")
DECODE_KV = "decode_kv"
GEMM_EXCESS = "gemm_tokens_over_knee"


def iteration_features(chunks: Iterable) -> dict[str, float]:
    """Features of one iteration from the scheduler's chunks (anything with num_tokens, start, is_decode)."""
    decode_lens: list[int] = []
    prefill: list[tuple[int, int]] = []
    for c in chunks:
        if c.is_decode:
            decode_lens.append(c.start + 1)
        else:
            prefill.append((c.num_tokens, c.start))
    f = decode_features(decode_lens)
    for n, start in prefill:
        add_chunk(f, n, start)
    return f


def decode_features(decode_lens: Sequence[int]) -> dict[str, float]:
    """Features of an iteration of decodes only (each decode's history length, its new token included):
    where the scheduler starts before it sizes prefill chunks."""
    f = dict.fromkeys(FEATURES, 0.0)
    f["const"] = 1.0
    f["decode_tokens"] = float(len(decode_lens))
    f["decode_attn"] = float(attended_decode_area(decode_lens))
    f[DECODE_KV] = float(sum(decode_lens))
    return f


def add_chunk(features: dict[str, float], n: int, start: int) -> None:
    """Add a prefill chunk of `n` tokens after `start` computed ones to `features` (in place)."""
    if n <= 0:
        return
    features["prefill_tokens"] += n
    features["prefill_attn"] += n * (start + (n + 1) / 2)
    features["prefill_chunks"] += 1


def gemm_excess(features: dict[str, float], knee: float) -> float:
    """Rows the iteration's GEMMs multiply past `knee` (see the module docstring)."""
    rows = features.get("prefill_tokens", 0.0) + features.get("decode_tokens", 0.0)
    return max(0.0, rows - knee)


def synthetic_features(
    prefill_tokens: int, decode_tokens: int, prefill_context: int = 0, decode_context: int = 0
) -> dict[str, float]:
    """Features of a hypothetical iteration: one prefill chunk at `prefill_context`, decodes at
    `decode_context` (for tuning and planning)."""
    n = prefill_tokens
    decode_area = float(decode_tokens * (decode_context + 1)) if decode_tokens else 0.0
    return {
        "const": 1.0,
        "prefill_tokens": float(n),
        "decode_tokens": float(decode_tokens),
        "prefill_attn": n * (prefill_context + (n + 1) / 2) if n else 0.0,
        "decode_attn": decode_area,
        DECODE_KV: decode_area,
        "prefill_chunks": 1.0 if n else 0.0,
    }


def prefill_context(p: float, context: float, prompt_end: float | None) -> float:
    """Mean tokens a prefill token attends to: half the prompt on average over a prompt of `context`
    tokens; for the last `p` tokens of a `prompt_end`-token prompt, prompt_end - (p - 1)/2, as the profiler
    counts them (several whole prompts when the chunk is longer than one)."""
    if prompt_end is None:
        return context / 2
    end = max(prompt_end, 0.0)
    return end - (min(p, end) - 1) / 2


def planning_features(
    p: float, d: float, context: float, prompt_end: float | None = None
) -> dict[str, float]:
    """Features of an iteration the controller plans: `p` prefill and `d` decode tokens (non-negative) at a
    mean context of `context` tokens.

    Decodes attend over `context` tokens each. A prefill token attends, on average over its prompt, to half
    the prompt before it, whatever the chunking (a prompt of P tokens costs P^2/2 query-key pairs in one
    chunk or in many), so prefill attention is charged at context/2 per token. Treating a budget-sized
    chunk as one prompt starting at 0 instead would charge budget/2 per token and make budgets larger
    than the prompts look slower than they are. With `prompt_end`, the prefill tokens are the last chunk of
    a prompt that long (its slowest chunk)."""
    return {
        "const": 1.0,
        "prefill_tokens": p,
        "prefill_attn": p * prefill_context(p, context, prompt_end),
        "prefill_chunks": 1.0 if p > 0 else 0.0,
        "decode_tokens": d,
        "decode_attn": d * (context + 1) if d > 0 else 0.0,
        DECODE_KV: d * (context + 1) if d > 0 else 0.0,
    }
