"""Probes, mounted without the API key.

`/livez` says the process serves HTTP and touches nothing else, so a slow or down database
never gets a healthy gateway restarted. `/readyz` says requests can be served: the database
answers. `/healthz` is the older name of `/readyz`, kept for existing probes.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from agentflow.api.deps import SessionMakerDep
from agentflow.api.public_url import INSTANCE_HEADER
from agentflow.db.session import read_connection

router = APIRouter(tags=["health"])

_LIVE = b'{"status":"ok"}'


@router.get("/livez")
async def livez(request: Request) -> Response:
    """200 while the process serves requests; never touches the database. The instance id
    tells this gateway from another one at the same URL (`public_url`)."""
    headers = {INSTANCE_HEADER: request.app.state.instance_id}
    return Response(_LIVE, media_type="application/json", headers=headers)


async def _database_check(maker: SessionMakerDep) -> JSONResponse:
    try:
        async with maker() as session:
            conn = await read_connection(session)
            await conn.execute(text("SELECT 1"))
    except (SQLAlchemyError, OSError) as exc:
        return JSONResponse({"status": "error", "database": str(exc)[:500]}, status_code=503)
    return JSONResponse({"status": "ok", "database": "ok"})


@router.get("/readyz")
async def readyz(maker: SessionMakerDep) -> JSONResponse:
    """200 when the database answers, 503 otherwise."""
    return await _database_check(maker)


@router.get("/healthz")
async def healthz(maker: SessionMakerDep) -> JSONResponse:
    """The same check as `/readyz`."""
    return await _database_check(maker)
