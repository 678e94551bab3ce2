"""Wiring of one local-mode run: engines, controller thread, proxy server, live view, shutdown."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import secrets
import signal
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

from stallfree.costmodel.model import load_cost_model
from stallfree.local.config import LocalDeployment
from stallfree.local.engines import EngineFleet, write_engine_config
from stallfree.operator.builders.config import cost_model_document
from stallfree.operator.builders.meta import COST_MODEL_KEY, BuildContext, Owner
from stallfree.operator.controller.applier import EngineApplier
from stallfree.operator.controller.config import loop_inputs
from stallfree.operator.controller.direct import StatsSource, read_settings
from stallfree.operator.controller.loop import ControlLoop
from stallfree.operator.controller.metrics import ControllerMetrics
from stallfree.operator.controller.types import Settings
from stallfree.operator.status import budget_in_force, controller_status

log = logging.getLogger("stallfree.local")


class LocalRun:
    def __init__(self, dep: LocalDeployment, args: argparse.Namespace, admin_token: str | None) -> None:
        self.dep = dep
        self.args = args
        self.admin_token = admin_token
        self.stop = threading.Event()
        self.failed: str | None = None  # why the engines could not start; `up` then exits 1
        self._server = None  # the uvicorn server, so a failed start can end it
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"stallfree-{dep.name}-"))
        spec = dep.spec
        self.inputs = inp = loop_inputs(spec, **self._cooldowns(spec))
        # spec.controller.enabled counts here as in a cluster (the kopf timer); so does --no-controller.
        self.retunes = spec.controller.enabled and not args.no_controller
        self.engine_token = secrets.token_urlsafe(24)
        self.fleet = EngineFleet(
            name=dep.name,
            spec=spec,
            run_dir=self.run_dir,
            config_path=self.run_dir / "engine.yaml",
            admin_token=self.engine_token,
            stats_window_s=inp.window_s,
            cost_model=self._cost_model_prior(),
        )
        self.applier = EngineApplier(self.fleet.targets, self.engine_token)
        if args.prometheus:
            from stallfree.operator.controller.prometheus import PrometheusSource

            source = PrometheusSource(
                args.prometheus, self._selector(), max_age_s=max(30.0, 3 * inp.interval_s)
            )
        else:
            source = StatsSource(self.fleet.endpoints, self.engine_token)
        self.source = source
        self.loop = ControlLoop.start(
            inp.specs,
            inp.config,
            inp.initial_budget,
            inp.initial_replicas,
            source=source,
            apply=self._apply,
            window_s=inp.window_s,
            min_window_s=min(inp.window_s, max(5.0, 2 * inp.interval_s)),
            model=inp.model if args.cost_model is None else load_cost_model(args.cost_model),
        )
        self.metrics = ControllerMetrics()
        self.loop.observers.append(self.metrics.observe)
        self._written = self.loop.settings  # what engine.yaml holds
        write_engine_config(self.fleet.config_path, dep.name, dep.doc["spec"], spec, self._written)

    def _cost_model_prior(self) -> Path | None:
        """Time mode: the engines' --cost-model prior, --cost-model's file or spec.controller.costModel
        written as a cost_model.json (as the operator puts it in the ConfigMap); None otherwise."""
        spec = self.dep.spec
        if spec.time_target is None:
            return None
        if self.args.cost_model is not None:
            return Path(self.args.cost_model).resolve()
        ctx = BuildContext(
            Owner(self.dep.name, "local", "local"), spec, self.dep.doc["spec"], engine_image=""
        )
        doc = cost_model_document(ctx)
        if doc is None:
            return None
        path = self.run_dir / COST_MODEL_KEY
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return path

    @staticmethod
    def _cooldowns(spec) -> dict:
        """The engines' stats window is fixed (unlike a Prometheus range): wait until it has turned over
        after a change before judging it, so one bad window does not shrink the budget twice."""
        turns = max(1, math.ceil(spec.controller.window_seconds / spec.controller.interval_seconds))
        return {"shrink_cooldown": turns, "grow_cooldown": turns + 1}

    def _selector(self) -> str:
        ports = "|".join(str(r.port) for r in self.fleet.replicas) or "0"
        return f'instance=~"127.0.0.1:({ports})"'

    def _apply(self, settings: Settings) -> None:
        if settings.replicas != len(self.fleet.replicas):
            self.fleet.scale_to(settings.replicas)
            self.write_targets()
        if settings != self._written:  # a hold rewrites nothing
            write_engine_config(
                self.fleet.config_path, self.dep.name, self.dep.doc["spec"], self.dep.spec, settings
            )
            self._written = settings
        self.applier(settings)

    def status(self) -> dict:
        doc = controller_status(self.loop) if self.loop.last else {"budget": budget_in_force(self.loop)}
        doc["endpoint"] = self.endpoint
        doc["replicas"] = len(self.fleet.replicas)
        doc["readyReplicas"] = len(self.fleet.endpoints())
        doc["phase"] = "Ready" if doc["readyReplicas"] else "Progressing"
        doc["engines"] = [
            {
                "index": r.index,
                "url": r.base,
                "ready": r.ready,
                "restarts": r.restarts,
                "log": str(r.log_path),
            }
            for r in self.fleet.replicas
        ]
        return doc

    @property
    def endpoint(self) -> str:
        host = self.args.host if self.args.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.args.port}/v1"

    # ---- the controller thread ----------------------------------------------------------------------
    def _control(self) -> None:
        inp = self.inputs
        try:
            ready = self.fleet.wait_ready(self.args.ready_timeout, self.stop)
        except RuntimeError as e:  # a replica kept exiting
            return self._fail(str(e))
        if not ready:
            if not self.stop.is_set():
                self._fail(f"engines not ready after {self.args.ready_timeout:g} s; logs in {self.run_dir}")
            return
        log.info("engines ready: %s", ", ".join(self.fleet.endpoints()))
        try:  # adopt what the engines run (the tuned engine.yaml), never jump back to the spec
            found = read_settings(self.fleet.endpoints()[0], self.engine_token, len(self.fleet.replicas))
            self.loop.adopt(
                replace(found, clusters={n: k for n, k in found.clusters.items() if n in self._names()})
            )
        except Exception as e:  # noqa: BLE001 - adopting is best effort; the spec settings stand
            log.debug("could not read engine settings: %s", e)
        while not self.stop.wait(inp.interval_s):
            try:
                self.fleet.check()
                if hasattr(self.source, "selector"):
                    self.source.selector = self._selector()
                if not self.retunes:
                    continue
                self.loop.step()
            except Exception:  # noqa: BLE001 - the loop must survive one bad interval
                log.exception("controller step failed")

    def _fail(self, why: str) -> None:
        """The engines cannot start: say why and end `up` (exit 1) rather than answer 503 for ever."""
        log.error("%s", why)
        self.failed = why
        self.stop.set()
        if self._server is not None:
            self._server.should_exit = True

    def _names(self) -> set[str]:
        return {s.name for s in self.inputs.specs}

    # ---- serving ------------------------------------------------------------------------------------
    def serve(self) -> int:
        import uvicorn

        from stallfree.local.proxy import build_app

        app = build_app(self.fleet.endpoints, self.status, self.metrics.render, self.admin_token)
        server = uvicorn.Server(
            uvicorn.Config(app, host=self.args.host, port=self.args.port, log_level="warning", lifespan="on")
        )
        self._server = server
        print(
            f"stallfree up: {self.dep.name} ({self.dep.spec.model.name}), "
            f"{self.inputs.initial_replicas} replica(s) starting; logs in {self.run_dir}\n"
            f"  OpenAI endpoint  {self.endpoint}\n"
            f"  status           {self.endpoint[:-3]}/admin/v1/status\n"
            f"  metrics          {self.endpoint[:-3]}/metrics",
            file=sys.stderr,
            flush=True,
        )
        if self.args.prometheus:
            print(
                f"  Prometheus must scrape the engines: file_sd targets in {self.run_dir / 'targets.json'}",
                file=sys.stderr,
            )
        self.fleet.scale_to(self.inputs.initial_replicas)
        self.write_targets()
        controller = threading.Thread(target=self._control, name="controller", daemon=True)
        controller.start()
        view = None
        if not self.args.no_view and sys.stdout.isatty():
            view = self._start_view()
        # uvicorn re-raises the signal that stopped it once it is done; a handler of ours (instead of the
        # default, which would end the process on the spot) lets the engines be stopped below.
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        try:
            asyncio.run(server.serve())
        except KeyboardInterrupt:
            pass
        finally:
            self.stop.set()
            if view is not None:
                view.stop()
            print("stallfree up: stopping engines...", file=sys.stderr, flush=True)
            self.fleet.stop()
            controller.join(timeout=10)
        if self.failed:
            print(f"stallfree up: {self.failed}", file=sys.stderr, flush=True)
            return 1
        return 0

    def _start_view(self):
        from rich.live import Live

        from stallfree.local.view import render

        def renderable():
            return render(self.loop, self.endpoint, self.fleet.endpoints(), f"stallfree up · {self.dep.name}")

        live = Live(
            get_renderable=renderable, refresh_per_second=1, redirect_stderr=True, redirect_stdout=True
        )
        live.start()
        return live

    def write_targets(self) -> None:
        targets = [f"127.0.0.1:{r.port}" for r in self.fleet.replicas]
        tmp = self.run_dir / "targets.tmp"
        tmp.write_text(json.dumps([{"targets": targets, "labels": {"job": "stallfree"}}]))
        tmp.replace(self.run_dir / "targets.json")
