"""`stallfree profile --from-figures engine.json`: a GPU cost model fitted to `python -m experiments.engine_bench` figures.

When no GPU is at hand to run a `profile` grid, the figures one engine-bench run left behind (decode steps
at batch 1 / 32 / 128, a one-shot prefill, the same prompt chunked at three budgets, a hybrid iteration and
the chunk alone, and two per-kernel breakdowns) still pin down a GPU iteration's cost structure:

    T = const + c * decode_tokens + e * decode_kv + d * prefill_attn + f * prefill_chunks
        + g * max(0, prefill_tokens + decode_tokens - knee)

- const: the weight read (every GEMM reads every weight, however few rows), the graph launch, sampling;
- decode_kv: key positions the decodes read (the paged decode kernel: no padding);
- prefill_attn / prefill_chunks: query-key pairs of the chunks, and each chunk's eager attention calls;
- g past the knee: rows past the ridge point (the matmul FLOP rate over the weight-read bandwidth, in
  rows) cost their FLOPs. The figures cannot locate the knee (no iteration has between 128 and 512 rows),
  so it is derived from the run's hardware figures and kept fixed.

Each figure becomes one observation: the summed features of the iterations it timed (a chunked prefill is
4096 / budget iterations) and their total time. The two kernel breakdowns become observations of one term
each (the decode kernel's time against decode_kv alone, the flash kernel's against prefill_attn alone):
without them decode_kv and decode_tokens are inseparable (every decode figure is at context 1024). The
held-out error is leave-one-out over the timed figures (the kernel rows always stay in).

The iterations each figure timed mirror experiments.engine_bench_gpu (Plan and the bench functions): decode
steps after the decodes reached their first token and three warm steps; the hybrid and chunk-alone
figures are medians over the 512-token chunks of a 4096-token prompt (its last chunk, which samples, left
out), so the median chunk starts at 1536; the hybrid's profiled step is the prompt's second chunk.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stallfree.costmodel.features import DECODE_KV, GEMM_EXCESS, gemm_excess, iteration_features
from stallfree.costmodel.fit import error_summary, fit
from stallfree.costmodel.fitted import FittedCostModel

GPU_FEATURES = ("const", "decode_tokens", DECODE_KV, "prefill_attn", "prefill_chunks", GEMM_EXCESS)
# engine_gpu.Plan's defaults, for figures that do not record their plan (runs before it wrote "plan"; tests
# check they agree).
PLAN = {"context": 1024, "prompt": 4096, "hybrid_decodes": 32, "hybrid_chunk": 512}
DECODE_REPS = 12  # timed decode steps: the decodes sit at context + 3 warm steps + about half of these
BYTES_PER_PARAM = 2  # bf16
SOURCE_NOTE = (
    "fitted to engine-bench figures ({path}, backend {backend}), not to a `stallfree profile` grid: "
    "{n} timed figures and {k} kernel breakdowns"
)


@dataclass(frozen=True, slots=True)
class _Chunk:
    """The scheduler chunk fields iteration_features reads."""

    num_tokens: int
    start: int
    is_decode: bool


def _decodes(n: int, position: int) -> list[_Chunk]:
    return [_Chunk(1, position, True) for _ in range(n)]


def _iteration(*chunks: list[_Chunk] | _Chunk) -> dict[str, float]:
    flat: list[_Chunk] = []
    for c in chunks:
        flat.extend(c if isinstance(c, list) else [c])
    return iteration_features(flat)


def _sum(rows: list[dict[str, float]], knee: float) -> dict[str, float]:
    """Features of several iterations, summed; gemm_tokens_over_knee per iteration (it is not linear in
    the summed token counts)."""
    out = {k: float(sum(r.get(k, 0.0) for r in rows)) for k in rows[0]}
    out[GEMM_EXCESS] = float(sum(gemm_excess(r, knee) for r in rows))
    return out


def gemm_knee(doc: dict) -> float:
    """Rows at which a GEMM turns from reading weights to computing: the matmul FLOP rate over the
    bandwidth, times bytes per parameter over 2 FLOPs per parameter per row."""
    try:
        return float(doc["matmul_tflops"] / doc["bandwidth_tb_s"] * BYTES_PER_PARAM / 2)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise ValueError("the figures lack matmul_tflops / bandwidth_tb_s: give the knee (--knee)") from e


def observations(doc: dict, knee: float, backend: str | None = None) -> tuple[list[dict], list[dict]]:
    """(timed figures, kernel breakdowns) of one engine-bench JSON: each {"name", "iterations", "features"
    (summed over the iterations), "time_s"}."""
    name = backend or doc.get("backend")
    row = (doc.get("backends") or {}).get(name)
    if row is None:
        have = ", ".join(doc.get("backends") or {}) or "none"
        raise ValueError(f"no backend {name!r} in the figures (have: {have})")
    plan = {**PLAN, **(doc.get("plan") or {})}
    ctx, prompt = plan["context"], plan["prompt"]
    nd, chunk = plan["hybrid_decodes"], plan["hybrid_chunk"]
    timed: list[dict] = []

    def add(label: str, iterations: list[dict[str, float]], ms: float) -> None:
        timed.append(
            {
                "name": label,
                "iterations": len(iterations),
                "features": _sum(iterations, knee),
                "time_s": ms / 1e3,
            }
        )

    decode_pos = ctx + 3 + plan.get("decode_steps", DECODE_REPS) // 2
    for batch, ms in row["decode_ms"].items():
        add(f"decode batch {batch}", [_iteration(_decodes(int(batch), decode_pos))], ms)
    add(f"one-shot {prompt} prefill", [_iteration(_Chunk(prompt, 0, False))], row["prefill_4096_ms"])
    for budget, ms in (row.get("chunked_ms") or {}).items():
        b = int(budget)
        add(f"{prompt} prompt at budget {b}", [_iteration(_Chunk(min(b, prompt - s), s, False))
                                               for s in range(0, prompt, b)], ms)  # fmt: skip
    h = row.get("hybrid")
    if h:
        mid = int(statistics.median(range(0, prompt - chunk, chunk)))  # the median timed chunk's start
        add(f"{chunk}-token chunk alone", [_iteration(_Chunk(chunk, mid, False))], h["chunk_alone_ms"])
        pos = ctx + mid // chunk  # the decodes rode along the chunks before the median one
        add(f"{nd} decodes + {chunk}-token chunk", [_iteration(_decodes(nd, pos), _Chunk(chunk, mid, False))],
            h["hybrid_ms"])  # fmt: skip
    return timed, _kernel_rows(row.get("launches") or {}, plan)


def _kernel_rows(launches: dict, plan: dict) -> list[dict]:
    """The decode kernel's time in the decode profile, the flash kernel's in the hybrid one, each against
    the one feature it is the cost of."""
    rows = []
    nd, chunk, ctx = plan["hybrid_decodes"], plan["hybrid_chunk"], plan["context"]
    dec = (launches.get(f"decode_{nd}") or {}).get("gpu_ms_top_kernels") or {}
    ms = sum(v for k, v in dec.items() if k.startswith("_decode_"))  # the split-KV kernel and its merge
    if ms:  # the profiled step is the decodes' second (context + 2 keys each)
        rows.append({"name": f"decode attention kernels, batch {nd}", "iterations": 1,
                     "features": {DECODE_KV: float(nd * (ctx + 2))}, "time_s": ms / 1e3})  # fmt: skip
    hyb = (launches.get(f"hybrid_{nd}_plus_{chunk}") or {}).get("gpu_ms_top_kernels") or {}
    ms = max((v for k, v in hyb.items() if "flash_fwd_kernel" in k), default=0.0)
    if ms:  # the profiled step is the prompt's second chunk: `chunk` tokens of history
        rows.append({"name": f"prefill attention kernel, {chunk}-token chunk after {chunk}", "iterations": 1,
                     "features": {"prefill_attn": chunk * (chunk + (chunk + 1) / 2)}, "time_s": ms / 1e3})  # fmt: skip
    return rows


def _fit(rows: list[dict], knee: float) -> FittedCostModel:
    m = fit([r["features"] for r in rows], [r["time_s"] for r in rows], GPU_FEATURES)
    m.gemm_knee = knee
    return m


def _rel(pred: float, t: float) -> float:
    return abs(pred - t) / t


def fit_figures(
    doc: dict, backend: str | None = None, knee: float | None = None
) -> tuple[FittedCostModel, dict]:
    """Fit GPU_FEATURES to one engine-bench run: (model, report with every observation and the errors).
    `knee` overrides the ridge point derived from the run's bandwidth and matmul rate."""
    k = gemm_knee(doc) if knee is None else float(knee)
    timed, kernels = observations(doc, k, backend)
    model = _fit(timed + kernels, k)
    for r in timed + kernels:
        r["predicted_s"] = model.predict(r["features"])
    for i, r in enumerate(timed):  # leave one timed figure out, fit the rest, predict it
        m = _fit([t for j, t in enumerate(timed) if j != i] + kernels, k)
        r["held_out_predicted_s"] = m.predict(r["features"])
    train = [_rel(r["predicted_s"], r["time_s"]) for r in timed]
    held = [_rel(r["held_out_predicted_s"], r["time_s"]) for r in timed]
    report = {
        "backend": backend or doc.get("backend"),
        "gemm_knee_tokens": k,
        "observations": timed,
        "kernel_rows": kernels,
        "fit_error": {
            "train": error_summary(np.array(train)),
            "held_out": error_summary(np.array(held)),
            "held_out_method": "leave-one-out over the timed figures (the kernel rows always in)",
            "num_train": len(timed) + len(kernels),
            "num_held_out": len(timed),
        },
    }
    return model, report


def load_figures(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"engine-bench figures {path}: cannot read them: {e}") from e


def check_runs(model: FittedCostModel, docs: dict[str, dict], backend: str | None) -> dict:
    """The model's error on other engine-bench runs' figures (other machines, older engine versions):
    {path: {"errors": error summary, "observations": [...]}} for the runs that have the backend."""
    out = {}
    knee = model.gemm_knee or 0.0
    for path, doc in docs.items():
        try:
            timed, _ = observations(doc, knee, backend)
        except ValueError:
            continue
        for r in timed:
            r["predicted_s"] = model.predict(r["features"])
        errs = np.array([_rel(r["predicted_s"], r["time_s"]) for r in timed])
        out[path] = {"errors": error_summary(errs), "observations": timed}
    return out


def plot(report: dict, out: Path) -> Path:
    """Measured vs predicted for every figure (fitted and left-one-out), and each figure's errors."""
    from stallfree.bench.report import pyplot

    plt = pyplot()
    obs = report["observations"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    per_it = [(r["time_s"] / r["iterations"] * 1e3, r) for r in obs]
    a1.scatter([m for m, _ in per_it], [r["predicted_s"] / r["iterations"] * 1e3 for _, r in per_it],
               label="fitted on all")  # fmt: skip
    a1.scatter([m for m, _ in per_it], [r["held_out_predicted_s"] / r["iterations"] * 1e3 for _, r in per_it],
               marker="x", label="left out of the fit")  # fmt: skip
    hi = max(m for m, _ in per_it) * 1.1
    a1.plot([1, hi], [1, hi], color="grey", lw=0.8)
    a1.set_xscale("log")
    a1.set_yscale("log")
    a1.set_xlabel("measured ms per iteration (engine-bench)")
    a1.set_ylabel("predicted ms per iteration")
    a1.set_title(f"GPU cost model vs engine-bench figures (knee {report['gemm_knee_tokens']:.0f} rows)")
    a1.legend(fontsize=8)
    names = [r["name"] for r in obs]
    y = np.arange(len(obs))
    a2.barh(y - 0.2, [100 * (r["predicted_s"] / r["time_s"] - 1) for r in obs], 0.4, label="fitted on all")
    a2.barh(y + 0.2, [100 * (r["held_out_predicted_s"] / r["time_s"] - 1) for r in obs], 0.4,
            label="left out")  # fmt: skip
    a2.set_yticks(y, names, fontsize=7)
    a2.axvline(0, color="grey", lw=0.8)
    a2.set_xlabel("prediction error, %")
    a2.legend(fontsize=8)
    fig.tight_layout()
    path = out / "figures_fit.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
