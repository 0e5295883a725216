"""The `agentflow` CLI against a real gateway process."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.integration.test_serve import _server
from trainer.cli import app

pytestmark = pytest.mark.integration


def test_envs_and_runs_commands(sqlite_database: str, tmp_path: Path) -> None:
    runner = CliRunner()
    name = f"cli-{uuid.uuid4().hex[:6]}"
    env_file = tmp_path / "env.yaml"
    env_file.write_text(
        f"name: {name}\nkind: http\nspec:\n  url: http://127.0.0.1:9\nmax_concurrency: 4\n"
    )
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'name = "cli-run"\n[[envs]]\nid = "{name}"\n')

    with _server(sqlite_database, tmp_path) as url:
        opts = ["--url", url]
        created = runner.invoke(app, ["envs", "register", str(env_file), *opts])
        assert created.exit_code == 0, created.output
        env_id = json.loads(created.output)["id"]

        again = runner.invoke(app, ["envs", "register", str(env_file), *opts])
        assert again.exit_code == 1 and "409" in again.output

        listed = runner.invoke(app, ["envs", "list", "--name", name, *opts])
        assert env_id in listed.output and "1 environment(s)" in listed.output
        shown = runner.invoke(app, ["envs", "show", env_id, *opts])
        assert json.loads(shown.output)["max_concurrency"] == 4

        run = runner.invoke(app, ["runs", "create", str(run_file), "--no-start", *opts])
        assert run.exit_code == 0, run.output
        run_id = json.loads(run.output)["id"]
        assert run_id in runner.invoke(app, ["runs", "list", *opts]).output
        assert (
            json.loads(runner.invoke(app, ["runs", "show", run_id, *opts]).output)["status"]
            == "pending"
        )

        # The env mix: shown, changed (a revision each), refusals naming the option.
        envs = ["runs", "envs", run_id, *opts]
        added = runner.invoke(
            app, [*envs, "--set", "agentflow/guess-number-v0=3", "--cap", f"{name}=2"]
        )
        assert added.exit_code == 0, added.output
        assert "revision 1:" in added.output
        assert "agentflow/guess-number-v0  weight=3  cap=64" in added.output
        assert f"{name}  weight=1  cap=2" in added.output
        shown = runner.invoke(app, [*envs, "--json"])
        assert [r["revision"] for r in json.loads(shown.output)["env_revisions"]] == [0, 1]
        stale = runner.invoke(app, [*envs, "--remove", name, "--revision", "0"])
        assert stale.exit_code == 1 and "revision 1, not 0" in stale.output
        emptied = runner.invoke(
            app, [*envs, "--remove", name, "--remove", "agentflow/guess-number-v0"]
        )
        assert emptied.exit_code == 1 and "remove" in emptied.output
        garbled = runner.invoke(app, [*envs, "--set", "agentflow/guess-number-v0=heavy"])
        assert garbled.exit_code == 1 and "set:" in garbled.output
        removed = runner.invoke(app, [*envs, "--remove", name, "--revision", "1"])
        assert removed.exit_code == 0 and "revision 2:" in removed.output, removed.output

        bad = tmp_path / "bad.toml"
        bad.write_text('name = "x"\n[[envs]]\nid = "e"\n[rollout]\ngroup_size = 0\n')
        refused = runner.invoke(app, ["runs", "create", str(bad), *opts])
        assert refused.exit_code == 1 and "rollout.group_size" in refused.output

        deleted = runner.invoke(app, ["envs", "delete", env_id, *opts])
        assert deleted.exit_code == 0, deleted.output
        missing = runner.invoke(app, ["envs", "show", env_id, *opts])
        assert missing.exit_code == 1 and "404" in missing.output


def test_the_split_trainer_refuses_a_config_that_disagrees_with_its_run(
    sqlite_database: str, tmp_path: Path
) -> None:
    runner = CliRunner()
    config = {
        "name": "split-check",
        "envs": [{"id": "agentflow/guess-number-v0"}],
        "weights": {"sync": "disk"},
        "trainer": {"run_dir": str(tmp_path / "runs")},
    }
    stored, other = tmp_path / "run.json", tmp_path / "other.json"
    stored.write_text(json.dumps(config))
    other.write_text(json.dumps({**config, "agent": {"temperature": 0.7}}))
    with _server(sqlite_database, tmp_path) as url:
        created = runner.invoke(app, ["runs", "create", str(stored), "--no-start", "--url", url])
        assert created.exit_code == 0, created.output
        run_id = json.loads(created.output)["id"]

        trainer = ["trainer", str(other), "--gateway", url, "--run", run_id]
        refused = runner.invoke(app, trainer)
        assert refused.exit_code == 1, refused.output
        assert refused.output.startswith("error: agent.temperature: 0.7 here but 1.0 in run")

        trainer = ["trainer", str(stored), "--gateway", url, "--run", str(uuid.uuid4())]
        missing = runner.invoke(app, trainer)
        assert missing.exit_code == 1 and "404" in missing.output
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing written
