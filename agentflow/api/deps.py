"""FastAPI dependencies as `Annotated` aliases."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.agents.keys import episode_for_key
from agentflow.agents.runtime import RuntimeRegistry
from agentflow.config import Settings
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import Forbidden, NotFound, Unauthorized
from agentflow.rollout.manager import RunManager


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_sessionmaker(request: Request) -> async_sessionmaker[AsyncSession]:
    maker: async_sessionmaker[AsyncSession] = request.app.state.sessionmaker
    return maker


async def get_session(
    maker: Annotated[async_sessionmaker[AsyncSession], Depends(get_sessionmaker)],
) -> AsyncIterator[AsyncSession]:
    async with maker() as session:
        yield session


async def get_runtimes(request: Request) -> RuntimeRegistry:
    runtimes: RuntimeRegistry = request.app.state.runtimes
    return runtimes


async def get_run_manager(request: Request) -> RunManager:
    manager: RunManager = request.app.state.run_manager
    return manager


async def get_turn_tree(request: Request) -> TurnTree:
    turns: TurnTree = request.app.state.turn_tree
    return turns


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[AsyncSession, Depends(get_session)]
SessionMakerDep = Annotated[async_sessionmaker[AsyncSession], Depends(get_sessionmaker)]
RuntimesDep = Annotated[RuntimeRegistry, Depends(get_runtimes)]
RunManagerDep = Annotated[RunManager, Depends(get_run_manager)]
TurnTreeDep = Annotated[TurnTree, Depends(get_turn_tree)]


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def bearer_token(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("send the key as `Authorization: Bearer <key>`")
    return token.strip()


def is_api_key(token: str, settings: Settings) -> bool:
    # Bytes: compare_digest refuses str with non-ASCII characters, which a header may hold.
    key = (settings.api_key or "").encode()
    return bool(key) and secrets.compare_digest(token.encode("utf-8", "surrogateescape"), key)


def parse_episode_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound(f"episode {raw!r} not found (not a UUID)") from None


def authorize_episode(request: Request, raw_id: str | None) -> uuid.UUID:
    """The episode this request may act on: the one its episode key is bound to, which
    must be `raw_id` when given. The gateway's API key (when one is set) may act on any
    episode it names. The key is checked before the id is even parsed."""
    settings = _settings(request)
    token = bearer_token(request)
    if raw_id is not None and is_api_key(token, settings):
        return parse_episode_id(raw_id)
    bound = episode_for_key(token, settings.secret_key)
    if raw_id is not None:
        try:
            named = uuid.UUID(raw_id)
        except ValueError:
            named = None
        if named != bound:
            raise Unauthorized("this key is bound to another episode")
    return bound


# The checks `routing.GatewayRoute` runs before it reads anything of a request. Each takes
# the request alone, so it can run ahead of FastAPI's own solving.


def check_api_key(request: Request) -> None:
    """Every route but the health checks, the docs and the agents' own routes needs
    `Authorization: Bearer <key>` when an API key is set."""
    settings = _settings(request)
    if not settings.api_key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not is_api_key(token, settings):
        raise Unauthorized("missing or wrong API key: send `Authorization: Bearer <key>`")


def check_episode_key(request: Request) -> None:
    """The `{episode_id}` of the path may be acted on with this request's key."""
    authorize_episode(request, request.path_params["episode_id"])


# The dashboard's session cookie: a browser cannot send the key as a header when it
# opens a page or an image, so `POST /ui/login` trades the key for this cookie.
UI_COOKIE = "agentflow_ui"


def ui_cookie_value(settings: Settings) -> str:
    """What the cookie holds: a MAC of the API key under the secret key, so the cookie
    is not the key itself, and a new API key (or secret) ends every dashboard session."""
    message = b"agentflow-ui-session:" + (settings.api_key or "").encode()
    return hmac.new(settings.secret_key.encode(), message, hashlib.sha256).hexdigest()


def ui_access_granted(request: Request) -> bool:
    """No API key is set, or the request carries it (as a header or as the cookie)."""
    settings = _settings(request)
    if not settings.api_key:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and is_api_key(token.strip(), settings):
        return True
    cookie = request.cookies.get(UI_COOKIE, "")
    return secrets.compare_digest(
        cookie.encode("utf-8", "surrogateescape"), ui_cookie_value(settings).encode()
    )


def ui_csrf_token(request: Request) -> str:
    """The token the dashboard's page sends with each action (`X-CSRF-Token`): a MAC of
    this browser session (its cookie) under the secret key, which the page reads from
    `GET /ui/api/session`. Another site can make a browser send the cookie, never read
    this token (the browser keeps another origin's answers from it)."""
    settings = _settings(request)
    session = request.cookies.get(UI_COOKIE, "") if settings.api_key else "no-key"
    message = b"agentflow-ui-action:" + session.encode("utf-8", "surrogateescape")
    return hmac.new(settings.secret_key.encode(), message, hashlib.sha256).hexdigest()


def check_ui_action(request: Request) -> None:
    """A dashboard action (pause, resume, stop, a mix change) is refused from another
    site: a browser session needs its page's token and, on top, an `Origin` that is this
    host's own. A request with the API key as its header is not a browser session: the
    key itself is the proof."""
    settings = _settings(request)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if settings.api_key and scheme.lower() == "bearer" and is_api_key(token.strip(), settings):
        return
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is None or origin != own:
        raise Forbidden(
            f"a dashboard action must come from the dashboard's own page (Origin {own}, "
            f"not {origin or 'none'})"
        )
    sent = request.headers.get("x-csrf-token", "")
    if not secrets.compare_digest(
        sent.encode("utf-8", "surrogateescape"), ui_csrf_token(request).encode()
    ):
        raise Forbidden("missing or wrong X-CSRF-Token: reload the dashboard's page")


def check_ui_access(request: Request) -> None:
    """The dashboard's data and assets: the API key, as a header or as the cookie."""
    if not ui_access_granted(request):
        raise Unauthorized("missing or wrong API key: sign in at /ui, or send the key")


# The same checks as the dependencies routers declare. FastAPI runs them again after
# `GatewayRoute`; `async def` keeps that second run on the event loop (a plain `def`
# dependency goes to a worker thread on every request).
async def require_api_key(request: Request) -> None:
    check_api_key(request)


async def require_episode_key(request: Request) -> None:
    check_episode_key(request)


async def require_ui_access(request: Request) -> None:
    check_ui_access(request)


async def require_ui_action(request: Request) -> None:
    check_ui_action(request)


# What a router that needs the API key declares (`APIRouter(dependencies=API_KEY)`): on
# the router itself, where `GatewayRoute` sees it, not at `include_router`.
API_KEY = [Depends(require_api_key)]
UI_ACCESS = [Depends(require_ui_access)]
# A dashboard action: signed in, and from the dashboard's own page.
UI_ACTION = [Depends(require_ui_access), Depends(require_ui_action)]
# Each auth dependency, and the check `GatewayRoute` runs for it before anything else.
AUTH_CHECKS: dict[Callable[..., Any], Callable[[Request], None]] = {
    require_api_key: check_api_key,
    require_episode_key: check_episode_key,
    require_ui_access: check_ui_access,
    require_ui_action: check_ui_action,
}
