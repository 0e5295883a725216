"""Digit-string skills: `agentflow/shift-digits-v0`, `agentflow/mirror-digits-v0` and
`agentflow/digit-relay-v0`, whose turns alternate between the two.

Each episode asks `questions` questions, one per turn, about a fresh string of `length`
digits. A question is one line, ``shift 4821`` or ``mirror 4821``:

- ``shift``: every digit plus one, 9 wrapping to 0 (``5932``);
- ``mirror``: every digit subtracted from 9 (``5178``).

Both map each digit in place, which a two-layer byte-level model learns in minutes on a
CPU (reversing the string, tried first, needs a different offset per output digit and
kept a distilled student on a plateau for hundreds of steps). The two maps agree only
on 4 and 9, so a turn answered with the other skill is almost always wrong.

The shift and mirror envs ask only their own skill; the relay env alternates, starting
with a random one, so every episode needs both skills, a turn at a time. They exist for
multi-teacher distillation (`trainer.teachers`): a teacher trained on each skill env,
and a student distilled on the relay, where routing each *turn* to the teacher of its
skill (`skill_of_turn`) is right and routing a whole episode to one teacher is wrong on
half the turns.

Answer format: the last run of digits in the text (``"answer 1284"`` -> ``1284``).
Reward: ``1 / questions`` per right answer, so an episode's return is the share it got
right; a wrong answer does not end the episode (each turn is its own question), so a
policy sees every question whatever it answered before. The next question comes with
the verdict: ``right. shift 0417`` / ``wrong. shift 0417``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any, Literal

from envs.base import Action, Message, Observation, TextAction
from envs.turn_env import Outcome, TextPlayer, TurnEnv, noisy_text_player

Skill = Literal["shift", "mirror"]
SKILLS: tuple[Skill, ...] = ("shift", "mirror")
_DIGITS = re.compile(r"\d+")
_QUESTION = re.compile(r"\b(shift|mirror) (\d+)\s*$")


def solve(skill: str, digits: str) -> str:
    """The right answer to ``{skill} {digits}``."""
    if skill == "shift":
        return "".join(str((int(d) + 1) % 10) for d in digits)
    if skill == "mirror":
        return "".join(str(9 - int(d)) for d in digits)
    raise ValueError(f"unknown skill {skill!r}")


def _user(text: str) -> Observation:
    return Observation(messages=[Message(role="user", content=text)], text=text)


class DigitsEnv(TurnEnv):
    """`questions` digit-string questions of `skill` (or alternating, for ``relay``)."""

    def __init__(
        self,
        skill: Literal["shift", "mirror", "relay"] = "shift",
        questions: int = 3,
        length: int = 4,
    ) -> None:
        if skill not in ("shift", "mirror", "relay"):
            raise ValueError("skill must be 'shift', 'mirror' or 'relay'")
        if not 1 <= questions <= 64:
            raise ValueError("questions must be in [1, 64]")
        if not 1 <= length <= 32:
            raise ValueError("length must be in [1, 32]")
        super().__init__(max_turns=questions)
        self.skill = skill
        self.env_id = {
            "shift": "agentflow/shift-digits-v0",
            "mirror": "agentflow/mirror-digits-v0",
            "relay": "agentflow/digit-relay-v0",
        }[skill]
        self.questions, self.length = questions, length
        self.asked: list[tuple[Skill, str]] = []
        self.right = 0

    def _draw(self) -> tuple[Skill, str]:
        if self.skill == "relay":
            first = self.asked[0][0] if self.asked else self.rng.choice(SKILLS)
            skill: Skill = SKILLS[(SKILLS.index(first) + len(self.asked)) % 2]
        else:
            skill = self.skill
        digits = "".join(self.rng.choice("0123456789") for _ in range(self.length))
        self.asked.append((skill, digits))
        return skill, digits

    async def _start(self, options: dict[str, Any]) -> Observation:
        self.asked, self.right = [], 0
        skill, digits = self._draw()
        return _user(f"{skill} {digits}")

    async def _turn(self, action: Action) -> Outcome:
        assert isinstance(action, TextAction)
        skill, digits = self.asked[-1]
        found = _DIGITS.findall(action.text)
        correct = bool(found) and found[-1] == solve(skill, digits)
        self.right += correct
        verdict = "right" if correct else "wrong"
        reward = round(1.0 / self.questions, 6) if correct else 0.0
        info: dict[str, Any] = {"skill": skill, "correct": correct}
        if len(self.asked) >= self.questions:
            info.update(success=self.right == self.questions, right=self.right)
            return Outcome(_user(f"{verdict}. done"), reward=reward, terminated=True, info=info)
        skill, digits = self._draw()
        return Outcome(_user(f"{verdict}. {skill} {digits}"), reward=reward, info=info)

    def _state(self) -> dict[str, Any]:
        return {"skill": self.skill, "asked": len(self.asked), "right": self.right}


def question(text: str) -> tuple[Skill, str] | None:
    """The question an observation asks (``"wrong. shift 0417"`` -> ``("shift", "0417")``)."""
    match = _QUESTION.search(text)
    if match is None:
        return None
    skill: Skill = "shift" if match.group(1) == "shift" else "mirror"
    return skill, match.group(2)


def _last_question(history: Sequence[Observation]) -> tuple[Skill, str] | None:
    for observation in reversed(history):
        for message in reversed(observation.messages):
            asked = question(message.content)
            if asked is not None:
                return asked
    return None


def oracle(history: Sequence[Observation]) -> TextAction:
    """Answers the last question asked."""
    return TextAction(text=_answer(history))


def _answer(history: Sequence[Observation]) -> str:
    asked = _last_question(history)
    return "0" if asked is None else solve(*asked)


def _guess(rng: random.Random, history: Sequence[Observation]) -> str:
    asked = _last_question(history)
    return "".join(rng.choice("0123456789") for _ in (asked[1] if asked else "0"))


def noisy_oracle(p_oracle: float, seed: int | None = None) -> TextPlayer:
    """The right answer with probability ``p_oracle``, else random digits of its length."""
    return noisy_text_player(_answer, _guess, p_oracle, seed)


def shift_digits(**kwargs: Any) -> DigitsEnv:
    return DigitsEnv(skill="shift", **kwargs)


def mirror_digits(**kwargs: Any) -> DigitsEnv:
    return DigitsEnv(skill="mirror", **kwargs)


def digit_relay(**kwargs: Any) -> DigitsEnv:
    return DigitsEnv(skill="relay", **kwargs)
