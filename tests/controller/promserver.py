"""A real Prometheus (Debian's `prometheus` binary) for tests: free port, generated config, 1s scrapes.

Targets come from a file_sd file so tests can add, move and remove engines while it runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from stallfree.ports import free_port

BINARY = shutil.which("prometheus") or "/usr/bin/prometheus"


def available() -> bool:
    return Path(BINARY).exists()


class PrometheusServer:
    def __init__(self, job: str = "stallfree", scrape_interval: str = "1s") -> None:
        self.job = job
        self.dir = Path(tempfile.mkdtemp(prefix="stallfree-prom-"))
        self.targets_file = self.dir / "targets.json"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.rule_files: list[str] = []
        self.scrape_interval = scrape_interval
        self.set_targets([])

    def set_targets(self, targets: list[str], labels: dict[str, str] | None = None) -> None:
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": targets, "labels": labels or {}}]))
        tmp.replace(self.targets_file)  # atomic: Prometheus never reads half a file

    def write_config(self) -> Path:
        cfg = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "rule_files": self.rule_files,
            "scrape_configs": [
                {
                    "job_name": self.job,
                    "scrape_timeout": self.scrape_interval,
                    "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}],
                }
            ],
        }
        path = self.dir / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        config = self.write_config()
        log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [
                BINARY,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1h",
                "--query.lookback-delta=10s",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def query(self, expr: str) -> dict:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        return r.json()

    def wait_for(self, expr: str, timeout: float = 20.0, pred=lambda rows: bool(rows)) -> list:
        deadline = time.monotonic() + timeout
        rows: list = []
        while time.monotonic() < deadline:
            doc = self.query(expr)
            rows = doc.get("data", {}).get("result", []) if doc.get("status") == "success" else []
            if pred(rows):
                return rows
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {expr!r}; last result {rows}")

    def rules(self) -> dict:
        return httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()
