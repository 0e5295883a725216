from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from agentflow.api.deps import SessionMakerDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(maker: SessionMakerDep) -> JSONResponse:
    """200 when the database answers, 503 otherwise."""
    try:
        async with maker() as session:
            await session.execute(text("SELECT 1"))
    except (SQLAlchemyError, OSError) as exc:
        return JSONResponse({"status": "error", "database": str(exc)[:500]}, status_code=503)
    return JSONResponse({"status": "ok", "database": "ok"})
