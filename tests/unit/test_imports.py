"""The gateway and the CLI start without torch (docs/architecture.md, "The parts")."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_imports_without_torch() -> None:
    code = (
        "import sys, agentflow.api.app, agentflow.cli, agentflow.client, agentflow.inference.base;"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
