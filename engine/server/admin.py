"""The admin API (bearer admin token): read and change the run-time tunables, read live stats.

GET   /admin/v1/config   {"tokenBudget", "chunkAlign", "trafficClusters": {name: {...}}}
PATCH /admin/v1/config   a partial document of the same shape, merged; applied from the next iteration
GET   /admin/v1/stats    per-cluster queue lengths, recent P50/P99 TTFT/TBT, arrival and prefill rates,
                         prefix cache hit rates and cached blocks
POST  /admin/v1/reset_prefix_cache   drop every cached KV block (e.g. after changing weights in place)
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Depends, Header, Request

from stallfree.engine.server.errors import BadRequest, NotFound
from stallfree.engine.server.openai_routes import get_state
from stallfree.engine.server.traffic import TrafficConfigError

logger = logging.getLogger(__name__)


def require_admin(request: Request, authorization: str | None = Header(default=None)) -> None:
    get_state(request).check_admin(authorization)


router = APIRouter(prefix="/admin/v1", dependencies=[Depends(require_admin)])


@router.get("/config")
async def get_config(request: Request) -> dict:
    state = get_state(request)
    config = state.engine.traffic if state.engine is not None else state.settings.traffic
    return config.to_json()


@router.patch("/config")
async def patch_config(request: Request) -> dict:
    state = get_state(request)
    try:
        patch = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from e
    engine = state.ready_engine()
    async with state.admin_lock:
        current = engine.traffic
        try:
            new = current.patched(patch)
            new.tunables()  # the engine's own checks, before anything is applied
        except KeyError as e:
            raise NotFound(
                f"unknown traffic cluster {e.args[0]!r}; known: {', '.join(current.names)}",
                param="trafficClusters",
            ) from e
        except (TrafficConfigError, ValueError) as e:
            raise BadRequest(str(e)) from e
        await engine.update_config(new)
    logger.info("admin: applied %s", json.dumps(patch, separators=(",", ":")))
    return new.to_json()


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    engine = get_state(request).ready_engine()
    dropped = await engine.reset_prefix_cache()
    logger.info("admin: prefix cache reset, %d blocks dropped", dropped)
    return {"droppedBlocks": dropped}


@router.get("/stats")
async def get_stats(request: Request) -> dict:
    state = get_state(request)
    engine = state.ready_engine()
    waiting, running = engine.counts()
    return state.window.snapshot(engine.traffic, waiting, running)
