"""The OpenAI-compatible endpoints black-box agents call.

    POST /v1/episodes/{id}/chat/completions   key bound to that episode (or the API key)
    POST /v1/chat/completions                 the episode is the one the key is bound to
    POST /v1/episodes/{id}/responses          the Responses API (`responses_api`), likewise
    POST /v1/responses
    GET  /v1/models                           the models of the live runs
    GET  /v1/models/{id}                      one of them (404 when no live run serves it)

Agents authenticate with their per-episode key as `Authorization: Bearer <key>`, not the
gateway's API key, so these routes are mounted without it. Errors use OpenAI's body
shape (`{"error": {"message", "type", "param", "code"}}`) so OpenAI clients raise their
typed exceptions: 400 malformed request, 401 wrong key, 404 unknown episode or no live
run, 409 finished episode, 429 too many requests in flight for one episode. Images come
as `image_url` parts with base64 data URLs (a network URL is a 400: the gateway fetches
nothing); an engine that takes no images answers 400 before anything is recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentflow import ids
from agentflow.agents.blackbox.live import BudgetExhausted, LiveEpisodes
from agentflow.agents.blackbox.openai_schema import (
    ChatCompletionRequest,
    error_body,
    parse_request,
)
from agentflow.agents.blackbox.proxy import ChatProxy
from agentflow.agents.blackbox.responses import completion_of, token_entry
from agentflow.agents.blackbox.responses_api import parse_responses_request, response_of
from agentflow.agents.blackbox.sse import DONE, ChunkWriter, ContentStream, event
from agentflow.agents.keys import episode_for_key
from agentflow.agents.runtime import RuntimeRegistry
from agentflow.api.deps import SettingsDep, authorize_episode, bearer_token, is_api_key
from agentflow.api.errors import json_safe
from agentflow.api.strict_json import parse_json
from agentflow.config import Settings
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import AgentFlowError, InvalidInput, NotFound

# A plain APIRoute, not `GatewayRoute`: these routes authenticate and parse their bodies
# themselves (the same rules), so that every error is in OpenAI's shape.
router = APIRouter(tags=["openai"])
log = logging.getLogger(__name__)

_TYPES = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    404: ("not_found_error", "not_found"),
    409: ("invalid_request_error", "episode_finished"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
}


def _status(exc: AgentFlowError) -> int:
    # OpenAI answers every malformed request with 400, never FastAPI's 422.
    return 400 if exc.status_code == 422 else exc.status_code


def openai_error_body(exc: AgentFlowError) -> dict[str, Any]:
    type_, code = _TYPES.get(_status(exc), ("server_error", "server_error"))
    if isinstance(exc, BudgetExhausted):
        code = "budget_exhausted"
    param = ".".join(exc.field) if isinstance(exc, InvalidInput) and exc.field else None
    body: dict[str, Any] = json_safe(error_body(exc.message, type_=type_, code=code, param=param))
    return body


def openai_error(exc: AgentFlowError) -> JSONResponse:
    status = _status(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(openai_error_body(exc), status_code=status, headers=headers)


def live_episodes(request: Request) -> LiveEpisodes:
    live: LiveEpisodes = request.app.state.live_episodes
    return live


def turn_tree(app: Any) -> TurnTree:
    """The app's one `TurnTree` (it groups concurrent writes, and queues them on SQLite)."""
    turns: TurnTree = app.state.turn_tree
    return turns


def _failure(exc: BaseException) -> AgentFlowError:
    """A request's failure as the error it answers with."""
    if isinstance(exc, AgentFlowError):
        return exc
    # A bug or a failing part: this request fails, in OpenAI's shape.
    log.error("chat completion failed", exc_info=exc)
    return AgentFlowError(f"internal error: {type(exc).__name__}: {exc}")


async def _complete(request: Request, raw_id: str | None) -> Response:
    try:
        episode_id = authorize_episode(request, raw_id)
        # The agent's messages and tool results are stored as its turns: the same text
        # rule as every other body, with OpenAI's `param` naming the field.
        settings: Settings = request.app.state.settings
        chat_request = parse_request(
            parse_json(await request.body(), loc=()), max_image_bytes=settings.max_image_bytes
        )
        proxy = _proxy(request)
        if chat_request.stream:
            response = await _stream(proxy, episode_id, chat_request)
            _count(request, "chat", response.status_code)
            return response
        answer = await proxy.complete(episode_id, chat_request)
    except Exception as exc:
        return _counted(request, "chat", openai_error(_failure(exc)))
    _count(request, "chat", 200)
    return JSONResponse(completion_of(answer, with_logprobs=bool(chat_request.logprobs)))


def _proxy(request: Request) -> ChatProxy:
    runtimes: RuntimeRegistry = request.app.state.runtimes
    metrics = getattr(request.app.state, "metrics", None)
    return ChatProxy(turn_tree(request.app), runtimes, live_episodes(request), metrics)


def _count(request: Request, api: str, status: int) -> None:
    """`agentflow_chat_requests{api, outcome}`: `ok`, or the error status."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.chat_requests.labels(api=api, outcome="ok" if status < 400 else str(status)).inc()


def _counted(request: Request, api: str, response: JSONResponse) -> JSONResponse:
    _count(request, api, response.status_code)
    return response


async def _stream(
    proxy: ChatProxy, episode_id: uuid.UUID, chat_request: ChatCompletionRequest
) -> Response:
    """Stream the answer as it is generated (`sse`). The response starts once the first
    tokens are out, so a request refused before generating still gets its own status."""
    tokens: asyncio.Queue[tuple[list[int], list[float]]] = asyncio.Queue()
    turn_id = ids.new_id()
    task = asyncio.create_task(
        proxy.complete(
            episode_id,
            chat_request,
            lambda ids, lps: tokens.put_nowait((list(ids), list(lps))),
            turn_id,
        )
    )
    first = asyncio.ensure_future(tokens.get())
    await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
    head = [first.result()] if first.done() else []
    if not first.done():
        first.cancel()
        exc = task.exception()
        if exc is not None:
            return openai_error(_failure(exc))
    runtime = proxy.runtimes.get((await proxy.turns.episode(episode_id)).run_id)
    writer = ChunkWriter(
        chat_id=f"chatcmpl-{turn_id.hex}",
        model=runtime.model_name,
        created=int(time.time()),
        with_logprobs=bool(chat_request.logprobs),
    )
    stops = chat_request.stop_strings()
    content = ContentStream(runtime.template, stops, chat_request.parse_tool_calls)
    # Log-probs stream with their tokens, but for the last few while a stop string may
    # still cut them off; top log-probs only the finished answer has.
    hold = 4 * max(map(len, stops)) if stops else 0
    live_logprobs = writer.with_logprobs and not chat_request.top_logprobs
    options = chat_request.stream_options
    include_usage = bool(options and options.include_usage)

    pending: list[tuple[int, float]] = []  # tokens whose log-probs are not sent yet
    sent = 0

    def chunk_of(ids: list[int], lps: list[float]) -> bytes | None:
        nonlocal pending, sent
        delta = content.feed(ids)
        pending += zip(ids, lps, strict=True)
        entries = None
        if live_logprobs and len(pending) > hold:
            cut = len(pending) - hold
            entries = [token_entry(runtime.template, t, lp) for t, lp in pending[:cut]]
            pending, sent = pending[cut:], sent + cut
        return writer.chunk({"content": delta}, logprobs=entries) if delta or entries else None

    async def events() -> AsyncIterator[bytes]:
        try:
            yield writer.chunk({"role": "assistant", "content": ""})
            for ids, lps in head:
                if (chunk := chunk_of(ids, lps)) is not None:
                    yield chunk
            while not (task.done() and tokens.empty()):
                get = asyncio.ensure_future(tokens.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                elif (chunk := chunk_of(*get.result())) is not None:
                    yield chunk
            answer = await task
        except Exception as exc:  # after the response started: an error event ends it
            yield event(openai_error_body(_failure(exc)))
            yield DONE
            return
        finally:
            if not task.done():  # the client went away: stop generating for it
                task.cancel()
        for chunk in writer.finish(answer, content, sent, include_usage=include_usage):
            yield chunk

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _respond(request: Request, raw_id: str | None) -> Response:
    """`/v1/responses`: the Responses API on the same chat core (`responses_api`)."""
    try:
        episode_id = authorize_episode(request, raw_id)
        settings: Settings = request.app.state.settings
        responses_request, chat_request = parse_responses_request(
            parse_json(await request.body(), loc=()), max_image_bytes=settings.max_image_bytes
        )
        answer = await _proxy(request).complete(episode_id, chat_request)
    except Exception as exc:
        return _counted(request, "responses", openai_error(_failure(exc)))
    _count(request, "responses", 200)
    return JSONResponse(response_of(answer, responses_request))


@router.post("/v1/episodes/{episode_id}/responses", response_model=None)
async def episode_responses(episode_id: str, request: Request) -> Response:
    return await _respond(request, episode_id)


@router.post("/v1/responses", response_model=None)
async def responses(request: Request) -> Response:
    return await _respond(request, None)


@router.post("/v1/episodes/{episode_id}/chat/completions", response_model=None)
async def episode_chat(episode_id: str, request: Request) -> Response:
    return await _complete(request, episode_id)


@router.post("/v1/chat/completions", response_model=None)
async def chat(request: Request) -> Response:
    return await _complete(request, None)


def _model_names(request: Request, settings: Settings) -> list[str]:
    """The models of the live runs; the caller must hold the API key or an episode key."""
    token = bearer_token(request)
    if not is_api_key(token, settings):
        episode_for_key(token, settings.secret_key)
    runtimes: RuntimeRegistry = request.app.state.runtimes
    return list(dict.fromkeys(runtime.model_name for _, runtime in runtimes.items()))


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "agentflow"}


@router.get("/v1/models", response_model=None)
async def models(request: Request, settings: SettingsDep) -> Response:
    try:
        names = _model_names(request, settings)
    except AgentFlowError as exc:
        return openai_error(exc)
    return JSONResponse({"object": "list", "data": [_model(n) for n in names]})


@router.get("/v1/models/{model_id:path}", response_model=None)
async def model(model_id: str, request: Request, settings: SettingsDep) -> Response:
    try:
        names = _model_names(request, settings)
        if model_id not in names:
            raise NotFound(f"no live run serves the model {model_id!r}")
    except AgentFlowError as exc:
        return openai_error(exc)
    return JSONResponse(_model(model_id))
