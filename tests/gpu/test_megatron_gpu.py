"""The Megatron backend on GPUs: its per-token log-probs equal the torch backend's on the
same HF weights (the maximum absolute difference is printed), and its optimizer steps
lower the loss. Skipped without CUDA (megatron-core does not run on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_backend_matches_torch_and_learns(tmp_path: Path, tp: int) -> None:
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA devices")
    run = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={tp}", str(ROOT / "tests" / "gpu" / "megatron_worker.py"),
            str(tmp_path), str(tp),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    print(f"tp={tp}: log-prob max |megatron - torch| = {result['logprob_max_abs_diff']:.3g}")
    print(f"tp={tp}: losses {result['losses']}")
    assert result["logprob_max_abs_diff"] < 1e-3
    assert result["losses"][-1] < result["losses"][0]
    assert "model.embed_tokens.weight" in result["exported_names"]
