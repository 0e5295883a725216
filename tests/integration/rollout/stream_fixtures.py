"""Runs, groups and finished episodes written straight into a real database."""

from __future__ import annotations

import uuid

from sqlalchemy import update

from agentflow.db.models import Run
from agentflow.db.turn_tree import TurnTree
from agentflow.run_config import RunConfig
from agentflow.types import TurnRecord


async def make_run(turns: TurnTree, version: int = 0, group_size: int = 1) -> uuid.UUID:
    config = RunConfig.model_validate(
        {"name": "stream-test", "envs": [{"id": "test/x"}], "rollout": {"group_size": group_size}}
    ).model_dump(mode="json")
    async with turns.sessions.begin() as session:
        run = Run(name="stream-test", config=config, status="running", weight_version=version)
        session.add(run)
        await session.flush()
        return run.id


async def set_version(turns: TurnTree, run_id: uuid.UUID, version: int) -> None:
    async with turns.sessions.begin() as session:
        await session.execute(update(Run).where(Run.id == run_id).values(weight_version=version))


async def open_episode(turns: TurnTree, run_id: uuid.UUID, group: str, version: int) -> uuid.UUID:
    """A running episode with a prompt and one policy turn made by `version`."""
    episode = await turns.create_episode(run_id=run_id, env_ref="test/x", group_id=group)
    prompt = await turns.add_turn(episode, None, TurnRecord(kind="prompt", token_ids=(1, 2, 3)))
    policy = TurnRecord(
        kind="policy", token_ids=(4, 5), logprobs=(-0.5, -0.25), weight_versions=(version,) * 2
    )
    await turns.add_turn(episode, prompt, policy)
    return episode


async def finished_group(
    turns: TurnTree, run_id: uuid.UUID, size: int, version: int = 0, reward: float = 1.0
) -> str:
    group = uuid.uuid4().hex
    for _ in range(size):
        episode = await open_episode(turns, run_id, group, version)
        await turns.complete_episode(episode, "completed", reward)
    return group
