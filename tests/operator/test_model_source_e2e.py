"""From hf:// to a chat completion, with the operator's own manifests: the download init container's exact
command (mount paths moved into a temp dir) runs as a process against a real HTTP server that speaks the
hub's file API and fills the model cache; the engine container's exact arguments then start `stallfree
serve` on that folder, and the real openai client gets an answer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest_k8s import free_port
from fake_hub import FakeHub
from model_fixtures import make_tiny_hf_model, save_hf_folder, train_tiny_tokenizer
from test_builders import make_ctx

from stallfree.operator.builders import build_children, render_engine_config
from stallfree.operator.builders.meta import CONFIG_DIR, CONFIG_KEY, MODELS_DIR
from stallfree.operator.builders.model import TERMINATION_LOG

MODEL_NAME = "acme/tiny-chat"


def _pod_spec(ctx) -> dict:
    workload = next(c for c in build_children(ctx) if c["kind"] == "Deployment")
    return workload["spec"]["template"]["spec"]


def _local(value: str, root: Path, term: Path) -> str:
    """A manifest string with the pod's paths moved under `root`."""
    if value == TERMINATION_LOG:
        return str(term)
    if value.startswith(CONFIG_DIR):
        return str(root / "config" / value[len(CONFIG_DIR) + 1 :])
    if value.startswith(MODELS_DIR):
        return str(root / "models") + value[len(MODELS_DIR) :]
    return value


def _command(container: dict, root: Path, term: Path) -> list[str]:
    assert container["command"][0] == "stallfree"
    argv = [*container["command"][1:], *container["args"]]
    return [sys.executable, "-m", "stallfree", *(_local(a, root, term) for a in argv)]


def _env(container: dict, root: Path, term: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = _local(e["value"], root, term)
    return env


@pytest.mark.slow
def test_init_container_fills_the_cache_and_the_engine_serves_it(tmp_path: Path):
    folder = save_hf_folder(tmp_path / "published", make_tiny_hf_model(), train_tiny_tokenizer())
    hub = FakeHub()
    hub.add_repo("acme/tiny-llama", folder)
    hub.start()
    proc = None
    try:
        spec = {
            "model": {
                "name": MODEL_NAME,
                "source": {"type": "HuggingFace", "uri": "hf://acme/tiny-llama", "endpoint": hub.url},
                "dtype": "float32",
                "maxModelLen": 128,
            },
            "resources": {"gpusPerPod": 0},
            "engine": {"maxNumSeqs": 8},
        }
        ctx = make_ctx(spec)
        pod = _pod_spec(ctx)
        root, term = tmp_path / "pod", tmp_path / "termination-log"
        (root / "config").mkdir(parents=True)
        (root / "config" / CONFIG_KEY).write_text(render_engine_config(ctx))

        (init,) = pod["initContainers"]
        done = subprocess.run(_command(init, root, term), env=_env(init, root, term), capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert (root / "models" / "acme" / "tiny-llama" / "main" / "model.safetensors").is_file()
        assert not term.exists()
        again = subprocess.run(_command(init, root, term), env=_env(init, root, term), capture_output=True,
                               text=True, timeout=120)  # fmt: skip
        assert again.returncode == 0 and "already downloaded" in again.stderr  # a restart: no download

        engine = next(c for c in pod["containers"] if c["name"] == "engine")
        argv = _command(engine, root, term)
        port = free_port()
        argv[argv.index("--port") + 1] = str(port)
        argv[argv.index("--host") + 1] = "127.0.0.1"
        argv += ["--num-kv-blocks", "64", "--log-level", "warning"]
        proc = subprocess.Popen(argv, env=_env(engine, root, term), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 420  # a loaded 2-core box can take minutes (first CPU kernel build)
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "engine not ready after 420 s"
            time.sleep(0.3)

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        ids = [m.id for m in client.models.list().data]
        assert ids == [MODEL_NAME]  # spec.model.name, through --served-model-name
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
        )
        assert reply.choices[0].message.content is not None
        assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens > 1
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        hub.stop()
