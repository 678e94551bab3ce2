"""docker/engine.Dockerfile read statically (no Docker engine here): an image that can run the CUDA path on a
GPU node. Its base is a CUDA *devel* image (nvcc for FlashInfer's JIT) unless FlashInfer's kernels come
precompiled, the base's CUDA major.minor is the pinned torch build's, and the C toolchain and Python headers
that Triton's launcher is compiled with are installed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
DOCKERFILE = REPO / "docker" / "engine.Dockerfile"


def parse(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comment lines dropped (as Docker does)."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        keyword, _, rest = (buf + line).partition(" ")
        out.append((keyword.upper(), " ".join(rest.split())))
        buf = ""
    assert not buf, "the Dockerfile ends inside a continuation line"
    return out


@pytest.fixture(scope="module")
def image() -> dict:
    """The parsed Dockerfile: instructions, build-arg defaults, the base image with them substituted."""
    instructions = parse(DOCKERFILE.read_text())
    froms = [i for i, (kw, _) in enumerate(instructions) if kw == "FROM"]
    assert len(froms) == 1, "one stage expected"
    args = {}
    for kw, rest in instructions:
        if kw == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')

    def expand(s: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), s)  # shell vars stay

    runs = [rest for kw, rest in instructions if kw == "RUN"]
    env = " ".join(rest for kw, rest in instructions if kw == "ENV")
    return {
        "instructions": instructions,
        "args": args,
        "base": expand(instructions[froms[0]][1]),
        "runs": runs,
        "run": expand(" && ".join(runs)),
        "env": env,
        "expand": expand,
    }


def test_build_args_pin_cuda_torch_and_flashinfer(image):
    args = image["args"]
    for name in ("CUDA_VERSION", "TORCH_VERSION", "TORCH_CUDA", "FLASHINFER_VERSION"):
        assert args.get(name), f"build arg {name} with a default"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"]), "torch pinned to one release"
    assert re.fullmatch(r"cu\d{3,}", args["TORCH_CUDA"]), "torch's CUDA variant, e.g. cu130"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["CUDA_VERSION"])


def test_base_is_devel_or_flashinfer_kernels_are_precompiled(image):
    devel = re.fullmatch(r"nvidia/cuda:[\d.]+-(?:cudnn-)?devel-ubuntu[\d.]+", image["base"]) is not None
    # Precompiled only counts when the jit cache is installed by default, not behind a build arg left at 0.
    precompiled = image["args"].get("FLASHINFER_JIT_CACHE") == "1" and "flashinfer-jit-cache" in image["run"]
    assert devel or precompiled, f"{image['base']}: no nvcc and no precompiled FlashInfer kernels"


def test_the_base_cuda_is_the_pinned_torch_builds_cuda(image):
    m = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-", image["base"])
    assert m, f"base {image['base']!r} does not name a CUDA version"
    assert image["args"]["TORCH_CUDA"] == f"cu{m.group(1)}{m.group(2)}"
    pin = f"torch=={image['args']['TORCH_VERSION']}+{image['args']['TORCH_CUDA']}"
    assert pin in image["run"], f"torch installed as {pin}"
    assert f"download.pytorch.org/whl/{image['args']['TORCH_CUDA']}" in image["run"]
    # ... and the build itself stops when torch's CUDA and nvcc's disagree.
    assert "nvcc --version" in image["run"] and "torch.version.cuda" in image["run"]


def test_triton_can_build_its_launcher(image):
    installs = " ".join(r for r in image["runs"] if "apt-get install" in r).split()
    for package in ("gcc", "libc6-dev", "python3-dev", "python3-venv"):
        assert package in installs, f"{package} missing from apt-get install"
    # Link against the toolkit's stub: a GPU container has the driver's libcuda.so.1 but no libcuda.so.
    assert "TRITON_LIBCUDA_PATH=/usr/local/cuda/lib64/stubs" in image["env"]
    assert "-devel-" in image["base"], "the stubs ship in devel images only"


def test_flashinfer_is_pinned_and_its_kernel_cache_matches(image):
    version = image["args"]["FLASHINFER_VERSION"]
    assert f"flashinfer-python=={version}" in image["run"]
    assert "|| echo" not in image["run"], "a failed install must fail the build, not be skipped"
    if "flashinfer-jit-cache" in image["run"]:
        assert f"flashinfer-jit-cache=={version}" in image["run"]
        assert f"flashinfer.ai/whl/{image['args']['TORCH_CUDA']}" in image["run"]


def test_runs_the_server_as_uid_1000_under_tini(image):
    ins = image["instructions"]
    assert ("USER", "1000:1000") in ins
    assert any(kw == "RUN" and "useradd --uid 1000" in rest for kw, rest in ins)
    assert ins[-1][0] == "CMD" and '"stallfree", "serve"' in ins[-1][1]
    assert ("ENTRYPOINT", '["/usr/bin/tini", "--"]') in ins


def test_copied_sources_exist(image):
    for kw, rest in image["instructions"]:
        if kw == "COPY":
            *sources, _ = rest.split()
            for s in sources:
                assert (REPO / s).exists(), f"COPY {s}: not in the repository"
