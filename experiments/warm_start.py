"""The first requests after readiness against the later ones: does a fresh server meet its SLOs at once?

    python -m experiments.warm_start [--qps 1] [--num-requests 240] [--window 120] [--seeds 0,1,2]
        [--token-budget 256] [--chunk-context-scale C] [--replay] [--peer-url URL [--peer-text-prompts]]
        [--out results/warm-start]

For each seed a fresh `stallfree serve` (sarathi, --token-budget, --chunk-context-scale, --threads) is started
and, as soon as it answers /ready, sent --num-requests requests of the capacity protocol's workload (ShareGPT
lengths x --scale, <= --max-output-tokens out, Poisson at --qps, seeded) with no warm-up request of any kind.
Reported per seed:
the share of requests that meet TTFT <= --slo-ttft and their own P99 TBT <= --slo-tbt among the first
--window requests and among the rest, and their median TBT. The first window and the rest are different
requests, so on a noisy box at a load near capacity their difference is mostly the requests'. --replay pairs
them: once the run is over, the server's prefix cache is emptied (POST /admin/v1/reset_prefix_cache) and the
same workload is sent again, same prompts, same arrival offsets; the first window's figures on the warm server
are then reported beside the fresh server's ("replay"). With --peer-url the same workload (first seed)
goes to that server too; start it fresh just before, since this command cannot restart it.

Output: a table on the terminal and warm_start.json in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from experiments.protocol import add_protocol_args, protocol_workload
from stallfree.bench.launcher import ServerProcess, ServerSpec
from stallfree.bench.metrics import OK, RequestRecord, slo_attainment
from stallfree.bench.serve_cmd import bench_once, load_text_prompts, reset_prefix_cache
from stallfree.bench.simulate import workload_of
from stallfree.slo import Slo


def window_figures(records: list[RequestRecord], window: int, slo: Slo) -> dict:
    """Attainment and median gap between tokens of the first `window` requests (by arrival) and the rest."""
    ordered = sorted(records, key=lambda r: r.index)
    out = {}
    for name, part in (("first", ordered[:window]), ("rest", ordered[window:])):
        gaps = [g for r in part for g in r.tbts]
        out[name] = {
            "requests": len(part),
            "attainment": slo_attainment(part, slo.ttft_p99, slo.tbt_p99),
            "median_tbt_s": statistics.median(gaps) if gaps else None,
            "ok": sum(1 for r in part if r.outcome == OK),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qps", type=float, default=1.0, help="Poisson arrival rate (default %(default)s)")
    ap.add_argument("--num-requests", type=int, default=240, help="requests per server (default %(default)s)")
    ap.add_argument("--window", type=int, default=120, help="the first requests, compared with the rest")
    ap.add_argument("--seeds", default="0,1,2", help="request samples, one fresh server each")
    add_protocol_args(ap)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument(
        "--chunk-context-scale",
        type=int,
        default=None,
        metavar="C",
        help="the server's --chunk-context-scale (default: off)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--replay",
        action="store_true",
        help="then empty the prefix cache and send the same workload again: the first window warm",
    )
    ap.add_argument("--peer-url", default=None, help="also send the first seed's workload to this server")
    ap.add_argument("--peer-text-prompts", action="store_true", help="prompts as text (llama.cpp's server)")
    ap.add_argument("--out", default="results/warm-start")
    a = ap.parse_args(argv)
    if not 0 < a.window < a.num_requests:
        ap.error("need 0 < --window < --num-requests")
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    # The capacity command's own workload options, so the requests are the protocol's.
    args, trace, model, load_format = protocol_workload(a)
    slo = Slo(ttft_p99=a.slo_ttft, tbt_p99=a.slo_tbt)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for seed in seeds:
        wl = workload_of(trace, args, a.qps, seed=seed)
        spec = ServerSpec(token_budget=a.token_budget, chunk_context_scale=a.chunk_context_scale, model=model,
                          load_format=load_format, threads=a.threads)  # fmt: skip
        with ServerProcess(spec, out / f"server-s{seed}.log") as server:
            _, records = bench_once(server.url, wl, slo, desc=f"stallfree seed {seed}")
            results[f"stallfree-s{seed}"] = window_figures(records, a.window, slo)
            if a.replay:
                if not reset_prefix_cache(server.url):
                    raise SystemExit("the server has no /admin/v1/reset_prefix_cache: cannot replay")
                _, again = bench_once(server.url, wl, slo, desc=f"stallfree seed {seed}, again")
                results[f"stallfree-s{seed}"]["replay"] = window_figures(again, a.window, slo)["first"]
    if a.peer_url:
        wl = workload_of(trace, args, a.qps, seed=seeds[0])
        text = load_text_prompts() if a.peer_text_prompts else None
        _, records = bench_once(a.peer_url, wl, slo, logprobs=False, text_prompts=text, desc="peer")
        results[f"peer-s{seeds[0]}"] = window_figures(records, a.window, slo)
    print(f"\n{a.num_requests} requests at {a.qps} QPS from readiness; first {a.window} vs the rest")
    for name, r in results.items():
        f, rest = r["first"], r["rest"]
        print(
            f"{name:16s} first: {f['attainment']:6.1%} (median TBT {f['median_tbt_s'] or 0:.3f} s)   "
            f"rest: {rest['attainment']:6.1%} (median TBT {rest['median_tbt_s'] or 0:.3f} s)"
            + (
                f"   first again, warm: {r['replay']['attainment']:6.1%} "
                f"(median TBT {r['replay']['median_tbt_s'] or 0:.3f} s)"
                if "replay" in r
                else ""
            )
        )
    (out / "warm_start.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=2))
    print(f"wrote {out / 'warm_start.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
