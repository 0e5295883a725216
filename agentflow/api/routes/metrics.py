"""`GET /metrics`: Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import func, select

from agentflow.api.deps import API_KEY, RuntimesDep, SessionDep
from agentflow.api.routing import GatewayRoute
from agentflow.db.models import Episode
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
    for run_id, runtime in runtimes.items():
        info = await runtime.engine.info()
        gauges.engine_queue.labels(run=str(run_id)).set(info.waiting)
        gauges.engine_running.labels(run=str(run_id)).set(info.running)
    return Response(gauges.render(), media_type=CONTENT_TYPE_LATEST)
