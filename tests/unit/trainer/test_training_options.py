"""bf16 autocast, gradient checkpointing and LoRA on the torch backend: checkpointing
changes no number, bf16 stays close to fp32 and still learns, LoRA trains the adapters
only and hands engines merged weights under the model's own names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentflow.errors import InvalidInput
from agentflow.inference.base import GenerateRequest, SamplingParams, WeightUpdate
from agentflow.inference.local import LocalEngine
from agentflow.modeling import build_model, load_model
from agentflow.run_config import LoraSettings
from tests.unit.trainer.test_torch_backend import SMALL_BATCHES, TINY, _batch, _surrogate
from trainer.algorithms import AlgorithmConfig
from trainer.backends.torch_backend import TorchBackendConfig, TorchPolicy, checkpoint_dir

LORA = LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _policy(**options: object) -> TorchPolicy:
    config = TorchBackendConfig(lr=1e-2, batching=SMALL_BATCHES, **options)  # type: ignore[arg-type]
    return TorchPolicy(build_model(TINY, seed=0), config)


def test_gradient_checkpointing_changes_no_number() -> None:
    trajs, adv = _batch(build_model(TINY, seed=0))
    plain, checkpointed = _policy(), _policy(gradient_checkpointing=True)
    calls = {"plain": 0, "checkpointed": 0}
    for name, policy in (("plain", plain), ("checkpointed", checkpointed)):
        q_proj = policy.model.model.layers[0].self_attn.q_proj

        def count(*_: object, name: str = name) -> None:
            calls[name] += 1

        q_proj.register_forward_hook(count)
    a = plain.train_step(trajs, adv, AlgorithmConfig())
    b = checkpointed.train_step(trajs, adv, AlgorithmConfig())
    # The backward pass ran each checkpointed layer again.
    assert calls["checkpointed"] == 2 * calls["plain"] > 0
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for x, y in zip(plain.model.parameters(), checkpointed.model.parameters(), strict=True):
        assert torch.allclose(x, y, atol=1e-6)
    assert not checkpointed.model.training  # back in eval mode for scoring


def test_gradient_checkpointing_refuses_a_model_with_dropout() -> None:
    model = build_model(TINY, seed=0)
    model.config.attention_dropout = 0.1
    with pytest.raises(InvalidInput) as err:
        TorchPolicy(model, TorchBackendConfig(gradient_checkpointing=True))
    assert err.value.field == ("gradient_checkpointing",)


def test_bf16_autocast_is_close_to_fp32_and_learns() -> None:
    trajs, adv = _batch(build_model(TINY, seed=0))
    fp32, bf16 = _policy(), _policy(precision="bf16")
    for mb in fp32_microbatches(trajs, adv):
        assert torch.allclose(fp32.logprobs(mb), bf16.logprobs(mb), atol=0.05)
    before = _surrogate(fp32, trajs, adv)
    metrics = bf16.train_step(trajs, adv, AlgorithmConfig())
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # fp32 master
    assert _surrogate(bf16, trajs, adv) < before


def fp32_microbatches(trajs, adv):  # type: ignore[no-untyped-def]
    from trainer.batching import build_microbatches

    return build_microbatches(trajs, adv)


def test_lora_trains_adapters_only_and_merges_for_engines() -> None:
    base = build_model(TINY, seed=0)
    trajs, adv = _batch(base)
    policy = _policy(lora=LORA)
    names = set(build_model(TINY, seed=0).state_dict())
    trained = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    # LoRA's B starts at zero: the merged weights are the base model's.
    merged = policy.state_dict()
    assert set(merged) == names
    for name, tensor in base.state_dict().items():
        assert torch.equal(merged[name], tensor), name

    before = _surrogate(policy, trajs, adv)
    policy.train_step(trajs, adv, AlgorithmConfig())
    assert _surrogate(policy, trajs, adv) < before
    merged = policy.state_dict()
    changed = [n for n in names if not torch.equal(merged[n], base.state_dict()[n])]
    assert changed and all("proj" in n for n in changed)  # only adapted matrices moved
    # The merged weights are the adapted model: same log-probs, through a plain model.
    plain = build_model(TINY, seed=0)
    plain.load_state_dict(merged)
    mb = fp32_microbatches(trajs, adv)[0]
    plain_policy = TorchPolicy(plain)
    assert torch.allclose(policy.logprobs(mb), plain_policy.logprobs(mb), atol=1e-5)


async def test_an_engine_takes_the_merged_weights() -> None:
    trajs, adv = _batch(build_model(TINY, seed=0))
    policy = _policy(lora=LORA)
    policy.train_step(trajs, adv, AlgorithmConfig())
    engine = LocalEngine.from_init(TINY, seed=0, max_batch_size=4)
    try:
        assert await engine.update_weights(WeightUpdate(state_dict=policy.state_dict())) == 1
        request = GenerateRequest(input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=2))
        assert len((await engine.generate(request)).output_ids) == 2
    finally:
        await engine.close()


def test_lora_checkpoints_resume_and_export_merged(tmp_path: Path) -> None:
    trajs, adv = _batch(build_model(TINY, seed=0), n=6)
    policy = _policy(lora=LORA)
    policy.train_step(trajs, adv)
    saved = policy.save_checkpoint(checkpoint_dir(tmp_path, 1), step=1, weight_version=2)
    exported = load_model(saved / "model").state_dict()
    for name, tensor in policy.state_dict().items():
        assert torch.allclose(exported[name], tensor), name

    other = _policy(lora=LORA)
    assert other.load_checkpoint(saved)[:2] == (1, 2)
    policy.train_step(trajs, adv)
    other.train_step(trajs, adv)
    for a, b in zip(policy.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
