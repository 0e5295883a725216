"""The `torch` trainer backend: an HF causal LM on CPU or CUDA, AdamW, one step per batch.

    TorchPolicy(model, config)
      .train_step(trajectories, advantages, algorithm) -> metrics
      .logprobs(microbatch, temperature)               -> (rows, width) log-probs
      .state_dict()                                    -> HF names → tensors, for weight sync
      .save_checkpoint(dir, step, version, extra) / .load_checkpoint(dir)

A step: lay the batch out as micro-batches (`trainer.batching`), compute what must be
fixed before the update with no grad (proximal log-probs when needed, reference
log-probs for a KL term), then per micro-batch the loss (`trainer.algorithms`) and its
backward, accumulating gradients; clip; AdamW step. With `algorithm.minibatches > 1` the
batch is split and each part takes its own optimizer step.

The proximal pass: π_prox is the weights before the update. With one optimizer step per
batch (the default) every micro-batch's gradient pass runs on exactly those weights, so
its own detached log-probs *are* the proximal log-probs and a separate forward would
recompute the same numbers (`proximal = "auto"` skips it; `"recompute"` runs it anyway).
With several mini-batches the later ones run on updated weights, so the pass is needed.

Log-probs are `agentflow.modeling.token_logprobs` of the logits at the predicting
positions, the same function the engine's scores use. The LM head runs only on the
positions that are needed (policy tokens), not the whole grid: with a large vocabulary
the full logits are the biggest tensor of the step. The model stays in eval mode: RL
ratios need a deterministic forward (no dropout); gradients flow all the same.

Distributed (FSDP2): when `torch.distributed` is initialised with more than one rank
(NCCL on CUDA, gloo on CPU), each decoder layer and then the root are wrapped with
`fully_shard`; the forward runs through the root module (hooks gather the shards) and
takes the logits of the needed positions from it; gradients are reduced only on a
mini-batch's last micro-batch, summed, not averaged: the token-mean denominator is
already the global policy-token count, so the sum is the full batch's gradient; every
rank runs the same number of micro-batches (short ranks repeat one with zero loss
weight, as FSDP's collectives need every rank); state dicts are gathered full on CPU and
rank 0 writes checkpoints. `tests/integration/trainer/test_fsdp.py` runs it on two CPU
ranks against one process on the whole batch.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from pydantic import BaseModel, ConfigDict, Field

from agentflow.errors import InvalidInput, NotFound
from agentflow.modeling import (
    MODEL_INIT_FILE,
    load_model,
    save_model,
    save_tokenizer_files,
    token_logprobs,
)
from agentflow.run_config import LoraSettings
from agentflow.types import Trajectory
from trainer.algorithms import (
    AlgorithmConfig,
    DistillLoss,
    distill_terms,
    policy_loss,
    teacher_metrics,
)
from trainer.batching import Advantage, BatchingConfig, MicroBatch, build_microbatches

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainer.teachers import TeacherScores

CHECKPOINT_FORMAT = 1
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
MODEL_DIR = "model"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class TorchBackendConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(default="cpu", description="`cpu`, `cuda` or `cuda:N`")
    lr: float = Field(default=3e-4, gt=0, le=1.0, description="AdamW learning rate")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(default=1.0, gt=0, description="clip the global grad norm")
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="bf16: forward passes under bf16 autocast (weights, gradients and the "
        "optimizer stay fp32; log-probs are taken in fp32 from bf16 logits)",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute each layer's activations in the backward pass"
    )
    lora: LoraSettings | None = Field(default=None, description="train low-rank adapters only")


def _autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class TorchPolicy:
    """The trained policy; `reference` (frozen) is only needed for a KL term."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: TorchBackendConfig | None = None,
        *,
        reference: PreTrainedModel | None = None,
    ) -> None:
        self.config = config or TorchBackendConfig()
        self.device = torch.device(self.config.device)
        if self.config.lora is not None:
            if _distributed():
                raise InvalidInput(
                    "LoRA is not available with several trainer ranks yet", field="lora"
                )
            model = _with_adapters(model, self.config.lora)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.reference = None if reference is None else reference.to(self.device).eval()  # type: ignore[arg-type]
        if self.reference is not None:
            self.reference.requires_grad_(False)
        self.sharded = _distributed()
        # Which share of a batch this rank trains (trainer/ranks.py): every FSDP rank its own.
        self.data_rank = torch.distributed.get_rank() if self.sharded else 0
        self.data_ranks = torch.distributed.get_world_size() if self.sharded else 1
        if self.config.gradient_checkpointing:
            self._checkpoint_layers()
        if self.sharded:
            self._shard()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.adam_eps,
            weight_decay=self.config.weight_decay,
        )
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])

    # -- forward ------------------------------------------------------------------------

    def _checkpoint_layers(self) -> None:
        """HF checkpoints a layer only in training mode; `_training` switches to it for the
        gradient passes. Training mode must not change the forward (ratios need it
        deterministic), so a model with dropout is refused."""
        config = self.model.config
        rates = {
            name: float(getattr(config, name, 0.0) or 0.0)
            for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop")
        }
        if any(rates.values()):
            raise InvalidInput(
                f"gradient checkpointing runs the layers in training mode, and this model "
                f"has dropout ({rates}): the forward would not be deterministic",
                field="gradient_checkpointing",
            )
        self.model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )

    @contextmanager
    def _training(self) -> Iterator[None]:
        """The gradient passes: training mode where checkpointing needs it, then eval."""
        if not self.config.gradient_checkpointing:
            yield
            return
        self.model.train()
        try:
            yield
        finally:
            self.model.eval()

    def _shard(self) -> None:
        from torch.distributed.fsdp import fully_shard

        shards = [fully_shard(layer) for layer in self.model.get_decoder().layers]
        shards.append(fully_shard(self.model))
        for module in shards:
            # FSDP averages gradients over ranks by default; the loss is already divided
            # by the global token count, so the ranks' gradients must add up instead.
            # Plain SUM collectives: gloo has no pre-multiplied sum.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

    def _selected_logprobs(
        self,
        model: Any,
        mb: MicroBatch,
        temperature: float,
        select: torch.Tensor,
        *,
        entropy: bool = False,
        full: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of `mb.targets` at the `select`ed positions (flat, row-major), and
        optionally the entropy of log_softmax(logits / T) there (no grad). With `full`
        given, log_softmax(logits / T) itself (with grad) is appended to it."""
        inputs = {
            "input_ids": mb.input_ids,
            "position_ids": mb.position_ids,
            "attention_mask": mb.attention_mask,
            "use_cache": False,
        }
        with _autocast(self.device, self.config.precision):
            if self.sharded:
                logits = model(**inputs).logits[select]
            else:
                hidden = model.get_decoder()(**inputs).last_hidden_state
                logits = model.get_output_embeddings()(hidden[select])
        logits = logits.float()
        logp = token_logprobs(logits, mb.targets[select], temperature)
        if full is not None:
            scaled = logits / temperature if temperature > 0 else logits
            full.append(torch.log_softmax(scaled.float(), dim=-1))
        ent = None
        if entropy:
            with torch.no_grad():
                scaled = logits / temperature if temperature > 0 else logits
                all_logp = torch.log_softmax(scaled.float(), dim=-1)
                ent = -(all_logp.exp() * all_logp).sum(-1)
        return logp, ent

    def logprobs(self, microbatch: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
        """(rows, width) log-prob of each position's target token; 0 where none is valid."""
        mb = microbatch.to(self.device)
        with torch.no_grad():
            flat, _ = self._selected_logprobs(self.model, mb, temperature, mb.target_valid)
        grid = torch.zeros(mb.target_valid.shape, dtype=torch.float32, device=self.device)
        grid[mb.target_valid] = flat
        return grid

    # -- training -----------------------------------------------------------------------

    def train_step(
        self,
        trajectories: Sequence[Trajectory],
        advantages: Sequence[Advantage],
        algorithm: AlgorithmConfig | None = None,
        *,
        teacher: TeacherScores | None = None,
        distill: DistillLoss | None = None,
        idle: bool = False,
    ) -> dict[str, float]:
        """One batch: `algorithm.minibatches` optimizer steps; returns the step's metrics.
        With `teacher` (its scores of these trajectories), the reverse-KL term of
        `distill` joins the loss (`trainer.algorithms.distill_terms`).

        `idle` (sharded only): this rank got no share of a batch smaller than the ranks;
        it runs `trajectories` with no weight and adds no tokens, as FSDP's collectives
        need every rank, and the optimizer steps with the other ranks' gradients."""
        if idle and not self.sharded:
            raise InvalidInput("only a sharded rank can be idle", field="idle")
        algorithm = algorithm or AlgorithmConfig()
        if (teacher is None) != (distill is None):
            raise InvalidInput("teacher scores and the distill loss go together", field="teacher")
        if not trajectories:
            raise InvalidInput("no trajectories to train on", field="trajectories")
        if len(advantages) != len(trajectories):
            raise InvalidInput(
                f"{len(advantages)} advantages for {len(trajectories)} trajectories",
                field="advantages",
            )
        if algorithm.kl_coef > 0 and self.reference is None:
            raise InvalidInput("kl_coef > 0 needs a reference model", field="kl_coef")
        started = time.perf_counter()
        parts = _split(len(trajectories), algorithm.minibatches)
        minibatches = [
            [
                mb.to(self.device)
                for mb in build_microbatches(
                    [trajectories[i] for i in part],
                    [advantages[i] for i in part],
                    self.config.batching,
                    vocab_size=self.vocab_size,
                    teacher=None if teacher is None else [teacher.targets[i] for i in part],
                )
            ]
            for part in parts
        ]
        temperature = algorithm.temperature
        batched = time.perf_counter()

        # What must be fixed before the first update, computed with no grad.
        need_prox = algorithm.decoupled and (
            algorithm.minibatches > 1 or algorithm.proximal == "recompute"
        )
        fixed_prox: dict[int, torch.Tensor] = {}
        fixed_ref: dict[int, torch.Tensor] = {}
        if need_prox or algorithm.kl_coef > 0:
            with torch.no_grad():
                for mb in (mb for part in minibatches for mb in part):
                    if need_prox:
                        fixed_prox[id(mb)] = self._selected_logprobs(
                            self.model, mb, temperature, mb.loss_mask
                        )[0]
                    if algorithm.kl_coef > 0:
                        fixed_ref[id(mb)] = self._selected_logprobs(
                            self.reference, mb, temperature, mb.loss_mask
                        )[0]
        fixed_s = time.perf_counter() - batched

        sums: dict[str, float] = defaultdict(float)
        kl_by_teacher: dict[tuple[int, str], float] = defaultdict(float)
        max_is_weight = 0.0
        losses, norms = [], []
        skipped = 0
        params = [p for p in self.model.parameters() if p.requires_grad]
        with self._training():  # checkpointed layers recompute in training mode
            for part in minibatches:
                total = 0.0 if idle else float(sum(mb.num_policy_tokens for mb in part))
                count = len(part)
                if self.sharded:
                    total, count = _global_sum_and_max(total, count, self.device)
                self.optimizer.zero_grad(set_to_none=True)
                part_loss = 0.0
                for k in range(count):
                    mb = part[min(k, len(part) - 1)]
                    # FSDP: a short rank repeats one, an idle rank runs its own, no weight.
                    dummy = idle or k >= len(part)
                    if self.sharded:
                        self.model.set_requires_gradient_sync(k == count - 1)
                    full: list[torch.Tensor] | None = (
                        [] if distill is not None and distill.estimator == "full" else None
                    )
                    logp, ent = self._selected_logprobs(
                        self.model,
                        mb,
                        temperature,
                        mb.loss_mask,
                        entropy=algorithm.entropy,
                        full=full,
                    )
                    weights = mb.policy_values(mb.loss_weights) * (0.0 if dummy else 1.0)
                    advantages_mb = mb.policy_values(mb.advantages)
                    kl_loss = None
                    if distill is not None:
                        advantages_mb, kl_loss, kl_sums = distill_terms(
                            distill,
                            logp,
                            advantages_mb,
                            weights,
                            mb,
                            student_full=full[0] if full else None,
                            normalizer=total,
                        )
                        if not dummy:
                            for name, value in kl_sums.items():
                                kl_by_teacher[name] += value
                    loss, metrics = policy_loss(
                        logp,
                        fixed_prox.get(id(mb), logp.detach()),
                        mb.policy_values(mb.behaviour_logprobs),
                        advantages_mb,
                        weights,
                        algorithm,
                        normalizer=total,
                        logp_ref=fixed_ref.get(id(mb)),
                    )
                    if kl_loss is not None:
                        loss = loss + kl_loss
                    loss.backward()
                    if dummy:
                        continue
                    part_loss += float(loss.detach())
                    n = metrics.pop("tokens")
                    max_is_weight = max(max_is_weight, metrics.pop("max_is_weight"))
                    for key, value in metrics.items():
                        sums[key] += value * n
                    sums["policy_tokens"] += n
                    if ent is not None:
                        sums["entropy"] += float(ent.sum())
                grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
                norm = float(
                    grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                )
                if math.isfinite(norm):
                    self.optimizer.step()
                else:  # a non-finite gradient would poison AdamW's moments: skip the update
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                losses.append(part_loss)
                norms.append(norm)

        seconds = time.perf_counter() - started
        policy_tokens = sums.pop("policy_tokens", 0.0)
        tokens = 0 if idle else sum(mb.num_tokens for part in minibatches for mb in part)
        out = {key: value / policy_tokens for key, value in sums.items()} if policy_tokens else {}
        out.update(
            loss=sum(losses) / len(losses),
            grad_norm=sum(norms) / len(norms),
            max_is_weight=max_is_weight,
            tokens=float(tokens),
            policy_tokens=policy_tokens,
            trajectories=0.0 if idle else float(len(trajectories)),
            microbatches=0.0 if idle else float(sum(len(part) for part in minibatches)),
            optimizer_steps=float(len(minibatches) - skipped),
            skipped_steps=float(skipped),
            seconds=seconds,
            batching_seconds=batched - started,
            no_grad_pass_seconds=fixed_s,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            lr=float(self.optimizer.param_groups[0]["lr"]),
        )
        if teacher is not None:
            out.update(teacher_metrics(teacher.names, kl_by_teacher))
        return out

    # -- weights and checkpoints --------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF parameter names → detached CPU tensors. On a CPU model these alias the live
        parameters (no copy): hand them to a publisher, which copies, before the next step."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=options))
        if self.config.lora is not None:
            return merged_state_dict(self.model)
        return {name: t.detach().cpu() for name, t in self.model.state_dict().items()}

    @property
    def hf_model(self) -> PreTrainedModel:
        """The HF model under any adapter wrapper (its config, its save_pretrained)."""
        if self.config.lora is not None:
            return cast("PreTrainedModel", self.model.get_base_model())
        return self.model

    def save_checkpoint(
        self,
        directory: str | Path,
        step: int,
        weight_version: int,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write model (HF format), optimizer, step, version and `extra` (JSON) into
        `directory`, atomically: a temporary sibling renamed into place (an existing
        checkpoint there is replaced). Under FSDP every rank must call it; rank 0 writes."""
        final = Path(directory)
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": int(step),
            "weight_version": int(weight_version),
            "extra": extra or {},
        }
        try:
            text = json.dumps(state, indent=2)  # fail before writing anything
        except (TypeError, ValueError) as e:
            raise InvalidInput(f"checkpoint extra must be JSON: {e}", field="extra") from e
        model_state, optim_state = self._full_states()
        if self.sharded and torch.distributed.get_rank() != 0:
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            if self.config.lora is not None:
                # The merged model, loadable alone; the adapters resume training.
                self.hf_model.save_pretrained(
                    tmp / MODEL_DIR, state_dict=merged_state_dict(self.model)
                )
                init = getattr(self.hf_model.config, "agentflow_init", None)
                if init is not None:
                    (tmp / MODEL_DIR / MODEL_INIT_FILE).write_text(json.dumps(init, indent=2))
                save_tokenizer_files(self.hf_model, tmp / MODEL_DIR)
                _save_adapters(self.model, tmp / ADAPTER_FILE)
            elif model_state is None:
                save_model(self.model, tmp / MODEL_DIR)
            else:
                self.model.save_pretrained(tmp / MODEL_DIR, state_dict=model_state)
                init = getattr(self.model.config, "agentflow_init", None)
                if init is not None:
                    (tmp / MODEL_DIR / MODEL_INIT_FILE).write_text(json.dumps(init, indent=2))
                save_tokenizer_files(self.model, tmp / MODEL_DIR)
            torch.save(optim_state, tmp / OPTIMIZER_FILE)
            (tmp / STATE_FILE).write_text(text)
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _full_states(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
        """(full model state or None to save the model as is, optimizer state)."""
        if not self.sharded:
            return None, self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (
            cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=options)),
            get_optimizer_state_dict(self.model, self.optimizer, options=options),
        )

    def load_checkpoint(self, directory: str | Path) -> tuple[int, int, dict[str, Any]]:
        """Restore weights and optimizer state from `directory`; (step, version, extra)."""
        path = Path(directory)
        state = read_checkpoint_state(path, "torch")
        optim = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        if self.config.lora is not None:
            _load_adapters(self.model, path / ADAPTER_FILE)
            self.optimizer.load_state_dict(optim)
            return int(state["step"]), int(state["weight_version"]), dict(state["extra"])
        weights = load_model(path / MODEL_DIR).state_dict()
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, weights, options=options)
            set_optimizer_state_dict(self.model, self.optimizer, optim, options=options)
        else:
            self.model.load_state_dict(weights, strict=True)
            self.optimizer.load_state_dict(optim)
        return int(state["step"]), int(state["weight_version"]), dict(state["extra"])


ADAPTER_FILE = "adapters.safetensors"


def _with_adapters(model: PreTrainedModel, lora: LoraSettings) -> Any:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise InvalidInput(
            f"trainer.lora needs peft ({exc}): pip install 'agentflow[lora]'", field="lora"
        ) from None
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft types it int, takes a float
        lora_dropout=0.0,  # ratios need a deterministic forward
        target_modules=list(lora.target_modules),
        bias="none",
    )
    try:
        with warnings.catch_warnings():
            # peft asks transformers 5's deprecated `is_gradient_checkpointing`.
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as exc:  # no module matched, say
        raise InvalidInput(f"trainer.lora: {exc}", field="lora") from None


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """HF parameter names → weights with each adapter's update added (W + alpha/r * BA),
    detached on the CPU; the model is not changed. What engines load."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = tensor.detach().cpu()
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                key = f"{name}.weight"
                # Each concrete adapter layer (Linear, ...) defines it; the base class not.
                delta = module.get_delta_weight("default").detach().cpu()  # type: ignore[attr-defined]
                out[key] = out[key] + delta.to(out[key].dtype)
    return out


def _save_adapters(model: Any, path: Path) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(model)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path))


def _load_adapters(model: Any, path: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if not path.is_file():
        raise NotFound(f"no adapters at {path}: the checkpoint was not written with LoRA")
    result = set_peft_model_state_dict(model, load_file(str(path)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise InvalidInput(f"the checkpoint's adapters do not fit: {unexpected[:3]}", field="lora")


def read_checkpoint_state(path: Path, backend: str) -> dict[str, Any]:
    """A checkpoint's state file, refused unless `backend` wrote it in this format (a
    checkpoint without a `backend` is the torch backend's)."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise NotFound(f"no trainer checkpoint at {path} ({STATE_FILE} missing)")
    state: dict[str, Any] = json.loads(state_file.read_text())
    if state.get("format") != CHECKPOINT_FORMAT:
        raise InvalidInput(f"unknown checkpoint format {state.get('format')!r}", field="format")
    written_by = state.get("backend", "torch")
    if written_by != backend:
        raise InvalidInput(
            f"{path} was written by the {written_by} backend, not the {backend} one",
            field="backend",
        )
    return state


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Where step `step`'s checkpoint goes under `root` (what `latest_checkpoint` finds)."""
    return Path(root) / f"step-{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete `step-N` checkpoint under `root` with the highest N; None if none."""
    best: tuple[int, Path] | None = None
    base = Path(root)
    if not base.is_dir():
        return None
    for entry in base.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / STATE_FILE).is_file():
            step = int(match.group(1))
            if best is None or step > best[0]:
                best = (step, entry)
    return None if best is None else best[1]


def _split(n: int, parts: int) -> list[list[int]]:
    """0..n-1 in `parts` nearly equal, non-empty minibatches (fewer if n < parts), dealt
    round-robin: a batch holds each group's samples side by side, and contiguous chunks
    gave each optimizer step a group or two, i.e. a handful of distinct tasks; dealt,
    every step sees every group (with contiguous chunks on-policy distillation sat on its
    plateau for hundreds of steps more: docs/distillation.md)."""
    parts = min(parts, n)
    return [list(range(k, n, parts)) for k in range(parts)]


def _global_sum_and_max(total: float, count: int, device: torch.device) -> tuple[float, int]:
    """FSDP: the policy-token count summed over ranks, the micro-batch count maxed."""
    t = torch.tensor([total], dtype=torch.float64, device=device)
    c = torch.tensor([count], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t)
    torch.distributed.all_reduce(c, op=torch.distributed.ReduceOp.MAX)
    return float(t.item()), int(c.item())


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
