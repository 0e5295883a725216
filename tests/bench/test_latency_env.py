"""`agentflow/latency-model-v0`: seeded turns, long-tailed waits, a reward that varies within
a group, and the Env protocol's edges."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Iterator

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from bench.latency_env import ENV_ID, LatencyModelEnv, register
from envs import registry
from envs.adapters.as_gymnasium import register_with_gymnasium
from envs.base import Env as EnvProtocol
from envs.base import EnvClosed, EpisodeFinished, StepTimeout, TextAction, ToolCall, ToolCallsAction


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    register()
    yield
    registry.unregister(ENV_ID)


async def play(env: LatencyModelEnv, seed: int, answer: str = "a") -> tuple[int, float, float]:
    """(turns, reward, wall seconds) of one episode answering `answer` every turn."""
    result = await env.reset(seed=seed)
    turns, started = 0, time.perf_counter()
    while not result.done:
        result = await env.step(TextAction(text=answer))
        turns += 1
    assert result.terminated and not result.truncated
    return turns, result.reward, time.perf_counter() - started


async def test_registered_and_configured_by_kwargs() -> None:
    env = registry.make(ENV_ID, min_turns=3, max_turns=3, latency_median_s=0.0)
    assert isinstance(env, LatencyModelEnv) and isinstance(env, EnvProtocol)
    assert (await play(env, seed=1))[0] == 3
    await env.close()
    with pytest.raises(ValueError):
        LatencyModelEnv(min_turns=4, max_turns=2)
    with pytest.raises(ValueError):
        LatencyModelEnv(time_scale=0.0)


async def test_turns_are_drawn_per_seed_within_bounds() -> None:
    env = LatencyModelEnv(min_turns=2, max_turns=6, latency_median_s=0.0)
    turns = [(await play(env, seed))[0] for seed in range(60)]
    assert set(turns) == {2, 3, 4, 5, 6}
    assert [(await play(env, seed))[0] for seed in range(60)] == turns  # reproducible
    await env.close()


async def test_steps_wait_a_long_tailed_latency_scaled_by_time_scale() -> None:
    env = LatencyModelEnv(latency_median_s=1.0, latency_sigma=1.0, latency_max_s=20.0)
    rng = random.Random(0)
    draws = sorted(env.draw_latency(rng) for _ in range(4000))
    assert 0.9 < statistics.median(draws) < 1.1
    assert draws[int(0.99 * len(draws))] > 6.0 and max(draws) <= 20.0

    fast = LatencyModelEnv(latency_median_s=1.0, latency_sigma=0.5, time_scale=0.01)
    await fast.reset(seed=3)
    expected = sum(fast.latencies)  # wall seconds, already scaled
    assert len(fast.latencies) == fast.episode_turns and 0.004 < expected / fast.episode_turns
    _, _, wall = await play(fast, seed=3)
    # It waits its latencies, scaled: far less than they would take unscaled (a bound
    # that a busy machine's late wake-ups cannot reach, unlike "a few ms more").
    assert expected <= wall < 0.5 * expected / fast.time_scale
    await fast.close()


async def test_reward_is_binary_task_dependent_and_varies_within_a_group() -> None:
    env = LatencyModelEnv(latency_median_s=0.0, min_turns=1, max_turns=1)
    by_task = []
    for seed in range(40):
        rewards = [(await play(env, seed, answer=f"sample {i}"))[1] for i in range(16)]
        assert set(rewards) <= {0.0, 1.0}
        by_task.append(statistics.mean(rewards))
    mixed = [m for m in by_task if 0.0 < m < 1.0]
    assert len(mixed) > 20  # most groups have a non-zero advantage
    assert min(by_task) < 0.2 and max(by_task) > 0.8  # easy and hard tasks
    # The same answers to the same task score the same.
    assert (await play(env, 7, "same"))[1] == (await play(env, 7, "same"))[1]
    await env.close()


async def test_protocol_edges() -> None:
    env = LatencyModelEnv(min_turns=2, max_turns=2, latency_median_s=0.0)
    with pytest.raises(EpisodeFinished):
        await env.step(TextAction(text="before reset"))
    first = await env.reset(seed=0)
    assert first.observation.messages[0].role == "user" and env.tools() == []
    call = ToolCallsAction(calls=[ToolCall(id="c", name="anything", arguments={"x": 1})])
    middle = await env.step(call)  # any action type is accepted
    assert not middle.done and middle.observation.messages
    last = await env.step(TextAction(text="b"))
    assert last.terminated and last.info["success"] in (True, False)
    with pytest.raises(EpisodeFinished):
        await env.step(TextAction(text="after the end"))
    state = await env.state()
    assert state["episode_turns"] == 2 and state["done"]
    await env.reset(seed=0)  # reset again after the end
    await env.close()
    await env.close()  # idempotent
    with pytest.raises(EnvClosed):
        await env.reset(seed=1)


async def test_a_slow_step_times_out() -> None:
    env = LatencyModelEnv(min_turns=2, latency_median_s=5.0, latency_sigma=0.0)
    await env.reset(seed=0)
    with pytest.raises(StepTimeout):
        await env.step(TextAction(text="a"), timeout_s=0.01)
    await env.close()


def test_passes_gymnasium_check_env() -> None:
    register_with_gymnasium(ENV_ID, latency_median_s=0.0)
    env = gymnasium.make(ENV_ID).unwrapped
    check_env(env)
    env.close()
    env.close()


async def test_many_episodes_wait_concurrently() -> None:
    envs = [LatencyModelEnv(latency_median_s=0.05, latency_sigma=0.0) for _ in range(50)]
    started = time.perf_counter()
    results = await asyncio.gather(*[play(env, seed=i) for i, env in enumerate(envs)])
    assert time.perf_counter() - started < 0.6  # at most 6 turns of 50 ms, all at once
    assert all(2 <= turns <= 6 for turns, _, _ in results)
    for env in envs:
        await env.close()
