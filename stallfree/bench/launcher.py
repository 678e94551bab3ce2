"""Start and stop `stallfree serve` for a benchmark: one process per policy, on a free local port.

The server's output goes to a log file next to the results. `sarathi-nohybrid` (the paper's chunking-only
ablation) is `stallfree serve --policy sarathi --no-hybrid-batching`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stallfree.bench.simulator import split_policy
from stallfree.ports import free_port

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerSpec:
    """What to start: the same knobs for every policy, so runs differ only in the policy."""

    policy: str = "sarathi"
    token_budget: int = 512
    max_num_seqs: int = 128
    num_kv_blocks: int | None = None
    chunk_align: int = 0
    chunk_context_scale: int | None = None
    model: str | None = None
    load_format: str = "auto"  # "dummy": random weights of the shape `model` names (stallfree serve --shape)
    threads: int = 1  # torch CPU threads (OMP_NUM_THREADS)
    extra_args: list[str] = field(default_factory=list)
    prefix_caching: bool = True
    # Time-budgeted iterations (sarathi): the target (token_budget is then the cap) and the one cluster's
    # SLOs (P99 TBT, P99 TTFT) the server is told, as a user who writes SLOs and nothing else
    time_target: float | None = None
    slo: tuple[float, float] | None = None

    def command(self, port: int) -> list[str]:
        policy, hybrid = split_policy(self.policy)
        head = [sys.executable, "-m", "stallfree", "serve"]
        if not hybrid:
            head.append("--no-hybrid-batching")
        cmd = [*head, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--token-budget", str(self.token_budget), "--max-num-seqs", str(self.max_num_seqs),
               "--chunk-align", str(self.chunk_align), "--log-level", "warning"]  # fmt: skip
        if self.time_target is not None:
            cmd += ["--time-target", str(self.time_target)]
        if self.slo is not None:
            tbt, ttft = self.slo
            cmd += ["--traffic-cluster", f"name=default,tbtP99Seconds={tbt:g},ttftP99Seconds={ttft:g}"]
        if self.num_kv_blocks:
            cmd += ["--num-kv-blocks", str(self.num_kv_blocks)]
        if self.chunk_context_scale:
            cmd += ["--chunk-context-scale", str(self.chunk_context_scale)]
        if self.model:
            cmd += ["--model", self.model]
        if self.load_format != "auto":
            cmd += ["--load-format", self.load_format]
        if not self.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        return cmd + self.extra_args


def iteration_log_path(out: Path, entry: str) -> Path:
    """Where `bench capacity --iteration-logs` puts the iteration log of server entry `entry` (sarathi@B)."""
    return out / f"iterations-{entry.replace('@', '-')}.jsonl"


def iteration_log_args(enabled: bool, out: Path, entry: str) -> list[str]:
    """`stallfree serve` arguments for an iteration log next to the server's log (--iteration-logs)."""
    return ["--iteration-log", str(iteration_log_path(out, entry))] if enabled else []


class ServerProcess:
    """A `stallfree serve` child process; use as a context manager."""

    def __init__(self, spec: ServerSpec, log_path: Path, ready_timeout: float = 300.0) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(self.spec.threads),
            "MKL_NUM_THREADS": str(self.spec.threads),
        }
        cmd = self.spec.command(self.port)
        logger.info("starting %s", " ".join(cmd))
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"stallfree serve exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(
            f"stallfree serve was not ready within {self.ready_timeout:g} s (log: {self.log_path})"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def __exit__(self, *exc) -> None:
        self.stop()
