from __future__ import annotations

import pytest

from agentflow.run_config import RunConfig
from trainer.backends.torch_backend import TorchPolicy
from trainer.setup import build_policy


def test_the_policy_takes_the_run_configs_optimizer_settings() -> None:
    config = RunConfig.model_validate(
        {
            "name": "r",
            "envs": [{"id": "agentflow/guess-number-v0"}],
            "model": {"init": {"layers": 1, "hidden": 16, "heads": 2, "max_context": 64}},
            "trainer": {"lr": 5e-3, "betas": [0.8, 0.95], "adam_eps": 1e-6},
        }
    )
    policy = build_policy(config)
    assert isinstance(policy, TorchPolicy)
    group = policy.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-3)
    assert tuple(group["betas"]) == (0.8, 0.95)
    assert group["eps"] == pytest.approx(1e-6)
