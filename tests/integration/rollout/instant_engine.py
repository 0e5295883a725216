"""An engine that answers at once ("7" then the stop id): the scheduler's tests are about
admission, so the engine only has to keep the protocol and tag weight versions."""

from __future__ import annotations

import asyncio
import uuid

from agentflow.inference.base import (
    EngineInfo,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    VersionSpan,
    WeightUpdate,
)


class InstantEngine:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.weight_version = 0
        self.running = 0
        self.peak = 0
        self._resumed = asyncio.Event()
        self._resumed.set()

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        await self._resumed.wait()
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.running -= 1
        stop = req.sampling.stop_token_ids[:1]
        output = [ord("7"), *stop]
        return GenerateResult(
            rid=req.rid,
            output_ids=output,
            logprobs=[-0.1] * len(output),
            finish_reason="stop",
            weight_versions=[VersionSpan(version=self.weight_version, start=0, end=len(output))],
            prompt_tokens=len(req.input_ids),
        )

    async def open_session(self, session_id: str | None = None) -> str:
        return session_id or uuid.uuid4().hex

    async def close_session(self, session_id: str) -> None:
        return None

    async def abort(self, rid: str) -> None:
        return None

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    async def update_weights(self, update: WeightUpdate) -> int:
        self.weight_version = update.version or self.weight_version + 1
        return self.weight_version

    async def info(self) -> EngineInfo:
        return EngineInfo(
            model="instant",
            vocab_size=266,
            max_context=4096,
            weight_version=self.weight_version,
            running=self.running,
            extra={"max_batch_size": 8},
        )

    async def close(self) -> None:
        return None
