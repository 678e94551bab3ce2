"""`python -m experiments.responses_overhead`: what streaming through /v1/responses costs the server per
token, against /v1/chat/completions, on the same server and the same batch.

One `stallfree serve` process on the bundled model. Every repetition sends --batch concurrent streaming
requests to each endpoint in turn (which goes first alternates), each the same chat (one user message)
generating exactly --tokens tokens (ignore_eos, greedy), and reads every SSE event. What is measured is the
server process's CPU time (user + system, all its threads: HTTP, event building, engine) over the whole
round, divided by the tokens it streamed; the client runs in this process and is not counted. Process CPU
time is what the server spent, whatever else the box runs, so it holds up on a shared machine (run it under
`nice`); wall time per token is recorded beside it. Medians over repetitions; ratio = responses / chat.

The engine's forward pass dominates that figure and is the same for both, so the part that differs is also
measured alone, in this process: the CPU time of building one token's SSE event (chat: ResponseBuilder's
chunk; responses: ResponseWriter's output_text.delta event) over --batch x --tokens outputs, interleaved.
Results: responses-vs-chat-stream-cpu.json in --out.
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
from pathlib import Path

from stallfree.ports import free_port

ENDPOINTS = ("chat", "responses")
PROMPT = "Tell me a long story about a lighthouse keeper, number {i}."


def request_body(endpoint: str, i: int, tokens: int) -> tuple[str, dict]:
    """(path, body) of request i: the same conversation and sampling on either endpoint."""
    text = PROMPT.format(i=i)
    common = {"stream": True, "temperature": 0, "ignore_eos": True}
    if endpoint == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                                        **common}  # fmt: skip
    return "/v1/responses", {"input": text, "max_output_tokens": tokens, **common}


def count_tokens(endpoint: str, lines: list[str]) -> int:
    """Text-bearing events of one stream (one per token here); raises if the stream did not end well."""
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]
    if endpoint == "chat":
        if lines[-1] != "data: [DONE]" or any("error" in d for d in data):
            raise RuntimeError(f"a chat stream failed: {lines[-3:]}")
        return sum(1 for d in data if d["choices"] and d["choices"][0]["delta"].get("content"))
    if data[-1]["type"] not in ("response.completed", "response.incomplete"):
        raise RuntimeError(f"a responses stream failed: {data[-1]}")
    return sum(1 for d in data if d["type"] == "response.output_text.delta")


async def one_round(base: str, endpoint: str, batch: int, tokens: int, salt: int) -> int:
    """Stream `batch` requests at once; the text events received."""
    import httpx

    async def one(client: httpx.AsyncClient, i: int) -> int:
        path, body = request_body(endpoint, salt * batch + i, tokens)
        lines: list[str] = []
        async with client.stream("POST", base + path, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
        return count_tokens(endpoint, lines)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=batch)) as client:
        return sum(await asyncio.gather(*(one(client, i) for i in range(batch))))


def start_server(port: int, args: argparse.Namespace) -> subprocess.Popen:
    import httpx

    cmd = [sys.executable, "-m", "stallfree", "serve", "--port", str(port), "--max-num-seqs", str(args.batch),
           "--threads", str(args.threads), "--log-level", "warning", *args.serve_arg]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stallfree serve exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("stallfree serve did not become ready in 300 s")


def event_cost_us(endpoint: str, batch: int, tokens: int) -> float:
    """Process CPU microseconds per token to turn engine outputs into one stream's events, for `batch`
    streams of `tokens` tokens each (the per-token work of the HTTP path that differs between endpoints)."""
    from stallfree.engine.outputs import RequestOutput
    from stallfree.engine.server.responses import ResponseBuilder
    from stallfree.engine.server.responses_output import ResponseWriter

    word = " word"
    streams = []
    for b in range(batch):
        if endpoint == "chat":
            builder = ResponseBuilder("chat", f"chatcmpl-{b}", "model", None, False)  # type: ignore[arg-type]
            streams.append(lambda out, builder=builder: builder.delta_chunk(out))
        else:
            writer = ResponseWriter(f"resp_{b}", "model", {"store": True}, None)
            writer.start()
            streams.append(writer.feed)
    c0 = time.process_time()
    for t in range(tokens):
        last = t == tokens - 1
        for b, emit in enumerate(streams):
            ids = list(range(t + 1))
            out = RequestOutput(request_id=str(b), prompt_token_ids=[1] * 32, token_ids=ids, text=word * (t + 1),
                                new_token_ids=[t], new_text=word, finished=last,
                                finish_reason="length" if last else None)  # fmt: skip
            emit(out)
    return (time.process_time() - c0) * 1e6 / (batch * tokens)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.responses_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--batch", type=int, default=32, help="concurrent streams per round (default 32)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each stream generates (default 64)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions; both endpoints run in each (default 7)")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads (default 1)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `stallfree serve` argument "
                    "(repeatable), e.g. --serve-arg=--dtype=float32")  # fmt: skip
    ap.add_argument(
        "--out", default="results/responses-api", help="folder for responses-vs-chat-stream-cpu.json"
    )
    args = ap.parse_args(argv)

    import psutil

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(port, args)
    server = psutil.Process(proc.pid)

    def cpu() -> float:
        t = server.cpu_times()
        return t.user + t.system

    rounds: list[dict] = []
    try:
        for endpoint in ENDPOINTS:  # warm-up: kernels, the prefix cache of the template's head
            asyncio.run(one_round(base, endpoint, args.batch, min(args.tokens, 8), salt=10_000))
        for rep in range(args.reps):
            order = ENDPOINTS if rep % 2 == 0 else ENDPOINTS[::-1]
            for endpoint in order:
                c0, t0 = cpu(), time.perf_counter()
                n = asyncio.run(one_round(base, endpoint, args.batch, args.tokens, salt=rep))
                c1, t1 = cpu(), time.perf_counter()
                if n != args.batch * args.tokens:
                    raise RuntimeError(f"{endpoint}: {n} text events, expected {args.batch * args.tokens}")
                rounds.append({"rep": rep, "endpoint": endpoint, "tokens": n, "cpu_s": c1 - c0, "wall_s": t1 - t0,
                               "cpu_ms_per_token": (c1 - c0) * 1e3 / n, "wall_ms_per_token": (t1 - t0) * 1e3 / n})  # fmt: skip
            print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(60)

    events: dict[str, list[float]] = {e: [] for e in ENDPOINTS}
    for rep in range(args.reps * 3):  # cheap: more repetitions, alternating which goes first
        for endpoint in ENDPOINTS if rep % 2 == 0 else ENDPOINTS[::-1]:
            events[endpoint].append(event_cost_us(endpoint, args.batch, args.tokens))

    per = {e: [r for r in rounds if r["endpoint"] == e] for e in ENDPOINTS}
    ratios = [
        next(r for r in per["responses"] if r["rep"] == rep)["cpu_ms_per_token"]
        / next(r for r in per["chat"] if r["rep"] == rep)["cpu_ms_per_token"]
        for rep in range(args.reps)
    ]
    med = {e: {k: _median([r[k] for r in rs]) for k in ("cpu_ms_per_token", "wall_ms_per_token")}
           for e, rs in per.items()}  # fmt: skip
    result = {
        "what": "server process CPU (and wall) time per streamed token, /v1/responses vs /v1/chat/completions",
        "command": "python -m experiments.responses_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
        "batch": args.batch, "tokens_per_stream": args.tokens, "reps": args.reps, "threads": args.threads,
        "serve_args": args.serve_arg, "cpu_count": os.cpu_count(), "nice": os.nice(0),
        "median": med,
        "cpu_ratio_median_of_medians": med["responses"]["cpu_ms_per_token"] / med["chat"]["cpu_ms_per_token"],
        "cpu_ratio_per_rep": ratios,
        "cpu_ratio_median_of_reps": _median(ratios),
        "rounds": rounds,
        "event_building_us_per_token": {e: {"median": _median(v), "runs": v} for e, v in events.items()},
        "event_building_ratio": _median(events["responses"]) / _median(events["chat"]),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "responses-vs-chat-stream-cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"streaming at batch {args.batch}, {args.tokens} tokens each, {args.reps} interleaved reps; "
          f"server process CPU per token, median")  # fmt: skip
    for e in ENDPOINTS:
        print(
            f"  {e:10s} cpu {med[e]['cpu_ms_per_token']:7.3f} ms/token   wall {med[e]['wall_ms_per_token']:7.3f} ms/token"
        )
    print(f"  ratio responses/chat (CPU): {result['cpu_ratio_median_of_medians']:.3f} of medians, "
          f"{result['cpu_ratio_median_of_reps']:.3f} median of per-rep ratios {[round(r, 3) for r in ratios]}")  # fmt: skip
    ev = result["event_building_us_per_token"]
    print(f"  building one token's event alone (this process, median of {len(events['chat'])}): chat "
          f"{ev['chat']['median']:.2f} us, responses {ev['responses']['median']:.2f} us, "
          f"ratio {result['event_building_ratio']:.3f}")  # fmt: skip
    print(f"wrote {out / 'responses-vs-chat-stream-cpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
