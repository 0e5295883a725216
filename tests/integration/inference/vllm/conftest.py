"""A real vLLM server (vLLM's own venv, made by the README's test command with
`agentflow engine install-vllm`), started once per test session by the project's own
launcher and shared by the tests marked `vllm` (one xdist worker takes them all).

It serves `policy`: the black-box tests' tiny model (2 layers x 64, byte tokenizer),
taught to answer one lookup question with a real tool call; `other` has the same shapes
and other weights (a new version to publish); `misfit` has other shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentflow.inference.vllm import VLLMEngine, VLLMSettings
from agentflow.inference.vllm_checkpoint import untie_head
from agentflow.inference.vllm_install import DEFAULT_VENV, installed_version
from agentflow.inference.vllm_server import VLLMServer
from agentflow.modeling import ModelInit, build_model, save_model
from agentflow.run_config import VLLMLaunchConfig
from agentflow.tokenization.chat import ByteChatTemplate
from envs.builtin.lookup import LookupEnv
from tests.integration.agents.blackbox.conftest import TINY
from tests.support.teach import teach

REPO = Path(__file__).resolve().parents[4]
VENV = Path(os.environ.get("AGENTFLOW_TEST_VLLM_VENV", REPO / DEFAULT_VENV))
MAX_MODEL_LEN = 1024
PLUGINS = REPO / "tests" / "support" / "vllm_plugins"
SYSTEM = {"role": "system", "content": "Find the pet with the lookup tool, then answer."}


@dataclass(frozen=True)
class Checkpoints:
    tied: Path  # the policy as the trainer saves it: output head tied to the embedding
    policy: Path  # ...and untied, served at the start
    other: Path  # the same shapes, other weights
    misfit: Path  # other shapes
    lookup_key: str  # what the policy's tool call looks up
    prompt: tuple[int, ...]  # the lookup question, rendered with its tools
    messages: list[dict[str, Any]]  # ...as chat messages
    tools: list[dict[str, Any]]


@dataclass(frozen=True)
class Served:
    url: str
    server: VLLMServer
    checkpoints: Checkpoints
    pace_file: Path  # while it exists, each decoding step sleeps the seconds it holds

    @contextlib.contextmanager
    def paced(self, seconds_per_step: float) -> Iterator[None]:
        """Slow the server's decoding (tests/support/vllm_plugins) for what must land
        mid-answer; the tokens and log-probs stay the model's."""
        self.pace_file.write_text(str(seconds_per_step))
        try:
            yield
        finally:
            self.pace_file.unlink(missing_ok=True)


def lookup_prompt() -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """The first request of `LookupEnv(hops=2)` at seed 7: messages, tools, the key."""
    env = LookupEnv(hops=2)
    first = asyncio.run(env.reset(seed=7))
    person = env.question.split("does ")[1].split("'s")[0]
    messages = [SYSTEM, *[dict(m) for m in first.observation.messages]]
    return messages, env.tools(), f"{person}.friend"


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    root = tmp_path_factory.mktemp("vllm-checkpoints")
    messages, tools, key = lookup_prompt()
    template = ByteChatTemplate()
    prompt = template.render(messages, tools=tools).token_ids
    call = json.dumps({"name": "lookup", "arguments": {"key": key}})
    target = [
        *template.tokenizer.encode(f"<|tool_call|>{call}<|/tool_call|>", allow_special=True),
        template.tokenizer.end_id,
    ]
    # Served untied, as AgentFlow serves a tied checkpoint on vLLM (vllm_checkpoint.py).
    python = str(vllm_python())
    tied = save_model(teach(TINY, prompt, target, steps=200), root / "policy-tied")
    policy = untie_head(tied, root / "policy", python=python)
    other = untie_head(
        save_model(build_model(TINY, seed=1), root / "other-tied"), root / "other", python=python
    )
    misfit = save_model(
        build_model(ModelInit(layers=2, hidden=128, heads=4, max_context=512), seed=0),
        root / "misfit",
    )
    return Checkpoints(
        tied=tied,
        policy=policy,
        other=other,
        misfit=misfit,
        lookup_key=key,
        prompt=tuple(prompt),
        messages=messages,
        tools=tools,
    )


def vllm_python() -> Path:
    if installed_version(VENV) is None:
        pytest.fail(
            f"no vLLM in {VENV}: the README's test command makes it "
            "(`agentflow engine install-vllm`)",
            pytrace=False,
        )
    return VENV / "bin" / "python"


def launch_config(**update: object) -> VLLMLaunchConfig:
    return VLLMLaunchConfig(
        python=str(vllm_python()),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=1,
        **update,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="session")
def vllm_server(
    vllm_checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    pace_file = logs / "pace"
    server = VLLMServer(
        launch_config(
            extra_args=["--logits-processors", "agentflow_test_pacing:PacingLogitsProcessor"],
            env={"PYTHONPATH": str(PLUGINS), "AGENTFLOW_TEST_VLLM_PACE_FILE": str(pace_file)},
        ),
        str(vllm_checkpoints.policy),
        log_dir=logs,
    )
    url = server.start()
    try:
        yield Served(url=url, server=server, checkpoints=vllm_checkpoints, pace_file=pace_file)
    finally:
        server.stop()


def client_of(served: Served) -> VLLMEngine:
    """A client of the shared server (not its owner: closing it leaves the server up)."""
    return VLLMEngine(
        VLLMSettings(
            url=served.url,
            reference_checkpoint=str(served.checkpoints.policy),
            vocab_size=ByteChatTemplate().tokenizer.vocab_size,
        )
    )
