"""The OpenAI-compatible endpoints black-box agents call.

    POST /v1/episodes/{id}/chat/completions   key bound to that episode (or the API key)
    POST /v1/chat/completions                 the episode is the one the key is bound to
    GET  /v1/models                           the models of the live runs

Agents authenticate with their per-episode key as `Authorization: Bearer <key>`, not the
gateway's API key, so these routes are mounted without it. Errors use OpenAI's body
shape (`{"error": {"message", "type", "param", "code"}}`) so OpenAI clients raise their
typed exceptions: 400 malformed request, 401 wrong key, 404 unknown episode or no live
run, 409 finished episode, 429 too many requests in flight for one episode. Images come
as `image_url` parts with base64 data URLs (a network URL is a 400: the gateway fetches
nothing); an engine that takes no images answers 400 before anything is recorded.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentflow.agents.blackbox.live import BudgetExhausted, LiveEpisodes
from agentflow.agents.blackbox.openai_schema import error_body, parse_request
from agentflow.agents.blackbox.proxy import ChatProxy
from agentflow.agents.blackbox.responses import completion_of
from agentflow.agents.blackbox.sse import stream_chunks
from agentflow.agents.keys import episode_for_key
from agentflow.agents.runtime import RuntimeRegistry
from agentflow.api.deps import SettingsDep, authorize_episode, bearer_token, is_api_key
from agentflow.api.errors import json_safe
from agentflow.api.strict_json import parse_json
from agentflow.config import Settings
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import AgentFlowError, InvalidInput

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


def openai_error(exc: AgentFlowError) -> JSONResponse:
    # OpenAI answers every malformed request with 400, never FastAPI's 422.
    status = 400 if exc.status_code == 422 else exc.status_code
    type_, code = _TYPES.get(status, ("server_error", "server_error"))
    if isinstance(exc, BudgetExhausted):
        code = "budget_exhausted"
    param = ".".join(exc.field) if isinstance(exc, InvalidInput) and exc.field else None
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = error_body(exc.message, type_=type_, code=code, param=param)
    return JSONResponse(json_safe(body), status_code=status, headers=headers)


def live_episodes(request: Request) -> LiveEpisodes:
    live: LiveEpisodes = request.app.state.live_episodes
    return live


def turn_tree(app: Any) -> TurnTree:
    """The app's one `TurnTree` (it groups concurrent writes, and queues them on SQLite)."""
    turns: TurnTree = app.state.turn_tree
    return turns


async def _complete(request: Request, raw_id: str | None) -> Response:
    try:
        episode_id = authorize_episode(request, raw_id)
        # The agent's messages and tool results are stored as its turns: the same text
        # rule as every other body, with OpenAI's `param` naming the field.
        settings: Settings = request.app.state.settings
        chat_request = parse_request(
            parse_json(await request.body(), loc=()), max_image_bytes=settings.max_image_bytes
        )
        runtimes: RuntimeRegistry = request.app.state.runtimes
        proxy = ChatProxy(turn_tree(request.app), runtimes, live_episodes(request))
        answer = await proxy.complete(episode_id, chat_request)
    except AgentFlowError as exc:
        return openai_error(exc)
    except Exception as exc:  # a bug or a failing part: this request fails, in OpenAI's shape
        log.exception("chat completion failed")
        return openai_error(AgentFlowError(f"internal error: {type(exc).__name__}: {exc}"))
    if chat_request.stream:
        options = chat_request.stream_options
        include_usage = bool(options and options.include_usage)
        return StreamingResponse(
            stream_chunks(answer, include_usage=include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return JSONResponse(completion_of(answer, with_logprobs=bool(chat_request.logprobs)))


@router.post("/v1/episodes/{episode_id}/chat/completions", response_model=None)
async def episode_chat(episode_id: str, request: Request) -> Response:
    return await _complete(request, episode_id)


@router.post("/v1/chat/completions", response_model=None)
async def chat(request: Request) -> Response:
    return await _complete(request, None)


@router.get("/v1/models", response_model=None)
async def models(request: Request, settings: SettingsDep) -> Response:
    try:
        token = bearer_token(request)
        if not is_api_key(token, settings):
            episode_for_key(token, settings.secret_key)
    except AgentFlowError as exc:
        return openai_error(exc)
    runtimes: RuntimeRegistry = request.app.state.runtimes
    names = dict.fromkeys(runtime.model_name for _, runtime in runtimes.items())
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "agentflow"} for n in names]
    return JSONResponse({"object": "list", "data": data})
