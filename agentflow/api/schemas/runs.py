from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

RunStatus = Literal["pending", "running", "paused", "stopped", "finished", "failed"]
# Runs in these states hold their environments: those cannot be deleted.
ACTIVE_RUN_STATUSES: tuple[str, ...] = ("running", "paused")


class RunPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    name: str
    status: str
    weight_version: int
    env_revision: int = 0
    config: dict[str, Any]
    error: str | None
    created_at: datetime
    updated_at: datetime


class EnvRevisionPublic(BaseModel):
    """One revision of a run's env mix: in effect from `created_at`, when the run served
    `weight_version`, made by `changed_by`."""

    model_config = ConfigDict(from_attributes=True)

    revision: int
    envs: list[dict[str, Any]]
    weight_version: int
    changed_by: str
    created_at: datetime


class RunDetail(RunPublic):
    """A run with its env mix now (`envs`, revision `env_revision`) and every revision
    the mix has had, oldest first."""

    envs: list[dict[str, Any]]
    env_revisions: list[EnvRevisionPublic]


class EpisodePublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    run_id: uuid.UUID | None
    environment_id: uuid.UUID | None
    env_ref: str
    task: dict[str, Any]
    group_id: str | None
    status: str
    reward: float | None
    error: str | None
    min_weight_version: int | None
    max_weight_version: int | None
    created_at: datetime
    finished_at: datetime | None
