"""The FastAPI app factory: settings, database, routes, one error handler."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import agentflow
from agentflow.agents.blackbox.live import LiveEpisodes
from agentflow.agents.runtime import RuntimeRegistry
from agentflow.api.errors import install_error_handlers
from agentflow.api.limits import BodySizeLimit
from agentflow.api.public_url import PublicUrlCheck, check_public_url
from agentflow.api.routes import (
    agent_callbacks,
    blobs,
    chat,
    envs,
    episodes,
    health,
    metrics,
    runs,
    trajectories,
    trajectory_stream,
    weights,
)
from agentflow.config import Settings, get_settings
from agentflow.db.blobs import blob_store_for
from agentflow.db.migrate import ensure_schema_current
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.metrics import GatewayMetrics
from agentflow.rollout.manager import RunManager
from agentflow.ui import routes as ui
from agentflow.ui.tokens import TokenTexts
from envs import registry


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(
            settings.database_url,
            echo=settings.db_echo,
            synchronous_commit=settings.db_synchronous_commit,
        )
        try:
            await ensure_schema_current(engine)  # refuse to serve a schema that is behind
            app.state.sessionmaker = session_factory(engine)
            # One TurnTree per app: it groups concurrent writes (and queues them on SQLite).
            app.state.turn_tree = TurnTree(
                app.state.sessionmaker, blob_store=blob_store_for(settings)
            )
            manager = RunManager(
                app.state.turn_tree,
                app.state.runtimes,
                settings,
                live=app.state.live_episodes,
                metrics=app.state.metrics,
            )
            app.state.run_manager = manager
            await manager.recover()
            checking = None
            if settings.public_url:
                app.state.public_url_check = PublicUrlCheck(settings.public_url)
                checking = asyncio.create_task(
                    check_public_url(app.state.public_url_check, app.state.instance_id)
                )
            try:
                yield
            finally:
                if checking is not None:
                    checking.cancel()
                try:
                    await manager.shutdown()
                finally:
                    await registry.close_shared()  # the browsers envs share, and the like
        finally:
            await engine.dispose()

    app = FastAPI(title="AgentFlow", version=agentflow.__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.instance_id = uuid.uuid4().hex  # tells this gateway from others at one URL
    app.state.runtimes = RuntimeRegistry()
    app.state.token_texts = TokenTexts(app.state.runtimes)  # the dashboard's token texts
    app.state.metrics = GatewayMetrics()
    app.state.live_episodes = LiveEpisodes()  # black-box episodes' chat state and agents
    app.add_middleware(
        BodySizeLimit,
        max_body_bytes=settings.max_body_bytes,
        max_chat_body_bytes=settings.max_chat_body_bytes,
    )
    install_error_handlers(app)
    app.include_router(health.router)
    # Black-box agents authenticate with their per-episode key, not the API key.
    app.include_router(chat.router)
    app.include_router(agent_callbacks.router)
    # The rest need the API key; each router declares it (`deps.API_KEY`).
    for module in (
        envs,
        runs,
        episodes,
        trajectories,
        trajectory_stream,
        blobs,
        metrics,
        weights,
    ):
        app.include_router(module.router)
    app.include_router(runs.controls)
    # The dashboard: its page and assets, and the JSON its pages read (`agentflow.ui`).
    for router in ui.routers:
        app.include_router(router)
    return app
