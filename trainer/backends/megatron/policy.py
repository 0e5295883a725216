"""`MegatronPolicy`: the trained policy on megatron-core, with `TorchPolicy`'s calls.

    MegatronPolicy(hf_model, MegatronBackendConfig(tensor_parallel=2))
      .train_step(trajectories, advantages, algorithm) -> metrics
      .logprobs(microbatch, temperature)               -> (rows, width) log-probs
      .state_dict()                                    -> HF names → tensors, for weight sync
      .save_checkpoint(dir, step, version, extra) / .load_checkpoint(dir)

Every rank of a torchrun job builds one (trainer/ranks.py sends them the same calls).
The model is megatron-core's GPTModel with its local layer spec (no Transformer Engine or
Apex), tensor- and pipeline-parallel as configured, data-parallel over the remaining
ranks, wrapped in Megatron's DDP with its distributed optimizer (Adam, fp32 main
weights; bf16 model weights unless `precision = "fp32"`). The HF checkpoint's weights
come in, and go out to engines and checkpoints, through `convert` (mbridge).

A step lays the rank's share of the batch out as the torch backend does (padded rows:
Megatron's rotary embedding takes positions from 0 along the row, so rows are not
packed), runs Megatron's forward-backward schedule with the loss of `loss` (the torch
backend's policy loss on vocab-parallel log-probs), and one optimizer step. Distillation
and several mini-batches per step are the torch backend's only, for now.

It needs CUDA: megatron-core's model, optimizer and schedules call it throughout.
`require_cuda` refuses a machine without, naming the field, before anything starts.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentflow.errors import InvalidInput
from agentflow.modeling import MODEL_INIT_FILE, load_model, save_tokenizer_files
from agentflow.types import Trajectory
from trainer.algorithms import AlgorithmConfig
from trainer.backends.megatron.convert import (
    DEFAULT_VOCAB_DIVISIBLE_BY,
    hf_bridge,
    quiet_megatron,
    tied,
    to_hf,
    to_megatron,
)
from trainer.backends.megatron.loss import megatron_scale, microbatch_loss
from trainer.backends.torch_backend import (
    CHECKPOINT_FORMAT,
    MODEL_DIR,
    STATE_FILE,
    read_checkpoint_state,
)
from trainer.batching import Advantage, BatchingConfig, MicroBatch, build_microbatches

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

OPTIMIZER_FILE = "optimizer-tp{tp:02d}-pp{pp:02d}.pt"
_SUMMED = ("tokens", "max_is_weight")


class MegatronBackendConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel: int = Field(default=1, ge=1, le=64)
    pipeline_parallel: int = Field(default=1, ge=1, le=64)
    sequence_parallel: bool = Field(default=False, description="with tensor_parallel > 1")
    distributed_optimizer: bool = Field(default=True, description="shard Adam over DP ranks")
    precision: Literal["bf16", "fp32"] = Field(default="bf16")
    lr: float = Field(default=3e-4, gt=0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    vocab_divisible_by: int = Field(default=DEFAULT_VOCAB_DIVISIBLE_BY, ge=1)
    seed: int = Field(default=0, ge=0)


def require_cuda(field: tuple[str, ...] = ("trainer", "backend")) -> None:
    """Refuse, naming the field, a machine where the Megatron backend cannot run."""
    import torch

    if not torch.cuda.is_available():
        raise InvalidInput(
            "the Megatron backend needs CUDA (megatron-core's model, optimizer and schedules "
            "run on GPUs only) and this machine has none: use backend = 'torch'",
            field=field,
        )
    try:
        with quiet_megatron():
            import mbridge  # noqa: F401
            import megatron.core  # noqa: F401
    except ImportError as exc:
        raise InvalidInput(
            f"the Megatron backend needs megatron-core and mbridge ({exc}): "
            "pip install 'agentflow[megatron]'",
            field=field,
        ) from None


class MegatronPolicy:
    """The trained policy on megatron-core; see the module docstring."""

    def __init__(self, model: PreTrainedModel, config: MegatronBackendConfig | None = None):
        require_cuda()
        import torch
        import torch.distributed as dist

        with quiet_megatron():
            from megatron.core import parallel_state, tensor_parallel
            from megatron.core.distributed import (
                DistributedDataParallel,
                DistributedDataParallelConfig,
                finalize_model_grads,
            )
            from megatron.core.models.gpt import GPTModel
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.config = config or MegatronBackendConfig()
        cfg = self.config
        if not dist.is_initialized():
            raise InvalidInput(
                "the Megatron backend runs under torchrun (agentflow trainer starts it)",
                field=("trainer", "backend"),
            )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=cfg.tensor_parallel,
                pipeline_model_parallel_size=cfg.pipeline_parallel,
            )
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        self.device = torch.device("cuda", torch.cuda.current_device())
        dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        hf_config = model.config
        self.bridge = hf_bridge(
            hf_config,
            tp=cfg.tensor_parallel,
            pp=cfg.pipeline_parallel,
            dtype=dtype,
            divisible_by=cfg.vocab_divisible_by,
            sequence_parallel=cfg.sequence_parallel and cfg.tensor_parallel > 1,
            # The local spec's own kernels: no Apex or Transformer Engine fusions.
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            # RL ratios need a deterministic forward.
            hidden_dropout=0.0,
            attention_dropout=0.0,
            variable_seq_lengths=True,
        )
        transformer = self.bridge.config
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.data_rank = parallel_state.get_data_parallel_rank()
        self.data_ranks = parallel_state.get_data_parallel_world_size()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        with quiet_megatron():
            gpt = GPTModel(
                config=transformer,
                transformer_layer_spec=get_gpt_layer_local_spec(
                    normalization="RMSNorm", qk_layernorm=transformer.qk_layernorm
                ),
                vocab_size=self.bridge.padded_vocab_size,
                max_sequence_length=hf_config.max_position_embeddings,
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=self.last_stage,
                share_embeddings_and_output_weights=tied(self.bridge),
                position_embedding_type="rope",
                rotary_base=_rope_theta(hf_config),
            ).to(self.device)
        self._load_hf(model.state_dict(), gpt)
        self.module = gpt
        self.ddp = DistributedDataParallel(
            transformer,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=cfg.distributed_optimizer,
            ),
            gpt,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                adam_beta1=cfg.betas[0],
                adam_beta2=cfg.betas[1],
                adam_eps=cfg.adam_eps,
                bf16=cfg.precision == "bf16",
                params_dtype=dtype,
                clip_grad=cfg.max_grad_norm,
                use_distributed_optimizer=cfg.distributed_optimizer,
            ),
            [self.ddp],
        )
        transformer.no_sync_func = self.ddp.no_sync
        transformer.finalize_model_grads_func = finalize_model_grads
        transformer.grad_scale_func = self.optimizer.scale_loss
        # `model` keeps the HF config and tokenizer source for checkpoints and publishers;
        # its weights are the initial ones, the live ones are Megatron's.
        self.model = model
        self.vocab_size = int(hf_config.vocab_size)
        self.sharded = True

    # -- weights ------------------------------------------------------------------------

    def _load_hf(self, hf_state: dict[str, torch.Tensor], module: Any) -> None:
        shard = to_megatron(hf_state, self.bridge)[self.pp_rank][self.tp_rank]
        result = module.load_state_dict(shard, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise InvalidInput(
                f"the converted weights do not fit the Megatron model: missing {missing[:3]}, "
                f"unexpected {list(result.unexpected_keys)[:3]}",
                field=("model", "path"),
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF names → CPU tensors of the whole model (every rank takes part; each gets it)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        local = {
            k: v.detach().cpu()
            for k, v in self.module.state_dict().items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")
        }
        group = parallel_state.get_model_parallel_group()
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (self.pp_rank, self.tp_rank, local), group=group)
        stages: list[list[dict[str, torch.Tensor]]] = [
            [{} for _ in range(self.config.tensor_parallel)]
            for _ in range(self.config.pipeline_parallel)
        ]
        for pp, tp, state in every:
            stages[pp][tp] = state
        return to_hf(stages, self.bridge)

    # -- forward and training -----------------------------------------------------------

    def _run(
        self,
        microbatches: Sequence[MicroBatch],
        loss_of: Any,
        *,
        forward_only: bool,
    ) -> list[Any]:
        """Megatron's schedule over `microbatches`; what `loss_of` recorded, per micro-batch
        (on the last pipeline stage; the other stages get it broadcast)."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        records: list[Any] = []

        def forward_step(data: Iterator[MicroBatch], model: Any) -> tuple[Any, Any]:
            mb = next(data)
            mask = None if mb.attention_mask is None else ~mb.attention_mask  # True: masked
            output = model(mb.input_ids, mb.position_ids, mask)
            return output, partial(loss_of, mb, records)

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[self.ddp],
            num_microbatches=len(microbatches),
            seq_length=max(mb.input_ids.shape[1] for mb in microbatches),
            micro_batch_size=max(mb.input_ids.shape[0] for mb in microbatches),
            forward_only=forward_only,
        )
        if self.config.pipeline_parallel > 1:
            box = [records]
            dist.broadcast_object_list(
                box,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
            records = box[0]
        return records

    def logprobs(self, microbatch: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
        """(rows, width) log-prob of each position's target token; 0 where none is valid."""
        import torch

        from trainer.backends.megatron.loss import vocab_parallel_logprobs

        mb = microbatch.to(self.device)

        def loss_of(mb: MicroBatch, records: list[Any], logits: Any) -> Any:
            select = mb.target_valid
            logp = vocab_parallel_logprobs(logits[select], mb.targets[select], temperature)
            grid = torch.zeros(select.shape, dtype=torch.float32, device=logits.device)
            grid[select] = logp
            records.append(grid.cpu())
            return logp.sum() * 0.0, {}

        self.ddp.eval()
        with torch.no_grad():
            (grid,) = self._run([mb], loss_of, forward_only=True)
        return grid

    def train_step(
        self,
        trajectories: Sequence[Trajectory],
        advantages: Sequence[Advantage],
        algorithm: AlgorithmConfig | None = None,
        *,
        teacher: Any = None,
        distill: Any = None,
        idle: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on this data-parallel rank's share of a batch (module doc)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        algorithm = algorithm or AlgorithmConfig()
        if teacher is not None or distill is not None:
            raise InvalidInput(
                "distillation is not available with the Megatron backend yet", field="teachers"
            )
        if algorithm.minibatches != 1:
            raise InvalidInput(
                "the Megatron backend takes one optimizer step per batch",
                field=("trainer", "minibatches"),
            )
        if self.config.batching.layout != "padded":
            raise InvalidInput(
                "the Megatron backend lays rows out padded (its rotary embedding counts "
                "positions along the row)",
                field="layout",
            )
        if not trajectories:
            raise InvalidInput("no trajectories to train on", field="trajectories")
        started = time.perf_counter()
        microbatches = [
            mb.to(self.device)
            for mb in build_microbatches(
                trajectories, advantages, self.config.batching, vocab_size=self.vocab_size
            )
        ]
        local = 0.0 if idle else float(sum(mb.num_policy_tokens for mb in microbatches))
        total = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        scale = megatron_scale(len(microbatches), self.data_ranks)

        def loss_of(mb: MicroBatch, records: list[Any], logits: Any) -> Any:
            loss, metrics, _ = microbatch_loss(logits, mb, algorithm, normalizer=float(total))
            if idle:
                loss = loss * 0.0
            records.append((float(loss.detach()), metrics))
            return loss * scale, {"loss": loss.detach()}

        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        records = self._run(microbatches, loss_of, forward_only=False)
        updated, grad_norm, _ = self.optimizer.step()
        seconds = time.perf_counter() - started

        sums: dict[str, float] = defaultdict(float)
        max_is_weight = 0.0
        for _, metrics in records:
            n = metrics.pop("tokens")
            max_is_weight = max(max_is_weight, metrics.pop("max_is_weight"))
            for key, value in metrics.items():
                sums[key] += value * n
            sums["policy_tokens"] += n
        policy_tokens = 0.0 if idle else sums.pop("policy_tokens", 0.0)
        out = {k: v / policy_tokens for k, v in sums.items() if k != "policy_tokens"}
        out = out if policy_tokens else {}
        tokens = 0 if idle else sum(mb.num_tokens for mb in microbatches)
        out.update(
            loss=sum(loss for loss, _ in records),
            grad_norm=float(grad_norm or 0.0),
            max_is_weight=max_is_weight,
            tokens=float(tokens),
            policy_tokens=policy_tokens,
            trajectories=0.0 if idle else float(len(trajectories)),
            microbatches=0.0 if idle else float(len(microbatches)),
            optimizer_steps=1.0 if updated else 0.0,
            skipped_steps=0.0 if updated else 1.0,
            seconds=seconds,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            lr=float(self.optimizer.param_groups[0]["lr"]),
        )
        return out

    # -- checkpoints --------------------------------------------------------------------

    def save_checkpoint(
        self,
        directory: str | Path,
        step: int,
        weight_version: int,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """The model in HF format (rank 0), each model-parallel rank's optimizer state, the
        step, version and `extra`; written under a temporary name and renamed into place.
        Every rank must call it."""
        import torch
        import torch.distributed as dist

        final = Path(directory)
        state = {
            "format": CHECKPOINT_FORMAT,
            "backend": "megatron",
            "step": int(step),
            "weight_version": int(weight_version),
            "extra": extra or {},
        }
        try:
            text = json.dumps(state, indent=2)
        except (TypeError, ValueError) as e:
            raise InvalidInput(f"checkpoint extra must be JSON: {e}", field="extra") from e
        box = [f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"]
        dist.broadcast_object_list(box, src=0)  # one temporary directory for every rank
        tmp = final.parent / box[0]
        if dist.get_rank() == 0:
            tmp.mkdir(parents=True)
        dist.barrier()
        weights = self.state_dict()
        optimizer_file = tmp / OPTIMIZER_FILE.format(tp=self.tp_rank, pp=self.pp_rank)
        if self.config.distributed_optimizer:
            # Gathers this model-parallel rank's shards over its data-parallel group;
            # data-parallel rank 0 writes them.
            self.optimizer.save_parameter_state(str(optimizer_file.with_suffix(".params.pt")))
        if self.data_rank == 0:
            torch.save(self.optimizer.state_dict(), optimizer_file)
        if dist.get_rank() == 0:
            self.model.save_pretrained(tmp / MODEL_DIR, state_dict=weights)
            init = getattr(self.model.config, "agentflow_init", None)
            if init is not None:
                (tmp / MODEL_DIR / MODEL_INIT_FILE).write_text(json.dumps(init, indent=2))
            save_tokenizer_files(self.model, tmp / MODEL_DIR)
            (tmp / STATE_FILE).write_text(text)
        dist.barrier()
        if dist.get_rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        dist.barrier()
        return final

    def load_checkpoint(self, directory: str | Path) -> tuple[int, int, dict[str, Any]]:
        """Restore weights and optimizer state from `directory`; (step, version, extra)."""
        import torch

        path = Path(directory)
        state = read_checkpoint_state(path, "megatron")
        self._load_hf(load_model(path / MODEL_DIR).state_dict(), self.module)
        optimizer_file = path / OPTIMIZER_FILE.format(tp=self.tp_rank, pp=self.pp_rank)
        self.optimizer.load_state_dict(
            torch.load(optimizer_file, map_location="cpu", weights_only=False)
        )
        if self.config.distributed_optimizer:
            self.optimizer.load_parameter_state(str(optimizer_file.with_suffix(".params.pt")))
        return int(state["step"]), int(state["weight_version"]), dict(state["extra"])


def _rope_theta(hf_config: Any) -> float:
    """transformers 5 keeps it in `rope_parameters`; earlier ones as `rope_theta`."""
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)
