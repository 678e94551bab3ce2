"""`stallfree profile`: measure iteration time on this hardware and fit the cost model T(n_prefill, n_decode,
context).

The grid is (running decodes x their context) states; in each state, iterations with a prefill chunk of
each size at each prefill context are run through the real LLMEngine (sarathi policy, the budget set so the
batch holds exactly the decodes plus the chunk). Each configuration is repeated and its median kept. A
seeded quarter of the configurations is held out: the saved model is fitted on the rest, and its error on
the held-out points is reported, so the error belongs to the model you use.

Output (--out): cost_model.json (coefficients, fit error, grid, hardware), profile.json (every point),
profile.png (measured vs predicted, time vs prefill tokens).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from stallfree.bench import servedfit
from stallfree.bench.figuresfit import GPU_FEATURES
from stallfree.bench.host import HostWatch, describe
from stallfree.bench.report import measured_vs_predicted, pyplot, table, write_json
from stallfree.costmodel.features import iteration_features
from stallfree.costmodel.fit import fit_held_out
from stallfree.costmodel.fitted import FittedCostModel, spec_snippet
from stallfree.engine.config import DTYPES, QUANTIZATIONS
from stallfree.engine.serve_cli import add_load_format_args, resolve_load_format

# (decodes, decode contexts, chunks, prefill contexts): a CPU grid for a small model, and a GPU grid for a
# 7-8B one: batches to 128, chunks to 2048, contexts to 4096 (a prefill context of 4096 puts the chunk's
# end past 4096, so its attention reaches 6K), ~70 configurations, a few minutes on an H200.
GRIDS = {
    "cpu": ("0,8,32", "64,384", "0,64,256,768", "0,512"),
    "gpu": ("0,8,32,128", "512,4096", "0,128,512,1024,2048", "0,4096"),
}
KNEES = tuple(range(0, 513, 16))  # GEMM knees the GPU form tries (rows)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _engine(loaded, max_seqs: int, kv_tokens: int):
    from stallfree.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SchedulerTunables
    from stallfree.engine.engine import LLMEngine

    weights = next(loaded.model.parameters())  # the engine runs where the model was loaded, in its dtype
    cfg = EngineConfig(
        device=str(weights.device),
        dtype=str(weights.dtype).removeprefix("torch."),
        scheduler=SchedulerConfig(
            policy="sarathi", max_num_seqs=max_seqs, tunables=SchedulerTunables(token_budget=8192)
        ),
        cache=CacheConfig(
            num_kv_blocks=kv_tokens // 16 + 64, enable_prefix_caching=False
        ),  # NOTE: repeated prompts must be computed, not served from the prefix cache
    )
    return LLMEngine(cfg, loaded=loaded)


class _Capture:
    """Wraps the engine's scheduler.schedule to keep the last SchedulerOutput (for its features)."""

    def __init__(self, engine) -> None:
        self.last = None
        self._orig = engine.scheduler.schedule
        engine.scheduler.schedule = self

    def __call__(self):
        self.last = self._orig()
        return self.last


def synthetic_ids(vocab: int, n: int, salt: int = 0) -> list[int]:
    """n deterministic prompt token ids, different for each salt, clear of the vocabulary's first 100 and last
    200 ids (special and rare tokens): prompts whose cost, not content, is measured."""
    return [(1009 * (i + 1) + 7919 * salt) % (vocab - 300) + 100 for i in range(n)]


def _set_budget(engine, budget: int) -> None:
    from dataclasses import replace

    engine.set_tunables(replace(engine.tunables, token_budget=max(1, budget)))


def _measure(engine, cap: _Capture, steps: int) -> tuple[dict[str, float], list[float], list[float]]:
    """Run `steps` iterations; (mean features, wall seconds of each, CPU seconds of this thread for each)."""
    rows, wall, cpu = [], [], []
    for _ in range(steps):
        c0 = time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - c0)
        rows.append(iteration_features(cap.last.chunks))
        wall.append(engine.last_stats.time_total)
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    return mean, wall, cpu


def profile_grid(
    loaded, decodes, decode_ctxs, chunks, prefill_ctxs, reps, bar, clock: str = "cpu"
) -> list[dict]:
    """Run the grid; one point per configuration with mean features and median iteration time.

    clock "cpu": the engine thread's CPU time (with one torch thread the forward runs on it), which on a
    shared box measures the iteration and not the neighbours; "wall": elapsed time. Both are recorded."""
    from stallfree.engine.sampling_params import SamplingParams

    vocab = loaded.config.vocab_size
    max_seqs = max(decodes) + 2
    kv_tokens = max(decodes) * (max(decode_ctxs) + 512) + max(prefill_ctxs) + max(chunks) * reps + 2048
    engine = _engine(loaded, max_seqs, kv_tokens)
    cap = _Capture(engine)
    long_run = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    # Warm-up: the first iterations of a process are slow (allocator, kernels' first calls).
    engine.add_request("warm", synthetic_ids(vocab, 256, 0), SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    points, salt = [], 1
    for n_dec in decodes:
        for dctx in decode_ctxs if n_dec else [0]:
            _set_budget(engine, 8192)
            for b in range(n_dec):
                engine.add_request(f"d{b}", synthetic_ids(vocab, dctx, salt + b), long_run)
            salt += n_dec
            while engine.scheduler.waiting or any(not r.in_decode for r in engine.scheduler.running):
                engine.step()
            for pctx in prefill_ctxs:
                for c in chunks:
                    if c == 0 and (n_dec == 0 or pctx != prefill_ctxs[0]):
                        bar.update(1)
                        continue  # decode-only iterations do not depend on the prefill context
                    if c:
                        engine.add_request(
                            "p", synthetic_ids(vocab, pctx + c * reps + 1, salt), SamplingParams(max_tokens=1)
                        )
                        salt += 1
                        if pctx:
                            _set_budget(engine, n_dec + pctx)
                            engine.step()
                    _set_budget(engine, n_dec + c if c else n_dec)
                    feats, wall, cpu = _measure(engine, cap, reps)
                    if c:
                        engine.abort_request("p")
                    points.append(
                        {
                            "decodes": n_dec,
                            "decode_context": dctx,
                            "chunk": c,
                            "prefill_context": pctx,
                            "features": feats,
                            "time_s": statistics.median(cpu if clock == "cpu" else wall),
                            "wall_s": wall,
                            "cpu_s": cpu,
                        }
                    )
                    bar.update(1)
            for b in range(n_dec):
                engine.abort_request(f"d{b}")
    return points


def fit_with_holdout(
    points: list[dict], holdout: float, seed: int, form: str = "cpu"
) -> tuple[FittedCostModel, dict]:
    rng = np.random.default_rng(seed)
    n = len(points)
    test = (
        set(rng.choice(n, size=max(1, int(round(n * holdout))), replace=False).tolist()) if holdout else set()
    )
    if form == "gpu":
        return fit_held_out(points, test, GPU_FEATURES, KNEES)
    return fit_held_out(points, test)


def _plot(points: list[dict], out: Path) -> Path:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    measured_vs_predicted(a1, points, "measured iteration ms (median)", "Cost model fit")
    for n_dec in sorted({p["decodes"] for p in points}):
        pts = sorted(
            (
                p
                for p in points
                if p["decodes"] == n_dec
                and p["prefill_context"] == 0
                and p["decode_context"]
                in (0, max(q["decode_context"] for q in points if q["decodes"] == n_dec))
            ),
            key=lambda p: p["chunk"],
        )
        if pts:
            a2.plot(
                [p["chunk"] for p in pts],
                [p["time_s"] * 1e3 for p in pts],
                marker="o",
                label=f"{n_dec} decodes",
            )
    a2.set_xlabel("prefill tokens in the iteration")
    a2.set_ylabel("iteration ms")
    a2.set_title("Iteration time vs prefill chunk")
    a2.legend(fontsize=8)
    fig.tight_layout()
    path = out / "profile.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _print_saved(out: Path, png: Path, model: FittedCostModel, name: str = "cost_model.json") -> None:
    print(f"\nsaved {out / name}, {out / 'profile.json'}, {png}")
    if model.gemm_knee is not None:  # the CRD's costModel has the CPU form's terms only
        print(
            f"\nGPU form (GEMM knee {model.gemm_knee:.0f} rows): give the controller the file, not a spec snippet"
        )
        return
    print(f"\nfor the budget controller, in the SarathiDeployment:\n{spec_snippet(model.coefficients)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="stallfree profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2-135M)")
    add_load_format_args(ap)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--dtype", choices=DTYPES, default="auto", help="weights/KV dtype (auto: as `stallfree "
                    "serve` and LLM() resolve it: bfloat16 on the CPU and on CUDA)")  # fmt: skip
    ap.add_argument("--quantization", choices=("auto", *QUANTIZATIONS), default="auto", help="CPU with --dtype "
                    "bfloat16: int4/int8 weight-only linear layers, as `stallfree serve` runs them (auto: int4 "
                    "with bfloat16 on the CPU, else none)")  # fmt: skip
    ap.add_argument("--decodes", default=None, help="running decodes per iteration (default: "
                    f"{GRIDS['cpu'][0]} on the CPU, {GRIDS['gpu'][0]} on a GPU)")  # fmt: skip
    ap.add_argument("--decode-contexts", default=None, help="context length of the running decodes "
                    f"(default: {GRIDS['cpu'][1]} / {GRIDS['gpu'][1]})")  # fmt: skip
    ap.add_argument("--chunks", default=None, help="prefill chunk sizes, tokens (default: "
                    f"{GRIDS['cpu'][2]} / {GRIDS['gpu'][2]})")  # fmt: skip
    ap.add_argument("--prefill-contexts", default=None, help="tokens already prefilled before the chunk "
                    f"(default: {GRIDS['cpu'][3]} / {GRIDS['gpu'][3]})")  # fmt: skip
    ap.add_argument("--form", choices=("cpu", "gpu"), default=None, help="cost model form: cpu (the "
                    "linear terms) or gpu (decode_kv, and a GEMM knee chosen by the fit); default: the "
                    "device's")  # fmt: skip
    ap.add_argument("--clock", choices=("cpu", "wall"), default=None, help="fit thread CPU time (robust "
                    "on a shared box; needs --threads 1) or wall time (default: cpu on the CPU, wall on a "
                    "GPU, where the thread's CPU time does not see the kernels)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=2, help="iterations per configuration (median kept)")
    ap.add_argument("--holdout", type=float, default=0.25, help="fraction of configurations held out")
    ap.add_argument("--seed", type=int, default=0, help="seed of the held-out split (and of dummy weights)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: robust on a shared 2-core box)"
    )
    ap.add_argument("--out", default="results/profile", help="folder for cost_model.json and plots")
    ap.add_argument("--from-log", metavar="LOG", nargs="+", default=None, help="fit to a server's own "
                    "iterations instead of profiling a grid: iteration logs from `stallfree serve "
                    "--iteration-log FILE` (or `stallfree bench capacity --iteration-logs`)")  # fmt: skip
    ap.add_argument("--target", choices=servedfit.TARGETS, default="period", help="with --from-log: fit "
                    "the period between iteration ends (what a streaming client sees) or the step's own "
                    "wall time (default %(default)s)")  # fmt: skip
    ap.add_argument("--from-figures", metavar="ENGINE_JSON", default=None, help="fit a GPU cost model to "
                    "the figures of one `python -m experiments.engine_bench --device cuda` run (engine.json) instead of "
                    "profiling a grid (stallfree.bench.figuresfit)")  # fmt: skip
    ap.add_argument("--backend", default=None, help="with --from-figures: the backend row to fit "
                    "(default: the run's default backend)")  # fmt: skip
    ap.add_argument("--knee", type=float, default=None, help="with --from-figures: GEMM rows at which "
                    "compute overtakes the weight read (default: the run's matmul rate / bandwidth)")  # fmt: skip
    ap.add_argument("--check", metavar="ENGINE_JSON", nargs="*", default=[], help="with --from-figures: "
                    "also report the model's error on these other runs' figures")  # fmt: skip
    ap.add_argument("--name", default="cost_model.json", help="file name of the cost model in --out")
    args = ap.parse_args(argv)
    if args.from_figures:
        return from_figures(args)
    if args.from_log:
        if not 0 <= args.holdout < 1:
            ap.error("--holdout must be in [0, 1)")
        return from_log(args)

    import torch

    from stallfree.engine.model.loader import load_model
    from stallfree.engine.placement import resolve_placement

    try:
        model, load_format = resolve_load_format(args.model, args.load_format, args.shape)
        placement = resolve_placement(args.device, args.dtype, args.quantization)
        device = placement.device
    except (ValueError, RuntimeError) as e:
        ap.error(str(e))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device is available here")
    on_gpu = device.type != "cpu"
    clock = args.clock or ("wall" if on_gpu else "cpu")
    if clock == "cpu" and on_gpu:
        ap.error(
            "--clock cpu measures the calling thread's CPU time, not the GPU's kernels: use --clock wall"
        )
    torch.set_num_threads(args.threads)
    grid = GRIDS["gpu" if on_gpu else "cpu"]
    given = (args.decodes, args.decode_contexts, args.chunks, args.prefill_contexts)
    decodes, dctx, chunks, pctx = (_ints(g if g is not None else d) for g, d in zip(given, grid, strict=True))
    form = args.form or ("gpu" if on_gpu else "cpu")
    if args.reps < 1 or not 0 <= args.holdout < 1:
        ap.error("--reps must be >= 1 and --holdout in [0, 1)")
    if clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures the calling thread: use it with --threads 1, or use --clock wall")
    out = Path(args.out)
    try:
        loaded = load_model(
            model,
            dtype=placement.dtype,
            device=device,
            load_format=load_format,
            seed=args.seed,
            quantization=placement.quantization,
        )
    except ValueError as e:
        ap.error(str(e))
    n_states = sum(len(dctx) if d else 1 for d in decodes)
    t0 = time.time()
    host = HostWatch()
    with tqdm(
        total=n_states * len(pctx) * len(chunks), desc="profile", unit="config", file=sys.stderr
    ) as bar:
        points = profile_grid(loaded, decodes, dctx, chunks, pctx, args.reps, bar, clock)
    model, fit_error = fit_with_holdout(points, args.holdout, args.seed, form)
    model.meta = {
        "form": form,
        "model": loaded.name,
        "device": str(device),
        "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        "quantization": placement.quantization,
        "threads": args.threads,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "profile_wall_s": time.time() - t0,
        "fit_error": fit_error,
        "clock": clock,
        # How much slower wall time was than CPU time while profiling: 1.0 on an idle box. The simulator's
        # --contention takes it to predict this box as it was.
        "contention_factor": float(
            np.median(
                [statistics.median(p["wall_s"]) / max(1e-9, statistics.median(p["cpu_s"])) for p in points]
            )
        ),
        "loadavg_1m": os.getloadavg()[0],
        "host": host.summary(),  # steal share: whether the shared host slowed this profile down
        "grid": {
            "decodes": decodes,
            "decode_contexts": dctx,
            "chunks": chunks,
            "prefill_contexts": pctx,
            "reps": args.reps,
        },
        "units": "seconds per iteration; features as in stallfree.costmodel.features",
    }
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / args.name)
    write_json(out, "profile.json", {"points": points, "cost_model": model.to_json()})
    png = _plot(points, out)
    rows = [[k, f"{v:.4g}"] for k, v in model.coefficients.items()]
    print(
        table(
            ["feature", "seconds per unit"], rows, title=f"cost model ({loaded.name}, {args.threads} threads)"
        )
    )
    print(
        f"\nclock: {clock}; wall / CPU time while profiling (contention factor): "
        f"{model.meta['contention_factor']:.2f}; {describe(model.meta['host'])}"
    )
    fe = fit_error["held_out"]
    print(
        f"\nfit on {fit_error['num_train']} configurations; relative error on {fit_error['num_held_out']} held-out: "
        f"median {fe['median']:.1%}, max {fe['max']:.1%}"
        if fe["median"] is not None
        else "\nno held-out points"
    )
    dec = [p for p in points if p["chunk"] == 0]
    if dec:
        print(
            table(
                ["decodes", "context", "measured ms", "predicted ms"],
                [
                    [
                        p["decodes"],
                        p["decode_context"],
                        f"{p['time_s'] * 1e3:.1f}",
                        f"{p['predicted_s'] * 1e3:.1f}",
                    ]
                    for p in dec
                ],
                title="\ndecode-only iterations",
            )
        )
    _print_saved(out, png, model)
    return 0


def from_log(args: argparse.Namespace) -> int:
    try:
        model, points = servedfit.fit_logs(args.from_log, args.target, args.holdout, args.seed)
    except ValueError as e:
        print(f"stallfree profile: {e}", file=sys.stderr)
        return 2
    fit_error = model.meta["fit_error"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / "cost_model.json")
    write_json(out, "profile.json", {"points": points, "cost_model": model.to_json()})
    png = servedfit.plot(points, out)
    rows = [[k, f"{v:.4g}"] for k, v in model.coefficients.items()]
    print(table(["feature", "seconds per unit"], rows, title=f"cost model (served {args.target}s)"))
    fe, p99 = fit_error["held_out"], fit_error["held_out_p99_s"]
    if fe["median"] is not None:
        print(
            f"\nfit on {fit_error['num_train']} iterations; relative error on {fit_error['num_held_out']} "
            f"held out: median {fe['median']:.1%}, p90 {fe['p90']:.1%}; held-out P99 "
            f"{p99['measured'] * 1e3:.0f} ms measured, {p99['predicted'] * 1e3:.0f} ms predicted"
        )
    else:
        print(f"\nfit on {fit_error['num_train']} iterations; too few to hold any out")
    _print_saved(out, png, model)
    return 0


def from_figures(args: argparse.Namespace) -> int:
    """`--from-figures`: the GPU cost model fitted to one engine-bench run (stallfree.bench.figuresfit)."""
    from stallfree.bench import figuresfit

    try:
        doc = figuresfit.load_figures(args.from_figures)
        model, report = figuresfit.fit_figures(doc, args.backend, args.knee)
        others = {p: figuresfit.load_figures(p) for p in args.check}
    except ValueError as e:
        print(f"stallfree profile: {e}", file=sys.stderr)
        return 2
    checks = figuresfit.check_runs(model, others, report["backend"])
    fe = report["fit_error"]
    model.meta = {
        "source": figuresfit.SOURCE_NOTE.format(
            path=args.from_figures,
            backend=report["backend"],
            n=fe["num_held_out"],
            k=len(report["kernel_rows"]),
        ),
        "fitted_to": "engine-bench figures",
        "figures": args.from_figures,
        "model": doc.get("model"),
        "device": doc.get("device_name"),
        "dtype": doc.get("dtype"),
        "backend": report["backend"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "fit_error": fe,
        "clock": "wall",
        "units": "seconds per iteration; features as in stallfree.costmodel.features (GPU terms: "
        "decode_kv, gemm_tokens_over_knee)",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / args.name)
    stem = Path(args.name).stem
    path = write_json(
        out, f"{stem}.fit.json", {"cost_model": model.to_json(), **report, "other_runs": checks}
    )
    png = figuresfit.plot(report, out)
    png = png.rename(out / f"{stem}.fit.png")
    print(table(["feature", "seconds per unit"], [[k, f"{v:.4g}"] for k, v in model.coefficients.items()],
                title=f"GPU cost model from {args.from_figures} ({report['backend']}; GEMM knee "
                f"{report['gemm_knee_tokens']:.0f} rows)"))  # fmt: skip
    rows = [[r["name"], r["iterations"], f"{r['time_s'] * 1e3:.2f}", f"{r['predicted_s'] * 1e3:.2f}",
             f"{r['predicted_s'] / r['time_s'] - 1:+.1%}",
             f"{r['held_out_predicted_s'] / r['time_s'] - 1:+.1%}" if "held_out_predicted_s" in r else "-"]
            for r in report["observations"] + report["kernel_rows"]]  # fmt: skip
    print(table(["figure", "iterations", "measured ms", "fitted ms", "error", "left-out error"], rows,
                title="\nresiduals (left-out: fitted without that figure)"))  # fmt: skip
    tr, ho = fe["train"], fe["held_out"]
    print(f"\nrelative error on {fe['num_held_out']} timed figures: fitted median {tr['median']:.1%}, max "
          f"{tr['max']:.1%}; held out (leave-one-out) median {ho['median']:.1%}, max {ho['max']:.1%}")  # fmt: skip
    for p, c in checks.items():
        e = c["errors"]
        print(f"on {p}: median {e['median']:.1%}, max {e['max']:.1%} ({len(c['observations'])} figures)")
    print(f"\nsaved {out / args.name}, {path}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
