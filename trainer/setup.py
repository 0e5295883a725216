"""From a run config to the trainer's parts: the policy and the loop's settings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from agentflow.run_config import RunConfig, check_device
from trainer.algorithms import AlgorithmConfig, DistillLoss
from trainer.backends.base import Policy
from trainer.backends.torch_backend import TorchBackendConfig, TorchPolicy
from trainer.batching import BatchingConfig
from trainer.loop import LoopSettings


def build_policy(config: RunConfig) -> Policy:
    """The model RL starts from (`model.path`, or built from `model.init`) with AdamW, on
    the configured backend (a `MegatronPolicy` answers the same calls)."""
    from agentflow.modeling import build_model, load_model

    check_device(config.trainer.device, ("trainer", "device"))
    if config.trainer.backend == "megatron":
        from trainer.backends.megatron.policy import require_cuda

        require_cuda()

    model = (
        load_model(config.model.path)
        if config.model.path
        else build_model(config.model.init, seed=config.seed)
    )
    trainer = config.trainer
    if trainer.backend == "megatron":
        return _megatron_policy(config, model)
    return TorchPolicy(
        model,
        TorchBackendConfig(
            device=trainer.device,
            lr=trainer.lr,
            betas=trainer.betas,
            adam_eps=trainer.adam_eps,
            max_grad_norm=trainer.max_grad_norm,
            batching=BatchingConfig(max_tokens_per_microbatch=trainer.max_tokens_per_microbatch),
            precision=trainer.precision,
            gradient_checkpointing=trainer.gradient_checkpointing,
            lora=trainer.lora,
        ),
    )


def _megatron_policy(config: RunConfig, model: Any) -> Policy:
    from trainer.backends.megatron.policy import MegatronBackendConfig, MegatronPolicy

    trainer, megatron = config.trainer, config.megatron
    return MegatronPolicy(
        model,
        MegatronBackendConfig(
            tensor_parallel=megatron.tensor_parallel,
            pipeline_parallel=megatron.pipeline_parallel,
            sequence_parallel=megatron.sequence_parallel,
            distributed_optimizer=megatron.distributed_optimizer,
            vocab_divisible_by=megatron.vocab_divisible_by,
            precision=trainer.precision,
            lr=trainer.lr,
            betas=trainer.betas,
            adam_eps=trainer.adam_eps,
            max_grad_norm=trainer.max_grad_norm,
            batching=BatchingConfig(max_tokens_per_microbatch=trainer.max_tokens_per_microbatch),
            seed=config.seed,
        ),
    )


def loop_settings(config: RunConfig, checkpoint_root: Path) -> LoopSettings:
    trainer = config.trainer
    grpo = trainer.algorithm != "ppo"  # every GRPO form divides by the group's std
    credit = {"turn_grpo": "turn", "rtpo": "rtpo"}.get(trainer.algorithm, "trajectory")
    return LoopSettings(
        steps=trainer.steps,
        # `batch_episodes` counts trajectories, RTPO's re-rolls among them.
        groups_per_batch=max(1, math.ceil(trainer.batch_episodes / config.samples_per_group())),
        group_size=config.samples_per_group(),
        algorithm=AlgorithmConfig(
            temperature=config.agent.temperature,
            clip_eps=trainer.clip_eps,
            clip_eps_high=trainer.clip_eps_high,
            decoupled=trainer.decoupled,
            tis_cap=trainer.tis_cap,
            kl_coef=trainer.kl_coef,
            normalize_std=grpo,
            minibatches=trainer.minibatches,
        ),
        normalize_std=grpo,
        checkpoint_root=checkpoint_root,
        checkpoint_every=trainer.checkpoint_every,
        keep_checkpoints=trainer.keep_checkpoints,
        max_tokens=trainer.max_tokens_per_microbatch,
        credit=credit,  # type: ignore[arg-type]
        rtpo_update=config.rtpo.update,
        distill=DistillLoss(
            coef=config.distill.coef, rl=config.distill.rl, estimator=config.distill.estimator
        )
        if config.teachers
        else None,
    )
