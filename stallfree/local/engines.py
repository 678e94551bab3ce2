"""Engine replicas as local `stallfree serve` processes: start, watch, restart, scale, stop.

Each replica gets a free port on 127.0.0.1, the run's admin token, and the engine config file (the same
document the operator writes to the ConfigMap key engine.yaml). The controller rewrites that file whenever
it changes settings, so a replica that crashes and restarts comes back tuned.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from stallfree.operator.builders.config import engine_config
from stallfree.operator.builders.meta import BuildContext, Owner, Tuned
from stallfree.operator.builders.workload import budget_args
from stallfree.operator.controller.applier import Target
from stallfree.operator.controller.types import Settings
from stallfree.operator.spec import SarathiSpec
from stallfree.ports import free_port

log = logging.getLogger(__name__)


def write_engine_config(
    path: Path, name: str, raw_spec: dict, spec: SarathiSpec, settings: Settings | None
) -> None:
    """engine.yaml for the replicas: the spec's clusters with the controller's settings on top."""
    tuned = Tuned()
    if settings is not None:
        tuned = Tuned(
            token_budget=settings.token_budget,
            time_target=settings.time_target,
            replicas=settings.replicas,
            clusters={n: k.as_engine() for n, k in settings.clusters.items()},
        )
    ctx = BuildContext(Owner(name, "local", "local"), spec, raw_spec, engine_image="", tuned=tuned)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(engine_config(ctx), sort_keys=False))
    tmp.replace(path)


@dataclass
class Replica:
    index: int
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    ready: bool = False
    restarts: int = 0
    started_at: float = 0.0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EngineFleet:
    """The local engine replicas of one SarathiDeployment."""

    name: str
    spec: SarathiSpec
    run_dir: Path
    config_path: Path
    admin_token: str
    stats_window_s: float
    cost_model: Path | None = None  # time mode: a cost_model.json, the engines' --cost-model prior
    replicas: list[Replica] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def command(self, port: int) -> list[str]:
        s = self.spec
        cmd = [sys.executable, "-m", "stallfree", "serve", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--policy", s.engine.policy, "--max-num-seqs", str(s.engine.max_num_seqs)]
        # as the pods: --token-budget alone (tokens mode), or the cap with --time-target (time mode)
        ctx = BuildContext(Owner(self.name, "local", "local"), s, {}, engine_image="")
        cmd += budget_args(ctx, None if self.cost_model is None else str(self.cost_model))
        cmd += ["--block-size", str(s.engine.block_size), "--dtype", s.model.dtype]
        cmd += ["--traffic-clusters", str(self.config_path)]  # the admin token goes by env (_spawn)
        cmd += ["--stats-window", str(self.stats_window_s), "--log-level", "warning"]
        cmd += ["--served-model-name", s.model.name]  # clients send spec.model.name, as in the cluster
        if s.model.max_model_len:
            cmd += ["--max-model-len", str(s.model.max_model_len)]
        if s.budget.chunk_context_scale is not None:
            cmd += ["--chunk-context-scale", str(s.budget.chunk_context_scale)]
        if s.model.source.type == "HostPath" and s.model.source.path:
            cmd += ["--model", s.model.source.path]
        elif s.model.source.type == "HuggingFace" and s.model.source.uri:
            cmd += ["--model", s.model.source.uri]  # serve downloads it once into the local model cache
        return cmd

    def _spawn(self, r: Replica) -> None:
        log_file = open(r.log_path, "ab")  # noqa: SIM115 - owned by the child
        threads = max(1, (os.cpu_count() or 2) // max(1, self.spec.replicas.max))
        # The token goes in the environment, as the operator's pods get it: on a command line a token that
        # starts with "-" reads as an option to argparse, and any local user could read it with ps.
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
            "STALLFREE_ADMIN_TOKEN": self.admin_token,
        }
        r.proc = subprocess.Popen(
            self.command(r.port),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches us only; we stop the engines in order
            preexec_fn=_die_with_parent,
        )
        log_file.close()
        r.ready = False
        r.started_at = time.monotonic()

    def scale_to(self, n: int) -> None:
        with self._lock:
            while len(self.replicas) < n:
                i = len(self.replicas)
                r = Replica(index=i, port=free_port(), log_path=self.run_dir / f"replica-{i}.log")
                self.replicas.append(r)
                self._spawn(r)
                log.info("started replica %d on port %d", i, r.port)
            while len(self.replicas) > n:
                r = self.replicas.pop()
                _terminate(r)
                log.info("stopped replica %d", r.index)

    def check(self) -> None:
        """Mark replicas ready; restart the ones that died (they read the tuned engine config)."""
        for r in list(self.replicas):
            if not r.alive():
                code = r.proc.returncode if r.proc else None
                log.warning("replica %d exited (%s); restarting it, log: %s", r.index, code, r.log_path)
                r.restarts += 1
                self._spawn(r)
                continue
            if not r.ready:
                try:
                    r.ready = httpx.get(f"{r.base}/ready", timeout=2).status_code == 200
                except httpx.HTTPError:
                    r.ready = False

    def endpoints(self) -> list[str]:
        return [r.base for r in self.replicas if r.ready and r.alive()]

    def targets(self) -> list[Target]:
        """The ready replicas, for the controller's applier: a restarted replica is a new incarnation
        (it read engine.yaml afresh), so it is sent the settings again."""
        return [Target(r.base, key=f"{r.base}#{r.restarts}") for r in self.replicas if r.ready and r.alive()]

    def wait_ready(self, timeout_s: float, stop: threading.Event | None = None) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            self.check()
            if self.replicas and all(r.ready for r in self.replicas):
                return True
            for r in self.replicas:
                if r.restarts > 2:
                    raise RuntimeError(
                        f"replica {r.index} keeps exiting; see {r.log_path}:\n{_tail(r.log_path)}"
                    )
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        with self._lock:
            for r in self.replicas:
                if r.alive():
                    r.proc.send_signal(signal.SIGTERM)  # all at once: they drain in parallel
            for r in self.replicas:
                _terminate(r)


def _die_with_parent() -> None:
    """In the child: get SIGTERM when local mode dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _terminate(r: Replica, grace_s: float = 15.0) -> None:
    if r.proc is None or r.proc.poll() is not None:
        return
    r.proc.terminate()
    try:
        r.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        r.proc.kill()
        r.proc.wait()


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
