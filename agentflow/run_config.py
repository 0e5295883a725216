"""The run config (docs/architecture.md, "Run config"): one document for the CLI (TOML),
the REST API (JSON) and tests.

Every field is documented and bounded so a malformed config fails before anything starts,
naming the field. Backends are `type`-discriminated so each gets only its own options.

Every option either works or is refused here, at parse time: the values the schema names
for features not built yet (`megatron`, `nccl`, `kl_coef > 0`)
stay in the schema, so the docs show what is planned, but a validator refuses them with
"... is not available yet" (docs/runs.md has the table); so does an option that the
chosen kind would ignore (an agent option of another agent type, `weights.dir` without
disk sync). What depends on the process form (the embedded trainer drives a local engine
in process, the split trainer publishes by disk) or on the machine (a CUDA device) is
checked where the run starts, before anything runs.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agentflow.errors import InvalidInput
from agentflow.integers import Int32, Int64
from agentflow.modeling import ModelInit
from agentflow.plugins import load_function
from agentflow.tokenization.tool_calls import ToolCallStyle

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")

# The work that will make each refused option available (docs/runs.md has the table).
REFERENCE_MODEL = "the reference model"


def _not_available(what: str, planned: str, why: str = "") -> ValueError:
    """The one refusal of a planned option. Raised in the field's own validator, so pydantic
    names the field in `loc` (the API's 422 `body.trainer.algorithm`, the CLI's
    `trainer.algorithm: 'rtpo' is not available yet ...`): the message gives the value."""
    return ValueError(f"{what} is not available yet{why} (planned: {planned})")


# `RunConfig.model_validate(document, context=UNLOADED)`: a stored config read for its
# settings, not to run (a finished run's trajectory stream), imports no plug-in.
UNLOADED = {"load_plugins": False}


def _plugin(path: str, info: ValidationInfo) -> str:
    """A plug-in's dotted path must load (`agentflow.plugins`): refused at parse time,
    so the API's 422 and the CLI name the field, before anything runs."""
    if (info.context or {}).get("load_plugins", True):
        try:
            load_function(path, field=())
        except InvalidInput as exc:
            raise ValueError(exc.message) from None
    return path


def _name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError("must be 1-200 letters, digits, '.', '_' or '-'")
    return value


# A run's or a teacher's name: it names directories, metrics and errors.
Name = Annotated[str, AfterValidator(_name)]

# "package.module:function", imported from an allowed module when the config is parsed.
PluginPath = Annotated[str, AfterValidator(_plugin)]


def _check_device(value: str) -> str:
    if not _DEVICE.match(value):
        raise ValueError(f"must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    return value


def _default(model: type[BaseModel], name: str) -> object:
    return model.model_fields[name].default


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    path: str = Field(default="", description="local HF-format checkpoint dir; empty: build")
    init: ModelInit = Field(default_factory=ModelInit, description="used when path is empty")
    chat_template: str = Field(
        default="",
        description="a Jinja chat template replacing the checkpoint's: a file path, or the "
        "template itself (text with `{%` or `{{`)",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra variables for every rendering (e.g. enable_thinking = false)",
    )
    tool_call_format: ToolCallStyle | None = Field(
        default=None, description="how the model writes tool calls; None: what the template shows"
    )
    chat_history: Literal["append", "rerender"] = Field(
        default="append",
        description="black-box requests as token deltas after each recorded answer (exact "
        "contexts), or the template's rendering of the whole conversation (branches where "
        "the template rewrote history); docs/model-families.md",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_source(cls, value: str) -> str:
        if value and "{%" not in value and "{{" not in value and not Path(value).is_file():
            raise ValueError(f"no chat template file at {value!r}")
        return value

    @model_validator(mode="after")
    def _template_needs_checkpoint(self) -> ModelConfig:
        custom = self.chat_template or self.chat_template_kwargs or self.tool_call_format
        if custom and not self.path:
            raise ValueError(
                "chat_template, chat_template_kwargs and tool_call_format apply to a "
                "checkpoint's tokenizer (model.path); built models use the byte template"
            )
        return self

    def template_text(self) -> str | None:
        """The override template's text, read from its file when it is a path."""
        if not self.chat_template:
            return None
        if "{%" in self.chat_template or "{{" in self.chat_template:
            return self.chat_template
        return Path(self.chat_template).read_text()


class LocalEngineConfig(_Section):
    type: Literal["local"] = "local"
    device: str = Field(default="cpu", description="`cpu`, `cuda`, `cuda:N`")
    max_batch_size: Int64 = Field(default=64, ge=1, le=4096, description="sequences per step")
    kv_budget_tokens: Int64 = Field(default=1 << 20, ge=1024, description="session KV budget")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return _check_device(value)


class SGLangEngineConfig(_Section):
    type: Literal["sglang"] = "sglang"
    urls: list[AnyHttpUrl] = Field(
        default_factory=list,
        description="an sglang-router, or the first server then the others; empty when "
        "`[placement] ray` starts the servers as engine actors",
    )
    behind_router: bool = Field(default=True, description="a single URL is an sglang-router")
    timeout_s: float = Field(default=600.0, gt=0, description="per-request timeout")
    max_context: Int64 = Field(default=32768, ge=32, description="the served context length")


class VLLMLaunchConfig(_Section):
    """vLLM servers AgentFlow starts, watches, restarts and stops itself, on this machine
    (docs/inference.md, "VLLMEngine")."""

    python: str = Field(
        default=".venv-vllm/bin/python",
        min_length=1,
        description="the python of vLLM's own venv (`agentflow engine install-vllm`)",
    )
    servers: Int64 = Field(default=1, ge=1, le=64, description="servers, one pool")
    host: str = Field(default="127.0.0.1", min_length=1, description="where they listen")
    port: Int64 = Field(default=0, ge=0, le=65535, description="first port; 0: free ports")
    kv_cache_gib: Int64 = Field(default=1, ge=1, le=4096, description="KV cache per server, GiB")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        default="float32", description="weights and activations on the server"
    )
    max_model_len: Int64 | None = Field(
        default=None, ge=32, description="the served context; None: the checkpoint's"
    )
    threads: Int64 = Field(default=1, ge=1, le=1024, description="CPU threads per server")
    ready_s: float = Field(default=300.0, gt=0, description="how long a start may take")
    extra_args: list[str] = Field(
        default_factory=list, max_length=64, description="more `api_server` arguments"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="more environment for the server (VLLM_* settings, a plugin's path)",
    )

    @field_validator("env")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in value if not k or "=" in k or "\0" in k)
        if bad:
            raise ValueError(f"{bad} are not environment variable names")
        return value

    @field_validator("extra_args")
    @classmethod
    def _not_ours(cls, value: list[str]) -> list[str]:
        ours = {"--model", "--host", "--port", "--served-model-name", "--dtype"}
        taken = sorted({a.split("=", 1)[0] for a in value} & ours)
        if taken:
            raise ValueError(f"{taken} are set from the run's config, not extra_args")
        return value


class VLLMEngineConfig(_Section):
    type: Literal["vllm"] = "vllm"
    urls: list[AnyHttpUrl] = Field(
        default_factory=list,
        max_length=256,
        description="vLLM servers that already run (with VLLM_SERVER_DEV_MODE=1 and "
        "--enable-scale-out), one pool routed by session; empty: `launch` starts them",
    )
    launch: VLLMLaunchConfig | None = Field(
        default=None, description="start the servers from the run's checkpoint instead"
    )
    served_model_name: str | None = Field(
        default=None, max_length=200, description="the servers' --served-model-name"
    )
    timeout_s: float = Field(default=600.0, gt=0, description="per-request timeout")
    check_model: bool = Field(
        default=True,
        description="refuse servers whose model directory is not the run's model.path",
    )

    @model_validator(mode="after")
    def _urls_or_launch(self) -> VLLMEngineConfig:
        if bool(self.urls) == (self.launch is not None):
            raise ValueError(
                "give engine.urls (servers that run) or [engine.launch] (servers to start), "
                "one of the two"
            )
        return self


EngineConfig = Annotated[
    LocalEngineConfig | SGLangEngineConfig | VLLMEngineConfig, Field(discriminator="type")
]


class EnvEntry(_Section):
    id: str = Field(
        min_length=1,
        max_length=264,
        description="a built-in id (`namespace/Name-vN`) or a registered env `name[@version]`",
    )
    weight: float = Field(
        default=1.0, gt=0, allow_inf_nan=False, description="share of episodes in the mix"
    )
    max_concurrency: Int64 = Field(default=64, ge=1, le=100_000, description="live episodes cap")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="passed to a built-in env (`namespace/Name-vN`); a registered env takes "
        "its settings from its stored spec",
    )
    reward: PluginPath | None = Field(
        default=None,
        description="`pkg.mod:fn`, fn(RewardInput) -> float (sync or async): its value "
        "replaces the reward of this env's completed and truncated episodes",
    )

    @field_validator("kwargs")
    @classmethod
    def _kwargs_for_builtins(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        env_id = info.data.get("id")
        if value and env_id is not None:
            from envs.registry import ENV_ID

            if not ENV_ID.match(env_id):  # `name[@version]`: a registered env
                raise ValueError(
                    f"kwargs go to built-in envs only; {env_id!r} is a registered env, "
                    "whose settings are its stored spec"
                )
        return value


class EnvPatch(_Section):
    """One env of a mix change: added when the mix lacks it, else its fields as given."""

    id: str = Field(min_length=1, max_length=264, description="as in `envs[].id`")
    weight: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="new share (added: 1.0)"
    )
    max_concurrency: Int64 | None = Field(
        default=None, ge=1, le=100_000, description="new live episodes cap (added: 64)"
    )
    kwargs: dict[str, Any] | None = Field(
        default=None, description="a built-in env's arguments (only when it is added)"
    )
    reward: PluginPath | None = Field(default=None, description="as in `envs[].reward`")


class EnvMixChange(_Section):
    """A change of a live run's env mix (`PATCH /v1/runs/{id}`): either the whole new mix
    (`envs`), or edits of the current one (`set`, then `remove`). It applies to the groups
    admitted after it; episodes in flight finish in the env they started in."""

    revision: Int32 | None = Field(
        default=None,
        ge=0,
        description="the mix revision this change was made against: refused (409) when "
        "the run's mix has moved past it; without it, changes apply in the order they come",
    )
    envs: list[EnvEntry] | None = Field(
        default=None, min_length=1, max_length=1000, description="the whole new mix"
    )
    set: list[EnvPatch] = Field(default_factory=list, max_length=1000)
    remove: list[Annotated[str, Field(min_length=1, max_length=264)]] = Field(
        default_factory=list, max_length=1000, description="ids to take out of the mix"
    )

    @model_validator(mode="after")
    def _one_form(self) -> EnvMixChange:
        if self.envs is not None and (self.set or self.remove):
            raise ValueError("send either the whole mix (envs) or edits (set, remove), not both")
        if self.envs is None and not self.set and not self.remove:
            raise ValueError("nothing to change: give envs, set or remove")
        return self


class AgentConfig(_Section):
    type: Literal["whitebox", "http", "container", "python"] = Field(default="whitebox")
    max_turns: Int64 = Field(default=6, ge=1, le=1000, description="turn budget per episode")
    max_tokens: Int64 = Field(default=512, ge=1, description="token budget per episode")
    max_new_tokens: Int64 = Field(default=64, ge=1, description="tokens per policy turn")
    system_prompt: str | None = Field(default=None, description="prepended when the env has none")
    url: AnyHttpUrl | None = Field(default=None, description="agent service (type=http)")
    command: list[str] = Field(default_factory=list, description="agent program (container)")
    entry_point: str | None = Field(
        default=None,
        description="`pkg.mod:factory` (type=python): factory(AgentConfig) -> an Agent, "
        "called once per run",
    )
    deadline_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="black-box episode deadline (container: at most 3600, the sandbox's bound)",
    )
    reward: Literal["env", "agent", "external"] = Field(
        default="env",
        description="black-box reward: the env's verifier, the agent's report, or POST .../reward",
    )
    temperature: float = Field(default=1.0, ge=0, description="sampling temperature")

    # The fields of one agent type are refused with another, which would ignore them
    # (as the engine's options are, by its `type`). `type` comes first, so it is known.
    @field_validator("system_prompt")
    @classmethod
    def _prompt_is_whitebox(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("type")
        if value is not None and kind not in (None, "whitebox"):
            raise ValueError(
                f"agent type {kind!r} sends its own messages: system_prompt is for 'whitebox'"
            )
        return value

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, value: AnyHttpUrl | None, info: ValidationInfo) -> AnyHttpUrl | None:
        kind = info.data.get("type")
        if value is not None and kind not in (None, "http"):
            raise ValueError(f"url is the agent service of type 'http', not of {kind!r}")
        return value

    @field_validator("command")
    @classmethod
    def _command_is_container(cls, value: list[str], info: ValidationInfo) -> list[str]:
        kind = info.data.get("type")
        if value and kind not in (None, "container"):
            raise ValueError(f"command is the program of type 'container', not of {kind!r}")
        return value

    @field_validator("entry_point")
    @classmethod
    def _entry_point_is_python(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("type")
        if value is not None and kind not in (None, "python"):
            raise ValueError(f"entry_point is the factory of type 'python', not of {kind!r}")
        if value is not None and kind == "python":
            _plugin(value, info)
        return value

    @field_validator("deadline_s")
    @classmethod
    def _deadline_is_blackbox(cls, value: float, info: ValidationInfo) -> float:
        kind = info.data.get("type")
        if kind in ("whitebox", "python") and value != _default(cls, "deadline_s"):
            raise ValueError(f"a {kind} agent has no deadline: deadline_s is for http/container")
        if kind == "container" and value > 3600:
            raise ValueError("a container agent's deadline is at most 3600 s (the sandbox's)")
        return value

    @field_validator("reward")
    @classmethod
    def _reward_source(cls, value: str, info: ValidationInfo) -> str:
        kind = info.data.get("type")
        if value != "env" and kind in ("whitebox", "python"):
            raise ValueError(
                f"a {kind} agent's reward is the env's: reward = {value!r} is for "
                "black-box agents (http, container)"
            )
        return value

    @model_validator(mode="after")
    def _kind_fields(self) -> AgentConfig:
        if self.type == "http" and self.url is None:
            raise ValueError("agent.url is required when agent.type is 'http'")
        if self.type == "container" and not self.command:
            raise ValueError("agent.command is required when agent.type is 'container'")
        if self.type == "python" and self.entry_point is None:
            raise ValueError("agent.entry_point is required when agent.type is 'python'")
        return self


class RolloutConfig(_Section):
    group_size: Int64 = Field(default=8, ge=1, le=1024, description="samples per task")
    max_staleness: Int64 = Field(
        default=2, ge=0, le=1000, description="versions a token may lag the trainer's policy"
    )
    wait_for_trainer: bool = Field(
        default=True,
        description="admit at most (max_staleness + 1) * trainer.batch_episodes episodes ahead "
        "of the trainer's version; false: collect without a trainer (no bound)",
    )
    max_reuse: Int64 = Field(
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
    max_concurrency: Int64 = Field(default=256, ge=1, description="live episodes in total")
    controllers: Int64 = Field(
        default=1,
        ge=1,
        le=64,
        description="controller processes that play the run's episodes (shards; "
        "docs/architecture.md, 'Controller shards'): each plays whole groups with its "
        "share of the live episodes and of the engines, on the run's PostgreSQL database",
    )
    elastic: bool = Field(
        default=False,
        description="adapt live episodes to measured engine load and env latency, "
        "between min_concurrency and max_concurrency",
    )
    min_concurrency: Int64 = Field(default=4, ge=1, description="elastic pool floor")
    max_episodes: Int64 | None = Field(
        default=None, ge=1, description="stop after this many episodes; None: until stopped"
    )
    max_consecutive_failures: Int64 = Field(
        default=50, ge=1, description="fail the run after this many failed episodes in a row"
    )
    park_after_s: float | None = Field(
        default=5.0, ge=0, description="release a waiting session's KV after this; None: never"
    )
    hooks: list[PluginPath] = Field(
        default_factory=list,
        description="`pkg.mod:fn` each, fn(EpisodeEvent) -> None (sync or async), called "
        "once each episode is recorded; one that raises is logged and counted",
    )

    @model_validator(mode="after")
    def _bounds(self) -> RolloutConfig:
        if self.elastic and self.min_concurrency > self.max_concurrency:
            raise ValueError("min_concurrency must not exceed max_concurrency")
        return self


class LoraSettings(_Section):
    """Low-rank adapters (through `peft`) instead of full fine-tuning: only the adapters
    train; engines get the merged weights, checkpoints hold both."""

    rank: Int64 = Field(default=16, ge=1, le=4096, description="adapter rank r")
    alpha: float = Field(default=32.0, gt=0, description="scale: the update is alpha / r * BA")
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        min_length=1,
        description="module names that get adapters",
    )


class GatewayCallsConfig(_Section):
    """How the split trainer (`agentflow trainer`) times out and retries its calls to the
    gateway (docs/training.md, "When the gateway goes away").

    Each attempt has a deadline on the whole exchange (connect to the answer's last byte),
    shorter than the retry window, so a gateway that hangs is retried like one that died.
    Publishes get their own, longer deadline: the gateway answers a publish once its engines
    have loaded the new weights, and sends nothing before, so no inactivity timeout could
    tell a big model's load from a hung gateway; the deadline is a budget for that load.
    """

    retry_window_s: float = Field(
        default=300.0,
        gt=0,
        description="how long a call is retried from its first failed attempt; then the "
        "trainer exits 1 (`--retry-window-s` overrides it)",
    )
    attempt_timeout_s: float = Field(
        default=60.0, gt=0, description="each attempt of a call, whole; < retry_window_s"
    )
    publish_timeout_s: float = Field(
        default=240.0,
        gt=0,
        description="each attempt of a weights publish (the engines load the version before "
        "the gateway answers); < retry_window_s",
    )

    @model_validator(mode="after")
    def _inside_the_window(self) -> GatewayCallsConfig:
        for name in ("attempt_timeout_s", "publish_timeout_s"):
            value = getattr(self, name)
            if not value < self.retry_window_s:
                raise ValueError(
                    f"{name} ({value:g} s) must be shorter than retry_window_s "
                    f"({self.retry_window_s:g} s): one hung attempt would use up the window "
                    "before any retry"
                )
        return self


class TrainerConfig(_Section):
    backend: Literal["torch", "megatron"] = Field(
        default="torch",
        description="torch: an HF model on CPU or CUDA (FSDP2 with several ranks); megatron: "
        "megatron-core on CUDA, split by [megatron] (the split trainer, under torchrun)",
    )
    algorithm: Literal["grpo", "ppo", "turn_grpo", "rtpo"] = Field(
        default="grpo",
        description="grpo: advantages (r - group mean) / group std per trajectory; ppo: "
        "r - group mean; turn_grpo: per policy turn, its return-to-go against the group's "
        "turns at that position; rtpo: re-rolled continuations ([rtpo]) give each turn its "
        "own advantage, updated deepest turn first (trainer.credit); all with the "
        "decoupled PPO-clip loss. For multi-turn envs the credit study (docs/credit.md) "
        "advises grpo or turn_grpo with trainer.minibatches = the turns of an episode",
    )
    batch_episodes: Int64 = Field(default=64, ge=1, description="episodes per optimizer step")
    lr: float = Field(default=3e-4, gt=0, le=1.0, description="AdamW learning rate")
    betas: tuple[float, float] = Field(
        default=(0.9, 0.999),
        description="AdamW betas; a lower second (0.95) bounds the step a sudden gradient "
        "takes after a long quiet stretch (docs/distillation.md)",
    )
    adam_eps: float = Field(default=1e-8, gt=0, le=1.0, description="AdamW epsilon")
    # Each step publishes the next weight version, a 32-bit column (agentflow.integers).
    steps: Int32 = Field(default=200, ge=1, description="optimizer steps to run")
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
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="KL to the reference policy; > 0 is not available yet (no reference model)",
    )
    max_grad_norm: float = Field(default=1.0, gt=0)
    minibatches: Int64 = Field(default=1, ge=1, le=256, description="optimizer steps per batch")
    max_tokens_per_microbatch: Int64 = Field(
        default=16384, ge=64, description="tokens (padding included) per forward/backward"
    )
    device: str = Field(default="cpu", description="`cpu`, `cuda`, `cuda:N`")
    ranks: Int64 = Field(
        default=1,
        ge=1,
        le=1024,
        description="trainer processes (split form): > 1 shards the model with FSDP2 over "
        "torchrun, one rank per GPU (gloo ranks on CPU); rank 0 leases for all",
    )
    checkpoint_every: Int64 = Field(
        default=10, ge=1, description="steps between checkpoints (batches are acknowledged then)"
    )
    keep_checkpoints: Int64 = Field(default=2, ge=1, description="newest checkpoints kept")
    run_dir: str = Field(default="runs", description="run directories go under this path")
    threads: Int64 | None = Field(
        default=None, ge=1, description="torch CPU threads; None: torch's default"
    )
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32", description="bf16: forward passes under bf16 autocast"
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute layer activations in the backward pass"
    )
    lora: LoraSettings | None = Field(default=None, description="train adapters only (peft)")
    gateway: GatewayCallsConfig = Field(
        default_factory=GatewayCallsConfig,
        description="the split trainer's calls to the gateway: deadlines and retry window",
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value

    @field_validator("kl_coef")
    @classmethod
    def _kl_coef(cls, value: float) -> float:
        if value > 0:
            raise _not_available("kl_coef > 0", REFERENCE_MODEL, ": there is no reference model")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return _check_device(value)


class MegatronConfig(_Section):
    """`trainer.backend = "megatron"`: how the model is split over the trainer's ranks
    (`trainer.ranks` = tensor × pipeline × data parallel)."""

    tensor_parallel: Int64 = Field(default=1, ge=1, le=64, description="ranks a layer spans")
    pipeline_parallel: Int64 = Field(default=1, ge=1, le=64, description="stages of layers")
    sequence_parallel: bool = Field(
        default=False, description="split activations along the sequence (tensor_parallel > 1)"
    )
    distributed_optimizer: bool = Field(
        default=True, description="shard Adam's state over the data-parallel ranks"
    )
    vocab_divisible_by: Int64 = Field(
        default=128, ge=1, le=65536, description="pad the vocabulary to a multiple of this × tp"
    )


class WarmStartConfig(_Section):
    """Supervised warm start on the env's scripted oracle, before RL (`agentflow sft`)."""

    enabled: bool = Field(default=False, description="run it when the run has no checkpoint")
    n_episodes: Int64 = Field(default=20_000, ge=1, le=10_000_000, description="oracle episodes")
    p_oracle: float = Field(
        default=0.35, ge=0.0, le=1.0, description="chance of the oracle's move (else random)"
    )
    min_reward: float | None = Field(
        default=None,
        description="train only on oracle episodes with at least this reward; None: all",
    )
    epochs: float = Field(default=2.0, gt=0, le=100, description="passes over the data")
    batch_size: Int64 = Field(default=128, ge=1, le=65536, description="sequences per step")
    lr: float = Field(default=1e-3, gt=0, le=1.0, description="peak AdamW learning rate")
    warmup: float = Field(default=0.05, ge=0.0, lt=1.0, description="warm-up fraction")
    max_seconds: float | None = Field(default=None, gt=0, description="time cap; None: none")
    eval_episodes: Int64 = Field(
        default=400, ge=0, le=1_000_000, description="sampled episodes to evaluate it on"
    )
    concurrency: Int64 = Field(
        default=1, ge=1, le=4096, description="episodes played at once (browser envs wait)"
    )
    envs: list[Annotated[str, Field(min_length=1, max_length=264)]] = Field(
        default_factory=list,
        max_length=100,
        description="built-in env ids whose oracles it plays, in turn; empty: every env of "
        "the mix (a run whose mix will grow while it trains can warm-start on the envs to come)",
    )


class BroadcastConfig(_Section):
    """`sync = "nccl"`: how the trainer broadcasts weights (trainer/broadcast_sync.py)."""

    backend: Literal["nccl", "gloo"] = Field(
        default="nccl",
        description="nccl between GPUs; gloo moves CPU tensors (tests, CPU trainers)",
    )
    master_address: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="the trainer's address as the engines reach it (it serves the group's store)",
    )
    master_port: Int64 = Field(default=0, ge=0, le=65535, description="0: a free port")
    bucket_mb: float = Field(
        default=512.0, gt=0, le=65536, description="tensors per broadcast call, in MiB"
    )
    timeout_s: float = Field(
        default=600.0, gt=0, description="forming the group, and each bucket's broadcast"
    )


class WeightsConfig(_Section):
    sync: Literal["inprocess", "disk", "nccl"] = Field(
        default="inprocess",
        description="inprocess: the embedded trainer's local engine; disk: safetensors the "
        "engines load (the split trainer); nccl: the split trainer broadcasts to SGLang "
        "engines over a process group ([weights.broadcast])",
    )
    dir: str = Field(
        default="", description="where `disk` sync writes shards; empty: RUN_DIR/weights"
    )
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)

    @field_validator("dir")
    @classmethod
    def _dir_is_disk(cls, value: str, info: ValidationInfo) -> str:
        sync = info.data.get("sync")
        if value and sync not in (None, "disk"):
            raise ValueError(f"only disk sync writes here; with sync = {sync!r} nothing is")
        return value

    @model_validator(mode="after")
    def _broadcast_is_nccl(self) -> WeightsConfig:
        if self.sync != "nccl" and self.broadcast != BroadcastConfig():
            raise ValueError(f"[weights.broadcast] is for sync = 'nccl', not {self.sync!r}")
        return self


class TeacherConfig(_Section):
    """One teacher of on-policy distillation (`trainer.teachers`): a local HF checkpoint
    loaded into the trainer, or an SGLang engine that scores over HTTP."""

    name: Name = Field(description="the teacher's name in metrics and errors")
    path: str = Field(default="", description="local HF-format checkpoint directory")
    url: AnyHttpUrl | None = Field(
        default=None, description="an SGLang server (or router) serving the teacher"
    )
    envs: list[str] = Field(
        default_factory=list, description="env ids whose episodes this teacher scores"
    )
    tags: list[str] = Field(
        default_factory=list,
        description="turn tags (what `distill.rule` answers) this teacher scores; its name "
        "is always one of them",
    )
    weight: float = Field(
        default=1.0, gt=0, description="share of episodes when several teachers cover an env"
    )
    timeout_s: float = Field(default=120.0, gt=0, le=3600, description="url: per-request timeout")

    @model_validator(mode="after")
    def _one_source(self) -> TeacherConfig:
        if bool(self.path) == (self.url is not None):
            raise ValueError("give exactly one of path or url")
        if self.path and self.timeout_s != _default(TeacherConfig, "timeout_s"):
            raise ValueError("timeout_s is for a teacher engine (url), not a checkpoint")
        return self


# The built-in per-turn routing rule: the first word of a turn's observation's last
# sentence names its skill (`agentflow.turn_rules`).
DEFAULT_TURN_RULE = "agentflow.turn_rules:command_word"


class DistillConfig(_Section):
    """How teachers' scores enter the loss (`trainer.teachers`, docs/distillation.md)."""

    coef: float = Field(default=1.0, gt=0, le=1000, description="weight of the reverse-KL term")
    rl: bool = Field(
        default=True,
        description="keep the RL objective (the KL term is added to it); false: distil alone",
    )
    estimator: Literal["sampled", "full"] = Field(
        default="sampled",
        description="sampled: the teacher's log-prob of each sampled token (any teacher); "
        "full: the exact reverse KL over the whole vocabulary at each sampled position "
        "(local teachers only; holds vocab floats per policy token)",
    )
    route: Literal["episode", "turn"] = Field(
        default="episode",
        description="episode: one teacher per episode, by its env; turn: each policy turn "
        "by `rule` (a turn the rule leaves open falls back to its episode's teacher)",
    )
    rule: PluginPath | None = Field(
        default=None,
        description="`pkg.mod:fn`, fn(TurnContext) -> tag or None: the per-turn routing "
        f"rule; route = 'turn' without one: {DEFAULT_TURN_RULE}",
    )
    max_resident: Int64 = Field(
        default=1, ge=1, le=64, description="local teachers held in memory at once (LRU)"
    )
    offload: Literal["drop", "cpu"] = Field(
        default="drop",
        description="an evicted teacher: dropped (reloaded from its path) or moved to CPU "
        "memory (a CUDA trainer only)",
    )
    max_tokens_per_batch: Int64 = Field(
        default=16384, ge=64, description="tokens (padding included) per teacher forward"
    )

    @model_validator(mode="after")
    def _rule_for_turns(self) -> DistillConfig:
        if self.route == "episode" and self.rule is not None:
            raise ValueError("rule routes turns: set route = 'turn' to use it")
        return self

    @property
    def turn_rule(self) -> str:
        """The per-turn routing rule in force (route = 'turn')."""
        return self.rule or DEFAULT_TURN_RULE


class RtpoConfig(_Section):
    """RTPO's re-rolls (`trainer.algorithm = "rtpo"`, `trainer.credit`)."""

    branches: Int64 = Field(
        default=1, ge=1, le=16, description="continuations re-rolled from each chosen turn"
    )
    branch_turns: Int64 | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="how many policy turns after the first each episode re-rolls from, "
        "drawn at random; None: every one",
    )
    update: Literal["reverse", "joint"] = Field(
        default="reverse",
        description="reverse: one optimizer step per turn depth, deepest first (RTPO); "
        "joint: the same turns and advantages in one step (an ablation, bench/rtpo.py)",
    )


# SGLang's server as the engines need it: ids in and out, sessions with a radix cache.
SGLANG_LAUNCH = (
    "{python}",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "{model_path}",
    "--host",
    "{host}",
    "--port",
    "{port}",
    "--tp-size",
    "{tp}",
    "--skip-tokenizer-init",
    "--enable-session-radix-cache",
)


class PlacementConfig(_Section):
    """Where a run's parts run (docs/ray.md). Empty `ray`: all in the gateway's process;
    otherwise the run's inference engines are Ray actors behind the gateway (routed by
    session, replaced when they die), and `agentflow train --ray` also places the
    trainer's ranks and the env servers as actors."""

    ray: str = Field(
        default="",
        max_length=500,
        description="'' (no Ray), 'local' (start a Ray cluster on this machine, on "
        "loopback), 'auto' (the cluster this machine belongs to) or a cluster address",
    )
    engines: Int64 = Field(default=2, ge=1, le=4096, description="engine actors")
    engine_cpus: float = Field(default=1.0, gt=0, description="CPUs each engine actor holds")
    engine_gpus: float = Field(default=0.0, ge=0, description="GPUs each engine actor holds")
    trainer_cpus: float = Field(default=1.0, gt=0, description="CPUs each trainer rank holds")
    trainer_gpus: float = Field(default=0.0, ge=0, description="GPUs each trainer rank holds")
    env_servers: Int64 = Field(
        default=0,
        ge=0,
        le=4096,
        description="env-server actors per built-in env of the mix (0: envs run in the "
        "gateway's process); episodes are spread over them",
    )
    env_cpus: float = Field(default=1.0, gt=0, description="CPUs each env-server actor holds")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK", description="the placement groups' strategy (Ray's names)"
    )
    max_engine_replacements: Int64 = Field(
        default=8, ge=0, description="engine actors replaced after dying, over the run"
    )
    max_trainer_restarts: Int64 = Field(
        default=3,
        ge=0,
        description="times the trainer's ranks start again (from the newest checkpoint) "
        "after one of their actors died",
    )
    object_store_mb: Int64 = Field(
        default=1024, ge=100, description="object store of a 'local' cluster (MiB)"
    )
    sglang_command: list[str] = Field(
        default_factory=lambda: list(SGLANG_LAUNCH),
        min_length=1,
        description="how an engine actor starts its SGLang server (engine.type = 'sglang'); "
        "{python}, {model_path}, {host}, {port} and {tp} (engine_gpus) are filled in",
    )
    sglang_ready_s: float = Field(
        default=900.0, gt=0, description="how long a starting SGLang server may take"
    )

    @field_validator("sglang_command")
    @classmethod
    def _placeholders(cls, value: list[str]) -> list[str]:
        known = {"python": "", "model_path": "", "host": "", "port": "", "tp": ""}
        for part in value:
            try:
                part.format(**known)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"{part!r}: placeholders are {{python}}, {{model_path}}, {{host}}, "
                    f"{{port}} and {{tp}} ({type(exc).__name__}: {exc})"
                ) from None
        if not any("{port}" in part for part in value):
            raise ValueError("the server must listen on {port}, which its actor picks")
        return value

    @field_validator("ray")
    @classmethod
    def _address(cls, value: str) -> str:
        value = value.strip()
        if value and any(c.isspace() for c in value):
            raise ValueError(f"{value!r} is not a Ray address ('local', 'auto' or host:port)")
        return value


def _unshardable(config: RunConfig, count: int) -> str | None:
    """Why a run cannot be split over `count` controller shards, or None."""
    if config.agent.type in ("http", "container"):
        return (
            f"a {config.agent.type!r} agent calls the gateway back, where its sessions must "
            "live; shards play white-box and python agents"
        )
    if config.placement.ray:
        return "shards run as processes beside the gateway, not yet under [placement] ray"
    if config.weights.sync != "disk":
        return "each shard loads published weights from a directory: set weights.sync = 'disk'"
    rollout = config.rollout
    if rollout.max_concurrency < count:
        return f"rollout.max_concurrency ({rollout.max_concurrency}) gives a shard no episode"
    if rollout.elastic and rollout.min_concurrency < count:
        return f"rollout.min_concurrency ({rollout.min_concurrency}) gives a shard no episode"
    for i, entry in enumerate(config.envs):
        if entry.max_concurrency < count:
            return f"envs.{i}.max_concurrency ({entry.max_concurrency}) gives a shard no episode"
    engine = config.engine
    if isinstance(engine, VLLMEngineConfig) and engine.launch is not None:
        return "launched vLLM servers belong to one controller: list the servers in engine.urls"
    if isinstance(engine, (SGLangEngineConfig, VLLMEngineConfig)) and len(engine.urls) < count:
        return (
            f"each shard drives its own engine servers: engine.urls lists {len(engine.urls)} "
            "(one server's pauses and weight switches would reach another shard's requests)"
        )
    return None


def shard_config(config: RunConfig, index: int, count: int) -> RunConfig:
    """Controller shard `index` of `count`'s part of the run: its share of the live
    episodes (and of each env's cap) and of the engine servers; one scheduler."""

    def share(total: int) -> int:
        return total // count + (1 if index < total % count else 0)

    rollout = config.rollout.model_copy(
        update={
            "controllers": 1,
            "max_concurrency": share(config.rollout.max_concurrency),
            "min_concurrency": share(config.rollout.min_concurrency),
        }
    )
    envs = [e.model_copy(update={"max_concurrency": share(e.max_concurrency)}) for e in config.envs]
    engine: EngineConfig = config.engine
    if isinstance(engine, (SGLangEngineConfig, VLLMEngineConfig)):
        engine = engine.model_copy(update={"urls": engine.urls[index::count]})
    return config.model_copy(update={"rollout": rollout, "envs": envs, "engine": engine})


class RunConfig(_Section):
    """A whole run. `POST /v1/runs` takes this document as JSON."""

    name: Name = Field(description="run name: letters, digits, `.`, `_`, `-`")
    seed: Int64 = Field(default=0, ge=0)
    model: ModelConfig = Field(default_factory=ModelConfig)
    # Before the engine: whether the engine's servers are listed or started depends on it.
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    engine: EngineConfig = Field(default_factory=LocalEngineConfig)
    envs: list[EnvEntry] = Field(min_length=1, description="the env mix")
    agent: AgentConfig = Field(default_factory=AgentConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    teachers: list[TeacherConfig] = Field(
        default_factory=list, description="on-policy distillation (docs/distillation.md)"
    )
    distill: DistillConfig = Field(default_factory=DistillConfig)
    rtpo: RtpoConfig = Field(default_factory=RtpoConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    logger: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="trackers the step metrics also go to (trainer/loggers.py); "
        "metrics.jsonl is always written",
    )

    @field_validator("logger")
    @classmethod
    def _distinct_loggers(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("each logger at most once")
        return value

    @field_validator("engine")
    @classmethod
    def _engine_model(
        cls, value: LocalEngineConfig | SGLangEngineConfig | VLLMEngineConfig, info: ValidationInfo
    ) -> Any:
        model = info.data.get("model")
        if isinstance(value, SGLangEngineConfig) and model is not None and not model.path:
            raise ValueError(
                "an sglang engine needs model.path (its tokenizer must match the server's); "
                "model.init builds a model only for the local engine"
            )
        placement = info.data.get("placement")
        placed = placement is not None and bool(placement.ray)
        if isinstance(value, SGLangEngineConfig) and not value.urls and not placed:
            raise ValueError(
                "engine.urls: list the SGLang servers (or a router), or set "
                "[placement] ray to start them as engine actors"
            )
        if isinstance(value, VLLMEngineConfig) and placed:
            if value.launch is None:
                raise ValueError(
                    "engine.urls: with [placement] ray the engine actors start their vLLM "
                    "servers from [engine.launch]; give that instead"
                )
            if value.launch.servers != 1:
                raise ValueError(
                    "engine.launch.servers: with [placement] ray each engine actor starts one "
                    "server; set placement.engines for more"
                )
        if isinstance(value, SGLangEngineConfig) and value.urls and placed:
            raise ValueError(
                "engine.urls: with [placement] ray the engine actors start their SGLang "
                "servers; leave it empty"
            )
        return value

    @field_validator("weights")
    @classmethod
    def _broadcast_reaches_sglang(cls, value: WeightsConfig, info: ValidationInfo) -> Any:
        engine = info.data.get("engine")
        if engine is not None and engine.type == "vllm" and value.sync != "disk":
            raise ValueError(
                f"a vLLM engine loads weights from a directory: sync = 'disk', not {value.sync!r}"
            )
        if value.sync == "nccl" and engine is not None and engine.type != "sglang":
            raise ValueError(
                "sync = 'nccl' broadcasts to SGLang engines; a local engine takes weights "
                "in process (inprocess) or from disk"
            )
        return value

    @model_validator(mode="after")
    def _vllm_serves_a_checkpoint(self) -> RunConfig:
        if self.engine.type != "vllm" or self.model.path:
            return self
        if not self.warm_start.enabled:
            raise ValueError(
                "a vllm engine serves a checkpoint: set model.path, or model.init with "
                "[warm_start] enabled (the warm start writes the checkpoint it serves)"
            )
        if isinstance(self.engine, VLLMEngineConfig) and self.engine.urls:
            raise ValueError(
                "engine.urls: servers that already run cannot serve the warm start's "
                "checkpoint; use [engine.launch], or set model.path to what they serve"
            )
        return self

    @model_validator(mode="after")
    def _shards_can_split_the_run(self) -> RunConfig:
        """What controller shards cannot share is refused here, naming the setting."""
        count = self.rollout.controllers
        if count == 1:
            return self
        why = _unshardable(self, count)
        if why is not None:
            raise ValueError(f"rollout.controllers = {count}: {why}")
        return self

    @model_validator(mode="after")
    def _megatron_split(self) -> RunConfig:
        if self.trainer.backend != "megatron":
            if self.megatron != MegatronConfig():
                raise ValueError("[megatron] is for trainer.backend = 'megatron'")
            return self
        split = self.megatron.tensor_parallel * self.megatron.pipeline_parallel
        if self.trainer.ranks % split:
            raise ValueError(
                f"trainer.ranks ({self.trainer.ranks}) must be a multiple of "
                f"megatron.tensor_parallel × pipeline_parallel ({split})"
            )
        if self.trainer.lora is not None or self.trainer.minibatches != 1:
            raise ValueError("the Megatron backend trains all weights, one step per batch")
        if self.teachers:
            raise ValueError("distillation is not available with the Megatron backend yet")
        return self

    @model_validator(mode="after")
    def _placement(self) -> RunConfig:
        placement = self.placement
        if not placement.ray:
            if placement != PlacementConfig():
                raise ValueError("[placement] places the run on Ray: set placement.ray")
            return self
        if self.weights.sync == "nccl":
            raise ValueError(
                "weights reach placed engines from disk (a path every node sees): "
                "set weights.sync = 'disk'"
            )
        if placement.env_servers and any(e.id not in _builtin_env_ids() for e in self.envs):
            raise ValueError(
                "placement.env_servers serves built-in envs; a registered env already "
                "runs where its spec points"
            )
        return self

    @model_validator(mode="after")
    def _rerender_is_black_box(self) -> RunConfig:
        if self.model.chat_history == "rerender" and self.agent.type == "whitebox":
            raise ValueError(
                "model.chat_history = 'rerender' is for black-box agents, which resend the "
                "conversation; the white-box loop appends token deltas"
            )
        return self

    @model_validator(mode="after")
    def _rtpo(self) -> RunConfig:
        if self.trainer.algorithm != "rtpo":
            if self.rtpo != RtpoConfig():
                raise ValueError("[rtpo] configures re-rolls: set trainer.algorithm = 'rtpo'")
            return self
        if self.agent.type != "whitebox":
            raise ValueError(
                "rtpo re-rolls continuations by replaying the env in process: "
                f"agent.type must be 'whitebox', not {self.agent.type!r}"
            )
        if self.teachers:
            raise ValueError("rtpo with teachers is not available yet: use grpo or turn_grpo")
        if any(e.reward is not None for e in self.envs):
            raise ValueError(
                "rtpo needs each continuation's own return: an envs[].reward function "
                "scores whole episodes"
            )
        return self

    def samples_per_group(self) -> int:
        """Trajectories one group yields: `group_size` episodes, and with rtpo each one's
        re-rolls (`branches` per turn after the first, or per `branch_turns`): what
        `trainer.batch_episodes` counts, re-rolls included."""
        size = self.rollout.group_size
        if self.trainer.algorithm != "rtpo":
            return size
        turns = self.agent.max_turns - 1
        if self.rtpo.branch_turns is not None:
            turns = min(turns, self.rtpo.branch_turns)
        return size * (1 + self.rtpo.branches * turns)

    @model_validator(mode="after")
    def _teachers(self) -> RunConfig:
        if not self.teachers:
            if self.distill != DistillConfig():  # a stored config spells the defaults out
                raise ValueError("[distill] configures teachers: add [[teachers]] or remove it")
            return self
        names = [t.name for t in self.teachers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"teacher names must be unique: {', '.join(twice)} repeated")
        remote = [t.name for t in self.teachers if t.url is not None]
        if self.distill.estimator == "full" and remote:
            raise ValueError(
                f"distill.estimator = 'full' needs every teacher's full distribution, and "
                f"{', '.join(remote)} score over HTTP (sampled tokens only): use 'sampled'"
            )
        mix = {e.id for e in self.envs}
        for teacher in self.teachers:
            if not teacher.envs and not teacher.tags and self.distill.route == "episode":
                raise ValueError(
                    f"teacher {teacher.name!r} covers no env: list the env ids it scores "
                    "in envs (or route turns to its tags)"
                )
            stray = [e for e in teacher.envs if e not in mix]
            if stray:
                raise ValueError(
                    f"teacher {teacher.name!r} covers {', '.join(stray)}, which the run's "
                    f"envs do not include ({', '.join(sorted(mix))})"
                )
        # A checkpoint's presence and vocabulary are the trainer's to check
        # (`trainer.teachers.check_teachers`): the gateway never loads a teacher, and
        # its file system may not hold the path.
        return self

    @field_validator("warm_start")
    @classmethod
    def _warm_start_env(cls, value: WarmStartConfig, info: ValidationInfo) -> WarmStartConfig:
        envs = info.data.get("envs")
        if value.enabled:
            # The warm start plays its own envs, else every env of the mix.
            for env_id in value.envs or [e.id for e in envs or ()]:
                check_warm_start_env(env_id, value.p_oracle)
        return value


def _builtin_env_ids() -> list[str]:
    from envs import registry

    return registry.registered()


def check_warm_start_env(env_id: str, p_oracle: float) -> None:
    """The warm start plays each env's noisy oracle (`trainer.sft.noisy_policy`):
    a built-in registry env with an oracle, and a `noisy_oracle` unless p_oracle is 1.
    Raises ValueError saying what is missing."""
    from envs import registry
    from envs.base import EnvError

    try:
        entry = registry.spec(env_id)
    except EnvError:
        with_oracle = [e for e in registry.registered() if registry.spec(e).oracle is not None]
        raise ValueError(
            f"the warm start plays each env's scripted oracle, and {env_id!r} is not a "
            f"built-in env (those with an oracle: {', '.join(with_oracle)})"
        ) from None
    if entry.oracle is None:
        raise ValueError(f"the warm start needs a scripted oracle, and {env_id!r} has none")
    if p_oracle >= 1.0:
        return
    if registry.noisy_oracle_factory(env_id) is None:
        raise ValueError(
            f"{env_id!r} has no noisy oracle (its module has no `noisy_oracle`): "
            "set warm_start.p_oracle = 1"
        )


def check_device(device: str, field: tuple[str, ...]) -> None:
    """A CUDA device the config names must exist on this machine: refused here, naming the
    field, rather than failing inside torch (the config's parse checks the spelling)."""
    if not device.startswith("cuda"):
        return
    import torch  # only here: parsing a config needs no torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise InvalidInput(
            f"{device!r}: this machine has {count} CUDA device(s); use 'cpu'"
            if count == 0
            else f"{device!r}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})",
            field=field,
        )


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


def with_envs(config: RunConfig, envs: list[EnvEntry]) -> RunConfig:
    """`config` with another env mix, checked whole as a new run's config is (a teacher
    that names an env the mix lost, a cap that gives a controller shard no episode, ...):
    InvalidInput naming the field."""
    document = config.model_dump(mode="json")
    document["envs"] = [e.model_dump(mode="json") for e in envs]
    warm = document["warm_start"]
    if warm["enabled"] and not warm["envs"]:  # it played the mix it started with
        warm["envs"] = [e.id for e in config.envs]
    try:
        return RunConfig.model_validate(document)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise InvalidInput(
            f"the run with this mix: {error['msg']}", field=tuple(str(p) for p in error["loc"])
        ) from None
