"""FastAPI dependencies as `Annotated` aliases."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.agents.runtime import RuntimeRegistry
from agentflow.config import Settings
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import Unauthorized
from agentflow.rollout.manager import RunManager


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_sessionmaker(request: Request) -> async_sessionmaker[AsyncSession]:
    maker: async_sessionmaker[AsyncSession] = request.app.state.sessionmaker
    return maker


async def get_session(
    maker: Annotated[async_sessionmaker[AsyncSession], Depends(get_sessionmaker)],
) -> AsyncIterator[AsyncSession]:
    async with maker() as session:
        yield session


def get_runtimes(request: Request) -> RuntimeRegistry:
    runtimes: RuntimeRegistry = request.app.state.runtimes
    return runtimes


def get_run_manager(request: Request) -> RunManager:
    manager: RunManager = request.app.state.run_manager
    return manager


def get_turn_tree(request: Request) -> TurnTree:
    turns: TurnTree = request.app.state.turn_tree
    return turns


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[AsyncSession, Depends(get_session)]
SessionMakerDep = Annotated[async_sessionmaker[AsyncSession], Depends(get_sessionmaker)]
RuntimesDep = Annotated[RuntimeRegistry, Depends(get_runtimes)]
RunManagerDep = Annotated[RunManager, Depends(get_run_manager)]
TurnTreeDep = Annotated[TurnTree, Depends(get_turn_tree)]


async def require_api_key(request: Request, settings: SettingsDep) -> None:
    """Every route but /healthz and the docs needs `Authorization: Bearer <key>` when set."""
    if not settings.api_key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token, settings.api_key):
        raise Unauthorized("missing or wrong API key: send `Authorization: Bearer <key>`")
