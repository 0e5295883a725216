"""The scripted players of `textarena/TicTacToe-v0` (a warm start's data, tests): a
perfect player (minimax) and a noisy one. Both read the board from the last observation,
in either view (`TextArenaGame(view=...)`: TextArena's own text or the compact line), and
reply in TextArena's format (`[4]`)."""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence

from envs.base import Observation, TextAction
from envs.turn_env import TextPlayer, last_text, noisy_text_player

_LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
_COMPACT = re.compile(r"board ([OX.]{3})\|([OX.]{3})\|([OX.]{3})")
# TextArena's rendering: three rows like " O | 1 | X " between separator lines.
_ROW = re.compile(r"^ ?([OX0-8]) \| ([OX0-8]) \| ([OX0-8]) ?$", re.MULTILINE)


def read_board(history: Sequence[Observation]) -> str:
    """The last board shown, as nine characters (`O`, `X`, `.`), rows top to bottom."""
    text = last_text(history)
    compact = _COMPACT.findall(text)
    if compact:
        return "".join(compact[-1])
    rows = _ROW.findall(text)
    if len(rows) < 3:
        return "." * 9
    cells = "".join("".join(row) for row in rows[-3:])
    return "".join(c if c in "OX" else "." for c in cells)


def _winner(board: str) -> str | None:
    for a, b, c in _LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


@functools.cache
def _value(board: str, me: str, to_move: str) -> int:
    """The game's value for `me` with `to_move` to play: positive a win, 0 a draw,
    negative a loss, larger the sooner a win comes (and the later a loss)."""
    winner = _winner(board)
    if winner is not None:
        sooner = 1 + board.count(".")
        return sooner if winner == me else -sooner
    if "." not in board:
        return 0
    other = "X" if to_move == "O" else "O"
    values = [
        _value(board[:i] + to_move + board[i + 1 :], me, other)
        for i, cell in enumerate(board)
        if cell == "."
    ]
    return max(values) if to_move == me else min(values)


def best_move(board: str) -> int:
    """Minimax for the side to move (O when the marks are even: O moves first in
    TextArena's game), the lowest cell among the best."""
    me = "O" if board.count("O") == board.count("X") else "X"
    other = "X" if me == "O" else "O"
    empty = [i for i, cell in enumerate(board) if cell == "."]
    if not empty:
        return 0
    return max(empty, key=lambda i: (_value(board[:i] + me + board[i + 1 :], me, other), -i))


def _answer(history: Sequence[Observation]) -> str:
    return f"[{best_move(read_board(history))}]"


def _guess(rng: random.Random, history: Sequence[Observation]) -> str:
    empty = [i for i, cell in enumerate(read_board(history)) if cell == "."] or [0]
    return f"[{rng.choice(empty)}]"


def oracle(history: Sequence[Observation]) -> TextAction:
    """The minimax move, as `[cell]`."""
    return TextAction(text=_answer(history))


def noisy_oracle(p_oracle: float, seed: int | None = None) -> TextPlayer:
    """The minimax move with probability ``p_oracle``, else a random empty cell."""
    return noisy_text_player(_answer, _guess, p_oracle, seed)
