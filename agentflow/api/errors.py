"""The one place AgentFlow errors become HTTP answers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from agentflow.errors import AgentFlowError, InvalidInput


def validation_error(
    error: ValidationError, *, prefix: Sequence[str | int] = ("body",)
) -> RequestValidationError:
    """Re-root a nested model's errors under `prefix`, in FastAPI's own 422 shape."""
    return RequestValidationError(
        [
            {
                "type": e["type"],
                "loc": (*prefix, *e["loc"]),
                "msg": e["msg"],
                "input": e.get("input"),
            }
            for e in error.errors(include_url=False)
        ]
    )


async def _agentflow_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AgentFlowError)
    body: dict[str, Any]
    if isinstance(exc, InvalidInput):
        body = {"detail": [{"type": "value_error", "loc": list(exc.field), "msg": exc.message}]}
    else:
        body = {"detail": exc.message, "error": type(exc).__name__}
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(AgentFlowError, _agentflow_error)
