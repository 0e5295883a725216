"""The vault's variants for the credit study (bench/rtpo.py): a long horizon with noisy
rewards, stochastic transitions, and dials that depend on the agent's own key."""

from __future__ import annotations

import pytest

from envs import registry
from envs.base import Observation, StepResult, TextAction
from envs.builtin.long_vault import LongVaultEnv
from envs.builtin.recall_vault import RecallVaultEnv, noisy_oracle
from envs.builtin.slip_vault import SlipVaultEnv
from envs.builtin.vault import VaultEnv


async def _play(env: VaultEnv, seed: int, replies: list[str]) -> list[StepResult]:
    """The env's answers to `replies`, from a fresh episode of `seed`."""
    first = await env.reset(seed=seed)
    results = [first]
    for reply in replies:
        results.append(await env.step(TextAction(text=reply)))
    return results


def _text(result: StepResult) -> str:
    return result.observation.text or ""


def _right(env: VaultEnv, results: list[StepResult]) -> str:
    """The oracle's reply to the episode so far."""
    return registry.oracle(env.env_id)([r.observation for r in results]).text  # type: ignore[union-attr]


async def test_the_long_vault_has_seven_policy_turns_and_noisy_dial_rewards() -> None:
    env = LongVaultEnv()
    first = await env.reset(seed=1)
    history = [first]
    while not history[-1].terminated:
        history.append(await env.step(TextAction(text=_right(env, history))))
    assert len(history) - 1 == 7 and history[-1].info["success"]
    dial_rewards = [r.reward for r in history[2:-1]] + [history[-1].reward - 1.0]
    assert len(dial_rewards) == 6
    assert len(set(dial_rewards)) == 6  # each right dial pays 0.1 plus its own noise
    assert all(-0.4 < r - 0.1 < 0.4 for r in dial_rewards)
    with pytest.raises(ValueError, match="noise"):
        LongVaultEnv(noise=2.0)


async def test_the_luck_replays_with_the_replies_and_moves_when_one_differs() -> None:
    env = LongVaultEnv()
    replies = ["3", "1", "2", "3", "4", "5", "6"]
    once = [r.reward for r in await _play(env, 5, replies)]
    again = [r.reward for r in await _play(env, 5, replies)]
    assert once == again  # a replay meets the same draws
    other = [r.reward for r in await _play(env, 5, ["3", "9", *replies[2:]])]
    assert other[:2] == once[:2] and other[2:] != once[2:]  # later draws moved with a reply


async def test_a_slip_vault_dial_slips_and_says_so() -> None:
    env = SlipVaultEnv(slip=1.0)
    results = await _play(env, 2, [])
    results.append(await env.step(TextAction(text=_right(env, results))))
    results.append(await env.step(TextAction(text=_right(env, results))))
    assert results[-1].reward == 0.0 and _text(results[-1]).startswith("slip. dial ")
    never = SlipVaultEnv(slip=0.0)
    results = await _play(never, 2, [])
    results.append(await never.step(TextAction(text=_right(never, results))))
    results.append(await never.step(TextAction(text=_right(never, results))))
    assert results[-1].reward == pytest.approx(0.2) and _text(results[-1]).startswith("dial ")


@pytest.mark.parametrize(
    ("jam", "lucky", "key_right", "opened"),
    [
        (1.0, 0.0, True, False),
        (0.0, 0.0, True, True),
        (0.0, 1.0, False, True),
        (0.0, 0.0, False, False),
    ],
)
async def test_a_slip_vault_opens_by_luck(
    jam: float, lucky: float, key_right: bool, opened: bool
) -> None:
    env = SlipVaultEnv(dials=1, jam=jam, lucky=lucky, slip=0.0)
    first = await env.reset(seed=4)
    key = str(env.vault if key_right else (env.vault + 1) % 10)
    await env.step(TextAction(text=key))
    last = await env.step(TextAction(text="0"))
    assert last.terminated
    assert last.info["opened"] is opened and last.info["success"] is key_right
    assert last.reward >= (1.0 if opened else 0.0)
    assert _text(first).startswith("vault ")


async def test_two_slip_vault_episodes_from_the_same_key_can_end_differently() -> None:
    ends: set[bool] = set()
    env = SlipVaultEnv()
    for dials in ("000", "111", "222", "333", "444", "555", "666", "777", "888", "999"):
        first = await env.reset(seed=8)
        await env.step(TextAction(text=str(env.vault)))  # the same, right, key
        result = first
        for digit in dials:
            result = await env.step(TextAction(text=digit))
        ends.add(bool(result.info["opened"]))
    assert ends == {True, False}


async def test_a_recall_vault_dial_is_right_against_the_agents_own_key() -> None:
    env = RecallVaultEnv()
    first = await env.reset(seed=3)
    wrong_key = (env.vault + 4) % 10
    asked = await env.step(TextAction(text=f"key {wrong_key}"))
    assert _text(asked) == f"key plus {env.dial}?"  # the key is not said again
    right = await env.step(TextAction(text=str((wrong_key + env.dial) % 10)))
    assert right.reward == pytest.approx(0.2) and right.info["dial_right"]
    by_vault = (env.vault + env.dial) % 10
    last = await env.step(TextAction(text=str(by_vault)))
    # Answered as if the key had been the vault's: wrong, and the wrong key shuts it.
    assert last.terminated and not last.info["dial_right"] and not last.info["success"]
    assert last.reward == 0.0
    assert "vault" in _text(first)


async def test_the_recall_vault_noisy_oracle_answers_against_its_own_key() -> None:
    env = RecallVaultEnv()
    rewards = []
    for seed in range(30):
        player = noisy_oracle(0.0 if seed % 2 else 1.0, seed=seed)
        first = await env.reset(seed=seed)
        history: list[Observation] = [first.observation]
        key = player(history)
        result = await env.step(key)
        history.append(result.observation)
        total = 0.0
        while not result.terminated:
            result = await env.step(player(history))
            history.append(result.observation)
            total += result.reward
        rewards.append(total)
    assert all(r == pytest.approx(1.4) for r in rewards[0::2])  # p_oracle 1: all right
    assert sum(rewards[1::2]) / 15 < 0.5  # p_oracle 0: random digits


async def test_a_recall_vault_dial_shifts_the_key_by_less_than_shifts() -> None:
    for shifts in (1, 2, 10):
        env = RecallVaultEnv(shifts=shifts)
        seen = set()
        for seed in range(40):
            await env.reset(seed=seed)
            await env.step(TextAction(text="5"))
            seen.add(env.dial)
        assert seen == set(range(shifts))
    with pytest.raises(ValueError, match="shifts"):
        RecallVaultEnv(shifts=11)
