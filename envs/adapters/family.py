"""The adapters' env family: Gymnasium and TextArena games as our envs. Registered
through the `agentflow.envs` entry point (pyproject.toml); each is imported, with its
suite, only when made."""

from __future__ import annotations

from envs import registry

# id and `module:factory` under envs.adapters
_ADAPTED = (
    ("gymnasium/FrozenLake-v1", "gym_text:frozen_lake"),
    ("gymnasium/Blackjack-v1", "gym_text:blackjack"),
    ("textarena/TicTacToe-v0", "textarena_games:tictactoe"),
    ("textarena/ConnectFour-v0", "textarena_games:connect_four"),
)


# the envs with a scripted player (`module:oracle` under envs.adapters)
_ORACLES = {"textarena/TicTacToe-v0": "tictactoe:oracle"}


def register() -> None:
    for env_id, entry_point in _ADAPTED:
        oracle = _ORACLES.get(env_id)
        registry.register(
            env_id,
            f"envs.adapters.{entry_point}",
            oracle=None if oracle is None else f"envs.adapters.{oracle}",
            replace=True,
        )
