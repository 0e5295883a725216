"""TorchPolicy under FSDP2 on two CPU ranks (gloo) equals one process on the whole batch,
and its checkpoints round-trip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.trainer import fsdp_worker
from trainer.backends.torch_backend import TorchPolicy

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def test_two_ranks_train_as_one_process(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--standalone",
            str(Path(fsdp_worker.__file__)),
            str(tmp_path),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    torch.set_num_threads(1)
    trajs, adv = fsdp_worker.batch()
    one = TorchPolicy(fsdp_worker.build_model(fsdp_worker.TINY, seed=0), fsdp_worker.CONFIG)
    assert not one.sharded
    ref = one.train_step(trajs, adv)
    ranks = result["metrics"]
    # Ranks ran different numbers of micro-batches over different tokens ...
    assert ranks[0]["microbatches"] != ranks[1]["microbatches"]
    assert sum(m["policy_tokens"] for m in ranks) == ref["policy_tokens"]
    # ... and their gradients add up to the whole batch's: same loss, same global norm.
    assert sum(m["loss"] for m in ranks) == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6)
    for m in ranks:
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    # One AdamW step moves each weight by about lr * sign(grad), so the updated weights
    # agree wherever the gradient is clearly non-zero: nearly everywhere.
    expected = one.state_dict()
    state = result["state"]
    assert set(state) == set(expected)
    close = total = 0
    for name, value in expected.items():
        near = (state[name] - value).abs() <= 1e-6
        close += int(near.sum())
        total += near.numel()
    assert close / total > 0.999, close / total

    assert result["moved"] and result["restored"]
    # The checkpoint rank 0 wrote is a plain one: a single process loads it.
    plain = TorchPolicy(fsdp_worker.build_model(fsdp_worker.TINY, seed=1), fsdp_worker.CONFIG)
    step, version, _ = plain.load_checkpoint(tmp_path / "checkpoint")
    assert (step, version) == (1, 1)
    loaded = plain.state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)

    # The idle step: only rank 0's trajectory counts, as if one process trained it alone.
    lone, idle = result["idle_step"]
    assert idle["policy_tokens"] == 0 and idle["trajectories"] == 0 and idle["loss"] == 0
    alone = plain.train_step([trajs[0]], [adv[0]])
    assert lone["policy_tokens"] == alone["policy_tokens"]
    assert lone["loss"] == pytest.approx(alone["loss"], rel=1e-4, abs=1e-6)
    assert lone["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)
    assert idle["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)
    after = plain.state_dict()
    near = sum(int(((result["after_idle"][k] - v).abs() <= 1e-6).sum()) for k, v in after.items())
    assert near / sum(v.numel() for v in after.values()) > 0.999
