from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.agents.runtime import PolicyRuntime
from agentflow.db.session import create_engine, session_factory
from agentflow.inference.base import SamplingParams
from agentflow.inference.local import LocalEngine
from agentflow.modeling import ModelInit
from agentflow.tokenization.chat import ByteChatTemplate
from tests.support.engine import RecordingEngine

TINY = ModelInit(layers=2, hidden=64, heads=2, max_context=1024)


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
        engine=RecordingEngine(local_engine),
        template=ByteChatTemplate(),
        sampling=sampling,
        max_context=TINY.max_context,
    )
