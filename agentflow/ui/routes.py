"""`/ui`: the dashboard's page, its assets, signing in, and the JSON its pages read.

When the gateway has an API key, everything here but `POST /ui/login` needs it: as
`Authorization: Bearer <key>`, or as the session cookie `POST /ui/login` sets for a
browser (which cannot put a header on a page or an image it opens). Without it the page
answers 401 with the sign-in form, and the data routes 401 with the usual JSON error.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import uuid
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from agentflow.api.deps import (
    UI_ACCESS,
    UI_ACTION,
    UI_COOKIE,
    RuntimesDep,
    SessionDep,
    SettingsDep,
    TurnTreeDep,
    is_api_key,
    ui_access_granted,
    ui_cookie_value,
    ui_csrf_token,
)
from agentflow.api.routes.blobs import blob_response
from agentflow.api.routing import GatewayRoute
from agentflow.errors import Conflict, InvalidInput, NotFound
from agentflow.integers import Int32, Int64
from agentflow.rollout.manager import RunManager
from agentflow.run_config import EnvMixChange
from agentflow.types import EpisodeStatus
from agentflow.ui import queries
from agentflow.ui.tokens import TokenTexts

log = logging.getLogger(__name__)

# The browser runs only this origin's scripts and styles, and nothing frames the page.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
# A browser session lasts a week, then the key is asked again.
SESSION_SECONDS = 7 * 24 * 3600

pages = APIRouter(prefix="/ui", tags=["dashboard"], route_class=GatewayRoute)
data = APIRouter(
    prefix="/ui/api", tags=["dashboard"], route_class=GatewayRoute, dependencies=UI_ACCESS
)
assets = APIRouter(
    prefix="/ui/static", tags=["dashboard"], route_class=GatewayRoute, dependencies=UI_ACCESS
)


@cache
def _static() -> dict[str, bytes]:
    """The shipped assets by file name, read once (a dozen small files)."""
    folder = resources.files("agentflow.ui") / "static"
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


def _sign_in_page(message: str = "") -> HTMLResponse:
    """The sign-in form, 401. Its one inline style block is allowed by its hash."""
    page = _static()["login.html"].decode()
    return HTMLResponse(
        page.replace("<!--message-->", message),
        status_code=401,
        headers={
            **SECURITY_HEADERS,
            "Content-Security-Policy": _sign_in_policy(),
            "WWW-Authenticate": "Bearer",
        },
    )


@cache
def _sign_in_policy() -> str:
    page = _static()["login.html"].decode()
    style = page.split("<style>", 1)[1].split("</style>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()
    return (
        f"default-src 'none'; style-src 'sha256-{digest}'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    )


@pages.get("", response_class=HTMLResponse, include_in_schema=False)
@pages.get("/", response_class=HTMLResponse, include_in_schema=False)
async def dashboard(request: Request) -> Response:
    if not ui_access_granted(request):
        return _sign_in_page()
    return HTMLResponse(
        _static()["index.html"], headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"}
    )


@pages.post("/login", include_in_schema=False)
async def sign_in(request: Request, settings: SettingsDep) -> Response:
    """The sign-in form's post (`key=...`): the session cookie and back to the page, or
    401 and the form again."""
    try:
        form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
    except ValueError:  # more fields than the form has: not the form
        form = {}
    key = (form.get("key") or [""])[0].strip()
    if settings.api_key and not is_api_key(key, settings):
        return _sign_in_page('<p class="error" role="alert">That is not the key.</p>')
    answer = RedirectResponse("/ui", status_code=303)
    answer.set_cookie(
        UI_COOKIE,
        ui_cookie_value(settings),
        max_age=SESSION_SECONDS,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return answer


@pages.post("/logout", include_in_schema=False)
async def sign_out() -> Response:
    answer = RedirectResponse("/ui", status_code=303)
    answer.delete_cookie(UI_COOKIE, path="/ui")
    return answer


@assets.get("/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    suffix = name[name.rfind(".") :] if "." in name else ""
    body = _static().get(name)
    if body is None or suffix not in _MEDIA_TYPES:
        raise NotFound(f"no dashboard asset {name!r}")
    return Response(
        body,
        media_type=_MEDIA_TYPES[suffix],
        headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"},
    )


Limit = Annotated[Int64, Query(ge=1, le=500)]
Offset = Annotated[Int64, Query(ge=0)]


@data.get("/runs")
async def runs(session: SessionDep, limit: Limit = 50, offset: Offset = 0) -> dict[str, Any]:
    return await queries.run_list(session, limit=limit, offset=offset)


@data.get("/runs/{run_id}")
async def run(run_id: uuid.UUID, session: SessionDep) -> dict[str, Any]:
    return await queries.run_detail(session, run_id)


@data.get("/runs/{run_id}/episodes")
async def run_episodes(
    run_id: uuid.UUID,
    session: SessionDep,
    status: EpisodeStatus | None = None,
    env: Annotated[str | None, Query(max_length=200)] = None,
    reward_min: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    reward_max: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    weight_version: Annotated[Int32 | None, Query(ge=0)] = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> dict[str, Any]:
    where = queries.EpisodeFilter(status, env, reward_min, reward_max, weight_version)
    return await queries.episode_page(session, run_id, where, limit=limit, offset=offset)


@data.get("/episodes/{episode_id}")
async def episode(
    episode_id: uuid.UUID, request: Request, session: SessionDep, turns: TurnTreeDep
) -> dict[str, Any]:
    texts: TokenTexts = request.app.state.token_texts
    return await queries.episode_detail(session, turns, texts, episode_id)


@data.get("/envs")
async def envs(session: SessionDep) -> dict[str, Any]:
    return await queries.env_list(session)


@data.get("/engines")
async def engines(session: SessionDep, runtimes: RuntimesDep) -> dict[str, Any]:
    return await queries.engine_list(session, runtimes)


@data.get("/blobs/{sha256}", response_class=Response)
async def blob(sha256: str, turns: TurnTreeDep) -> Response:
    return await blob_response(sha256, turns)


# ---- run controls: the page's actions, refused from another site -------------------

actions = APIRouter(
    prefix="/ui/api",
    tags=["dashboard"],
    route_class=GatewayRoute,
    dependencies=UI_ACTION,
)


@data.get("/session")
async def ui_session(request: Request) -> dict[str, Any]:
    """What the page needs to act: its token (`X-CSRF-Token`), and whether this
    dashboard controls runs (the gateway's, and `agentflow train --ui-port`'s do)."""
    return {
        "csrf_token": ui_csrf_token(request),
        "controls": getattr(request.app.state, "run_manager", None) is not None,
    }


def _manager(request: Request) -> RunManager:
    manager: RunManager | None = getattr(request.app.state, "run_manager", None)
    if manager is None:
        raise Conflict("this dashboard shows runs but does not control them")
    return manager


def _who(request: Request) -> str:
    client = request.client.host if request.client is not None else "unknown"
    return f"dashboard from {client}"


@actions.post("/runs/{run_id}/{action}")
async def control_run(
    run_id: uuid.UUID,
    action: Annotated[str, Path(pattern="^(pause|resume|stop)$")],
    request: Request,
    session: SessionDep,
) -> dict[str, Any]:
    """Pause, resume or stop a run; logged with who and when."""
    manager = _manager(request)
    who = _who(request)
    live = await manager.live(run_id)
    if action == "pause":
        await live.pause()
    elif action == "resume":
        await live.resume()
    else:
        await live.stop(f"stopped from the dashboard ({who})")
    log.info("run %s: %s by %s at %s", run_id, action, who, datetime.now(UTC).isoformat())
    session.expire_all()
    return await queries.run_detail(session, run_id)


@actions.patch("/runs/{run_id}/envs")
async def change_envs(
    run_id: uuid.UUID, change: EnvMixChange, request: Request, session: SessionDep
) -> dict[str, Any]:
    """Change the run's env mix (as `PATCH /v1/runs/{id}`); the revision records who."""
    manager = _manager(request)
    who = _who(request)
    try:
        revision = await manager.change_envs(run_id, change, changed_by=who)
    except InvalidInput as exc:
        raise InvalidInput(exc.message, field=("body", *exc.field)) from None
    log.info(
        "run %s: env mix revision %d by %s at %s",
        run_id,
        revision.revision,
        who,
        revision.created_at.isoformat(),
    )
    session.expire_all()
    return await queries.run_detail(session, run_id)


routers = (pages, data, assets, actions)
