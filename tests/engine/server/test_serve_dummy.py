"""`stallfree serve --load-format dummy --shape NAME`: the flags' meaning, their errors, and a real server
process with random weights answering the openai client over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from stallfree.engine.serve_cli import build_configs, build_parser, main, resolve_load_format
from stallfree.ports import free_port

STALLFREE = [sys.executable, "-m", "stallfree"]


def configs(*argv: str):
    return build_configs(build_parser().parse_args(list(argv)))[0]


def test_help_mentions_the_load_format(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--load-format {auto,dummy}" in out and "--shape" in out and "llama3-8b" in out


def test_shape_implies_dummy_and_names_the_model():
    c = configs("--shape", "llama3-8b")
    assert (c.load_format, c.model) == ("dummy", "llama3-8b")
    c = configs("--load-format", "dummy", "--shape", "mistral-7b")
    assert (c.load_format, c.model) == ("dummy", "mistral-7b")
    c = configs("--load-format", "dummy", "--model", "tiny-hd128")  # as vLLM: --model is the config
    assert (c.load_format, c.model) == ("dummy", "tiny-hd128")
    c = configs("--load-format", "dummy")  # the default shape: the bundled model's
    assert (c.load_format, c.model) == ("dummy", None)
    assert configs().load_format == "auto"
    assert resolve_load_format(None, None, "smollm2-135m") == ("smollm2-135m", "dummy")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--load-format", "auto", "--shape", "llama3-8b"], "--shape builds random weights"),
        (["--shape", "llama3-8b", "--model", "x.gguf"], "--shape and --model both name the model"),
        (["--shape", "llama-3-8b"], "smollm2-135m, llama3-8b, mistral-7b"),
        (["--load-format", "dummy", "--model", "/no/such/config.json"], "named shape"),
    ],
)
def test_contradictions_and_bad_shapes_fail_fast(capsys, argv, words):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


@pytest.mark.slow
def test_a_dummy_server_answers_the_openai_client():
    from openai import OpenAI

    port = free_port()
    proc = subprocess.Popen(
        [*STALLFREE, "serve", "--load-format", "dummy", "--shape", "smollm2-135m", "--max-model-len", "128",
         "--num-kv-blocks", "32", "--max-num-seqs", "4", "--device", "cpu", "--port", str(port),
         "--log-level", "warning"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["dummy-smollm2-135m"]
        out = client.completions.create(
            model="dummy-smollm2-135m", prompt="t100 t101 t102 t103", max_tokens=4, temperature=0.0
        )
        choice = out.choices[0]
        assert out.usage.prompt_tokens == 4 and 1 <= out.usage.completion_tokens <= 4
        assert choice.finish_reason in ("length", "stop") and choice.text.split()[0].startswith("t")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
