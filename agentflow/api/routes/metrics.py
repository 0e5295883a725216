"""`GET /metrics`: Prometheus text format."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import func, select

from agentflow.agents.runtime import PolicyRuntime
from agentflow.api.deps import API_KEY, RuntimesDep, SessionDep
from agentflow.api.routing import GatewayRoute
from agentflow.db.models import Episode
from agentflow.inference.base import EngineInfo
from agentflow.metrics import GatewayMetrics
from agentflow.types import EpisodeStatus

router = APIRouter(tags=["metrics"], route_class=GatewayRoute, dependencies=API_KEY)

_STATUSES: tuple[EpisodeStatus, ...] = (
    "pending",
    "running",
    "completed",
    "truncated",
    "failed",
    "aborted",
)


@router.get("/metrics", response_class=Response)
async def metrics(request: Request, session: SessionDep, runtimes: RuntimesDep) -> Response:
    gauges: GatewayMetrics = request.app.state.metrics
    counts = dict(
        (await session.execute(select(Episode.status, func.count()).group_by(Episode.status))).all()
    )
    for status in _STATUSES:
        gauges.episodes.labels(status=status).set(counts.get(status, 0))
    items = runtimes.items()
    infos = await asyncio.gather(*(_engine_info(runtime) for _, runtime in items))
    for (run_id, _), info in zip(items, infos, strict=True):
        run = str(run_id)
        gauges.engine_up.labels(run=run).set(0 if info is None else 1)
        if info is not None:
            gauges.engine_queue.labels(run=run).set(info.waiting)
            gauges.engine_running.labels(run=run).set(info.running)
    return Response(gauges.render(), media_type=CONTENT_TYPE_LATEST)


# An engine that does not answer this fast is reported down: a scrape never waits on it.
ENGINE_INFO_TIMEOUT_S = 1.0


async def _engine_info(runtime: PolicyRuntime) -> EngineInfo | None:
    try:
        async with asyncio.timeout(ENGINE_INFO_TIMEOUT_S):
            return await runtime.engine.info()
    except Exception:  # dead, slow or failing: down, and the rest of the scrape goes on
        return None
