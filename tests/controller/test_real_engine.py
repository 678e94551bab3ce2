"""The controller end to end: a real `stallfree serve` process on the bundled model, a real Prometheus
scraping it every second, the control loop reading Prometheus and tuning the engine over its admin API.

Load shifts from chat alone to chat plus long-prompt summarization: the long prompts' prefill chunks stretch
iterations, chat's P99 TBT breaks its SLO, the controller lowers the budget until TBT is back under it, and
raises it again once the long prompts stop. Then the faults: Prometheus stopped (hold + condition), engine
restarted (gets the tuned settings back), controller restarted (no jump).

CPU timings vary with whatever else runs on the box, so the chat SLO is calibrated from a chat-only phase
and assertions are about direction (lowered, back under the SLO, raised), not exact budgets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from promserver import PrometheusServer, available, free_port

from stallfree.operator.controller.applier import EngineApplier, Target
from stallfree.operator.controller.direct import read_settings
from stallfree.operator.controller.loop import ControlLoop
from stallfree.operator.controller.prometheus import PrometheusSource
from stallfree.operator.controller.types import HOLD, LOWER, RAISE, ClusterSpec, ControllerConfig, Knobs, Slo
from stallfree.operator.status import controller_status

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.slow,
    pytest.mark.skipif(not available(), reason="needs the prometheus binary (scripts/bootstrap --test)"),
]
TOKEN = "test-admin-token"
INTERVAL = 2.0
MODEL = "SmolLM2-135M-Instruct"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 110  # ~1.5k tokens


def engine_yaml(path: Path) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "tokenBudget": 1024,
                "trafficClusters": [
                    {"name": "chat", "match": {"header": "chat"}, "maxWaiting": 64, "priority": 10},
                    {
                        "name": "summarization",
                        "match": {"header": "summarization"},
                        "chunkCap": 1024,
                        "maxWaiting": 16,
                    },
                ],
            }
        )
    )


class Engine:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.config = tmp / "engine.yaml"
        engine_yaml(self.config)
        self.log = tmp / "engine.log"
        self.proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240) -> None:
        # --token-budget alone: the tokens mode this controller test tunes (serve's default is time mode)
        cmd = [sys.executable, "-m", "stallfree", "serve", "--port", str(self.port), "--admin-token", TOKEN,
               "--traffic-clusters", str(self.config), "--stats-window", "10", "--max-num-seqs", "16",
               "--token-budget", "1024", "--log-level", "warning"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.base}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()  # the fixture never gets to: no engine left running after a failed start
        raise AssertionError(f"engine not ready after {timeout:g} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Load:
    """Closed-loop clients of one traffic cluster."""

    def __init__(self, base: str, cluster: str, prompt: str, max_tokens: int, clients: int) -> None:
        self.stop_event = threading.Event()
        self.sent = 0
        self.threads = [
            threading.Thread(target=self._run, args=(base, cluster, prompt, max_tokens), daemon=True)
            for _ in range(clients)
        ]
        for t in self.threads:
            t.start()

    def _run(self, base: str, cluster: str, prompt: str, max_tokens: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop_event.is_set():
                try:
                    c.post(
                        f"{base}/v1/completions",
                        headers={"x-traffic-cluster": cluster},
                        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
                    )
                    self.sent += 1
                except httpx.HTTPError:
                    time.sleep(0.2)

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real-engine")
    engine = Engine(tmp)
    prom = PrometheusServer()
    prom.start()
    engine.start()
    prom.set_targets([f"127.0.0.1:{engine.port}"])
    prom.wait_for("stallfree_token_budget")
    yield engine, prom
    prom.close()
    engine.stop()


def p99_tbt(prom: PrometheusServer, cluster: str, window: str) -> float | None:
    doc = prom.query(
        f'histogram_quantile(0.99, sum by (le) (rate(stallfree_time_between_tokens_seconds_bucket{{traffic_cluster="{cluster}"}}[{window}])))'
    )
    rows = doc["data"]["result"]
    v = float(rows[0]["value"][1]) if rows else float("nan")
    return None if v != v else v


def make_loop(prom: PrometheusServer, engine: Engine, chat_tbt_slo: float) -> ControlLoop:
    specs = (
        ClusterSpec(
            "chat", Slo(ttft_p99=60, tbt_p99=chat_tbt_slo, scheduling_delay_p50=60), 10, Knobs(None, 64, None)
        ),
        ClusterSpec(
            "summarization", Slo(ttft_p99=120, tbt_p99=60, scheduling_delay_p50=120), 0, Knobs(1024, 16, None)
        ),
    )
    cfg = ControllerConfig(
        budget_min=64, budget_max=1024, align=32, interval_s=INTERVAL, budget_home=1024,
        shrink_cooldown=1, grow_cooldown=1, scale_in_after=2,
    )  # fmt: skip
    loop = ControlLoop.start(
        specs, cfg, 1024, 1,
        source=PrometheusSource(prom.url, 'job="stallfree"', max_age_s=10),
        apply=EngineApplier(lambda: [Target(engine.base)], TOKEN), window_s=12, min_window_s=4,
    )  # fmt: skip
    loop.adopt(read_settings(engine.base, TOKEN, 1))
    return loop


def run_for(loop: ControlLoop, seconds: float, until=None) -> list:
    steps = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(INTERVAL)
        steps.append(loop.step())
        if until and until(steps):
            break
    return steps


def test_phase_shift_lowers_then_raises_budget(stack):
    engine, prom = stack
    chat = Load(engine.base, "chat", "Write a short poem about the sea.", 24, clients=2)
    try:
        time.sleep(8)
        base = p99_tbt(prom, "chat", "6s")
        assert base is not None, "no chat TBT samples"
        # Wide enough that chat alone at the floor budget has slack on a busy box (a long prompt's 1024-token
        # chunk still stalls chat for seconds, far past it).
        slo = max(3 * base, 0.3)
        loop = make_loop(prom, engine, slo)
        # The engine runs the spec's own settings (nothing tuned yet): no start-up cooldown to wait out.
        assert loop.state.intervals_since_change >= loop.config.shrink_cooldown, loop.state
        summ = Load(engine.base, "summarization", LONG_PROMPT, 2, clients=2)
        try:
            # Phase 1: long prompts stall chat; the controller lowers the budget until TBT is back under.
            steps = run_for(
                loop, 100,
                until=lambda s: any(x.action == LOWER for x in s) and s[-1].snapshot is not None
                and (s[-1].snapshot.cluster("chat").tbt_p99 or 1e9) <= slo and s[-1].action == HOLD,
            )  # fmt: skip
            lowered = [s for s in steps if s.action == LOWER]
            assert lowered, f"never lowered (SLO {slo:.3f}s): {[(s.action, s.reason) for s in steps]}"
            tuned = loop.settings.token_budget
            assert tuned < 1024
            cfg = httpx.get(
                f"{engine.base}/admin/v1/config", headers={"authorization": f"Bearer {TOKEN}"}
            ).json()
            assert cfg["tokenBudget"] == tuned, "the engine runs what the controller decided"
            last = steps[-1].snapshot.cluster("chat").tbt_p99
            worst = max(s.snapshot.cluster("chat").tbt_p99 or 0 for s in steps if s.snapshot)
            # Back under the SLO; or, when the box is too busy for even the floor to meet it (other jobs
            # share these 2 cores), at the floor with TBT clearly better than at the start.
            assert last is not None and (last <= slo or (tuned == 64 and last < worst)), (
                f"chat P99 TBT {last} (worst {worst}) above SLO {slo} at budget {tuned}"
            )
        finally:
            summ.stop()
        # Phase 2: long prompts gone; after lasting slack the budget climbs back toward the spec's.
        # The stale window right after the stop may still cap chat's running requests at the floor; lasting
        # slack undoes that first, then raises the budget.
        steps = run_for(loop, 120, until=lambda s: any(x.action == RAISE for x in s))
        assert any(s.action == RAISE for s in steps), [
            (s.action, s.reason, s.snapshot and s.snapshot.cluster("chat").tbt_p99) for s in steps
        ] + [f"SLO {slo:.3f}s"]
        assert loop.settings.token_budget > tuned
        status = controller_status(loop)
        assert status["budget"]["tokenBudget"] == loop.settings.token_budget
        assert {c["name"] for c in status["trafficClusters"]} == {"chat", "summarization"}
    finally:
        chat.stop()


def test_faults_prometheus_down_engine_restart_controller_restart(stack):
    engine, prom = stack
    loop = make_loop(prom, engine, 10.0)
    # Put the engine on tuned settings, as a controller would.
    tuned = loop.settings.__class__(384, 1, {**loop.settings.clusters, "summarization": Knobs(256, 8, None)})
    loop.apply(tuned)
    loop.settings = tuned
    # 1. Prometheus stopped: hold the last good settings and say so.
    prom.stop()
    try:
        step = loop.step()
        assert step.holding and step.action == HOLD and loop.settings == tuned
        cond = {c["type"]: c for c in controller_status(loop)["conditions"]}["MetricsAvailable"]
        assert cond["status"] == "False" and "Prometheus" in cond["message"]
    finally:
        prom.start()
    # 2. Engine restarted (fresh process, spec settings in its file): the next step gives it the tuned ones.
    engine.stop()
    engine.start()
    loop.apply.forget(engine.base)
    prom.wait_for("stallfree_token_budget")
    time.sleep(2)
    loop.step()
    got = read_settings(engine.base, TOKEN, 1)
    assert got.token_budget == loop.settings.token_budget
    assert got.clusters["summarization"].max_waiting == loop.settings.knobs("summarization").max_waiting
    # 3. Controller restarted: a new loop adopts what runs and does not jump back to the spec's 1024.
    again = make_loop(prom, engine, 10.0)
    assert again.settings.token_budget == loop.settings.token_budget
    assert again.state.intervals_since_change == 0  # tuned settings found: it waits out the cooldowns
    step = again.step()
    assert again.settings.token_budget == loop.settings.token_budget, step.reason
