"""Fixtures and helpers for tests against the real control plane of scripts/testenv.

Imported by tests/operator/conftest.py and tests/chart/conftest.py (`from conftest_k8s import *`; tests/
is on sys.path via tests/conftest.py). One control plane per pytest session: the first fixture that needs
it runs `scripts/testenv up` with its state in a temporary folder, and the session's end stops it.
Set STALLFREE_TESTENV_REUSE=1 to use an environment you started yourself (`eval $(scripts/testenv up)`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from stallfree.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TESTENV = ROOT / "scripts" / "testenv"
CRD_FILE = ROOT / "crds" / "sarathideployment.yaml"
GROUP, VERSION, PLURAL = "serving.stallfree.dev", "v1alpha1", "sarathideployments"
_ns_counter = itertools.count()


def wait_until(
    predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.25, what: str = ""
) -> object:
    """Poll until predicate() is truthy; return its value, or fail with `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}; last value: {last!r}")


@dataclass
class K8sEnv:
    """A running control plane: kubeconfig, tool paths and small helpers around kubectl/helm."""

    kubeconfig: Path
    tool_dir: Path
    state_dir: Path
    env: dict = field(default_factory=dict)

    def run(self, tool: str, *args: str, input: str | None = None, check: bool = True, timeout: float = 60):
        proc = subprocess.run(
            [str(self.tool_dir / tool), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}"
            )
        return proc

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run("kubectl", *args, **kw)

    def helm(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run("helm", *args, **kw)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict | None:
        args = ["get", kind, name, "-o", "json"] + (["-n", namespace] if namespace else [])
        proc = self.kubectl(*args, check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise AssertionError(proc.stderr)
        return json.loads(proc.stdout)

    def list(self, kind: str, namespace: str, selector: str | None = None) -> list[dict]:
        args = ["get", kind, "-n", namespace, "-o", "json"] + (["-l", selector] if selector else [])
        return json.loads(self.kubectl(*args).stdout)["items"]

    def apply(
        self, manifest: dict | str, namespace: str | None = None, *extra: str
    ) -> subprocess.CompletedProcess:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl("apply", "-f", "-", *(["-n", namespace] if namespace else []), *extra, input=text)

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))


def _binaries_built() -> bool:
    proc = subprocess.run([str(TESTENV), "paths"], capture_output=True, text=True)
    if proc.returncode != 0:
        return False
    bindir, tooldir = proc.stdout.split()
    return (Path(bindir) / "kube-apiserver").exists() and (Path(tooldir) / "kubectl").exists()


@pytest.fixture(scope="session")
def k8s() -> Iterator[K8sEnv]:
    """The control plane (kube-apiserver, etcd, controller-manager, scheduler, kwok GPU nodes)."""
    if not _binaries_built():
        if os.environ.get("CI"):
            pytest.fail(
                "the control plane is not built: scripts/testenv build (run by scripts/bootstrap --test)"
            )
        pytest.skip("the control plane is not built: run scripts/testenv build")
    reuse = os.environ.get("STALLFREE_TESTENV_REUSE") == "1"
    state = (
        Path(os.environ["STALLFREE_TESTENV_DIR"])
        if reuse
        else Path(tempfile.mkdtemp(prefix="stallfree-k8s-"))
    )
    env = {**os.environ, "STALLFREE_TESTENV_DIR": str(state)}
    up = subprocess.run([str(TESTENV), "up"], capture_output=True, text=True, env=env, timeout=300)
    if up.returncode != 0:
        pytest.fail(f"scripts/testenv up failed:\n{up.stderr[-4000:]}")
    exports = dict(re.findall(r"^export (\w+)=(.*)$", up.stdout, re.M))
    tool_dir = Path(exports["PATH"].split(":")[0])
    kubeconfig = Path(exports["KUBECONFIG"])
    env.update(KUBECONFIG=str(kubeconfig), PATH=f"{tool_dir}:{os.environ.get('PATH', '')}")
    try:
        yield K8sEnv(kubeconfig=kubeconfig, tool_dir=tool_dir, state_dir=state, env=env)
    finally:
        if not reuse:
            subprocess.run([str(TESTENV), "down"], capture_output=True, env=env, timeout=120)


@pytest.fixture(scope="session")
def crd(k8s: K8sEnv) -> dict:
    """The SarathiDeployment CRD installed from crds/ and Established."""
    k8s.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))

    def established() -> bool:
        crd = k8s.get("crd", f"{PLURAL}.{GROUP}") or {}
        conditions = (crd.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_until(established, timeout=60, what="CRD Established")

    # Established is not yet served: until the API server's storage for the new resource has initialized,
    # LIST and WATCH answer 429 "storage is (re)initializing", and an operator started now backs off
    # before it sees anything. Wait until a LIST is answered.
    def listed() -> bool:
        return k8s.kubectl("get", PLURAL, "--all-namespaces", "-o", "name", check=False).returncode == 0

    wait_until(listed, timeout=60, what=f"LIST {PLURAL} answered")
    return yaml.safe_load(CRD_FILE.read_text())


@pytest.fixture
def namespace(k8s: K8sEnv, request) -> Iterator[str]:
    """A fresh namespace per test (deleted afterwards without waiting)."""
    base = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-")
    name = f"t{next(_ns_counter)}-{base}"
    k8s.kubectl("create", "namespace", name)
    yield name
    k8s.kubectl("delete", "namespace", name, "--wait=false", check=False)


class OperatorProcess:
    """`stallfree operator` as a real process (the way it runs in its pod), with a liveness probe."""

    def __init__(self, k8s: K8sEnv, *args: str, kubeconfig: Path | None = None, resync: float = 2.0) -> None:
        self.port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix="stallfree-operator-", suffix=".log")[1])
        env = {**k8s.env, "KUBECONFIG": str(kubeconfig or k8s.kubeconfig), "PYTHONUNBUFFERED": "1"}
        cmd = [
            sys.executable, "-c", "import sys; from stallfree.cli import main; sys.exit(main())", "operator", *args,
            "--resync-seconds", str(resync),
            "--liveness", f"http://127.0.0.1:{self.port}/healthz",
        ]  # fmt: skip
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir()
        )
        wait_until(self.healthy, timeout=60, what=f"operator liveness endpoint; log:\n{self.log_path}")

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"operator exited with {self.proc.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text()

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def load_example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())
