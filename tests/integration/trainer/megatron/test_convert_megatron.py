"""HF ⇄ Megatron weights and the Megatron loss against megatron-core's own code, on CPU.

Each family's tiny checkpoint is converted for tensor-parallel size 2, loaded strictly
into the real local-spec GPTModel on two gloo ranks (`cpu_worker.py`), and layer 0's
q/k/v and MLP output are compared with the HF model's on the same input; the ranks'
state dicts then convert back to exactly the HF weights. And the loss: the Megatron
backend's, on two ranks' vocabulary slices of the same logits, equals the torch backend's
(log-probs of the whole logits, then the same `policy_loss`) in value, metrics and
gradient."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

from tests.integration.trainer.megatron import cpu_worker  # noqa: E402
from tests.support.megatron_models import FAMILIES, hf_model  # noqa: E402
from trainer.backends.megatron.convert import hf_bridge, to_hf  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[4]
TP = 2


@pytest.fixture(scope="module")
def ranks_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun for every family: megatron-core's import is most of its time."""
    out = tmp_path_factory.mktemp("megatron")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={TP}",
            "--standalone",
            str(Path(cpu_worker.__file__)),
            str(out),
            str(TP),
            *FAMILIES,
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_modules_compute_what_hf_computes(ranks_output: Path, family: str) -> None:
    got = torch.load(ranks_output / f"{family}.pt", weights_only=False)
    model = hf_model(family)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hidden = got["hidden"]  # [s, b, h]
    head_dim = attn.head_dim
    with torch.no_grad():
        q = attn.q_proj(hidden).unflatten(-1, (-1, head_dim))
        k = attn.k_proj(hidden).unflatten(-1, (-1, head_dim))
        v = attn.v_proj(hidden).unflatten(-1, (-1, head_dim))
        if family == "qwen3":
            q, k = attn.q_norm(q), attn.k_norm(k)
        expected_mlp = mlp(hidden)
    for name, expected in (("q", q), ("k", k), ("v", v)):
        actual = got[name]  # [s, b, heads, head_dim], the ranks' heads gathered
        assert actual.shape == expected.shape, name
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(got["mlp"], expected_mlp, rtol=1e-5, atol=1e-5)

    # The real model's state dicts, both ranks, convert back to exactly the HF weights.
    bridge = hf_bridge(model.config, tp=TP)
    back = to_hf([got["states"]], bridge)
    expected_state = model.state_dict()
    if model.config.tie_word_embeddings:
        expected_state.pop("lm_head.weight")
    assert set(back) == set(expected_state)
    for name, tensor in expected_state.items():
        assert torch.equal(back[name], tensor), name


def test_the_megatron_loss_is_the_torch_backends(ranks_output: Path) -> None:
    from agentflow.modeling import token_logprobs
    from trainer.algorithms import AlgorithmConfig, policy_loss

    got = torch.load(ranks_output / "loss.pt", weights_only=False)
    logits, mb = cpu_worker.loss_inputs()
    logits.requires_grad_(True)
    # The torch backend's path (TorchPolicy._selected_logprobs, then policy_loss).
    select = mb.loss_mask
    logp = token_logprobs(logits[select], mb.targets[select], cpu_worker.TEMPERATURE)
    loss, metrics = policy_loss(
        logp,
        logp.detach(),
        mb.policy_values(mb.behaviour_logprobs),
        mb.policy_values(mb.advantages),
        mb.policy_values(mb.loss_weights),
        AlgorithmConfig(temperature=cpu_worker.TEMPERATURE),
        normalizer=50.0,
    )
    loss.backward()
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    assert got["metrics"] == pytest.approx(metrics, rel=1e-5, abs=1e-6)
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    torch.testing.assert_close(got["grad"], logits.grad, rtol=1e-5, atol=1e-6)
