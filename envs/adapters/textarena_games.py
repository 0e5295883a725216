"""TextArena two-player board games as our envs, against a fixed opponent.

- ``textarena/TicTacToe-v0``: reply with a cell ``[4]`` (TextArena's own format);
- ``textarena/ConnectFour-v0``: reply with a column ``[col 3]`` (or ``[3]``).

The agent plays ``agent_player`` (0 moves first); the opponent moves right after it, by
a fixed policy: ``"random"`` (a legal move drawn from the episode's seed) or
``"first"`` (the lowest-numbered legal move). TextArena's rules apply unchanged: one
invalid move earns a warning and a retry, a second in a row loses the game. Reward at
the end: 1 for a win, 0.5 for a draw, 0 for a loss (TextArena's +1/0/-1 is in
``info["textarena_reward"]``). Observations carry only the text that is new to the agent.

``view="board"`` (TicTacToe only) replaces TextArena's text with a compact line the agent
can read in a small context: ``board O.X|.O.|.X. moves 1 3 5 6 8`` (rows top to bottom,
``.`` empty; the agent is O when it moves first, X otherwise), prefixed ``invalid.`` after
a move the game refused, and ending ``you won.``, ``draw.`` or ``you lost.``. The game,
its rules and rewards are TextArena's either way; an episode's text is about a fifth as
long (the credit study, bench/rtpo.py, trains on it).

Both games run offline (TextArena's word games download data; these do not).
"""

from __future__ import annotations

from typing import Any, Literal

from envs.base import Action, Message, Observation, TextAction
from envs.turn_env import Outcome, TurnEnv

GAMES = ("TicTacToe-v0", "ConnectFour-v0")


def legal_moves(game: str, board: list[list[str]]) -> list[str]:
    """The moves TextArena accepts now, in its own format."""
    if game == "TicTacToe-v0":
        return [f"[{r * 3 + c}]" for r in range(3) for c in range(3) if board[r][c] == ""]
    return [f"[col {c}]" for c in range(len(board[0])) if board[0][c] == "."]


class TextArenaGame(TurnEnv):
    """One TextArena two-player game per episode against a fixed opponent."""

    def __init__(
        self,
        game: str = "TicTacToe-v0",
        *,
        opponent: Literal["random", "first"] = "random",
        agent_player: int = 0,
        max_turns: int = 60,
        view: Literal["text", "board"] = "text",
    ) -> None:
        if game not in GAMES:
            raise ValueError(f"game must be one of {GAMES}")
        if agent_player not in (0, 1) or opponent not in ("random", "first"):
            raise ValueError("agent_player must be 0 or 1; opponent 'random' or 'first'")
        if view not in ("text", "board") or (view == "board" and game != "TicTacToe-v0"):
            raise ValueError("view must be 'text', or 'board' for TicTacToe-v0")
        super().__init__(max_turns=max_turns)
        self.env_id = f"textarena/{game}"
        self.game, self.opponent, self.agent_player = game, opponent, agent_player
        self.view = view
        self.ta_env: Any = None
        self._seen = ""

    def legal_moves(self) -> list[str]:
        return legal_moves(self.game, self.ta_env.state.game_state["board"])

    def _new_text(self) -> str:
        """What the agent has not seen yet of its (cumulative) TextArena observation."""
        _, observation = self.ta_env.get_observation()
        text = observation if isinstance(observation, str) else str(observation)
        new = text[len(self._seen) :] if text.startswith(self._seen) else text
        self._seen = text
        return new.strip() or "(no change)"

    def _opponent_moves(self) -> None:
        state = self.ta_env.state
        while not state.done and state.current_player_id != self.agent_player:
            moves = self.legal_moves()
            move = self.rng.choice(moves) if self.opponent == "random" else moves[0]
            self.ta_env.step(move)

    async def _start(self, options: dict[str, Any]) -> Observation:
        import textarena

        # A fresh game per episode: TextArena's observation wrapper keeps the text of
        # earlier games across its own reset.
        self.ta_env = textarena.make(self.game)
        self.ta_env.reset(num_players=2, seed=self.seed)
        self._seen = ""
        self._opponent_moves()
        return _user(self._board_line() if self.view == "board" else self._new_text())

    async def _turn(self, action: Action) -> Outcome:
        assert isinstance(action, TextAction)
        before = self._cells() if self.view == "board" else ""
        self.ta_env.step(action.text)
        refused = self.view == "board" and self._cells() == before
        self._opponent_moves()
        state = self.ta_env.state
        if not state.done:
            if self.view == "board":
                line = self._board_line()
                return Outcome(_user(f"invalid. {line}" if refused else line))
            return Outcome(_user(self._new_text()))
        raw = float(state.rewards[self.agent_player])
        reward = {1.0: 1.0, 0.0: 0.5}.get(raw, 0.0)
        text = self._final_text(raw)
        return Outcome(
            _user(text),
            reward=reward,
            terminated=True,
            info={"textarena_reward": raw, "success": raw > 0},
        )

    def _cells(self) -> str:
        """The TicTacToe board as nine characters, rows top to bottom (`.` empty)."""
        if self.game != "TicTacToe-v0":
            return ""
        board = self.ta_env.state.game_state["board"]
        return "".join(cell or "." for row in board for cell in row)

    def _board_line(self) -> str:
        cells = self._cells()
        rows = "|".join(cells[i : i + 3] for i in (0, 3, 6))
        moves = " ".join(str(i) for i, cell in enumerate(cells) if cell == ".")
        return f"board {rows} moves {moves}"

    def _final_text(self, raw: float) -> str:
        if self.view == "board":
            outcome = "you won." if raw > 0 else "draw." if raw == 0 else "you lost."
            return f"{self._board_line().partition(' moves')[0]} {outcome}"
        outcome = "You won." if raw > 0 else "Draw." if raw == 0 else "You lost."
        board = self.ta_env.get_board_str() if hasattr(self.ta_env, "get_board_str") else ""
        return f"{board}\n{outcome}".strip()

    def _state(self) -> dict[str, Any]:
        if self.ta_env is None:
            return {"game": self.game}
        return {"game": self.game, "legal_moves": self.legal_moves()}


def _user(text: str) -> Observation:
    return Observation(messages=[Message(role="user", content=text)], text=text)


def tictactoe(**kwargs: Any) -> TextArenaGame:
    return TextArenaGame("TicTacToe-v0", **kwargs)


def connect_four(**kwargs: Any) -> TextArenaGame:
    return TextArenaGame("ConnectFour-v0", **kwargs)
