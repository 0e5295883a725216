"""One HTTP call to an SGLang server or router, with the project's retry rule.

Retry only the transient: transport errors (refused connection, reset, per-attempt timeout)
and 5xx answers are retried with exponential backoff; a 4xx answer means the server refused
this request and is raised at once as `EngineRequestError`. Each attempt has its own
wall-clock limit, because httpx's timeouts bound each read, not the whole exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from agentflow.errors import EngineError, EngineRequestError, EngineUnavailable


class RetryPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_attempts: int = Field(default=4, ge=1, description="attempts per call, first included")
    backoff_s: float = Field(default=0.2, ge=0.0, description="sleep before the 2nd attempt")
    backoff_max_s: float = Field(default=5.0, ge=0.0, description="cap on one sleep")
    connect_timeout_s: float = Field(default=5.0, gt=0.0)

    def delay(self, attempt: int) -> float:
        """Sleep after failed attempt number `attempt` (1-based): full jitter over the
        exponential bound, so clients that failed together do not retry together."""
        return random.uniform(0.0, min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1)))


def _detail(resp: httpx.Response) -> str:
    """The server's own words, whatever shape SGLang or the router used for them."""
    try:
        body = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return resp.text[:500]
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            value = body.get(key)
            if isinstance(value, dict) and "message" in value:
                return str(value["message"])[:500]
            if value:
                return str(value)[:500]
    return str(body)[:500]


async def call(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    policy: RetryPolicy,
    timeout_s: float,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    retry: bool = True,
    before_retry: Callable[[], Awaitable[object]] | None = None,
) -> Any:
    """Send one request; return the decoded JSON answer (or text when it is not JSON).

    `before_retry` runs before each new attempt (e.g. to free a rid the server may still
    be working on); its errors are ignored, the retry goes ahead.
    """
    attempts = policy.max_attempts if retry else 1
    timeout = httpx.Timeout(timeout_s, connect=min(policy.connect_timeout_s, timeout_s))
    last = "no attempt made"
    for attempt in range(1, attempts + 1):
        try:
            async with asyncio.timeout(timeout_s):
                resp = await client.request(
                    method, url, json=body, headers=headers, timeout=timeout
                )
        except (httpx.TransportError, TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        else:
            if resp.status_code < 400:
                if not resp.content:
                    return None
                try:
                    return resp.json()
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return resp.text
            if resp.status_code < 500:
                raise EngineRequestError(
                    f"{method} {url} refused with HTTP {resp.status_code}: {_detail(resp)}"
                )
            last = f"HTTP {resp.status_code}: {_detail(resp)}"
        if attempt < attempts:
            await asyncio.sleep(policy.delay(attempt))
            if before_retry is not None:
                with contextlib.suppress(Exception):
                    await before_retry()
    raise EngineUnavailable(f"{method} {url} failed after {attempts} attempt(s): {last}")


async def call_stream(
    client: httpx.AsyncClient,
    url: str,
    *,
    policy: RetryPolicy,
    timeout_s: float,
    body: dict[str, Any],
    on_chunk: Callable[[dict[str, Any]], None],
    headers: dict[str, str] | None = None,
    before_retry: Callable[[], Awaitable[object]] | None = None,
) -> dict[str, Any]:
    """POST `body` to a server-sent-events route (`/generate` with `stream: true`): each
    `data:` chunk goes to `on_chunk`; the last chunk is returned. Attempts are retried as
    `call` retries them only until a chunk has been handed on; after that a failure is
    `EngineUnavailable` (the caller has seen part of the answer)."""
    timeout = httpx.Timeout(timeout_s, connect=min(policy.connect_timeout_s, timeout_s))
    last = "no attempt made"
    for attempt in range(1, policy.max_attempts + 1):
        delivered = 0
        final: dict[str, Any] | None = None
        try:
            async with asyncio.timeout(timeout_s):
                async with client.stream(
                    "POST", url, json=body, headers=headers, timeout=timeout
                ) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        if resp.status_code < 500:
                            raise EngineRequestError(
                                f"POST {url} refused with HTTP {resp.status_code}: {_detail(resp)}"
                            )
                        last = f"HTTP {resp.status_code}: {_detail(resp)}"
                    else:
                        async for line in resp.aiter_lines():
                            if not line.startswith("data:"):
                                continue
                            data = line[len("data:") :].strip()
                            if data == "[DONE]":
                                break
                            chunk = json.loads(data)
                            if not isinstance(chunk, dict):
                                raise EngineError(f"a stream chunk is not an object: {data[:200]}")
                            on_chunk(chunk)
                            delivered += 1
                            final = chunk
                        if final is None:
                            raise EngineError(f"POST {url}: the stream ended with no chunk")
                        return final
        except (httpx.TransportError, TimeoutError, json.JSONDecodeError) as exc:
            last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if delivered:
                raise EngineUnavailable(f"POST {url}: the stream broke: {last}") from exc
        if attempt < policy.max_attempts:
            await asyncio.sleep(policy.delay(attempt))
            if before_retry is not None:
                with contextlib.suppress(Exception):
                    await before_retry()
    raise EngineUnavailable(f"POST {url} failed after {policy.max_attempts} attempt(s): {last}")


def expect_dict(answer: Any, what: str) -> dict[str, Any]:
    if not isinstance(answer, dict):
        raise EngineError(f"{what}: expected a JSON object, got {type(answer).__name__}")
    return answer


def expect_success(answer: Any, what: str) -> dict[str, Any]:
    """SGLang's weight routes answer `{success, message}`; success false is a refusal."""
    body = expect_dict(answer, what)
    if body.get("success") is False:
        raise EngineRequestError(f"{what} failed: {body.get('message', '')}")
    return body
