"""`stallfree bench serve`: replay a trace against a running OpenAI-compatible server and report.

One run: an open-loop, seeded Poisson arrival process (or the trace's own arrival times) over requests with
the trace's lengths. Per request: TTFT, every inter-token gap, end-to-end latency, outcome (429s counted as
rejected). Summary: P50/P95/P99 TTFT and TBT, scheduling delay (from the server's /metrics where it has
them), throughput and goodput. Output (--out): records.json, summary.json, serve.png.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from stallfree.bench.host import HostWatch
from stallfree.bench.loadgen import metrics_delta, run_workload, scrape
from stallfree.bench.metrics import RequestRecord, summarize
from stallfree.bench.report import ms, pyplot, table, write_json
from stallfree.bench.traces import Workload
from stallfree.slo import Slo


async def _bench(
    url: str, workload: Workload, slo: Slo, *, model, api_key, timeout, logprobs, cluster, bar, text_prompts
) -> tuple[dict, list]:
    host = HostWatch()
    before = await scrape(url)
    records = await run_workload(
        url,
        workload,
        model=model,
        api_key=api_key,
        timeout=timeout,
        logprobs=logprobs,
        traffic_cluster=cluster,
        on_done=(lambda r: bar.update(1)) if bar is not None else None,
        text_prompts=text_prompts,
    )
    after = await scrape(url) if before is not None else None
    server = metrics_delta(before, after) if before is not None and after is not None else {}
    sd = server.get("scheduling_delay_s")
    summary = summarize(
        records, slo, server_scheduling_delay={k: sd[k] for k in ("p50", "p95", "p99")} if sd else None
    )
    summary["server"] = server
    # This box is a VM on a shared host: record how busy it was, so disturbed runs can be recognised.
    summary["host"] = host.summary()
    summary["loadavg_1m"] = summary["host"]["loadavg_1m"]
    summary["workload"] = workload.describe()
    return summary, records


def load_text_prompts():
    from stallfree.bench.textprompts import TextPrompts

    return TextPrompts.from_gguf()


def reset_prefix_cache(url: str) -> bool:
    """Empty a stallfree server's prefix cache (POST /admin/v1/reset_prefix_cache) so a run does not hit
    what the previous run at another QPS left (a capacity search replays the same prompts). False when the
    server has no such endpoint (a peer server)."""
    r = httpx.post(f"{url.rstrip('/')}/admin/v1/reset_prefix_cache", timeout=30.0)
    if r.status_code == 404:
        return False
    r.raise_for_status()
    return True


def bench_once(
    url: str,
    workload: Workload,
    slo: Slo,
    *,
    model: str | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
    logprobs: bool = True,
    traffic_cluster: str | None = None,
    progress: bool = True,
    desc: str = "bench",
    text_prompts=None,
) -> tuple[dict, list]:
    """One load run; returns (summary, records)."""
    bar = (
        tqdm(total=len(workload.requests), desc=desc, unit="req", file=sys.stderr, leave=False)
        if progress
        else None
    )
    try:
        return asyncio.run(
            _bench(
                url,
                workload,
                slo,
                model=model,
                api_key=api_key,
                timeout=timeout,
                logprobs=logprobs,
                cluster=traffic_cluster,
                bar=bar,
                text_prompts=text_prompts,
            )
        )
    finally:
        if bar is not None:
            bar.close()


def summary_row(name: str, s: dict) -> list[str]:
    o = s["outcomes"]
    return [name, f"{s['workload']['qps'] or 0:.3g}", f"{o['ok']}/{s['num_requests']}", str(o["rejected"]),
            ms(s["ttft_s"]["p50"]), ms(s["ttft_s"]["p99"]), ms(s["tbt_s"]["p50"]), ms(s["tbt_s"]["p99"]),
            ms(s["scheduling_delay_s"]["p50"]), f"{s['throughput_rps']:.3g}", f"{s['goodput_rps']:.3g}"]  # fmt: skip


SUMMARY_HEADERS = ["run", "QPS", "ok", "429", "TTFT p50 ms", "TTFT p99 ms", "TBT p50 ms", "TBT p99 ms",
                   "sched p50 ms", "req/s", "goodput/s"]  # fmt: skip


def plot_run(records: list[RequestRecord], slo: Slo, out: Path, name: str = "serve.png") -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    gaps = np.sort([g for r in records for g in r.tbts]) * 1e3
    ttft = np.sort([r.ttft for r in records if r.ttft is not None])
    if len(gaps):
        axes[0].plot(gaps, np.linspace(0, 1, len(gaps)))
    axes[0].axvline(slo.tbt_p99 * 1e3, color="red", ls="--", label="TBT SLO")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("inter-token gap, ms")
    axes[0].set_ylabel("CDF")
    axes[0].legend()
    if len(ttft):
        axes[1].plot(ttft, np.linspace(0, 1, len(ttft)))
    axes[1].axvline(slo.ttft_p99, color="red", ls="--", label="TTFT SLO")
    axes[1].set_xlabel("TTFT, s")
    axes[1].legend()
    done = [r for r in records if r.ttft is not None]
    axes[2].scatter([r.arrival for r in done], [r.ttft for r in done], s=8, label="TTFT")
    axes[2].scatter([r.arrival for r in done], [max(r.tbts, default=0) for r in done], s=8, label="max gap")
    axes[2].set_xlabel("arrival, s")
    axes[2].set_ylabel("s")
    axes[2].set_title("latency over the run")
    axes[2].legend()
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main_serve(args: argparse.Namespace, workload: Workload, slo: Slo) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary, records = bench_once(
        args.url,
        workload,
        slo,
        model=args.model_name,
        api_key=args.api_key,
        timeout=args.timeout,
        logprobs=not args.no_logprobs,
        traffic_cluster=args.traffic_cluster,
        text_prompts=load_text_prompts() if args.text_prompts else None,
    )
    write_json(out, "records.json", [r.to_json() for r in records])
    path = write_json(out, "summary.json", summary)
    png = plot_run(records, slo, out)
    wl = summary["workload"]
    print(
        table(
            SUMMARY_HEADERS,
            [summary_row(args.url, summary)],
            title=(
                f"{wl['trace']} x{wl['scale']:g} (median prompt {wl['prompt_tokens_median']:.0f}, output "
                f"{wl['output_tokens_median']:.0f} tokens; {wl['num_clipped']} clipped to {wl['max_model_len']}), "
                f"{wl['num_requests']} requests, seed {wl['seed']}; SLO TTFT {slo.ttft_p99:g} s, TBT {slo.tbt_p99 * 1e3:.0f} ms"
            ),
        )
    )
    print(
        f"scheduling delay: {summary['scheduling_delay_source']}; "
        f"output tokens/s {summary['output_tokens_per_s']:.1f}; makespan {summary['makespan_s']:.1f} s"
    )
    bad = [r for r in records if r.outcome != "ok"]
    for r in bad[:5]:
        print(f"  request {r.index}: {r.outcome}: {r.error}")
    print(f"saved {path}, {out / 'records.json'}, {png}")
    return 0
