"""Gymnasium and TextArena envs as ours, and ours as Gymnasium envs."""

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from envs import registry
from envs.adapters.as_gymnasium import GymnasiumEnv, register_with_gymnasium
from envs.adapters.gym_text import GymTextEnv
from envs.adapters.textarena_games import TextArenaGame
from envs.base import TextAction
from envs.builtin.family import BUILTIN_ENVS
from tests.unit.envs.fakes import SubprocessSandbox


async def test_frozen_lake_in_text() -> None:
    env = registry.make("gymnasium/FrozenLake-v1")
    assert isinstance(env, GymTextEnv)
    first = await env.reset(seed=0)
    assert first.observation.text is not None and first.observation.text.startswith("PFFF")
    reminder = await env.step(TextAction(text="jump!"))
    assert reminder.info["valid"] is False and (reminder.observation.text or "").startswith("P=")
    result = reminder
    for move in ["down", "Down then DOWN", "go right", "right", "down", "2"]:
        result = await env.step(TextAction(text=move))
    assert result.terminated and result.reward == 1.0 and result.info["success"]
    await env.close()


async def test_blackjack_in_text() -> None:
    env = registry.make("gymnasium/Blackjack-v1")
    first = await env.reset(seed=3)
    assert "Your sum:" in (first.observation.text or "")
    result = await env.step(TextAction(text="I will stick"))
    assert result.terminated and result.reward in (-1.0, 0.0, 1.0)
    await env.close()


@pytest.mark.parametrize("env_id", ["textarena/TicTacToe-v0", "textarena/ConnectFour-v0"])
@pytest.mark.parametrize("agent_player", [0, 1])
async def test_textarena_games_play_to_the_end(env_id: str, agent_player: int) -> None:
    env = registry.make(env_id, agent_player=agent_player)
    assert isinstance(env, TextArenaGame)
    result = await env.reset(seed=7)
    if agent_player == 1:
        assert "[Player 0]" in (result.observation.text or "")  # the opponent moved first
    while not result.done:
        move = (await env.state())["legal_moves"][0]
        result = await env.step(TextAction(text=f"My move: {move}"))
    assert result.terminated and result.reward in (0.0, 0.5, 1.0)
    assert result.info["textarena_reward"] in (-1.0, 0.0, 1.0)
    await env.close()


async def test_textarena_two_invalid_moves_lose() -> None:
    env = TextArenaGame("TicTacToe-v0", opponent="first")
    await env.reset(seed=1)
    warned = await env.step(TextAction(text="center please"))
    assert not warned.done and "invalid move" in (warned.observation.text or "")
    lost = await env.step(TextAction(text="[42]"))
    assert lost.terminated and lost.reward == 0.0 and lost.info["textarena_reward"] == -1.0


async def test_textarena_fixed_opponent_is_reproducible() -> None:
    async def play(seed: int) -> list[str]:
        env = TextArenaGame("ConnectFour-v0")
        result = await env.reset(seed=seed)
        texts = []
        while not result.done:
            result = await env.step(TextAction(text=(await env.state())["legal_moves"][-1]))
            texts.append(result.observation.text or "")
        return texts

    assert await play(5) == await play(5)


@pytest.mark.parametrize(
    "env_id",
    [*BUILTIN_ENVS, "gymnasium/FrozenLake-v1", "textarena/TicTacToe-v0"],
)
def test_our_envs_pass_gymnasium_check_env(env_id: str) -> None:
    defaults = {"sandbox_factory": SubprocessSandbox} if "calc" in env_id else {}
    register_with_gymnasium(env_id, **defaults)
    env = gymnasium.make(env_id).unwrapped
    assert isinstance(env, GymnasiumEnv) and env.spec is not None
    check_env(env)
    env.close()
    env.close()


async def test_gymnasium_adapter_works_inside_a_running_loop() -> None:
    env = GymnasiumEnv(lambda: registry.make("agentflow/guess-number-v0"))
    obs, _ = env.reset(seed=2)
    assert obs.startswith("Guess my number")
    obs, reward, terminated, truncated, _ = env.step("8")
    assert obs in {"higher", "lower", "correct"} and not truncated
    with pytest.raises(TypeError):
        env.step(8)  # type: ignore[arg-type]
    env.close()
