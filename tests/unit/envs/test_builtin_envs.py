"""The built-in envs: their oracles solve them, a random policy does clearly worse."""

import random
from collections.abc import Sequence

import pytest

from envs import registry
from envs.base import (
    Action,
    BrowserAction,
    EnvClosed,
    EpisodeFinished,
    InvalidAction,
    Observation,
    StepTimeout,
    TextAction,
    ToolCall,
    ToolCallsAction,
)
from envs.builtin.calc_tool import CalcToolEnv
from envs.builtin.family import BUILTIN_ENVS
from envs.builtin.guess_number import GuessNumberEnv
from envs.builtin.lookup import NAMES, PETS, LookupEnv
from tests.support.play import play_episode
from tests.unit.envs.fakes import SubprocessSandbox

SEEDS = range(40)


def make(env_id: str):
    if env_id == "agentflow/calc-tool-v0":
        return registry.make(env_id, sandbox_factory=SubprocessSandbox)
    return registry.make(env_id)


def random_policy(env_id: str, seed: int):
    """Uniform choices over well-formed actions: tool calls with plausible arguments and
    plausible answers, never peeking at the hidden state."""
    rng = random.Random(seed)

    def policy(history: Sequence[Observation]) -> Action:
        if env_id == "agentflow/guess-number-v0":
            return TextAction(text=str(rng.randint(1, 16)))
        if env_id == "agentflow/calc-tool-v0":
            if rng.random() < 0.5:
                code = f"print({rng.randint(10, 99)}*{rng.randint(10, 99)})"
                return ToolCallsAction(
                    calls=[ToolCall(id="c", name="python", arguments={"code": code})]
                )
            return TextAction(text=f"answer: {rng.randint(1, 3000)}")
        if env_id.endswith("vault-v0"):
            return TextAction(text=str(rng.randrange(10)))
        if env_id.endswith(("digits-v0", "relay-v0")):
            return TextAction(text="".join(rng.choice("0123456789") for _ in range(4)))
        if rng.random() < 0.5:
            key = f"{rng.choice(NAMES)}.{rng.choice(['friend', 'pet'])}"
            return TextAction(text=f"lookup({key})")
        return TextAction(text=f"answer: {rng.choice(PETS)}")

    return policy


@pytest.mark.parametrize("env_id", BUILTIN_ENVS)
async def test_oracle_solves_every_episode_and_random_does_clearly_worse(env_id: str) -> None:
    env = make(env_id)
    oracle = registry.oracle(env_id)
    oracle_rewards, random_rewards = [], []
    # calc-tool starts a Python process per tool call: fewer episodes keep the test fast.
    seeds = SEEDS[:12] if env_id == "agentflow/calc-tool-v0" else SEEDS
    for seed in seeds:
        episode = await play_episode(env, oracle, seed=seed)
        assert episode.success, (env_id, seed, episode.results[-1])
        oracle_rewards.append(episode.total_reward)
        episode = await play_episode(env, random_policy(env_id, 1000 + seed), seed=seed)
        random_rewards.append(episode.total_reward)
    await env.close()
    oracle_mean = sum(oracle_rewards) / len(seeds)
    random_mean = sum(random_rewards) / len(seeds)
    if env_id == "agentflow/guess-number-v0":
        # Binary search finds every number within 5 guesses: the best any policy that does
        # not know the number can do; its mean reward is about 0.78.
        assert min(oracle_rewards) >= 0.6 and oracle_mean > 0.7
    elif env_id in ("agentflow/vault-v0", "agentflow/recall-vault-v0"):
        assert oracle_mean == pytest.approx(1.4)  # the key (1) and two dials (0.2 each)
    elif env_id == "agentflow/long-vault-v0":
        # The key (1) and six dials (0.1 each), each with noise of sd 0.1: about 0.04
        # over 40 episodes.
        assert oracle_mean == pytest.approx(1.6, abs=0.15)
    elif env_id == "agentflow/slip-vault-v0":
        # The right key opens 70% of the time, each right dial pays 0.2 70% of the time.
        assert oracle_mean == pytest.approx(0.7 + 3 * 0.2 * 0.7, abs=0.25)
    else:
        assert oracle_mean == pytest.approx(1.0)  # the digit envs pay 1/questions a turn
    assert random_mean < 0.5 * oracle_mean, (oracle_mean, random_mean)


async def test_guess_number_rules_and_reward() -> None:
    env = GuessNumberEnv()
    first = await env.reset(seed=3, options={"target": 5})
    assert "1 to 16" in first.observation.messages[0].content
    assert (await env.step(TextAction(text="I guess 8"))).observation.text == "lower"
    reminder = await env.step(TextAction(text="no idea"))
    assert "Reply with one number" in (reminder.observation.text or "")
    assert reminder.info["valid"] is False
    assert (
        await env.step(TextAction(text="3 or maybe 99"))
    ).observation.text == "Reply with one number from 1 to 16."
    done = await env.step(TextAction(text="5"))
    assert done.terminated and done.reward == pytest.approx(1 - 0.1 * 3)
    with pytest.raises(EpisodeFinished):
        await env.step(TextAction(text="5"))
    with pytest.raises(InvalidAction):
        await env.reset(seed=1)
        await env.step(BrowserAction(call="click('1')"))
    await env.close()
    await env.close()  # idempotent
    with pytest.raises(EnvClosed):
        await env.reset()


async def test_guess_number_truncates_without_reward() -> None:
    env = GuessNumberEnv(max_turns=2)
    await env.reset(options={"target": 16})
    await env.step(TextAction(text="1"))
    last = await env.step(TextAction(text="2"))
    assert last.truncated and not last.terminated and last.reward == 0
    assert last.info["success"] is False


async def test_same_seed_same_task() -> None:
    for env_id in BUILTIN_ENVS:
        a, b = make(env_id), make(env_id)
        first_a, first_b = await a.reset(seed=11), await b.reset(seed=11)
        assert first_a.observation == first_b.observation
        await a.close()
        await b.close()


async def test_calc_tool_text_tool_call_and_tool_errors() -> None:
    sandbox = SubprocessSandbox()
    env = CalcToolEnv(sandbox_factory=lambda: sandbox)
    await env.reset(seed=1)
    out = await env.step(TextAction(text="python(print(6*7))"))
    assert out.observation.messages[0].role == "tool" and out.observation.text == "42"
    calls = ToolCallsAction(
        calls=[
            ToolCall(id="a", name="python", arguments={"code": "1/0"}),
            ToolCall(id="b", name="shell", arguments={}),
            ToolCall(id="c", name="python", arguments={"code": 3}),
        ]
    )
    errors = await env.step(calls)
    contents = [m.content for m in errors.observation.messages]
    assert contents[0] == "error: ZeroDivisionError: division by zero"
    assert "unknown tool" in contents[1] and "python needs" in contents[2]
    assert [m.tool_call_id for m in errors.observation.messages] == ["a", "b", "c"]
    assert env.tools()[0]["function"]["name"] == "python"
    await env.reset(seed=2)  # a new episode gets a new sandbox
    assert sandbox.closed == 1
    await env.close()
    assert sandbox.closed == 1  # nothing opened in the second episode


async def test_calc_tool_answer_parsing() -> None:
    env = CalcToolEnv(sandbox_factory=SubprocessSandbox)
    await env.reset(seed=2)
    target = env.target
    assert not (await env.step(TextAction(text="hmm"))).done
    result = await env.step(TextAction(text=f"2 steps later. Answer: {target}"))
    assert result.terminated and result.reward == 1.0
    await env.reset(seed=2)
    wrong = await env.step(TextAction(text=f"answer = {target + 1}"))
    assert wrong.terminated and wrong.reward == 0.0


async def test_lookup_chain_and_answer_format() -> None:
    env = LookupEnv(hops=3)
    first = await env.reset(seed=5)
    assert "friend's friend" in first.observation.messages[0].content
    await env.step(TextAction(text='lookup("nobody.pet")'))
    oracle = registry.oracle("agentflow/lookup-v0")
    episode = await play_episode(env, oracle, seed=5)
    assert episode.success and len(episode.actions) == 4  # three lookups, one answer


async def test_step_timeout_ends_the_episode() -> None:
    class SlowEnv(GuessNumberEnv):
        async def _turn(self, action):
            import asyncio

            await asyncio.sleep(5)
            return await super()._turn(action)

    env = SlowEnv()
    await env.reset(seed=0)
    with pytest.raises(StepTimeout) as info:
        await env.step(TextAction(text="1"), timeout_s=0.05)
    assert info.value.status_code == 504
    with pytest.raises(EpisodeFinished):
        await env.step(TextAction(text="1"))


async def test_noisy_oracle_sits_between_random_and_oracle() -> None:
    from envs.builtin.guess_number import noisy_oracle

    env = GuessNumberEnv()
    rates = []
    for p in (0.0, 0.35, 1.0):
        wins = 0
        for seed in range(100):
            episode = await play_episode(env, noisy_oracle(p, seed=seed + 10_000), seed=seed)
            wins += episode.success
        rates.append(wins / 100)
    assert rates[0] < 0.4 < rates[1] < 0.7 < rates[2] == 1.0, rates
