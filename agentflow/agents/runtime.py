"""What a running run's agents sample from: its policy engine and chat template.

The gateway holds one `PolicyRuntime` per live run in a `RuntimeRegistry`; the white-box
loop and the OpenAI-compatible proxy both look the run up there, so black-box and
white-box episodes of one run share the engine (and its KV caches) and record alike.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from agentflow.errors import NotFound
from agentflow.inference.base import Engine, SamplingParams
from agentflow.tokenization.chat import ChatTemplate


@dataclass
class PolicyRuntime:
    engine: Engine
    template: ChatTemplate
    model_name: str = "policy"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_context: int = 4096


class RuntimeRegistry:
    """Live runs' runtimes by run id."""

    def __init__(self) -> None:
        self._runtimes: dict[uuid.UUID, PolicyRuntime] = {}

    def register(self, run_id: uuid.UUID, runtime: PolicyRuntime) -> None:
        self._runtimes[run_id] = runtime

    def remove(self, run_id: uuid.UUID) -> PolicyRuntime | None:
        return self._runtimes.pop(run_id, None)

    def get(self, run_id: uuid.UUID | None) -> PolicyRuntime:
        if run_id is None or run_id not in self._runtimes:
            raise NotFound(f"run {run_id} has no live policy engine (is it running?)")
        return self._runtimes[run_id]

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._runtimes

    def items(self) -> list[tuple[uuid.UUID, PolicyRuntime]]:
        return list(self._runtimes.items())
