from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.agents.runtime import PolicyRuntime
from agentflow.db.session import create_engine, session_factory
from agentflow.inference.base import GenerateRequest, GenerateResult, SamplingParams
from agentflow.inference.local import LocalEngine
from agentflow.modeling import ModelInit
from agentflow.tokenization.chat import ByteChatTemplate

TINY = ModelInit(layers=2, hidden=64, heads=2, max_context=1024)


@dataclass
class RecordingEngine:
    """Wraps an engine and keeps, per request, the full context it saw and what it made."""

    inner: LocalEngine
    contexts: dict[str, list[int]] = field(default_factory=dict)
    results: dict[str, GenerateResult] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        prefix: list[int] = []
        if req.session is not None and req.session.parent_rid is not None:
            parent = req.session.parent_rid
            prefix = self.contexts[parent] + self.results[parent].output_ids
        result = await self.inner.generate(req)
        self.contexts[req.rid] = prefix + list(req.input_ids)
        self.results[req.rid] = result
        self.order.append(req.rid)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(database_url)
    yield session_factory(engine)
    await engine.dispose()


@pytest.fixture
async def local_engine() -> AsyncIterator[LocalEngine]:
    engine = LocalEngine.from_init(TINY, seed=0, max_batch_size=64)
    yield engine
    await engine.close()


@pytest.fixture
def runtime(local_engine: LocalEngine) -> PolicyRuntime:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=None)
    return PolicyRuntime(
        engine=RecordingEngine(local_engine),  # type: ignore[arg-type]
        template=ByteChatTemplate(),
        sampling=sampling,
        max_context=TINY.max_context,
    )
