"""Gymnasium toy-text envs as our envs: text observations, lenient text actions.

- ``gymnasium/FrozenLake-v1``: the map is drawn as text with ``P`` where the player
  stands; reply with a direction ``left``, ``down``, ``right`` or ``up`` (the last such
  word in the text counts), or its number 0-3. Reward 1 on reaching the goal.
- ``gymnasium/Blackjack-v1``: the hand is described in words; reply ``hit`` or ``stick``
  (the last such word counts). Reward +1 win, 0 draw, -1 loss, as in Gymnasium.

A reply that names no action costs a turn and is answered with the format reminder; the
Gymnasium env itself never sees it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from envs.base import Action, Message, Observation, TextAction
from envs.turn_env import Outcome, TurnEnv


def _user(text: str) -> Observation:
    return Observation(messages=[Message(role="user", content=text)], text=text)


class GymTextEnv(TurnEnv):
    """A Gymnasium env with a discrete action space, spoken to in text."""

    def __init__(
        self,
        gym_id: str,
        *,
        render: Callable[[Any, Any], str],
        actions: dict[str, int],
        help_text: str,
        max_turns: int,
        make_kwargs: dict[str, Any] | None = None,
    ) -> None:
        import gymnasium

        super().__init__(max_turns=max_turns)
        self.env_id = f"gymnasium/{gym_id}"
        self.gym = gymnasium.make(gym_id, **(make_kwargs or {}))
        self._render = render
        self._actions = actions
        self._help = help_text
        self._words = re.compile(r"\b(" + "|".join(map(re.escape, actions)) + r")\b", re.I)
        self.total_reward = 0.0

    def parse(self, text: str) -> int | None:
        found = self._words.findall(text)
        return self._actions[found[-1].lower()] if found else None

    async def _start(self, options: dict[str, Any]) -> Observation:
        obs, _ = self.gym.reset(seed=self.seed, options=options or None)
        self.total_reward = 0.0
        return _user(f"{self._render(self.gym.unwrapped, obs)}\n{self._help}")

    async def _turn(self, action: Action) -> Outcome:
        assert isinstance(action, TextAction)
        choice = self.parse(action.text)
        if choice is None:
            return Outcome(_user(self._help), info={"valid": False})
        obs, reward, terminated, truncated, info = self.gym.step(choice)
        self.total_reward += float(reward)
        text = self._render(self.gym.unwrapped, obs)
        done = bool(terminated or truncated)
        extra = {"valid": True, "success": float(reward) > 0} if done else {"valid": True}
        text = f"{text}\nDone. Reward: {float(reward):g}." if done else f"{text}\n{self._help}"
        return Outcome(
            _user(text),
            reward=float(reward),
            terminated=done,
            info={**extra, "gym_truncated": bool(truncated)},
        )

    def _state(self) -> dict[str, Any]:
        return {"total_reward": self.total_reward}

    async def _release(self) -> None:
        self.gym.close()


def _render_lake(env: Any, obs: Any) -> str:
    rows = [[c.decode() for c in row] for row in env.desc]
    ncol = len(rows[0])
    row, col = divmod(int(obs), ncol)
    rows[row][col] = "P"
    return "\n".join("".join(r) for r in rows)


def frozen_lake(
    map_name: str = "4x4", is_slippery: bool = False, max_turns: int = 30
) -> GymTextEnv:
    """FrozenLake: walk from S to G over F without falling into H."""
    directions = {"left": 0, "down": 1, "right": 2, "up": 3, "0": 0, "1": 1, "2": 2, "3": 3}
    return GymTextEnv(
        "FrozenLake-v1",
        render=_render_lake,
        actions=directions,
        help_text="P=you G=goal H=hole. Reply left, down, right or up.",
        max_turns=max_turns,
        make_kwargs={"map_name": map_name, "is_slippery": is_slippery},
    )


def _render_blackjack(env: Any, obs: Any) -> str:
    player, dealer, usable_ace = obs
    ace = "yes" if usable_ace else "no"
    return f"Your sum: {player}. Dealer shows: {dealer}. Usable ace: {ace}."


def blackjack(max_turns: int = 10) -> GymTextEnv:
    """Blackjack against Gymnasium's dealer."""
    return GymTextEnv(
        "Blackjack-v1",
        render=_render_blackjack,
        actions={"stick": 0, "hit": 1},
        help_text="Reply hit or stick.",
        max_turns=max_turns,
    )
