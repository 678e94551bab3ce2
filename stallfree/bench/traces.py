"""Request-length traces: loading, CPU scaling, clipping to the model context, seeded sampling, arrivals.

A trace is a CSV of per-request token counts (`num_prefill_tokens,num_decode_tokens,...`), optionally with
arrival times (`arrived_at` or `arrival_time`, seconds). The named traces ship with the project in
`data/traces/` (SOURCES.md there says where each came from); an installed wheel carries them as
`stallfree/traces/`. STALLFREE_TRACES names another folder.

On a CPU the lengths are multiplied by `scale` (e.g. 1/8) so the distribution keeps its shape, then clipped
so prompt + output fits the model context. Every report states the scale and how many requests were clipped.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from stallfree.bench.sharing import Sharing

TRACE_FILES = {
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
}
ARRIVAL_COLUMNS = ("arrived_at", "arrival_time")
# Token ids used for synthetic prompts: inside every common vocabulary (Llama-2: 32000), away from the
# special tokens at the bottom.
PROMPT_ID_RANGE = (1000, 30000)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay: its lengths after scaling and clipping, and when it arrives (seconds).
    `traffic_cluster`, when set, is sent as this request's x-traffic-cluster header (mixed workloads)."""

    index: int
    prompt_tokens: int
    output_tokens: int
    arrival: float
    traffic_cluster: str | None = None
    # The prompt's token ids when they matter (workloads with shared prefixes); None = synthetic ids that
    # share nothing (prompt_token_ids(index, prompt_tokens, seed)).
    prompt_ids: tuple[int, ...] | None = None

    def token_ids(self, seed: int) -> list[int]:
        return (
            list(self.prompt_ids)
            if self.prompt_ids is not None
            else prompt_token_ids(self.index, self.prompt_tokens, seed)
        )


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    path: str
    prompt_tokens: np.ndarray  # (N,) int64, raw lengths from the file
    output_tokens: np.ndarray  # (N,) int64
    arrivals: np.ndarray | None  # (N,) float64 seconds, when the file has them
    sharing: Sharing | None = None  # how requests share prompt prefixes (stallfree.bench.sharing)

    def __len__(self) -> int:
        return len(self.prompt_tokens)


def traces_dir() -> Path:
    """Where the named traces live: $STALLFREE_TRACES; else the repository's data/traces/ (a checkout or an
    editable install); else the copy a wheel carries as package data (stallfree/traces/)."""
    env = os.environ.get("STALLFREE_TRACES")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    checkout = here.parents[2] / "data" / "traces"
    if checkout.is_dir():
        return checkout
    return here.parents[1] / "traces"


def resolve_trace(spec: str) -> Path:
    """A trace name (sharegpt, arxiv) or a CSV path -> an existing file, or ValueError saying where we looked."""
    if spec in TRACE_FILES:
        path = traces_dir() / TRACE_FILES[spec]
    else:
        path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"trace {spec!r} not found at {path}; give a CSV path, or set STALLFREE_TRACES to the folder "
            f"holding {', '.join(TRACE_FILES.values())} (they ship in the repository's data/traces/)"
        )
    return path


def load_trace(spec: str) -> Trace:
    """Read a trace CSV. Needs num_prefill_tokens and num_decode_tokens columns."""
    path = resolve_trace(spec)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        for need in ("num_prefill_tokens", "num_decode_tokens"):
            if need not in cols:
                raise ValueError(f"trace {path} has no {need!r} column (columns: {', '.join(cols)})")
        arrival_col = next((c for c in ARRIVAL_COLUMNS if c in cols), None)
        prompts, outputs, arrivals = [], [], []
        for row in reader:
            prompts.append(int(float(row["num_prefill_tokens"])))
            outputs.append(int(float(row["num_decode_tokens"])))
            if arrival_col:
                arrivals.append(float(row[arrival_col]))
    if not prompts:
        raise ValueError(f"trace {path} has no rows")
    name = spec if spec in TRACE_FILES else path.stem
    return Trace(
        name=name,
        path=str(path),
        prompt_tokens=np.asarray(prompts, dtype=np.int64),
        output_tokens=np.asarray(outputs, dtype=np.int64),
        arrivals=np.asarray(arrivals, dtype=np.float64) if arrival_col else None,
    )


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests one run replays, and how they were derived (for the report)."""

    trace: str
    scale: float
    max_model_len: int
    seed: int
    qps: float | None  # None = the trace's own arrival times
    requests: tuple[TraceRequest, ...]
    num_clipped: int
    sharing: dict | None = None  # Sharing.describe() of a shared-prefix workload

    def describe(self) -> dict:
        p = np.array([r.prompt_tokens for r in self.requests])
        o = np.array([r.output_tokens for r in self.requests])
        return {
            "trace": self.trace,
            "scale": self.scale,
            "max_model_len": self.max_model_len,
            "seed": self.seed,
            "qps": self.qps,
            "num_requests": len(self.requests),
            "num_clipped": self.num_clipped,
            "prompt_tokens_median": float(np.median(p)),
            "prompt_tokens_p90": float(np.percentile(p, 90)),
            "prompt_tokens_max": int(p.max()),
            "output_tokens_median": float(np.median(o)),
            "output_tokens_p90": float(np.percentile(o, 90)),
            "output_tokens_max": int(o.max()),
            "sharing": self.sharing or {"kind": "trace"},
        }


def scale_and_clip(
    prompts: np.ndarray, outputs: np.ndarray, scale: float, max_model_len: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Multiply lengths by `scale` (rounded, at least 1) and clip so prompt + output <= max_model_len.

    The prompt keeps priority (up to max_model_len - 1 tokens, since the prompt is what the scheduler
    chunks) and the output is cut to what is left of the context.
    Returns (prompts, outputs, number of requests changed by clipping).
    """
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    p = np.maximum(1, np.rint(prompts * scale)).astype(np.int64)
    o = np.maximum(1, np.rint(outputs * scale)).astype(np.int64)
    p_clip = np.minimum(p, max_model_len - 1)
    o_clip = np.minimum(o, max_model_len - p_clip)
    clipped = int(np.count_nonzero((p_clip != p) | (o_clip != o)))
    return p_clip, o_clip, clipped


def poisson_arrivals(n: int, qps: float, seed: int) -> np.ndarray:
    """n arrival times (seconds, first at 0) of a Poisson process at `qps`.

    The gaps are seeded unit exponentials divided by qps, so runs at different QPS with one seed replay the
    same sequence, only compressed: that keeps a capacity search monotone in its noise.
    """
    if qps <= 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    gaps = np.random.default_rng([seed, 1]).standard_exponential(n) / qps
    gaps[0] = 0.0
    return np.cumsum(gaps)


def make_workload(
    trace: Trace,
    num_requests: int,
    *,
    qps: float | None,
    scale: float = 1.0,
    max_model_len: int = 8192,
    seed: int = 0,
    max_output_tokens: int | None = None,
) -> Workload:
    """Sample `num_requests` rows (seeded, without replacement while the trace lasts), scale, clip, and
    give them Poisson arrivals at `qps`, or the trace's own arrival times when qps is None. Outputs are
    capped at max_output_tokens when given (a chat-like workload of short answers)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng([seed, 0])
    if qps is None:
        if trace.arrivals is None:
            raise ValueError(f"trace {trace.name} has no arrival times: give --qps")
        idx = np.arange(min(num_requests, len(trace)))
        arrivals = trace.arrivals[idx] - trace.arrivals[idx[0]]
    else:
        idx = rng.choice(len(trace), size=num_requests, replace=num_requests > len(trace))
        arrivals = poisson_arrivals(len(idx), qps, seed)
    p, o, clipped = scale_and_clip(trace.prompt_tokens[idx], trace.output_tokens[idx], scale, max_model_len)
    if max_output_tokens is not None:
        o = np.minimum(o, max_output_tokens)
    reqs = tuple(TraceRequest(i, int(p[i]), int(o[i]), float(arrivals[i])) for i in range(len(idx)))
    if trace.sharing is not None and trace.sharing.kind != "trace":
        from stallfree.bench.sharing import apply_sharing  # noqa: PLC0415 - sharing imports this module

        reqs, cut = apply_sharing(reqs, trace.sharing, seed, max_model_len)
        return Workload(trace.name, scale, max_model_len, seed, qps, reqs, clipped + cut,
                        trace.sharing.describe())  # fmt: skip
    return Workload(trace.name, scale, max_model_len, seed, qps, reqs, clipped)


def prompt_token_ids(index: int, length: int, seed: int = 0) -> list[int]:
    """A deterministic synthetic prompt of `length` token ids, different per request (no shared prefix)."""
    lo, hi = PROMPT_ID_RANGE
    rng = np.random.default_rng([seed, 2, index])
    return rng.integers(lo, hi, size=length).tolist()
