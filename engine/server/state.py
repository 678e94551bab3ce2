"""ServerSettings (built once by the CLI) and ServerState (what the handlers share): the engine is loaded
in a background thread at startup so /health answers while the model loads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from stallfree.engine.engine import LLMEngine
from stallfree.engine.server.async_engine import AsyncEngine, EngineThread
from stallfree.engine.server.errors import Forbidden, NotFound, NotReady, Unauthorized
from stallfree.engine.server.iteration_log import IterationLog
from stallfree.engine.server.metrics import PrometheusMetrics
from stallfree.engine.server.observer import EngineObserver, FanOut
from stallfree.engine.server.response_store import ResponseStore
from stallfree.engine.server.stats import WindowStats
from stallfree.engine.server.traffic import TrafficConfig

logger = logging.getLogger(__name__)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    admin_token: str | None = None
    traffic: TrafficConfig = TrafficConfig()
    stats_window_s: float = 60.0
    drain_timeout_s: float = 30.0
    iteration_log: str | None = None  # JSON lines, one per iteration (`stallfree profile --from-log`)
    # --served-model-name: what clients send as `model`; the first is the one responses carry. Empty: the
    # loaded model's own name.
    served_model_names: tuple[str, ...] = ()
    tool_call_parser: str = "auto"  # how tool calls are read from the output: auto, hermes, llama3_json
    responses_store_size: int = (
        1024  # /v1/responses kept in memory for previous_response_id and GET (0: none)
    )
    responses_store_ttl_s: float = 3600.0  # how long each is kept


class ServerState:
    def __init__(self, settings: ServerSettings, engine_factory: Callable[[], LLMEngine]) -> None:
        self.settings = settings
        self.engine_factory = engine_factory
        self.engine: AsyncEngine | None = None
        self.metrics: PrometheusMetrics | None = None
        self.window = WindowStats(settings.stats_window_s)
        self.model_name: str | None = None  # the first of model_names: what responses and metrics carry
        self.model_names: tuple[str, ...] = ()
        self.load_error: str | None = None
        self.on_fatal: Callable[[], None] | None = None  # the CLI stops uvicorn when loading fails
        self.admin_lock = asyncio.Lock()
        self._load_task: asyncio.Task | None = None
        self.iteration_log: IterationLog | None = None
        self.responses = ResponseStore(settings.responses_store_size, settings.responses_store_ttl_s)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start_loading(self) -> None:
        self._load_task = asyncio.create_task(self._load())

    async def _load(self) -> None:
        thread = EngineThread()  # builds the engine, then steps it (see EngineThread's note)
        try:
            engine = await asyncio.wrap_future(thread.submit(self.engine_factory))
        except Exception as e:  # noqa: BLE001 - reported through /ready and the log, then the server exits
            thread.close(timeout=0)
            logger.exception("loading the model failed")
            self.load_error = f"{type(e).__name__}: {e}"
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self.model_names = self.settings.served_model_names or (engine.loaded.name,)
        self.model_name = self.model_names[0]
        self.metrics = PrometheusMetrics(self.model_name)
        observers: list[EngineObserver] = [self.metrics, self.window]
        if self.settings.iteration_log:
            self.iteration_log = IterationLog(self.settings.iteration_log)
            observers.append(self.iteration_log)
        self.engine = AsyncEngine(engine, self.settings.traffic, FanOut(*observers), thread)
        self.engine.start()
        logger.info("serving %s on http://%s:%d", self.model_name, self.settings.host, self.settings.port)

    async def shutdown(self) -> None:
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.engine is None:
            return
        if not await self.engine.drain(self.settings.drain_timeout_s):
            logger.warning(
                "drain timed out after %.0f s; aborting what is left", self.settings.drain_timeout_s
            )
        self.engine.stop()
        if self.iteration_log is not None:
            self.iteration_log.close()

    # ---- checks used by handlers -------------------------------------------------------------------
    def ready_engine(self) -> AsyncEngine:
        if self.load_error is not None:
            raise NotReady(f"the model failed to load: {self.load_error}")
        if self.engine is None:
            raise NotReady("the model is still loading", retry_after=5)
        self.engine.check_available()
        return self.engine

    def check_api_key(self, authorization: str | None) -> None:
        key = self.settings.api_key
        if key is not None and authorization != f"Bearer {key}":
            raise Unauthorized(
                "missing or wrong API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
            )

    def check_admin(self, authorization: str | None) -> None:
        token = self.settings.admin_token
        if token is None:
            if self.settings.host in LOCAL_HOSTS:
                return
            raise Forbidden(
                "the admin API is disabled: set STALLFREE_ADMIN_TOKEN (or --admin-token), or bind to 127.0.0.1"
            )
        if authorization != f"Bearer {token}":
            raise Unauthorized("missing or wrong admin token: send `Authorization: Bearer <admin token>`")

    def check_model(self, model: str | None) -> None:
        if model is None or model in self.model_names:
            return
        served = ", ".join(repr(n) for n in self.model_names)
        raise NotFound(
            f"the model {model!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )
