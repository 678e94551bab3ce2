"""--served-model-name and --max-model-len (vLLM's flags) on a real `stallfree serve` process serving a
tiny Qwen3 folder written by transformers, through the openai client over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from stallfree.engine import LLM
from stallfree.engine.engine import resolve_max_model_len
from stallfree.engine.serve_cli import build_configs, build_parser, main
from stallfree.ports import free_port

sys.path.insert(0, str(Path(__file__).parents[1]))
from model_fixtures import make_tiny_hf_model, save_hf_folder, train_qwen_style_tokenizer  # noqa: E402

MAX_LEN = 48


def _settings(*argv: str):
    return build_configs(build_parser().parse_args(list(argv)))


def test_flags_reach_the_configs():
    engine_config, settings = _settings("--served-model-name", "a", "b", "--max-model-len", "64")
    assert settings.served_model_names == ("a", "b") and engine_config.max_model_len == 64
    engine_config, settings = _settings()
    assert settings.served_model_names == () and engine_config.max_model_len is None


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--served-model-name", "a", "a"], "distinct non-empty names"),
        (["--served-model-name", ""], "distinct non-empty names"),
        (["--max-model-len", "1"], "--max-model-len must be >= 2"),
    ],
)
def test_bad_flags_fail_fast(capsys, argv, words):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_max_model_len_beyond_the_model_is_refused():
    assert resolve_max_model_len(None, 8192) == 8192 and resolve_max_model_len(100, 8192) == 100
    with pytest.raises(ValueError, match="max_model_len 9000 exceeds the model's context length 8192"):
        LLM(
            "tiny-hd128",
            load_format="dummy",
            device="cpu",
            dtype="float32",
            max_model_len=9000,
            num_kv_blocks=8,
        )


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    tok = train_qwen_style_tokenizer()
    folder = save_hf_folder(tmp_path_factory.mktemp("qwen3") / "Qwen3-tiny", make_tiny_hf_model(
        "qwen3", tie=True, vocab_size=tok.get_vocab_size(), head_dim=32, bos_token_id=317, eos_token_id=319,
    ), tok)  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stallfree", "serve", "--model", str(folder), "--dtype", "float32",
         "--served-model-name", "qwen3-tiny", "team/alias", "--max-model-len", str(MAX_LEN),
         "--attention-backend", "torch", "--num-kv-blocks", "32", "--device", "cpu", "--port", str(port),
         "--log-level", "warning"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server never became ready"
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url, tok
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_served_names_are_listed_accepted_and_echoed(qwen3_server):
    url, _ = qwen3_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    models = client.models.list().data
    assert [m.id for m in models] == ["qwen3-tiny", "team/alias"]
    assert {m.model_extra["max_model_len"] for m in models} == {MAX_LEN}
    for name in ("qwen3-tiny", "team/alias"):
        out = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0
        )
        assert out.model == "qwen3-tiny" and out.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="Qwen3-tiny", prompt="hello", max_tokens=2)  # the folder's name
    assert e.value.code == "model_not_found" and "'qwen3-tiny', 'team/alias'" in e.value.message


def test_prompt_plus_max_tokens_beyond_max_model_len_is_400_context_length_exceeded(qwen3_server):
    url, tok = qwen3_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    prompt = [5] * 40
    ok = client.completions.create(
        model="qwen3-tiny", prompt=prompt, max_tokens=MAX_LEN - 40, temperature=0.0
    )
    assert ok.usage.prompt_tokens + ok.usage.completion_tokens <= MAX_LEN
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="qwen3-tiny", prompt=prompt, max_tokens=MAX_LEN - 39)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert e.value.param == "max_tokens" and f"maximum context length is {MAX_LEN}" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # the prompt alone fills the context
        client.chat.completions.create(model="qwen3-tiny", messages=[{"role": "user", "content": "a " * 60}])
    assert e.value.code == "context_length_exceeded"
    body = httpx.post(
        f"{url}/v1/completions", json={"model": "qwen3-tiny", "prompt": prompt, "max_tokens": 9}
    )
    assert body.status_code == 400 and json.loads(body.text)["error"]["type"] == "invalid_request_error"
