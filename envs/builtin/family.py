"""The built-in env family: the text envs of this package (envs/builtin/), each with its
scripted oracle. Registered through the `agentflow.envs` entry point (pyproject.toml);
each env's module is imported only when the env is made."""

from __future__ import annotations

from envs import registry

# id, `module:factory` and `module:oracle` under envs.builtin
_BUILTINS = (
    ("agentflow/guess-number-v0", "guess_number:GuessNumberEnv", "guess_number:oracle"),
    ("agentflow/calc-tool-v0", "calc_tool:CalcToolEnv", "calc_tool:oracle"),
    ("agentflow/lookup-v0", "lookup:LookupEnv", "lookup:oracle"),
    ("agentflow/shift-digits-v0", "digits:shift_digits", "digits:oracle"),
    ("agentflow/mirror-digits-v0", "digits:mirror_digits", "digits:oracle"),
    ("agentflow/digit-relay-v0", "digits:digit_relay", "digits:oracle"),
    ("agentflow/vault-v0", "vault:VaultEnv", "vault:oracle"),
    ("agentflow/long-vault-v0", "long_vault:LongVaultEnv", "vault:oracle"),
    ("agentflow/slip-vault-v0", "slip_vault:SlipVaultEnv", "vault:oracle"),
    ("agentflow/recall-vault-v0", "recall_vault:RecallVaultEnv", "recall_vault:oracle"),
)
BUILTIN_ENVS = tuple(env_id for env_id, _, _ in _BUILTINS)


def register() -> None:
    for env_id, entry_point, oracle_path in _BUILTINS:
        registry.register(
            env_id,
            f"envs.builtin.{entry_point}",
            oracle=f"envs.builtin.{oracle_path}",
            replace=True,
        )
