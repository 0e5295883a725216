"""A checkpoint vLLM can keep up to date: its output head written out, not tied.

vLLM 0.32's `reload_weights` loads a model layer by layer into new tensors, which breaks
a tied output embedding: after the first reload the input embedding is the new one and
the output head (`lm_head`) stays at the weights the server started with, so every later
version samples through the first version's head (measured: log-probs off by up to 0.57
nats after one reload of the test model; exact again with the head untied). So a tied
checkpoint is served untied: `untie_head(src, dst)` writes a copy whose config says
`tie_word_embeddings = false` and whose tensors carry `lm_head.weight`, and the trainer
publishes with the head written out (`WeightPublisher(untied_head=True)`). The served
model is the same function; only its storage differs.

The conversion is one script run by a python that has safetensors and torch: vLLM's
venv when AgentFlow launches the server, this environment for
`agentflow engine untie-head`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agentflow.errors import EngineError

UNTIE_SCRIPT = r"""
import json, os, shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
tmp = dst.with_name(dst.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
tmp.mkdir(parents=True)
for f in src.iterdir():
    if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
        shutil.copy2(f, tmp / f.name)
tensors = {}
for f in sorted(src.glob("*.safetensors")):
    tensors.update(load_file(f))
if "lm_head.weight" not in tensors:
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
config = json.loads((src / "config.json").read_text())
config["tie_word_embeddings"] = False
(tmp / "config.json").write_text(json.dumps(config, indent=2))
shutil.rmtree(dst, ignore_errors=True)
os.replace(tmp, dst)
"""


def is_tied(checkpoint: str | Path) -> bool:
    """Whether the checkpoint's config ties the output head to the input embedding
    (transformers' default when the key is absent)."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", True))


def untie_head(src: str | Path, dst: str | Path, *, python: str = sys.executable) -> Path:
    """Write `src` to `dst` with its output head untied (see the module docstring)."""
    done = subprocess.run(
        [python, "-c", UNTIE_SCRIPT, str(src), str(dst)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise EngineError(
            f"writing an untied copy of {src} to {dst} failed: {done.stderr.strip()[-500:]}"
        )
    return Path(dst)
