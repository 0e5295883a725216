"""The credit study's protocol (bench/rtpo.py): every arm's config is a valid run on its
env, samples about the same trajectories per step from the same warm start, and takes K
optimizer steps per batch (all but the one-step GRPO reference)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agentflow.run_config import load_run_config
from bench.rtpo import ARMS, ENVS, compare, config_text, first_reaching, markdown, spread
from trainer.setup import loop_settings


@pytest.mark.parametrize("arm_name", list(ARMS))
@pytest.mark.parametrize("env_name", list(ENVS))
def test_every_arm_samples_the_same_budget_and_takes_k_steps(
    env_name: str, arm_name: str, tmp_path: Path
) -> None:
    case, arm = ENVS[env_name], ARMS[arm_name]
    path = tmp_path / "run.toml"
    path.write_text(
        config_text(
            case,
            arm,
            name="x",
            seed=1,
            steps=30,
            batch=60,
            model='path = "/models/warm"',
            run_dir=tmp_path,
        )
    )
    config = load_run_config(path)
    settings = loop_settings(config, tmp_path)
    sampled = settings.groups_per_batch * settings.group_size
    assert 60 <= sampled <= 72, sampled  # within a group of the budget, re-rolls included
    assert config.agent.max_turns == case.max_turns
    if arm.algorithm == "rtpo":
        assert config.rtpo.branches == arm.branches and config.rtpo.update == arm.update
        # reverse: one step per turn depth (K of them on full episodes); joint: K minibatches
        assert settings.rtpo_update == arm.update
        if arm.update == "reverse":
            assert config.trainer.minibatches == 1  # the depths are its steps
        k = config.trainer.minibatches if arm.update == "joint" else case.max_turns
    else:
        k = config.trainer.minibatches
    assert k == (1 if arm_name == "grpo" else case.max_turns)
    assert config.trainer.lr == 2e-4 and config.seed == 1


def test_steps_to_the_threshold_read_a_moving_mean() -> None:
    assert first_reaching([0.1, 0.9, 0.9, 0.9], 0.8) == 4  # 3-step mean 0.9 at step 4
    assert first_reaching([0.1, 0.9, 0.9, 0.6], 0.6) == 3  # (0.1+0.9+0.9)/3 = 0.633
    assert first_reaching([1.0, 1.0], 0.5) is None  # not a whole window yet
    assert first_reaching([0.2] * 10, 0.5) is None
    mean, sd = spread([1.0, 2.0, 3.0])
    assert mean == 2.0 and math.isclose(sd, 1.0)
    assert spread([0.5]) == (0.5, 0.0)


def test_an_arm_is_ahead_or_behind_only_beyond_two_standard_errors() -> None:
    base = {"return": (1.0, 0.1)}
    # 3 seeds, spreads 0.1 each: the standard error of the gap is sqrt(0.02 / 3) = 0.082.
    gap, error, verdict = compare({"return": (1.2, 0.1)}, base, 3)
    assert math.isclose(gap, 0.2) and math.isclose(error, math.sqrt(0.02 / 3))
    assert verdict == "ahead"
    assert compare({"return": (1.1, 0.1)}, base, 3)[2] == "level"
    assert compare({"return": (0.7, 0.1)}, base, 3)[2] == "behind"


def test_the_report_prints_one_markdown_row_per_arm() -> None:
    row = {
        "return": (1.0, 0.1),
        "success": (0.5, 0.05),
        "steps_to_threshold": [3, None],
        "seconds_to_threshold": [12.0],
        "trajectories_per_step": (60.0, 0.0),
    }
    report = {
        "envs": {
            "vault": {
                "id": "agentflow/vault-v0",
                "warm": {"return": 0.5, "success": 0.3},
                "oracle": {"return": 1.4, "success": 1.0},
                "threshold": 0.95,
                "arms": {"grpo_k": row, "rtpo": {**row, "return": (1.5, 0.1)}},
            }
        }
    }
    text = markdown(report)
    assert "| grpo_k | 1.000 ± 0.100 | 0.500 ± 0.050 | 3, - | 12 | 60 |  |" in text
    assert "| rtpo | 1.500 ± 0.100 |" in text and "+0.500 ± 0.100: ahead" in text
