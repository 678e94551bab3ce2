"""hf:// sources against a real HTTP server that speaks the hub's file API (tests/fake_hub.py), through the
installed huggingface_hub: `stallfree download` as a process, the cache marker, resumed files, error reasons,
`serve --model hf://...` and the facts the operator sizes pods from."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub
from model_fixtures import make_tiny_hf_model, save_hf_folder, train_tiny_tokenizer

from stallfree.engine.hub import (
    MARKER,
    HubError,
    HubRef,
    download,
    hub_error,
    model_facts,
    parse_hub_uri,
)

STALLFREE = [sys.executable, "-m", "stallfree"]
TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (safetensors + tokenizer + chat template) and files an engine does
    not need (a .bin copy, a README), which the download must skip."""
    folder = save_hf_folder(tmp_path_factory.mktemp("tiny"), make_tiny_hf_model(), train_tiny_tokenizer())
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    (folder / "README.md").write_text("# tiny\n")
    return folder


@pytest.fixture(scope="module")
def hub(tiny_folder: Path) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add_repo("acme/tiny-llama", tiny_folder, tags=("v1",))
    fake.add_repo("acme/gated-llama", tiny_folder, token=TOKEN)
    fake.start()
    yield fake
    fake.stop()


def run_download(hub: FakeHub, tmp_path: Path, source: str, *extra: str, token: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
    if token:
        env["HF_TOKEN"] = token
    term = tmp_path / "termination-log"
    cmd = [*STALLFREE, "download", source, "--download-dir", str(tmp_path / "cache"),
           "--termination-message-path", str(term), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    return proc, (json.loads(term.read_text()) if term.exists() else None)


def test_parse_hub_uri():
    assert parse_hub_uri("hf://Qwen/Qwen3-8B") == HubRef("Qwen", "Qwen3-8B", "main")
    ref = parse_hub_uri("hf://meta-llama/Llama-3.1-8B-Instruct@refs/pr/7")
    assert ref.revision == "refs/pr/7" and ref.local_dir("/m") == Path(
        "/m/meta-llama/Llama-3.1-8B-Instruct/refs--pr--7"
    )
    for bad in (
        "Qwen/Qwen3-8B",
        "hf://Qwen",
        "hf://Qwen/Qwen3-8B/extra",
        "hf://a/b@",
        "hf://../b",
        "hf://a/b@x y",
    ):
        with pytest.raises(ValueError, match=r"hf://ORG/NAME\[@REVISION\]"):
            parse_hub_uri(bad)


def test_download_fills_the_cache_with_serving_files_only_then_works_offline(hub: FakeHub, tmp_path: Path):
    proc, term = run_download(hub, tmp_path, "hf://acme/tiny-llama")
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip().splitlines()[-1])
    assert folder == tmp_path / "cache" / "acme" / "tiny-llama" / "main" and term is None
    names = {p.name for p in folder.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER} <= names
    assert "pytorch_model.bin" not in names and "README.md" not in names
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).read_bytes() == hub.repos["acme/tiny-llama"].files[name]
    assert json.loads((folder / MARKER).read_text())["commit"] == hub.repos["acme/tiny-llama"].commit

    seen = len(hub.requests)
    proc, _ = run_download(hub, tmp_path, "hf://acme/tiny-llama")
    assert proc.returncode == 0 and Path(proc.stdout.strip().splitlines()[-1]) == folder
    assert len(hub.requests) == seen, "a complete cache must not touch the hub"


def test_sharded_checkpoints_fetch_the_indexed_shards_only(tmp_path: Path):
    """A repo with an index gets exactly the shards it names: a consolidated copy beside them and the
    original/ folder stay on the hub (Mistral and Llama repos carry both)."""
    shards = {f"model-0000{i}-of-00002.safetensors": bytes([i]) * (1000 * i) for i in (1, 2)}
    index = {"metadata": {"total_size": 3000}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
             "b.weight": "model-00002-of-00002.safetensors", "c.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
    files = {
        "config.json": b'{"num_hidden_layers": 1}',
        "tokenizer.json": b"{}",
        "model.safetensors.index.json": json.dumps(index).encode(),
        "consolidated.safetensors": b"x" * 3000,
        "original/params.safetensors": b"y" * 10,
        "README.md": b"# sharded",
        **shards,
    }
    hub = FakeHub()
    hub.add_repo("acme/sharded", files)
    hub.start()
    try:
        folder = download(parse_hub_uri("hf://acme/sharded"), tmp_path, endpoint=hub.url)
        facts = model_facts(parse_hub_uri("hf://acme/sharded"), endpoint=hub.url)
    finally:
        hub.stop()
    got = sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts
    )
    assert got == sorted([MARKER, "config.json", "tokenizer.json", "model.safetensors.index.json", *shards])
    assert facts.weight_bytes == 3000 and facts.config == {"num_hidden_layers": 1}


def test_interrupted_file_resumes_where_it_stopped(tmp_path: Path):
    """A transfer cut after the first 10 MiB chunk (huggingface_hub writes in 10 MiB chunks) continues with
    a Range request from there instead of starting again."""
    weights = os.urandom(24 << 20)
    hub = FakeHub()
    hub.add_repo("acme/big", {"config.json": b"{}", "model.safetensors": weights})
    hub.truncate_once["model.safetensors"] = 15 << 20
    hub.start()
    try:
        folder = download(parse_hub_uri("hf://acme/big"), tmp_path, endpoint=hub.url)
    finally:
        hub.stop()
    assert (folder / "model.safetensors").read_bytes() == weights
    assert hub.ranges == [("model.safetensors", f"bytes={10 << 20}-")]


@pytest.mark.parametrize(
    ("source", "token", "reason", "words"),
    [
        ("hf://acme/no-such-model", None, "RepoNotFound", "acme/no-such-model does not exist"),
        ("hf://acme/gated-llama", None, "GatedRepo", "gated"),
        ("hf://acme/gated-llama", "hf_wrong", "GatedRepo", "gated"),
        ("hf://acme/tiny-llama@no-such-branch", None, "RevisionNotFound", "no revision 'no-such-branch'"),
        ("acme/tiny-llama", None, "InvalidSource", "hf://ORG/NAME"),
    ],
)
def test_failures_exit_1_with_a_reason_for_the_operator(hub, tmp_path, source, token, reason, words):
    proc, term = run_download(hub, tmp_path, source, token=token)
    assert proc.returncode == 1
    assert term["reason"] == reason and words in term["message"], term
    assert reason in proc.stderr
    assert not list((tmp_path / "cache").rglob(MARKER))


def test_gated_repo_with_its_token_downloads(hub: FakeHub, tmp_path: Path):
    proc, term = run_download(hub, tmp_path, "hf://acme/gated-llama", token=TOKEN)
    assert proc.returncode == 0, proc.stderr
    assert (Path(proc.stdout.strip().splitlines()[-1]) / "model.safetensors").is_file()


def test_unreachable_hub_is_its_own_reason(tmp_path: Path):
    closed = FakeHub().start()
    closed.stop()  # a port nothing listens on any more
    with pytest.raises(HubError) as e:
        download(parse_hub_uri("hf://acme/tiny-llama"), tmp_path, endpoint=closed.url)
    assert e.value.reason == "HubUnreachable" and not e.value.permanent


def test_full_disk_maps_to_disk_full():
    err = hub_error(OSError(errno.ENOSPC, "No space left on device"), parse_hub_uri("hf://a/b"))
    assert err.reason == "DiskFull" and "spec.model.cache.size" in err.message


def test_model_facts_read_config_and_weight_bytes_without_weights(hub: FakeHub, tiny_folder: Path):
    before = len(hub.requests)
    facts = model_facts(parse_hub_uri("hf://acme/tiny-llama"), endpoint=hub.url)
    assert facts.commit == hub.repos["acme/tiny-llama"].commit
    assert facts.config == json.loads((tiny_folder / "config.json").read_text())
    assert facts.weight_bytes == (tiny_folder / "model.safetensors").stat().st_size
    fetched = [p for _, p in hub.requests[before:] if "/resolve/" in p]
    assert fetched and all(p.endswith("/config.json") for p in fetched)
    with pytest.raises(HubError) as e:
        model_facts(parse_hub_uri("hf://acme/gated-llama"), endpoint=hub.url)
    assert e.value.reason == "GatedRepo" and e.value.permanent
    assert model_facts(parse_hub_uri("hf://acme/gated-llama"), endpoint=hub.url, token=TOKEN).weight_bytes


def test_serve_resolves_hf_models_through_the_same_cache(hub: FakeHub, tmp_path: Path, monkeypatch):
    from stallfree.engine.serve_cli import build_configs, build_parser

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    args = build_parser().parse_args(["--model", "hf://acme/tiny-llama", "--download-dir", str(tmp_path)])
    config, _ = build_configs(args)
    assert config.model == str(tmp_path / "acme" / "tiny-llama" / "main")
    assert (Path(config.model) / MARKER).is_file()
    args = build_parser().parse_args(["--model", "hf://acme/missing", "--download-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="RepoNotFound"):
        build_configs(args)
