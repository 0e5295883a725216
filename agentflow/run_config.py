"""The run config (DESIGN §7a): one document for the CLI (TOML), the REST API (JSON) and tests.

Every field is documented and bounded so a malformed config fails before anything starts,
naming the field. Backends are `type`-discriminated so each gets only its own options.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator, model_validator

from agentflow.modeling import ModelInit

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    path: str = Field(default="", description="local HF-format checkpoint dir; empty: build")
    init: ModelInit = Field(default_factory=ModelInit, description="used when path is empty")


class LocalEngineConfig(_Section):
    type: Literal["local"] = "local"
    device: str = Field(default="cpu", description="`cpu`, `cuda`, `cuda:N`")
    max_batch_size: int = Field(default=64, ge=1, le=4096, description="sequences per step")
    kv_budget_tokens: int = Field(default=1 << 20, ge=1024, description="session KV budget")


class SGLangEngineConfig(_Section):
    type: Literal["sglang"] = "sglang"
    urls: list[AnyHttpUrl] = Field(
        min_length=1, description="an sglang-router, or the first server then the others"
    )
    behind_router: bool = Field(default=True, description="a single URL is an sglang-router")
    timeout_s: float = Field(default=600.0, gt=0, description="per-request timeout")
    max_context: int = Field(default=32768, ge=32, description="the served context length")


EngineConfig = Annotated[LocalEngineConfig | SGLangEngineConfig, Field(discriminator="type")]


class EnvEntry(_Section):
    id: str = Field(
        min_length=1,
        max_length=264,
        description="a built-in id (`namespace/Name-vN`) or a registered env `name[@version]`",
    )
    weight: float = Field(default=1.0, gt=0, description="share of episodes in the mix")
    max_concurrency: int = Field(default=64, ge=1, le=100_000, description="live episodes cap")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to the env")


class AgentConfig(_Section):
    type: Literal["whitebox", "http", "container"] = Field(default="whitebox")
    max_turns: int = Field(default=6, ge=1, le=1000, description="turn budget per episode")
    max_tokens: int = Field(default=512, ge=1, description="token budget per episode")
    max_new_tokens: int = Field(default=64, ge=1, description="tokens per policy turn")
    system_prompt: str | None = Field(default=None, description="prepended when the env has none")
    url: AnyHttpUrl | None = Field(default=None, description="agent service (type=http)")
    command: list[str] = Field(default_factory=list, description="agent program (container)")
    deadline_s: float = Field(default=600.0, gt=0, description="black-box episode deadline")
    reward: Literal["env", "agent", "external"] = Field(
        default="env",
        description="black-box reward: the env's verifier, the agent's report, or POST .../reward",
    )
    temperature: float = Field(default=1.0, ge=0, description="sampling temperature")

    @model_validator(mode="after")
    def _kind_fields(self) -> AgentConfig:
        if self.type == "http" and self.url is None:
            raise ValueError("agent.url is required when agent.type is 'http'")
        if self.type == "container" and not self.command:
            raise ValueError("agent.command is required when agent.type is 'container'")
        return self


class RolloutConfig(_Section):
    group_size: int = Field(default=8, ge=1, le=1024, description="samples per task")
    max_staleness: int = Field(
        default=2, ge=0, le=1000, description="versions a token may lag the trainer's policy"
    )
    wait_for_trainer: bool = Field(
        default=True,
        description="admit at most (max_staleness + 1) * trainer.batch_episodes episodes ahead "
        "of the trainer's version; false: collect without a trainer (no bound)",
    )
    max_reuse: int = Field(
        default=1, ge=1, le=100, description="times a trajectory may be trained on (replay)"
    )
    partial_rollout: bool = Field(
        default=True,
        description="a weight update interrupts running generations, which then continue "
        "with their partial output; false: the update waits for them to finish",
    )
    interrupt: Literal["retract", "abort"] = Field(
        default="retract",
        description="how an update interrupts (partial rollout): retract keeps requests "
        "queued in the engine, abort ends them and the gateway resubmits the rest",
    )
    stale_policy: Literal["drop", "downweight"] = Field(
        default="drop", description="what happens to a trajectory past max_staleness"
    )
    lease_s: float = Field(
        default=600.0, gt=0, le=86_400, description="how long a trainer's lease lasts"
    )
    max_concurrency: int = Field(default=256, ge=1, description="live episodes in total")
    elastic: bool = Field(
        default=False,
        description="adapt live episodes to measured engine load and env latency, "
        "between min_concurrency and max_concurrency",
    )
    min_concurrency: int = Field(default=4, ge=1, description="elastic pool floor")
    max_episodes: int | None = Field(
        default=None, ge=1, description="stop after this many episodes; None: until stopped"
    )
    max_consecutive_failures: int = Field(
        default=50, ge=1, description="fail the run after this many failed episodes in a row"
    )
    park_after_s: float | None = Field(
        default=5.0, ge=0, description="release a waiting session's KV after this; None: never"
    )

    @model_validator(mode="after")
    def _bounds(self) -> RolloutConfig:
        if self.elastic and self.min_concurrency > self.max_concurrency:
            raise ValueError("min_concurrency must not exceed max_concurrency")
        return self


class TrainerConfig(_Section):
    backend: Literal["torch", "megatron"] = "torch"
    algorithm: Literal["grpo", "ppo", "rtpo"] = Field(
        default="grpo",
        description="grpo: advantages (r - group mean) / group std; ppo: r - group mean; "
        "both with the decoupled PPO-clip loss. rtpo is not available yet",
    )
    batch_episodes: int = Field(default=64, ge=1, description="episodes per optimizer step")
    lr: float = Field(default=3e-4, gt=0, le=1.0, description="AdamW learning rate")
    steps: int = Field(default=200, ge=1, description="optimizer steps to run")
    clip_eps: float = Field(default=0.2, gt=0, le=1.0, description="PPO clip range")
    clip_eps_high: float | None = Field(
        default=None, gt=0, le=10.0, description="upper clip range; None: clip_eps"
    )
    decoupled: bool = Field(
        default=True,
        description="decoupled PPO: ratio against the trainer's proximal policy, times the "
        "behaviour importance weight; false: plain PPO against the engine's log-probs",
    )
    tis_cap: float | None = Field(
        default=2.0, ge=1.0, description="truncate behaviour importance weights; None: never"
    )
    kl_coef: float = Field(default=0.0, ge=0, description="KL to the reference policy")
    max_grad_norm: float = Field(default=1.0, gt=0)
    minibatches: int = Field(default=1, ge=1, le=256, description="optimizer steps per batch")
    max_tokens_per_microbatch: int = Field(
        default=16384, ge=64, description="tokens (padding included) per forward/backward"
    )
    device: str = Field(default="cpu", description="`cpu`, `cuda`, `cuda:N`")
    checkpoint_every: int = Field(
        default=10, ge=1, description="steps between checkpoints (batches are acknowledged then)"
    )
    keep_checkpoints: int = Field(default=2, ge=1, description="newest checkpoints kept")
    run_dir: str = Field(default="runs", description="run directories go under this path")
    threads: int | None = Field(
        default=None, ge=1, description="torch CPU threads; None: torch's default"
    )


class WarmStartConfig(_Section):
    """Supervised warm start on the env's scripted oracle, before RL (`agentflow sft`)."""

    enabled: bool = Field(default=False, description="run it when the run has no checkpoint")
    n_episodes: int = Field(default=20_000, ge=1, le=10_000_000, description="oracle episodes")
    p_oracle: float = Field(
        default=0.35, ge=0.0, le=1.0, description="chance of the oracle's move (else random)"
    )
    epochs: float = Field(default=2.0, gt=0, le=100, description="passes over the data")
    batch_size: int = Field(default=128, ge=1, le=65536, description="sequences per step")
    lr: float = Field(default=1e-3, gt=0, le=1.0, description="peak AdamW learning rate")
    warmup: float = Field(default=0.05, ge=0.0, lt=1.0, description="warm-up fraction")
    max_seconds: float | None = Field(default=None, gt=0, description="time cap; None: none")
    eval_episodes: int = Field(
        default=400, ge=0, le=1_000_000, description="sampled episodes to evaluate it on"
    )


class WeightsConfig(_Section):
    sync: Literal["inprocess", "disk", "nccl"] = "inprocess"
    dir: str = Field(default="", description="where `disk` sync writes shards")


class TeacherConfig(_Section):
    name: str = Field(min_length=1)
    path: str = Field(default="", description="local HF checkpoint")
    url: AnyHttpUrl | None = Field(default=None, description="remote engine")
    envs: list[str] = Field(default_factory=list, description="env ids this teacher serves")
    weight: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _one_source(self) -> TeacherConfig:
        if bool(self.path) == (self.url is not None):
            raise ValueError("give exactly one of path or url")
        return self


class RunConfig(_Section):
    """A whole run. `POST /v1/runs` takes this document as JSON."""

    name: str = Field(description="run name: letters, digits, `.`, `_`, `-`")
    seed: int = Field(default=0, ge=0)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=LocalEngineConfig)
    envs: list[EnvEntry] = Field(min_length=1, description="the env mix")
    agent: AgentConfig = Field(default_factory=AgentConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    teachers: list[TeacherConfig] = Field(default_factory=list)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must be 1-200 letters, digits, '.', '_' or '-'")
        return value


def load_run_config(path: str | Path) -> RunConfig:
    """Read a run config file: TOML, or JSON (the API's body) when it ends in `.json`.
    Raises pydantic.ValidationError naming the bad field, ValueError on bad syntax."""
    with open(path, "rb") as fh:
        if Path(path).suffix.lower() == ".json":
            try:
                document = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not JSON: {exc}") from None
            return RunConfig.model_validate(document)
        return RunConfig.model_validate(tomllib.load(fh))
