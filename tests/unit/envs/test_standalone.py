"""`envs` stands alone: importing all of it loads nothing from the gateway or the trainer."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_envs_import_nothing_from_agentflow_or_trainer() -> None:
    code = (
        "import sys, envs.registry, envs.server, envs.client, envs.container, "
        "envs.builtin.calc_tool, envs.adapters.as_gymnasium, envs.adapters.gym_text, "
        "envs.adapters.textarena_games\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('agentflow', 'trainer'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""
