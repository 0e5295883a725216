"""`agentflow/slip-vault-v0`: the vault with stochastic transitions.

The turns are the vault's (`agentflow/vault-v0`: a key, then dials asking their digit
plus one), but what a reply does is left to chance:

- a right dial slips with probability `slip`: it pays nothing, and the next question
  says so (`slip. dial 4?`);
- at the end the right key opens the vault only with probability `1 - jam`, and a wrong
  key opens it with probability `lucky`.

So two trajectories from the same key end differently, and a trajectory's return blames
the dial turns for a jam and praises a wrong key for luck. Success (`info["success"]`)
is still the key being right; `info["opened"]` says whether the vault opened.

The luck is drawn from the episode's seed and the replies so far (`VaultEnv.chance`): a
replay of the stored replies meets the same luck (RTPO's re-rolls replay their path),
and two episodes of one task draw apart as soon as one reply differs.
"""

from __future__ import annotations

from envs.base import Observation
from envs.builtin.vault import VaultEnv, _user


class SlipVaultEnv(VaultEnv):
    env_id = "agentflow/slip-vault-v0"

    def __init__(
        self,
        dials: int = 3,
        dial_reward: float = 0.2,
        slip: float = 0.3,
        jam: float = 0.3,
        lucky: float = 0.15,
    ) -> None:
        for name, p in (("slip", slip), ("jam", jam), ("lucky", lucky)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        super().__init__(dials=dials, dial_reward=dial_reward)
        self.slip, self.jam, self.lucky = slip, jam, lucky
        self.slipped = False

    def _next_dial(self) -> Observation:
        asked = super()._next_dial().text or ""
        return _user(f"slip. {asked}" if self.slipped else asked)

    def dial_pays(self, right: bool) -> float:
        self.slipped = right and self.chance().random() < self.slip
        return 0.0 if self.slipped else super().dial_pays(right)

    def opens(self) -> bool:
        luck = self.chance().random()
        return luck >= self.jam if self.key == self.vault else luck < self.lucky
