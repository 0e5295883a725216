"""`agentflow train` with `logger = ["tensorboard"]`: the event files hold every step's
metrics, and a checkpoint directory loads alone with `AutoTokenizer` and
`AutoModelForCausalLM`, producing the logits the project's own loader does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

STEPS = 3
CONFIG = """
name = "tracked"
seed = 1
logger = ["tensorboard"]
[model]
init = {{ layers = 1, hidden = 32, heads = 2, max_context = 256 }}
[engine]
type = "local"
max_batch_size = 16
[[envs]]
id = "agentflow/guess-number-v0"
max_concurrency = 16
[agent]
max_turns = 2
max_new_tokens = 6
[rollout]
group_size = 4
[trainer]
batch_episodes = 8
steps = {steps}
checkpoint_every = {steps}
run_dir = "{run_dir}"
"""


def train(config: Path, text: str) -> None:
    """`agentflow train` on `text`, written to `config`; it must succeed."""
    config.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "train", str(config)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_tensorboard_events_and_a_checkpoint_that_loads_with_transformers(tmp_path: Path) -> None:
    train(tmp_path / "run.toml", CONFIG.format(steps=STEPS, run_dir=tmp_path / "runs"))
    run_dir = tmp_path / "runs" / "tracked"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = events.Scalars("reward")
    assert [e.step for e in rewards] == [int(r["step"]) for r in rows] == [1, 2, 3]
    assert [e.value for e in rewards] == pytest.approx([r["reward"] for r in rows])
    assert "loss" in events.Tags()["scalars"]

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentflow.modeling import load_model
    from agentflow.tokenization.chat import ByteChatTemplate

    model_dir = run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    messages = [{"role": "user", "content": "Guess a number from 1 to 10."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(ids["input_ids"]) == ByteChatTemplate().render(messages).token_ids
    batch = torch.tensor([ids["input_ids"]])
    with torch.inference_mode():
        theirs = model(input_ids=batch).logits
        ours = load_model(model_dir)(input_ids=batch).logits
    assert torch.allclose(theirs, ours, atol=1e-5)


def test_a_lora_bf16_checkpointed_run_trains_and_exports(tmp_path: Path) -> None:
    """The trainer options through `agentflow train`: LoRA adapters under bf16 autocast
    with gradient checkpointing; the engine gets merged weights each step, and the
    checkpoint holds the merged model (loadable alone) and the adapters."""
    text = CONFIG.format(steps=2, run_dir=tmp_path / "runs")
    text = text.replace('name = "tracked"', 'name = "lora"').replace(
        'logger = ["tensorboard"]\n', ""
    )
    options = 'precision = "bf16"\ngradient_checkpointing = true\n'
    train(tmp_path / "run.toml", text + options + "[trainer.lora]\nrank = 4\nalpha = 8\n")
    run_dir = tmp_path / "runs" / "lora"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == [1, 2]
    # Each step published new (merged) weights to the engine.
    assert 1 <= rows[0]["weight_version"] < rows[1]["weight_version"]
    saved = run_dir / "checkpoints" / "step-00000002"
    assert (saved / "adapters.safetensors").is_file()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved / "model", local_files_only=True)
    assert not any("lora" in name for name in model.state_dict())
