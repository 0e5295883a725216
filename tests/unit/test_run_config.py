from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from agentflow.run_config import RunConfig, load_run_config

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("**/*.toml"))


def test_minimal_config_fills_defaults() -> None:
    config = RunConfig.model_validate({"name": "r", "envs": [{"id": "a/B-v0"}]})
    assert config.engine.type == "local"
    assert config.rollout.max_staleness == 2
    assert config.model.init.layers == 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_config_parses(path: Path) -> None:
    assert load_run_config(path).name


@pytest.mark.parametrize(
    ("patch", "loc"),
    [
        ({"model": {"init": {"hidden": 100, "heads": 3}}}, ("model", "init")),
        ({"engine": {"type": "sglang", "urls": []}}, ("engine", "sglang", "urls")),
        ({"agent": {"type": "http"}}, ("agent",)),
        ({"teachers": [{"name": "t"}]}, ("teachers", 0)),
        ({"trainer": {"lr": 0}}, ("trainer", "lr")),
        ({"name": "has space"}, ("name",)),
    ],
)
def test_bad_fields_are_named(patch: dict[str, object], loc: tuple[object, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate({"name": "r", "envs": [{"id": "a/B-v0"}], **patch})
    assert info.value.errors()[0]["loc"] == loc


def test_toml_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('name = "t"\nseed = 3\n[[envs]]\nid = "agentflow/guess-number-v0"\n')
    config = load_run_config(path)
    assert (config.seed, config.envs[0].id) == (3, "agentflow/guess-number-v0")


def test_json_file_is_the_api_body(tmp_path: Path) -> None:
    body = RunConfig.model_validate({"name": "j", "seed": 4, "envs": [{"id": "a/B-v0"}]})
    path = tmp_path / "run.json"
    path.write_text(body.model_dump_json())
    assert load_run_config(path) == body
    path.write_text('{"name": "j",')
    with pytest.raises(ValueError, match="not JSON"):
        load_run_config(path)
    path.write_text('{"name": "j", "envs": [], "seed": "x"}')
    with pytest.raises(ValidationError):
        load_run_config(path)
