"""The commands that load a run config (`train`, `trainer`, `runs create`, `sft`) refuse a
malformed or unavailable option before anything starts: exit 1, one line naming the field."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.unit.test_run_config import BASE, NOT_AVAILABLE, REFUSED
from trainer.cli import app


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


def _toml(document: dict[str, Any]) -> str:
    """A run config as TOML (tables for sections, arrays of tables for lists)."""

    def value(v: Any) -> str:
        return json.dumps(v)  # strings, numbers, booleans and lists of them are TOML too

    def table(name: str, body: dict[str, Any], header: str) -> list[str]:
        lines = [header]
        nested = []
        for key, v in body.items():
            if isinstance(v, dict):
                nested.append((f"{name}.{key}", v))
            else:
                lines.append(f"{key} = {value(v)}")
        for sub, v in nested:
            lines += table(sub, v, f"[{sub}]")
        return lines

    def is_table(v: Any) -> bool:
        return isinstance(v, dict) or (isinstance(v, list) and any(isinstance(e, dict) for e in v))

    lines = [f"{k} = {value(v)}" for k, v in document.items() if not is_table(v)]
    for key, v in document.items():
        if isinstance(v, dict):
            lines += table(key, v, f"[{key}]")
        elif is_table(v):
            for entry in v:
                lines += table(key, entry, f"[[{key}]]")
    return "\n".join(lines) + "\n"


def _config(tmp_path: Path, patch: dict[str, Any]) -> Path:
    document = {**BASE, **patch}
    document["trainer"] = {"run_dir": str(tmp_path / "runs"), **document.get("trainer", {})}
    path = tmp_path / "run.toml"
    path.write_text(_toml(document))
    return path


COMMANDS = {
    "train": lambda config: ["train", config],
    "trainer": lambda config: [
        "trainer",
        config,
        "--gateway",
        "http://127.0.0.1:9",
        "--run",
        str(uuid.uuid4()),
    ],  # fmt: skip
    "runs create": lambda config: ["runs", "create", config, "--url", "http://127.0.0.1:9"],
}
PARSE_REFUSALS = [(patch, loc, "is not available yet") for patch, loc in NOT_AVAILABLE] + REFUSED


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("patch", "loc", "says"), PARSE_REFUSALS, ids=lambda v: str(v))
def test_refused_options_exit_1_naming_the_field(
    tmp_path: Path,
    command: str,
    patch: dict[str, Any],
    loc: tuple[str | int, ...],
    says: str,
) -> None:
    config = _config(tmp_path, patch)
    result = CliRunner().invoke(app, COMMANDS[command](str(config)))
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output  # one clear line
    assert f": {'.'.join(map(str, loc))}: " in lines[0] and says in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({}, "weights.sync"),  # inprocess: the embedded trainer's
        (
            {"weights": {"sync": "disk"}, "warm_start": {"enabled": True}},
            "warm_start.enabled",
        ),
        ({"weights": {"sync": "disk"}, "trainer": {"device": "cuda:99"}}, "trainer.device"),
        (  # NCCL moves CUDA tensors; this trainer's are on the CPU
            {
                "model": {"path": "/ckpt"},
                "engine": {"type": "sglang", "urls": ["http://127.0.0.1:9"]},
                "weights": {"sync": "nccl"},
            },
            "weights.broadcast.backend",
        ),
    ],
)
def test_the_split_trainer_refuses_what_its_form_cannot_do(
    tmp_path: Path, patch: dict[str, Any], field: str
) -> None:
    config = _config(tmp_path, patch)
    result = CliRunner().invoke(app, COMMANDS["trainer"](str(config)))
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: {field}: "), result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["train", "trainer"])
def test_the_megatron_backend_is_refused_without_cuda(tmp_path: Path, command: str) -> None:
    config = _config(tmp_path, {"trainer": {"backend": "megatron"}, "weights": {"sync": "disk"}})
    result = CliRunner().invoke(app, COMMANDS[command](str(config)))
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: trainer.backend: the Megatron backend needs CUDA"), (
        result.output
    )
    assert "use backend = 'torch'" in result.output
    assert not (tmp_path / "runs").exists()


def test_train_refuses_several_trainer_ranks(tmp_path: Path) -> None:
    config = _config(tmp_path, {"trainer": {"ranks": 2}})
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: trainer.ranks: the embedded trainer is one process")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("field", ["engine.device", "trainer.device"])
def test_train_refuses_a_cuda_device_this_machine_lacks(tmp_path: Path, field: str) -> None:
    section, key = field.split(".")
    extra: dict[str, Any] = {"type": "local"} if section == "engine" else {}
    config = _config(tmp_path, {section: {**extra, key: "cuda:99"}})
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: {field}: 'cuda:99': this machine has ")
    assert not (tmp_path / "runs").exists()


def test_sft_refuses_an_env_without_a_noisy_oracle(tmp_path: Path) -> None:
    # [warm_start] is off, so the parse passes; `agentflow sft` runs it all the same.
    config = _config(tmp_path, {"envs": [{"id": "agentflow/calc-tool-v0"}]})
    result = CliRunner().invoke(app, ["sft", str(config), "--out", str(tmp_path / "sft")])
    assert result.exit_code == 1, result.output
    assert "warm_start" in result.output and "no noisy oracle" in result.output
    assert not (tmp_path / "sft").exists()


def test_plugins_load_only_from_allowed_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = {"type": "python", "entry_point": "tests.support.plugins:guess_number_agent"}
    config = _config(tmp_path, {"agent": agent})
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 1, result.output
    assert ": agent.entry_point: module 'tests.support.plugins' is not on" in result.output
    # Allowed, the module loads; what it names must still be a function.
    monkeypatch.setenv("AGENTFLOW_PLUGIN_MODULES", "tests.support")
    agent["entry_point"] = "tests.support.plugins:NOT_CALLABLE"
    config = _config(tmp_path, {"agent": agent})
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 1, result.output
    assert ": agent.entry_point: 'tests.support.plugins:NOT_CALLABLE' is int" in result.output
    assert not (tmp_path / "runs").exists()
