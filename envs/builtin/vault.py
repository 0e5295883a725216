"""`agentflow/vault-v0`: a credit-assignment env, where the first turn decides the outcome
and the reward for it comes only at the end.

An episode is one key turn and then `dials` dial turns:

    vault 7. key?     -> the key: the vault's digit (7) opens it, any other digit not
    dial 3?           -> the dial: that digit plus one, 9 wrapping to 0 (4)
    dial 8?           -> ... (each right dial pays `dial_reward` at once)
    open / shut       (the last step pays 1 more if the key was right)

So the largest reward (1) is decided by the first reply but paid after the last, while
the later turns earn small rewards of their own. Trajectory-level advantages blame the
dial turns for the key and credit the key for the dials; per-turn returns
(turn-level GRPO) still give the dials the key's outcome; re-rolling continuations from
a dial turn (RTPO) compares dials under the same key. `bench/rtpo.py` trains all three.

Replies: the last digit in the text. Reward: `dial_reward` per right dial, plus 1 at the
end for the right key; an episode's return is at most 1 + dials * dial_reward.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from typing import Any

from envs.base import Action, Message, Observation, TextAction
from envs.turn_env import Outcome, TextPlayer, TurnEnv, last_text, noisy_text_player

_DIGIT = re.compile(r"\d")
_VAULT = re.compile(r"vault (\d)\. key\?")
_DIAL = re.compile(r"dial (\d)\?\s*$")


def _user(text: str) -> Observation:
    return Observation(messages=[Message(role="user", content=text)], text=text)


def _last_digit(text: str) -> int | None:
    found = _DIGIT.findall(text)
    return int(found[-1]) if found else None


class VaultEnv(TurnEnv):
    env_id = "agentflow/vault-v0"

    def __init__(self, dials: int = 2, dial_reward: float = 0.2) -> None:
        if not 1 <= dials <= 16:
            raise ValueError("dials must be in [1, 16]")
        if not 0.0 <= dial_reward <= 1.0:
            raise ValueError("dial_reward must be in [0, 1]")
        super().__init__(max_turns=1 + dials)
        self.dials, self.dial_reward = dials, dial_reward
        self.vault = 0
        self.key: int | None = None
        self.dial = 0
        self.said: list[int | None] = []  # the digit of each reply so far

    async def _start(self, options: dict[str, Any]) -> Observation:
        self.vault = self.rng.randrange(10)
        self.key = None
        self.said = []
        return _user(f"vault {self.vault}. key?")

    def _next_dial(self) -> Observation:
        self.dial = self.rng.randrange(10)
        return _user(f"dial {self.dial}?")

    async def _turn(self, action: Action) -> Outcome:
        assert isinstance(action, TextAction)
        said = _last_digit(action.text)
        self.said.append(said)
        if self.turns == 1:
            self.key = said
            return Outcome(self._next_dial(), info={"key_right": said == self.vault})
        right = said == self.dial_answer()
        reward = self.dial_pays(right)
        info: dict[str, Any] = {"dial_right": right}
        if self.turns < 1 + self.dials:
            return Outcome(self._next_dial(), reward=round(reward, 6), info=info)
        opened = self.opens()
        # Success is the decision under study, the key; the variants where luck opens or
        # jams the vault keep what happened in `opened`.
        key_right = self.key == self.vault
        info.update(success=key_right, key_right=key_right, opened=opened)
        reward += 1.0 if opened else 0.0
        return Outcome(
            _user("open" if opened else "shut"), reward=round(reward, 6), terminated=True, info=info
        )

    # The rules the variants change (envs/builtin/long_vault.py, slip_vault.py,
    # recall_vault.py): what a dial asks, what it pays, whether the vault opens.

    def dial_answer(self) -> int:
        """The dial's right reply: its digit plus one, 9 wrapping to 0."""
        return (self.dial + 1) % 10

    def dial_pays(self, right: bool) -> float:
        return self.dial_reward if right else 0.0

    def opens(self) -> bool:
        return self.key == self.vault

    def chance(self) -> random.Random:
        """Randomness for the rules, drawn from the episode's seed and every reply so far:
        a replay of the same replies meets the same luck (RTPO's re-rolls replay the
        stored path), and two episodes of one task that differ in any reply draw apart."""
        said = ",".join("-" if d is None else str(d) for d in self.said)
        digest = hashlib.blake2b(f"{self.seed}|{said}".encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "little"))


def _answer(history: Sequence[Observation]) -> str:
    text = last_text(history)
    vault = _VAULT.search(text)
    if vault is not None:
        return vault.group(1)
    dial = _DIAL.search(text)
    return str((int(dial.group(1)) + 1) % 10) if dial is not None else "0"


def oracle(history: Sequence[Observation]) -> TextAction:
    """The vault's digit, then each dial plus one."""
    return TextAction(text=_answer(history))


def noisy_oracle(p_oracle: float, seed: int | None = None) -> TextPlayer:
    """The oracle's reply with probability ``p_oracle``, else a random digit."""
    return noisy_text_player(_answer, lambda rng, _: str(rng.randrange(10)), p_oracle, seed)
