"""The gateway and the CLI start without torch (docs/architecture.md, "The parts"), and
without Ray unless a run is placed on it (docs/ray.md)."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_imports_without_torch() -> None:
    code = (
        "import sys, agentflow.api.app, trainer.cli, agentflow.client, agentflow.inference.base;"
        "bad = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_run_config_with_placement_parses_without_ray() -> None:
    code = (
        "import sys; from agentflow.run_config import RunConfig;"
        "RunConfig.model_validate({'name': 'r', 'envs': [{'id': 'agentflow/guess-number-v0'}],"
        " 'placement': {'ray': 'local', 'engines': 3}});"
        "assert 'ray' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
