"""HF ⇄ Megatron weights against megatron-core's own modules, on CPU.

Each family's tiny checkpoint is converted for tensor-parallel size 2, loaded strictly
into the real local-spec GPTModel on two gloo ranks (`cpu_worker.py`), and layer 0's
q/k/v and MLP output are compared with the HF model's on the same input; the ranks'
state dicts then convert back to exactly the HF weights."""

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
