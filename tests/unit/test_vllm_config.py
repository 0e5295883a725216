"""The `vllm` engine's config: refused where it could not run, with the field and why."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from agentflow.inference.vllm_server import server_env
from agentflow.run_config import RunConfig, VLLMLaunchConfig

BASE: dict[str, Any] = {
    "name": "r",
    "model": {"path": "/models/policy"},
    "engine": {"type": "vllm", "urls": ["http://127.0.0.1:8100"]},
    "weights": {"sync": "disk"},
    "envs": [{"id": "agentflow/guess-number-v0"}],
}


def _refused(patch: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as refused:
        RunConfig.model_validate({**BASE, **patch})
    return str(refused.value)


def test_a_vllm_run_parses() -> None:
    config = RunConfig.model_validate(BASE)
    assert config.engine.type == "vllm"


def test_urls_or_launch_one_of_the_two() -> None:
    assert "one of the two" in _refused({"engine": {"type": "vllm"}})
    both = {"type": "vllm", "urls": ["http://127.0.0.1:8100"], "launch": {}}
    assert "one of the two" in _refused({"engine": both})


def test_weights_come_from_disk() -> None:
    assert "sync = 'disk'" in _refused({"weights": {"sync": "inprocess"}})


def test_a_checkpoint_is_served() -> None:
    built = {"model": {"init": {"layers": 2, "hidden": 64, "heads": 2}}}
    assert "serves a checkpoint" in _refused(built)
    # Servers that run already cannot serve what the warm start will write.
    assert "cannot serve the warm start" in _refused({**built, "warm_start": {"enabled": True}})
    launched = {"type": "vllm", "launch": {}}
    config = RunConfig.model_validate(
        {**BASE, **built, "engine": launched, "warm_start": {"enabled": True}}
    )
    assert config.engine.type == "vllm"


def test_launch_settings_are_checked() -> None:
    for launch, why in (
        ({"kv_cache_gib": 0}, "kv_cache_gib"),
        ({"dtype": "int4"}, "dtype"),
        ({"extra_args": ["--port=9"]}, "set from the run's config"),
        ({"env": {"A=B": "1"}}, "not environment variable names"),
    ):
        assert why in _refused({"engine": {"type": "vllm", "launch": launch}})


def test_on_ray_each_engine_actor_launches_one_server() -> None:
    placed = {"placement": {"ray": "local", "engines": 2}}
    assert "start their vLLM servers from [engine.launch]" in _refused(placed)
    two = {"type": "vllm", "launch": {"servers": 2}}
    assert "set placement.engines for more" in _refused({**placed, "engine": two})
    config = RunConfig.model_validate({**BASE, **placed, "engine": {"type": "vllm", "launch": {}}})
    assert config.placement.engines == 2


def test_the_runs_environment_comes_last_and_the_gateways_path_not_at_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/gateway/site")
    launch = VLLMLaunchConfig(
        python="/venv/bin/python", env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", "X": "y"}
    )
    env = server_env(launch)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["X"] == "y"
    assert "PYTHONPATH" not in env
    assert env["TORCHDYNAMO_DISABLE"] == "1"  # no C++ compiler needed by the sampler
    assert (
        server_env(launch.model_copy(update={"env": {"PYTHONPATH": "/plugins"}}))["PYTHONPATH"]
        == "/plugins"
    )
