"""The Megatron backend's loss: the torch backend's, on vocab-parallel logits.

With tensor parallelism each rank holds the logits of its slice of the vocabulary
(`[..., V / tp]`), so the log-prob of a token is taken by megatron-core's
`vocab_parallel_cross_entropy`, which combines the slices' maxima and sums over the
tensor-parallel group, at the rollout's temperature (the engines' log-probs are of
`softmax(logits / T)`). From there the loss is `trainer.algorithms.policy_loss`, the
same function the torch backend calls, on the same micro-batch layout
(`trainer.batching`); `tests/integration/trainer/megatron` checks both give the same
loss and gradients on the same logits.

Megatron's schedules divide each micro-batch's loss by their number, and its DDP
averages gradients over data-parallel ranks. The loss here is already divided by the
policy-token count of the whole batch (every micro-batch on every data-parallel rank),
so summing is what is wanted: `megatron_scale` undoes both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.algorithms import AlgorithmConfig, policy_loss

if TYPE_CHECKING:
    import torch

    from trainer.batching import MicroBatch


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T)[target] over the whole vocabulary, from this rank's slice
    of `logits` (the last dim); T == 0 uses the unscaled logits."""
    from megatron.core import tensor_parallel

    scaled = logits.float()
    if temperature > 0:
        scaled = scaled / temperature
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, targets)


def microbatch_loss(
    logits: torch.Tensor,
    mb: MicroBatch,
    algorithm: AlgorithmConfig,
    *,
    normalizer: float,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """One micro-batch's loss from its (rows, width, V / tp) logits: (loss, metrics, the
    policy tokens' log-probs). The proximal log-probs are the step's own, detached: one
    optimizer step per batch, as the torch backend's `proximal = "auto"`."""
    select = mb.loss_mask
    logp = vocab_parallel_logprobs(logits[select], mb.targets[select], algorithm.temperature)
    loss, metrics = policy_loss(
        logp,
        logp.detach(),
        mb.policy_values(mb.behaviour_logprobs),
        mb.policy_values(mb.advantages),
        mb.policy_values(mb.loss_weights),
        algorithm,
        normalizer=normalizer,
    )
    return loss, metrics, logp.detach()


def megatron_scale(num_microbatches: int, data_parallel_size: int) -> float:
    """What a loss is multiplied by so that Megatron's schedules and DDP sum it (above)."""
    return float(num_microbatches * data_parallel_size)
