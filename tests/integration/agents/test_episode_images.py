"""The episode loop keeps every observation's screenshot: the first on the prompt turn,
each step's on its env turn, each distinct image stored once."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.agents.actions import ScriptedActions
from agentflow.agents.base import Budget
from agentflow.agents.episode import EpisodeLoop
from agentflow.agents.recorders import TurnTreeRecorder
from agentflow.db.blobs import blobs
from agentflow.db.turn_tree import TurnTree
from agentflow.images import blob_id
from agentflow.tokenization.chat import ByteChatTemplate
from envs.base import Action, Message, Observation, StepResult, TextAction

pytestmark = pytest.mark.integration


class ScreenEnv:
    """A screen that changes on every other step (so screenshots repeat), three steps;
    the last observation has a screenshot and no message."""

    def __init__(self) -> None:
        self.screens = [b"\x89PNG\r\n\x1a\n" + os.urandom(64) for _ in range(2)]
        self.steps = 0

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> StepResult:
        self.steps = 0
        return StepResult(
            observation=Observation(
                messages=[Message(role="user", content="click")], image=self.screens[0]
            )
        )

    async def step(self, action: Action, timeout_s: float | None = None) -> StepResult:
        self.steps += 1
        done = self.steps == 3
        messages = [] if done else [Message(role="user", content=f"screen {self.steps}")]
        image = self.screens[(self.steps // 2) % 2]
        return StepResult(
            observation=Observation(messages=messages, image=image),
            reward=1.0 if done else 0.0,
            terminated=done,
        )

    async def state(self) -> dict[str, Any]:
        return {}

    def tools(self) -> list[dict[str, Any]]:
        return []

    async def close(self) -> None:
        return None


def click(history: Sequence[Observation]) -> TextAction:
    return TextAction(text="ok")


async def test_screenshots_are_linked_from_their_turns(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    turns = TurnTree(sessions)
    env = ScreenEnv()
    loop = EpisodeLoop(ByteChatTemplate(), Budget(max_turns=5, max_tokens=2048))
    episode = await turns.create_episode(env_ref="screen")
    outcome = await loop.play(
        env, {}, ScriptedActions(loop.template, click), TurnTreeRecorder(turns, episode)
    )
    assert outcome.status == "completed"

    (leaf,) = await turns.leaves(episode)
    path = await turns.path(leaf.id)
    first, second = (blob_id(s) for s in env.screens)
    assert [(t.kind, t.images) for t in path] == [
        ("prompt", (first,)),
        ("policy", ()),
        ("env", (first,)),  # step 1
        ("policy", ()),
        ("env", (second,)),  # step 2
        ("policy", ()),
        ("env", (second,)),  # step 3: the screenshot alone
    ]
    async with sessions() as session:
        stored = await session.scalar(
            select(func.count()).select_from(blobs).where(blobs.c.sha256.in_([first, second]))
        )
    assert stored == 2
    assert (await turns.blob(second))[1] == env.screens[1]
