"""A stream never ends silently: killing the engine replica behind `stallfree up` in the middle of 6
streaming completions (or 4 streaming /v1/responses) ends every one of them with an error the openai SDK
raises, not a short answer."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from promserver import free_port

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "examples" / "local.yaml"
MODEL = "SmolLM2-135M-Instruct"


def wait_ready(proc: subprocess.Popen, base: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("stallfree up never became ready")


def replica_process(up: subprocess.Popen, port: int) -> psutil.Process:
    for child in psutil.Process(up.pid).children(recursive=True):
        cmd = child.cmdline()
        if "serve" in cmd and str(port) in cmd:
            return child
    raise AssertionError(f"no engine replica on port {port} among the children of stallfree up")


@contextlib.contextmanager
def local_up():
    """`stallfree up examples/local.yaml`: (the process, its base URL, the engine replica's process)."""
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "stallfree", "up", str(LOCAL), "--port", str(port), "--no-view"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(up, base)
        engine = httpx.get(f"{base}/admin/v1/status").json()["engines"][0]
        yield up, base, replica_process(up, int(engine["url"].rsplit(":", 1)[1]))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


def kill_when_all_stream(victim: psutil.Process, consume, n: int) -> list[object]:
    """Run consume(i, started) for i < n in threads; kill the replica once all n have streamed a few
    tokens (each calls started.wait() then); what each returned or raised."""
    started = threading.Barrier(n + 1)
    results: list[object] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = consume(i, started)
        except Exception as e:  # noqa: BLE001 - recorded and checked by the caller
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait(timeout=180)  # all n streams are producing tokens
    victim.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.mark.slow
def test_killing_the_replica_mid_stream_ends_every_stream_with_an_error(tmp_path):
    from openai import APIError, OpenAI

    with local_up() as (_, base, victim):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)

        def consume(i: int, started: threading.Barrier) -> object:
            text = ""
            stream = client.completions.create(model=MODEL, prompt=f"Story {i}: once upon a time",
                                               max_tokens=400, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            for n, chunk in enumerate(stream):
                text += chunk.choices[0].text if chunk.choices else ""
                if n == 2:
                    started.wait(timeout=120)
            return ("finished", text)

        results = kill_when_all_stream(victim, consume, 6)
        assert_every_stream_failed_explicitly(results)
        # the replica comes back and serves again
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                r = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=3)
                assert r.choices[0].text is not None
                break
            except APIError:
                time.sleep(1)
        else:
            raise AssertionError("the replica did not come back")


def assert_every_stream_failed_explicitly(results: list[object]) -> None:
    """Every stream raised the proxy's error event: not a dropped connection, not a short answer."""
    from openai import APIConnectionError, APIError

    outcomes = [type(got).__name__ + ": " + str(got)[:200] for got in results]
    assert all(isinstance(got, APIError) and not isinstance(got, APIConnectionError) for got in results), (
        outcomes
    )
    assert all("incomplete" in str(got) or "before it was complete" in str(got) for got in results), outcomes


@pytest.mark.slow
def test_killing_the_replica_mid_stream_fails_every_responses_stream():
    """/v1/responses through the proxy: a whole stream ends with response.completed and nothing after it;
    streams cut by the replica's death raise APIError in the SDK's responses.stream() helper."""
    from openai import OpenAI

    with local_up() as (_, base, victim):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=200) as stream:
            events = [e.type for e in stream]
            assert events[-1] == "response.completed" and stream.get_final_response().output_text

        def consume(i: int, started: threading.Barrier) -> object:
            deltas = 0
            with client.responses.stream(model=MODEL, input=f"Story {i}: once upon a time",
                                         max_output_tokens=400, extra_body={"ignore_eos": True}) as stream:  # fmt: skip
                for event in stream:
                    if event.type == "response.output_text.delta":
                        deltas += 1
                        if deltas == 3:
                            started.wait(timeout=120)
                return ("finished", stream.get_final_response().output_text)

        results = kill_when_all_stream(victim, consume, 4)
        assert_every_stream_failed_explicitly(results)
