"""`agentflow/recall-vault-v0`: the vault where later turns depend on the agent's own
earlier reply.

The key turn is the vault's (`vault 7. key?`: the vault's digit opens it, paid 1 at the
end). Each dial then asks `key plus 1?` (the shift drawn from `0 .. shifts - 1`): the
right reply is the key the agent gave plus the shift, mod 10, whether that key was right
or not, and pays `dial_reward` at once. The key is never repeated by the env: it is in
the context only as the agent's own reply. So a dial turn is right only under the context
it was sampled in, and a trainer that trained it under another (a re-rendered or
re-sampled history) would teach it the wrong digit. A key reply with no digit counts
as 0.

Two shifts by default: with ten (any digit), a small model did not learn the sum from a
warm start and thirty steps of RL (docs/credit.md), and the dials paid nothing to learn
from.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from envs.base import Observation, TextAction
from envs.builtin.vault import _VAULT, VaultEnv, _user
from envs.turn_env import TextPlayer, last_text

_DIAL = re.compile(r"key plus (\d)\?\s*$")


class RecallVaultEnv(VaultEnv):
    env_id = "agentflow/recall-vault-v0"

    def __init__(self, dials: int = 2, dial_reward: float = 0.2, shifts: int = 2) -> None:
        if not 1 <= shifts <= 10:
            raise ValueError("shifts must be in [1, 10]")
        super().__init__(dials=dials, dial_reward=dial_reward)
        self.shifts = shifts

    def _next_dial(self) -> Observation:
        self.dial = self.rng.randrange(self.shifts)
        return _user(f"key plus {self.dial}?")

    def dial_answer(self) -> int:
        return ((self.key or 0) + self.dial) % 10


def _reply(history: Sequence[Observation], key: int) -> str:
    dial = _DIAL.search(last_text(history))
    return str((key + int(dial.group(1))) % 10) if dial is not None else "0"


def _vault(history: Sequence[Observation]) -> int:
    found = _VAULT.search(last_text(history[:1]))
    return int(found.group(1)) if found is not None else 0


def oracle(history: Sequence[Observation]) -> TextAction:
    """The vault's digit as the key, then each dial plus that key."""
    if len(history) <= 1:
        return TextAction(text=str(_vault(history)))
    return TextAction(text=_reply(history, _vault(history)))


def noisy_oracle(p_oracle: float, seed: int | None = None) -> TextPlayer:
    """Each reply the oracle's with probability ``p_oracle``, else a random digit; the
    dials are answered (or guessed) against the key this player itself gave."""
    if not 0.0 <= p_oracle <= 1.0:
        raise ValueError("p_oracle must be in [0, 1]")
    rng = random.Random(seed)
    key = 0

    def policy(history: Sequence[Observation]) -> TextAction:
        nonlocal key
        lucky = rng.random() < p_oracle
        if len(history) <= 1:
            key = _vault(history) if lucky else rng.randrange(10)
            return TextAction(text=str(key))
        return TextAction(text=_reply(history, key) if lucky else str(rng.randrange(10)))

    return policy
