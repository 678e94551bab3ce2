"""Time between streamed tokens at a fixed number of concurrent streams: stallfree serve beside llama-server.

    python -m experiments.llamacpp.stream_gaps [--concurrency 1,2,4,8,16] [--tokens 64] [--reps 3]
        [--threads 2] [--slots 16] [--server NAME=URL ...] [--out FILE.json]

Starts `stallfree serve` (the defaults: bf16 + int4 on the CPU) and `scripts/peer-llamacpp serve` (llama-server,
--slots parallel slots, continuous batching) on the same GGUF with the same threads, then per repetition, per
concurrency, each server in turn: that many streaming completions at once (short distinct prompts, --tokens
tokens each, ignore_eos, temperature 0) through the openai client; the client's gaps between consecutive
streamed chunks with text. What it isolates is a decode iteration as a client sees it (engine step + server
+ HTTP), without prompt work: the capacity runs' median TBT is mostly this. --server adds an already running
OpenAI-compatible server (e.g. an older build) as one more row. Printed: the median gap and TTFT per server
and concurrency (median over repetitions, min-max spread); the JSON keeps every repetition.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from stallfree.bench.launcher import ServerProcess, ServerSpec
from stallfree.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


class PeerServer:
    """llama-server through scripts/peer-llamacpp serve, ready when /health answers 200."""

    def __init__(self, threads: int, slots: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(ROOT / "scripts/peer-llamacpp"), "serve", "--port", str(self.port),
                    "--threads", str(threads), "--slots", str(slots), "--slot-ctx", "1024"]  # fmt: skip
        self.log = log

    def __enter__(self) -> PeerServer:
        self._log = self.log.open("ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {self.proc.returncode} (log: {self.log})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"llama-server was not ready in 120 s (log: {self.log})")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


async def streams(url: str, n: int, tokens: int, salt: int) -> dict:
    """n concurrent streaming completions; every gap between text chunks and every TTFT, in seconds."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id

    async def one(i: int) -> tuple[list[float], float]:
        t0 = time.perf_counter()
        stream = await client.completions.create(
            model=model, prompt=f"Note {salt}-{i}: the weather today is", max_tokens=tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        at = [time.perf_counter() async for c in stream if c.choices and c.choices[0].text]
        return [b - a for a, b in zip(at, at[1:], strict=False)], at[0] - t0

    done = await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return {"gaps": [g for gaps, _ in done for g in gaps], "ttft": [t for _, t in done]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8,16", help="streams at once (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream (default %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each server (default %(default)s)")
    ap.add_argument(
        "--slots", type=int, default=16, help="llama-server's parallel slots (default %(default)s)"
    )
    ap.add_argument("--server", action="append", default=[], metavar="NAME=URL",
                    help="one more running OpenAI-compatible server to time (repeatable)")  # fmt: skip
    ap.add_argument("--out", default=None, help="write every repetition here as JSON")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    if a.slots < max(levels):
        ap.error(f"--slots {a.slots} < the largest --concurrency {max(levels)}: streams would queue")
    extra = dict(s.split("=", 1) for s in a.server)
    logs = Path(tempfile.mkdtemp(prefix="stream_gaps-"))  # the servers' logs
    print(f"server logs in {logs}", file=sys.stderr)
    spec = ServerSpec(threads=a.threads, max_num_seqs=max(levels))
    with (
        ServerProcess(spec, logs / "stream_gaps-stallfree.log") as ours,
        PeerServer(a.threads, a.slots, logs / "stream_gaps-llama-server.log") as peer,
    ):
        urls = {"stallfree": ours.url, f"llama-server -np {a.slots}": peer.url, **extra}
        for url in urls.values():  # warm-up: first requests after start are not measured
            asyncio.run(streams(url, 2, 8, salt=-1))
        runs: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in levels} for name in urls}
        for rep in range(a.reps):
            for n in levels:
                for name, url in urls.items():
                    r = asyncio.run(streams(url, n, a.tokens, salt=rep))
                    runs[name][n].append(r)
                    print(f"rep {rep} n={n:2d} {name:22s} median gap {statistics.median(r['gaps']) * 1e3:6.1f} ms",
                          file=sys.stderr, flush=True)  # fmt: skip
    table = {}
    w = max(len(name) for name in runs)
    print(f"{'server':{w}s} {'streams':>7s} {'median gap ms':>14s} {'spread':>13s} {'median TTFT ms':>15s}")
    for name, by_n in runs.items():
        table[name] = {}
        for n, reps in by_n.items():
            gaps = [statistics.median(r["gaps"]) * 1e3 for r in reps]
            ttft = [statistics.median(r["ttft"]) * 1e3 for r in reps]
            table[name][n] = {"median_gap_ms": statistics.median(gaps), "gap_ms_reps": gaps,
                              "median_ttft_ms": statistics.median(ttft)}  # fmt: skip
            print(f"{name:{w}s} {n:7d} {statistics.median(gaps):14.1f} {min(gaps):6.1f}-{max(gaps):<6.1f} "
                  f"{statistics.median(ttft):15.1f}")  # fmt: skip
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "table": table}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
