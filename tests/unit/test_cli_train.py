"""`agentflow train` refuses a malformed config before anything starts, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentflow.cli import app


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            'name = "q"\n[[envs]]\nid = "agentflow/guess-number-v0"\n[trainer]\nlr = -1\n',
            "trainer.lr",
        ),
        ('name = "q"\n[[envs]]\nid = "x"\n[rollout]\ngroup_size = 0\n', "rollout.group_size"),
        ('name = "q"\n[[envs]]\nid = "x"\n[warm_start]\nepochs = "two"\n', "warm_start.epochs"),
        ('name = "q"\nenvs = []\n', "envs"),
        ('name = "q"\n[[envs]\n', "Expected"),  # TOML syntax
    ],
)
def test_a_bad_config_is_refused_naming_the_field(tmp_path: Path, body: str, field: str) -> None:
    config = tmp_path / "run.toml"
    config.write_text(body)
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 1
    assert field in result.output
    assert not (tmp_path / "runs").exists()  # nothing started
