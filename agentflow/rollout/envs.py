"""Turn a run's env entries into runnable envs: built-in ids or registered environments."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.db.models import Environment
from agentflow.errors import InvalidInput
from agentflow.run_config import EnvEntry
from envs import registry
from envs.base import Env


@dataclass(frozen=True)
class EnvSource:
    """One entry of the env mix, resolved: how to make a fresh env for an episode."""

    ref: str
    weight: float
    max_concurrency: int
    step_timeout_s: float | None
    environment_id: uuid.UUID | None = None
    kind: str | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Set when the env is served elsewhere (env-server actors): makes its client.
    make_env: Callable[[], Env] | None = None

    def make(self) -> Env:
        if self.make_env is not None:
            return self.make_env()
        if self.kind is None:
            return registry.make(self.ref, **self.kwargs)
        return registry.resolve(registry.parse_spec(self.kind, self.spec))


async def resolve_env_sources(
    sessions: async_sessionmaker[AsyncSession], entries: list[EnvEntry]
) -> list[EnvSource]:
    """Registered envs (by `name[@version]`) first, then built-in registry ids."""
    sources: list[EnvSource] = []
    async with sessions() as session:
        for index, entry in enumerate(entries):
            name, _, version = entry.id.partition("@")
            query = select(Environment).where(Environment.name == name)
            if version:
                query = query.where(Environment.version == version)
            env = await session.scalar(query.order_by(Environment.created_at.desc()).limit(1))
            if env is not None:
                if entry.kwargs:
                    raise InvalidInput(
                        f"{entry.id!r} is a registered env: its spec fixes its arguments, "
                        "so kwargs would be ignored",
                        field=("envs", str(index), "kwargs"),
                    )
                sources.append(
                    EnvSource(
                        ref=entry.id,
                        weight=entry.weight,
                        max_concurrency=min(entry.max_concurrency, env.max_concurrency),
                        step_timeout_s=env.step_timeout_s,
                        environment_id=env.id,
                        kind=env.kind,
                        spec=dict(env.spec),
                    )
                )
            elif entry.id in registry.registered():
                sources.append(
                    EnvSource(
                        ref=entry.id,
                        weight=entry.weight,
                        max_concurrency=entry.max_concurrency,
                        step_timeout_s=None,
                        kwargs=dict(entry.kwargs),
                    )
                )
            else:
                raise InvalidInput(
                    f"unknown environment {entry.id!r}", field=("envs", str(index), "id")
                )
    return sources
