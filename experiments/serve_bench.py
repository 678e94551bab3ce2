"""`python -m experiments.serve_bench`: what the HTTP path costs on top of the engine.

  throughput  the same batch (N prompts, fixed output lengths via ignore_eos) through offline
              `LLM.generate` and through `stallfree serve` (a real server process, N concurrent streaming
              clients); output tokens per second of each and their ratio (target >= 0.9)
  latency     one request alone, streamed: time per output token seen by the HTTP client vs the offline
              engine's own per-token time; the difference is the added latency per token of the HTTP path

Offline and HTTP runs are interleaved and repeated; medians are reported (the box is shared and noisy).
Results: a table on the terminal and JSON in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from stallfree.ports import free_port

TEXT = (
    "Sarathi-Serve splits long prompts into chunks so that decodes keep flowing. Paged attention stores "
    "keys and values in fixed-size blocks; a block table maps positions to slots. "
)


def _prompts(n: int, words: int) -> list[str]:
    base = (TEXT * (words // 20 + 2)).split()
    return [f"[{i}] " + " ".join(base[i % 7 : i % 7 + words]) for i in range(n)]


def _start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stallfree", "serve", "--port", str(port), "--log-level", "warning",
           "--token-budget", str(args.token_budget), "--max-num-seqs", str(args.max_num_seqs),
           "--num-kv-blocks", str(args.num_kv_blocks), "--no-enable-prefix-caching"]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not become ready")


async def _http_batch(url: str, prompts: list[str], max_tokens: int) -> dict:
    """All prompts at once as streaming requests; wall time, tokens, and each client's token gaps."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(p: str) -> tuple[int, list[float]]:
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            times, n = [], 0
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"] and chunk["choices"][0]["text"]:
                        times.append(time.perf_counter())
            return n, times

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in results)
    gaps = [b - a for _, ts in results for a, b in zip(ts, ts[1:], strict=False)]
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_per_s": tokens / wall,
        "mean_gap_s": statistics.fmean(gaps),
    }


def _offline(llm, prompts: list[str], max_tokens: int, worker: ThreadPoolExecutor) -> dict:
    return worker.submit(_offline_run, llm, prompts, max_tokens).result()


def _offline_run(llm, prompts: list[str], max_tokens: int) -> dict:
    from stallfree.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    gaps = [g for o in outs for g in o.metrics.tbts]
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_per_s": tokens / wall,
        "mean_gap_s": statistics.fmean(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.serve_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2-135M)")
    ap.add_argument("--batch", type=int, default=32, help="prompts in the throughput batch")
    ap.add_argument("--prompt-words", type=int, default=48, help="words per prompt")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    ap.add_argument("--single-tokens", type=int, default=48, help="output tokens of the single-request run")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
                    help="torch threads of the server and of the offline engine (same for both)")  # fmt: skip
    ap.add_argument("--out", default="results/serve-bench", help="folder for the JSON")
    args = ap.parse_args(argv)

    import torch

    from stallfree.engine.llm import LLM

    # NOTE: the server steps its engine on a worker thread; the offline engine runs on one too, with the
    # same thread count, so both see the same OpenMP behaviour (which differs a lot on a busy box).
    worker = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(args.threads,))
    llm = LLM(args.model, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
              num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False)  # fmt: skip
    prompts = _prompts(args.batch, args.prompt_words)
    single = _prompts(1, args.prompt_words)
    port = free_port()
    proc = _start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    runs: dict[str, list[dict]] = {
        "offline_batch": [],
        "http_batch": [],
        "offline_single": [],
        "http_single": [],
    }
    try:
        asyncio.run(_http_batch(url, prompts[:4], 4))  # warm up both paths
        _offline(llm, prompts[:4], 4, worker)
        for rep in range(args.reps):
            runs["offline_batch"].append(_offline(llm, prompts, args.max_tokens, worker))
            runs["http_batch"].append(asyncio.run(_http_batch(url, prompts, args.max_tokens)))
            runs["offline_single"].append(_offline(llm, single, args.single_tokens, worker))
            runs["http_single"].append(asyncio.run(_http_batch(url, single, args.single_tokens)))
            print(f"rep {rep + 1}/{args.reps}: offline {runs['offline_batch'][-1]['tok_per_s']:.1f} tok/s, "
                  f"http {runs['http_batch'][-1]['tok_per_s']:.1f} tok/s", file=sys.stderr)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    off_tps, http_tps = med("offline_batch", "tok_per_s"), med("http_batch", "tok_per_s")
    off_gap, http_gap = med("offline_single", "mean_gap_s"), med("http_single", "mean_gap_s")
    result = {
        "config": vars(args),
        "throughput": {
            "offline_tok_per_s": off_tps,
            "http_tok_per_s": http_tps,
            "ratio": http_tps / off_tps,
            "tokens_per_run": runs["http_batch"][0]["tokens"],
        },
        "latency_per_token": {
            "offline_s": off_gap,
            "http_s": http_gap,
            "added_s": http_gap - off_gap,
            "batch_offline_s": med("offline_batch", "mean_gap_s"),
            "batch_http_s": med("http_batch", "mean_gap_s"),
        },
        "runs": runs,
        "load_average": os.getloadavg(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve-bench.json").write_text(json.dumps(result, indent=2))
    print(f"\nbatch of {args.batch} x {args.max_tokens} tokens (median of {args.reps}):")
    print(f"  offline LLM.generate  {off_tps:8.1f} output tok/s")
    print(f"  HTTP (SSE, streaming) {http_tps:8.1f} output tok/s   ratio {http_tps / off_tps:.3f}")
    print(f"single request, {args.single_tokens} tokens: time per output token")
    print(f"  offline {off_gap * 1e3:7.2f} ms   HTTP client {http_gap * 1e3:7.2f} ms   "
          f"added {(http_gap - off_gap) * 1e3:+.2f} ms/token")  # fmt: skip
    print(f"saved {out / 'serve-bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
