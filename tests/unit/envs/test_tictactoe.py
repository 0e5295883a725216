"""TicTacToe's compact board view and its scripted players (envs/adapters/tictactoe.py):
minimax never loses to the random opponent, in either view."""

from __future__ import annotations

import pytest

from envs import registry
from envs.adapters.textarena_games import TextArenaGame
from envs.adapters.tictactoe import best_move, noisy_oracle, read_board
from envs.base import Message, Observation, TextAction

ENV = "textarena/TicTacToe-v0"


def _seen(text: str) -> list[Observation]:
    return [Observation(messages=[Message(role="user", content=text)], text=text)]


async def test_the_board_view_shows_the_board_moves_refusals_and_the_end() -> None:
    env = TextArenaGame("TicTacToe-v0", opponent="first", view="board")
    first = await env.reset(seed=1)
    assert first.observation.text == "board ...|...|... moves 0 1 2 3 4 5 6 7 8"
    moved = await env.step(TextAction(text="[4]"))
    # The opponent (X) took the lowest free cell.
    assert moved.observation.text == "board X..|.O.|... moves 1 2 3 5 6 7 8"
    refused = await env.step(TextAction(text="[4]"))
    assert refused.observation.text == "invalid. board X..|.O.|... moves 1 2 3 5 6 7 8"
    result = refused
    for move in ("[2]", "[6]"):
        result = await env.step(TextAction(text=move))
    assert result.terminated and result.reward == 1.0
    assert result.observation.text == "board XXO|.O.|O.. you won."
    with pytest.raises(ValueError, match="view"):
        TextArenaGame("ConnectFour-v0", view="board")


def test_the_board_is_read_from_either_view() -> None:
    text = (
        "[GAME] Current Board:\n\n O | 1 | X \n---+---+---\n 3 | O | 5 \n---+---+---\n"
        " 6 | X | 8 \n\nAvailable Moves: '[1]', '[3]'"
    )
    assert read_board(_seen(text)) == "O.X.O..X."
    assert read_board(_seen("invalid. board O.X|.O.|.X. moves 1 3 5 6 8")) == "O.X.O..X."
    assert best_move("O.X.O..X.") == 8  # O completes the diagonal
    assert best_move("OO.XX....") == 2  # O to move wins before blocking
    assert best_move("O...X...O") in (1, 3, 5, 7)  # X to move: a corner loses to a fork


@pytest.mark.parametrize("view", ["text", "board"])
async def test_minimax_never_loses_to_the_random_opponent(view: str) -> None:
    env = registry.make(ENV, view=view)
    oracle = registry.oracle(ENV)
    rewards = []
    for seed in range(20):
        result = await env.reset(seed=seed)
        history = [result.observation]
        while not result.done:
            result = await env.step(oracle(history))
            history.append(result.observation)
        rewards.append(result.reward)
    await env.close()
    assert min(rewards) >= 0.5 and sum(rewards) / len(rewards) > 0.9


async def test_the_noisy_player_moves_on_empty_cells() -> None:
    env = registry.make(ENV, view="board")
    player = noisy_oracle(0.0, seed=3)
    result = await env.reset(seed=2)
    history = [result.observation]
    while not result.done:
        result = await env.step(player(history))
        assert not (result.observation.text or "").startswith("invalid")
        history.append(result.observation)
    assert registry.noisy_oracle_factory(ENV) is not None
