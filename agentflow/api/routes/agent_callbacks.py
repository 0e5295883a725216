"""What black-box agents (and outside graders) send back to the gateway.

    POST /v1/episodes/{id}/complete   {status, answer?, reward?, error?}  the agent is done
    POST /v1/episodes/{id}/reward     {reward}                            a reward from outside
    POST /v1/episodes/{id}/env/step   {action, timeout_s?}                act on the episode's env

Each needs the episode's key (or the gateway's API key, when one is set) as Bearer. They
act on episodes an `http` or `container` agent of this gateway is running: 404 for an
unknown episode, 409 for a finished one or one no black-box agent runs here. How the
report and rewards become the episode's reward is `agentflow.agents.blackbox.outcome`.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request, status
from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentflow.agents.blackbox.live import AgentReport, AgentSlot
from agentflow.api.deps import require_episode_key
from agentflow.api.routes.chat import live_episodes, turn_tree
from agentflow.api.routing import GatewayRoute
from agentflow.errors import Conflict, InvalidInput, NotFound
from agentflow.types import OPEN_EPISODE_STATUSES
from envs.base import EnvError, parse_action

# The episode's key is checked first, before the body is read (`routing.GatewayRoute`).
router = APIRouter(
    prefix="/v1/episodes",
    tags=["agents"],
    route_class=GatewayRoute,
    dependencies=[Depends(require_episode_key)],
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CompleteBody(_Body):
    status: Literal["completed", "failed"]
    answer: str | None = Field(default=None, max_length=100_000)
    reward: float | None = None
    error: str | None = Field(default=None, max_length=10_000)

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("reward must be finite")
        return value


class RewardBody(_Body):
    reward: float

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("reward must be finite")
        return value


class StepBody(_Body):
    action: dict[str, Any]
    timeout_s: float | None = Field(default=None, gt=0, le=3600)


async def _running_slot(request: Request, episode_id: uuid.UUID) -> AgentSlot:
    episode = await turn_tree(request.app).episode(episode_id)
    if episode.status not in OPEN_EPISODE_STATUSES:
        raise Conflict(f"episode {episode_id} is already {episode.status}")
    try:
        return live_episodes(request).agent(episode_id)
    except NotFound as exc:
        raise Conflict(exc.message) from None


@router.post("/{episode_id}/complete", status_code=status.HTTP_202_ACCEPTED)
async def complete(
    episode_id: uuid.UUID,
    body: CompleteBody,
    request: Request,
) -> dict[str, Any]:
    await _running_slot(request, episode_id)
    report = AgentReport(
        status=body.status, answer=body.answer, reward=body.reward, error=body.error
    )
    live_episodes(request).report(episode_id, report)
    return {"episode_id": str(episode_id), "accepted": True}


@router.post("/{episode_id}/reward", status_code=status.HTTP_202_ACCEPTED)
async def reward(
    episode_id: uuid.UUID,
    body: RewardBody,
    request: Request,
) -> dict[str, Any]:
    slot = await _running_slot(request, episode_id)
    slot.rewards.append(body.reward)
    return {"episode_id": str(episode_id), "rewards": len(slot.rewards)}


@router.post("/{episode_id}/env/step")
async def env_step(
    episode_id: uuid.UUID,
    body: StepBody,
    request: Request,
) -> dict[str, Any]:
    """Apply an action to the episode's env: how an agent runs the env's tools."""
    slot = await _running_slot(request, episode_id)
    try:
        action = parse_action(body.action)
    except EnvError as exc:
        raise InvalidInput(exc.message, field=("body", "action")) from None
    async with slot.env_lock:  # an env steps one action at a time
        if slot.env_done:
            raise Conflict(f"the env of episode {episode_id} has already ended")
        try:
            result = await slot.env.step(action, timeout_s=body.timeout_s)
        except EnvError as exc:
            raise _env_failure(exc) from None
        slot.env_reward += result.reward
        slot.env_done = result.done
    return result.model_dump(mode="json")


def _env_failure(exc: EnvError) -> Exception:
    if exc.status_code == 422:
        return InvalidInput(exc.message, field=("body", "action"))
    if exc.status_code == 409:
        return Conflict(exc.message)
    from agentflow.errors import AgentFlowError

    err = AgentFlowError(f"the env failed: {exc.message}")
    err.status_code = 504 if exc.status_code == 504 else 502
    return err
