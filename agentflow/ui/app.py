"""The dashboard alone, as an app over a database and runtimes another part of the same
process owns: `agentflow train --ui-port` serves it beside the run it trains.

It never starts or recovers a run (which the full gateway does at startup), so it is
safe to open on a database another process is training into. Given the process's
`RunManager` it also serves the controls of that manager's runs (`GET`/`PATCH
/v1/runs/{id}`, pause, resume, stop): the run being trained can be steered from its
dashboard.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI

import agentflow
from agentflow.agents.runtime import RuntimeRegistry
from agentflow.api.errors import install_error_handlers
from agentflow.api.routes import health, runs
from agentflow.config import Settings
from agentflow.db.turn_tree import TurnTree
from agentflow.rollout.manager import RunManager
from agentflow.ui import routes
from agentflow.ui.tokens import TokenTexts


def create_dashboard_app(
    settings: Settings,
    turn_tree: TurnTree,
    runtimes: RuntimeRegistry,
    manager: RunManager | None = None,
) -> FastAPI:
    app = FastAPI(title="AgentFlow dashboard", version=agentflow.__version__)
    app.state.settings = settings
    app.state.instance_id = uuid.uuid4().hex
    app.state.sessionmaker = turn_tree.sessions
    app.state.turn_tree = turn_tree
    app.state.runtimes = runtimes
    app.state.token_texts = TokenTexts(runtimes)
    install_error_handlers(app)
    app.include_router(health.router)
    for router in routes.routers:
        app.include_router(router)
    if manager is not None:
        app.state.run_manager = manager
        app.include_router(runs.controls)
    return app
