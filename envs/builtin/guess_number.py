"""`agentflow/guess-number-v0`: find a hidden number with higher/lower feedback.

Sized for a small byte-level model on CPU: the number is drawn from 1..16, the episode
has at most 5 guesses (enough for binary search), prompts and replies are a few words.

Answer format (also stated in the first observation): a text action holding a number.
Parsing is lenient and deterministic: the *last* integer in the text is the guess
(``"I guess 8"`` -> 8). Text without an integer in range costs a turn and is answered
with the format reminder.

Feedback: ``higher`` (the number is larger), ``lower``, or ``correct``.
Reward: ``1 - 0.1 * (turns - 1)`` on the turn the number is found, else 0.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from envs.base import Action, Message, Observation, TextAction
from envs.turn_env import Outcome, TurnEnv, last_integer


def _user(text: str) -> Observation:
    return Observation(messages=[Message(role="user", content=text)], text=text)


class GuessNumberEnv(TurnEnv):
    """Guess a number in ``[low, high]`` within ``max_turns`` guesses."""

    env_id = "agentflow/guess-number-v0"

    def __init__(self, low: int = 1, high: int = 16, max_turns: int = 5) -> None:
        if not low < high:
            raise ValueError("need low < high")
        super().__init__(max_turns=max_turns)
        self.low, self.high = low, high
        self.target = low

    def prompt(self) -> str:
        return f"Guess my number from {self.low} to {self.high}. Reply with one number."

    async def _start(self, options: dict[str, Any]) -> Observation:
        target = options.get("target")
        if target is None:
            self.target = self.rng.randint(self.low, self.high)
        elif isinstance(target, int) and self.low <= target <= self.high:
            self.target = target
        else:
            raise ValueError(f"options.target must be an int in [{self.low}, {self.high}]")
        return _user(self.prompt())

    async def _turn(self, action: Action) -> Outcome:
        assert isinstance(action, TextAction)
        guess = last_integer(action.text)
        if guess is None or not self.low <= guess <= self.high:
            reminder = f"Reply with one number from {self.low} to {self.high}."
            return Outcome(_user(reminder), info={"valid": False})
        if guess == self.target:
            reward = max(0.0, 1.0 - 0.1 * (self.turns - 1))
            return Outcome(
                _user("correct"),
                reward=round(reward, 6),
                terminated=True,
                info={"valid": True, "success": True, "target": self.target},
            )
        hint = "higher" if self.target > guess else "lower"
        info: dict[str, Any] = {"valid": True}
        if self.turns >= self.max_turns:
            info.update(success=False, target=self.target)
        return Outcome(_user(hint), info=info)


def oracle(history: Sequence[Observation], low: int = 1, high: int = 16) -> TextAction:
    """Binary search: replay its own midpoints against the feedback so far."""
    lo, hi = low, high
    for observation in history[1:]:
        feedback = observation.messages[-1].content if observation.messages else ""
        guess = (lo + hi) // 2
        if feedback == "higher":
            lo = guess + 1
        elif feedback == "lower":
            hi = guess - 1
    return TextAction(text=str((lo + hi) // 2))


def noisy_oracle(
    p_oracle: float, seed: int | None = None
) -> Callable[[Sequence[Observation]], TextAction]:
    """A warm-start policy: the midpoint of the interval the feedback so far allows, with
    probability ``p_oracle``, else a uniformly random number from 1 to 16.

    Unlike :func:`oracle` it must remember its own guesses (they are random), so use one
    per episode. With ``p_oracle=0.35`` it finds the number about half the time.
    """
    if not 0.0 <= p_oracle <= 1.0:
        raise ValueError("p_oracle must be in [0, 1]")
    rng = random.Random(seed)
    guesses: list[int] = []

    def policy(history: Sequence[Observation]) -> TextAction:
        lo, hi = 1, 16
        for guess, observation in zip(guesses, history[1:], strict=False):
            feedback = observation.messages[-1].content if observation.messages else ""
            if feedback == "higher":
                lo = max(lo, guess + 1)
            elif feedback == "lower":
                hi = min(hi, guess - 1)
        guess = (lo + hi) // 2 if rng.random() < p_oracle else rng.randint(1, 16)
        guesses.append(guess)
        return TextAction(text=str(guess))

    return policy
