"""The one place AgentFlow errors become HTTP answers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from agentflow.api.strict_json import MAX_INT_DIGITS
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


def json_safe(value: Any) -> Any:
    """`value` as something `json.dumps` always writes (strictly, and as UTF-8).

    An error body may echo what the caller sent, and what was sent may be what JSON or
    UTF-8 cannot carry: NaN and infinities (refused by a strict encoder), integers too
    long for `str()`, bytes that are not UTF-8, strings holding lone surrogates. Each
    becomes a string that says what it was; nothing else changes.
    """
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if value.bit_length() > 3 * MAX_INT_DIGITS:  # well past what str() allows
            return f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {str(json_safe(k)): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [json_safe(v) for v in value]
    return json_safe(str(value))


def invalid_input_detail(exc: InvalidInput) -> list[dict[str, Any]]:
    """`InvalidInput` as FastAPI's own 422 `detail`, safe to write whatever its place."""
    detail: list[dict[str, Any]] = json_safe(
        [{"type": "value_error", "loc": list(exc.field), "msg": exc.message}]
    )
    return detail


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 body, written safely whatever the input it echoes."""
    assert isinstance(exc, RequestValidationError)
    errors = [{k: v for k, v in e.items() if k != "url"} for e in exc.errors()]
    return JSONResponse({"detail": json_safe(errors)}, status_code=422)


async def _agentflow_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AgentFlowError)
    body: dict[str, Any]
    if isinstance(exc, InvalidInput):
        body = {"detail": invalid_input_detail(exc)}
    else:
        body = {"detail": exc.message, "error": type(exc).__name__}
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return JSONResponse(json_safe(body), status_code=exc.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(AgentFlowError, _agentflow_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
