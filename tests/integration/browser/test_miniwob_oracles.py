"""Every scripted oracle solves its MiniWoB++ task through the env API, as an agent would:
reading the observation's message and answering a text action."""

from __future__ import annotations

import asyncio

import pytest

from envs import registry
from envs.base import Observation, TextAction
from envs.browser.miniwob import make_env, task_names
from envs.browser.oracles import ORACLES, Oracle, noisy_oracle
from envs.browser.pool import BrowserPool

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SEEDS = (0, 1)


async def test_oracles_cover_enough_tasks_and_are_registered() -> None:
    assert len(ORACLES) >= 12 and set(ORACLES) <= set(task_names())
    assert len(task_names()) >= 120
    for name, fn in ORACLES.items():
        entry = registry.spec(f"miniwob/{name}-v0")
        assert entry.oracle == f"envs.browser.oracles:{fn.__name__}"
        assert registry.oracle(f"miniwob/{name}-v0") is fn
        assert registry.noisy_oracle_factory(f"miniwob/{name}-v0") is not None
    assert registry.spec("miniwob/book-flight-v0").oracle is None


async def _play(
    env_task: str, pool: BrowserPool, seed: int, policy: Oracle | None = None
) -> tuple[float, int]:
    env = make_env(env_task, pool=pool, screenshots=False)
    policy = policy or ORACLES[env_task]
    try:
        result = await env.reset(seed=seed)
        history: list[Observation] = [result.observation]
        for _ in range(10):
            action = policy(history)
            assert isinstance(action, TextAction)
            result = await env.step(action)
            assert result.info["last_action_error"] is None, (action.text, result.info)
            history.append(result.observation)
            if result.terminated:
                break
        return result.reward, len(history) - 1
    finally:
        await env.close()


@pytest.mark.parametrize("task", sorted(ORACLES))
async def test_oracle_solves_its_task(task: str, pool: BrowserPool) -> None:
    played = await asyncio.gather(*(_play(task, pool, seed) for seed in SEEDS))  # concurrent
    assert [reward for reward, _ in played] == [1.0] * len(SEEDS), (task, played)


async def test_noisy_oracle_is_the_oracle_at_p1_and_clicks_at_p0(pool: BrowserPool) -> None:
    solver = ORACLES["click-checkboxes"]
    reward, _ = await _play("click-checkboxes", pool, 3, noisy_oracle(1.0, 0, oracle=solver))
    assert reward == 1.0
    env = make_env("click-checkboxes", pool=pool, screenshots=False)
    try:
        first = await env.reset(seed=3)
        clicks = [noisy_oracle(0.0, s, oracle=solver)([first.observation]).text for s in range(8)]
        assert all(c.startswith("click('") for c in clicks) and len(set(clicks)) > 1
        for click in clicks[:3]:
            result = await env.step(TextAction(text=click))
            assert result.info["last_action_error"] is None
            if result.terminated:
                break
    finally:
        await env.close()
