"""`agentflow/long-vault-v0`: the vault over a long horizon, with noisy rewards on the way.

One key turn, then `dials` dial turns (6 by default: seven policy turns). As in
`agentflow/vault-v0`, the key decides the largest reward (1, paid after the last turn)
and each dial asks its digit plus one. Here every dial turn pays a small reward with
noise of its own: `dial_reward` when right, nothing when wrong, plus a draw from a normal
distribution of standard deviation `noise` either way. So a trajectory's return carries
the key's outcome and six noisy dial payments: trajectory-level credit mixes them all,
and each turn's own share is small against the noise of the others.

The noise is drawn from the episode's seed and the replies so far (`VaultEnv.chance`):
a replay meets the same draws, and so does an episode that repeats every reply.
"""

from __future__ import annotations

from envs.builtin.vault import VaultEnv


class LongVaultEnv(VaultEnv):
    env_id = "agentflow/long-vault-v0"

    def __init__(self, dials: int = 6, dial_reward: float = 0.1, noise: float = 0.1) -> None:
        if not 0.0 <= noise <= 1.0:
            raise ValueError("noise must be in [0, 1]")
        super().__init__(dials=dials, dial_reward=dial_reward)
        self.noise = noise

    def dial_pays(self, right: bool) -> float:
        return super().dial_pays(right) + self.chance().gauss(0.0, self.noise)
