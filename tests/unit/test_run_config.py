from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agentflow.errors import InvalidInput
from agentflow.run_config import UNLOADED, EnvEntry, RunConfig, load_run_config, with_envs

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("**/*.toml"))
BASE: dict[str, Any] = {"name": "r", "envs": [{"id": "agentflow/guess-number-v0"}]}
PYTHON_AGENT = {"type": "python", "entry_point": "agentflow.agents.whitebox:WhiteBoxAgent"}

# Planned options the schema names but nothing builds yet: (patch, loc). Each is refused
# at parse time, through the API (422) and the CLI (exit 1) alike.
NOT_AVAILABLE: list[tuple[dict[str, Any], tuple[str | int, ...]]] = [
    ({"trainer": {"kl_coef": 0.01}}, ("trainer", "kl_coef")),
]

# Options the run would ignore or fail on late: (patch, loc, what the message says).
REFUSED: list[tuple[dict[str, Any], tuple[str | int, ...], str]] = [
    ({"model": {"chat_template": "{{ x }}"}}, ("model",), "checkpoint's tokenizer"),
    ({"logger": ["tensorboard", "tensorboard"]}, ("logger",), "each logger at most once"),
    (
        {"model": {"path": "/ckpt", "chat_template": "/no/such.jinja"}},
        ("model", "chat_template"),
        "no chat template file",
    ),
    (
        {"model": {"path": "/ckpt", "chat_history": "rerender"}},
        (),
        "for black-box agents",
    ),
    ({"weights": {"sync": "nccl"}}, ("weights",), "broadcasts to SGLang engines"),
    ({"megatron": {"tensor_parallel": 2}}, (), "[megatron] is for trainer.backend"),
    (
        {"trainer": {"backend": "megatron", "ranks": 3}, "megatron": {"tensor_parallel": 2}},
        (),
        "must be a multiple of megatron.tensor_parallel",
    ),
    (
        {"trainer": {"backend": "megatron", "minibatches": 2}},
        (),
        "one step per batch",
    ),
    (
        {"weights": {"sync": "disk", "broadcast": {"backend": "gloo"}}},
        ("weights",),
        "is for sync = 'nccl'",
    ),
    ({"agent": {"reward": "agent"}}, ("agent", "reward"), "whitebox agent's reward"),
    ({"agent": {"reward": "external"}}, ("agent", "reward"), "whitebox agent's reward"),
    ({"agent": {"url": "http://a:1"}}, ("agent", "url"), "type 'http'"),
    (
        {"agent": {"type": "http", "url": "http://a:1", "command": ["x"]}},
        ("agent", "command"),
        "type 'container'",
    ),
    (
        {"agent": {"type": "container", "command": ["x"], "system_prompt": "hi"}},
        ("agent", "system_prompt"),
        "sends its own messages",
    ),
    ({"agent": {"deadline_s": 30}}, ("agent", "deadline_s"), "no deadline"),
    (
        {"agent": {"type": "container", "command": ["x"], "deadline_s": 3601}},
        ("agent", "deadline_s"),
        "3600",
    ),
    (
        {"agent": {"type": "http", "url": "http://a:1", "deadline_s": 86_401}},
        ("agent", "deadline_s"),
        "86400",
    ),
    ({"weights": {"dir": "/w"}}, ("weights", "dir"), "disk sync"),
    ({"engine": {"type": "sglang", "urls": ["http://r:1"]}}, ("engine",), "model.path"),
    ({"engine": {"type": "local", "device": "gpu"}}, ("engine", "local", "device"), "cuda:N"),
    ({"trainer": {"device": "cuda0"}}, ("trainer", "device"), "cuda:N"),
    ({"trainer": {"betas": [0.9, 1.0]}}, ("trainer", "betas"), "in [0, 1)"),
    ({"envs": [{"id": "my-env@2", "kwargs": {"n": 1}}]}, ("envs", 0, "kwargs"), "built-in"),
    (
        {"envs": [{"id": "agentflow/calc-tool-v0"}], "warm_start": {"enabled": True}},
        ("warm_start",),
        "no noisy oracle",
    ),
    (
        {"envs": [{"id": "my-env"}], "warm_start": {"enabled": True}},
        ("warm_start",),
        "not a built-in env",
    ),
    # Plug-ins by dotted path are imported at parse time (`agentflow.plugins`).
    (
        {"agent": {"entry_point": PYTHON_AGENT["entry_point"]}},
        ("agent", "entry_point"),
        "type 'python', not of 'whitebox'",
    ),
    ({"agent": {"type": "python"}}, ("agent",), "agent.entry_point is required"),
    (
        {"agent": {"type": "python", "entry_point": "os:system"}},
        ("agent", "entry_point"),
        "'os' is not on the plug-in allow-list",
    ),
    ({"agent": {**PYTHON_AGENT, "deadline_s": 30}}, ("agent", "deadline_s"), "no deadline"),
    ({"agent": {**PYTHON_AGENT, "reward": "agent"}}, ("agent", "reward"), "python agent's"),
    (
        {"envs": [{"id": "agentflow/guess-number-v0", "reward": "agentflow.no_such:f"}]},
        ("envs", 0, "reward"),
        "cannot import 'agentflow.no_such'",
    ),
    (
        {"envs": [{"id": "agentflow/guess-number-v0", "reward": "agentflow.plugins"}]},
        ("envs", 0, "reward"),
        "must look like 'package.module:function'",
    ),
    (
        {"rollout": {"hooks": ["agentflow.plugins:call", "agentflow.plugins:nothing"]}},
        ("rollout", "hooks", 1),
        "has no attribute 'nothing'",
    ),
    (
        {"rollout": {"hooks": ["agentflow.plugins:MODULES_ENV_VAR"]}},
        ("rollout", "hooks", 0),
        "is str, not callable",
    ),
]


def test_minimal_config_fills_defaults() -> None:
    config = RunConfig.model_validate({"name": "r", "envs": [{"id": "a/B-v0"}]})
    assert config.engine.type == "local"
    assert config.rollout.max_staleness == 2
    assert config.model.init.layers == 4


def test_examples_are_found() -> None:
    assert {p.name for p in EXAMPLES} >= {"quickstart.toml", "guess-number-rollout.toml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_config_parses(path: Path) -> None:
    config = load_run_config(path)
    # What the gateway stores (every field explicit) parses again: a restart reloads it.
    assert RunConfig.model_validate(config.model_dump(mode="json")) == config


@pytest.mark.parametrize(("patch", "loc"), NOT_AVAILABLE, ids=lambda v: str(v))
def test_planned_options_are_refused_as_not_available(
    patch: dict[str, Any], loc: tuple[str | int, ...]
) -> None:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate({**BASE, **patch})
    error = info.value.errors()[0]
    assert error["loc"] == loc
    assert "is not available yet" in error["msg"]


@pytest.mark.parametrize(("patch", "loc", "says"), REFUSED, ids=lambda v: str(v))
def test_options_that_would_do_nothing_are_refused(
    patch: dict[str, Any], loc: tuple[str | int, ...], says: str
) -> None:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate({**BASE, **patch})
    error = info.value.errors()[0]
    assert error["loc"] == loc
    assert says in error["msg"]


@pytest.mark.parametrize(
    "patch",
    [
        {"trainer": {"algorithm": "ppo", "backend": "torch", "kl_coef": 0.0}},
        {"trainer": {"device": "cuda:1"}, "engine": {"type": "local", "device": "cuda"}},
        {"weights": {"sync": "disk", "dir": "/w"}},
        {"rollout": {"interrupt": "abort", "partial_rollout": True}},
        {"agent": {"type": "http", "url": "http://a:1", "reward": "external", "deadline_s": 60}},
        {"agent": {"type": "container", "command": ["x"], "reward": "agent", "deadline_s": 3600}},
        {"agent": {"type": "whitebox", "system_prompt": "be brief", "deadline_s": 600}},
        {"engine": {"type": "sglang", "urls": ["http://r:1"]}, "model": {"path": "/ckpt"}},
        {"envs": [{"id": "agentflow/guess-number-v0", "kwargs": {"low": 1}}]},
        {"warm_start": {"enabled": True}},
        {"envs": [{"id": "agentflow/lookup-v0"}], "warm_start": {"enabled": True, "p_oracle": 1}},
        {"teachers": []},
        {
            "trainer": {
                "precision": "bf16",
                "gradient_checkpointing": True,
                "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
            },
            "logger": ["tensorboard", "wandb"],
        },
        {
            "model": {
                "path": "/ckpt",
                "chat_template": "{{ messages[0]['content'] }}",
                "chat_template_kwargs": {"enable_thinking": False},
                "tool_call_format": "llama3_json",
            }
        },
        {
            "model": {"path": "/ckpt", "chat_history": "rerender"},
            "agent": {"type": "http", "url": "http://a:1", "reward": "external"},
        },
        {
            "teachers": [{"name": "t", "path": "/ckpt", "envs": ["agentflow/guess-number-v0"]}],
            "distill": {"estimator": "full", "rl": False, "max_resident": 2},
        },
        {"agent": {**PYTHON_AGENT, "max_turns": 3}},
        {
            "envs": [{"id": "agentflow/guess-number-v0", "reward": "agentflow.plugins:call"}],
            "rollout": {"hooks": ["agentflow.plugins:call"]},
        },
    ],
    ids=lambda v: str(v),
)
def test_options_that_work_are_accepted(patch: dict[str, Any]) -> None:
    config = RunConfig.model_validate({**BASE, **patch})
    assert RunConfig.model_validate(config.model_dump(mode="json")) == config


@pytest.mark.parametrize(
    ("patch", "loc"),
    [
        ({"model": {"init": {"hidden": 100, "heads": 3}}}, ("model", "init")),
        ({"engine": {"type": "sglang", "urls": []}}, ("engine",)),
        ({"agent": {"type": "http"}}, ("agent",)),
        ({"teachers": [{"name": "t"}]}, ("teachers", 0)),  # neither path nor url
        ({"trainer": {"lr": 0}}, ("trainer", "lr")),
        ({"name": "has space"}, ("name",)),
    ],
)
def test_bad_fields_are_named(patch: dict[str, object], loc: tuple[object, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate({"name": "r", "envs": [{"id": "a/B-v0"}], **patch})
    assert info.value.errors()[0]["loc"] == loc


def test_a_stored_config_read_unloaded_imports_no_plugin() -> None:
    document = {
        **BASE,
        "envs": [{"id": "agentflow/guess-number-v0", "reward": "agentflow.no_such:f"}],
        "agent": {"type": "python", "entry_point": "os:system"},
        "rollout": {"hooks": ["this:d"], "group_size": 4},
    }
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(document)
    assert [e["loc"] for e in info.value.errors()] == [
        ("envs", 0, "reward"),
        ("agent", "entry_point"),
        ("rollout", "hooks", 0),
    ]
    # A finished run's stream reads its stored config for the settings alone.
    config = RunConfig.model_validate(document, context=UNLOADED)
    assert config.agent.entry_point == "os:system" and config.rollout.group_size == 4


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


PLACED = {"ray": "local"}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"placement": {"engines": 3}}, "set placement.ray"),
        (
            {
                "placement": PLACED,
                "model": {"path": "/ckpt"},
                "engine": {"type": "sglang", "urls": ["http://s:1"]},
            },
            "engine actors start their SGLang servers",
        ),
        (
            {
                "placement": PLACED,
                "model": {"path": "/ckpt"},
                "engine": {"type": "sglang"},
                "weights": {"sync": "nccl"},
            },
            "set weights.sync = 'disk'",
        ),
        (
            {"placement": {**PLACED, "env_servers": 2}, "envs": [{"id": "my-registered-env"}]},
            "serves built-in envs",
        ),
        ({"placement": {**PLACED, "sglang_command": ["x", "{nope}"]}}, "placeholders are"),
        ({"placement": {**PLACED, "sglang_command": ["x", "--port", "9"]}}, "listen on {port}"),
        ({"placement": {"ray": "two words"}}, "not a Ray address"),
    ],
)
def test_placement_refusals_say_why(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        RunConfig.model_validate({**BASE, **patch})


def test_a_placed_sglang_engine_needs_no_urls() -> None:
    config = RunConfig.model_validate(
        {
            **BASE,
            "placement": {**PLACED, "engines": 4, "engine_gpus": 2, "env_servers": 1},
            "model": {"path": "/ckpt"},
            "engine": {"type": "sglang"},
        }
    )
    assert config.placement.engines == 4
    assert RunConfig.model_validate(config.model_dump(mode="json")) == config


def test_the_warm_start_plays_its_own_envs_and_a_new_mix_keeps_them() -> None:
    guess, vault = "agentflow/guess-number-v0", "agentflow/vault-v0"
    config = RunConfig.model_validate(
        {"name": "w", "envs": [{"id": guess}], "warm_start": {"enabled": True}}
    )
    with pytest.raises(ValidationError, match="not a built-in env"):
        RunConfig.model_validate(
            {
                "name": "w",
                "envs": [{"id": guess}],
                "warm_start": {"enabled": True, "envs": ["nope"]},
            }
        )
    grown = with_envs(config, [EnvEntry(id=guess), EnvEntry(id=vault)])
    assert [e.id for e in grown.envs] == [guess, vault]
    assert grown.warm_start.envs == [guess]  # what it played when the run started
    # A mix the run could not have been created with is refused naming the field.
    sharded = RunConfig.model_validate(
        {
            "name": "s",
            "envs": [{"id": guess, "max_concurrency": 4}],
            "rollout": {"controllers": 2, "max_concurrency": 4},
            "weights": {"sync": "disk"},
        }
    )
    with pytest.raises(InvalidInput, match=r"envs\.0\.max_concurrency \(1\) gives a shard no"):
        with_envs(sharded, [EnvEntry(id=guess, max_concurrency=1)])
