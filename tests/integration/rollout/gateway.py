"""The gateway app in the test's process for run tests: its lifespan running (recovery
included), the typed client and a raw one on it; and waiting for a run's state."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from agentflow.api.app import create_app
from agentflow.client import AsyncClient
from agentflow.config import Settings


@contextlib.asynccontextmanager
async def serve_gateway(
    settings: Settings,
) -> AsyncIterator[tuple[AsyncClient, httpx.AsyncClient]]:
    """One app on `settings`; a second one on the same settings is a gateway restart."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with (
            AsyncClient("http://gateway", transport=transport) as client,
            httpx.AsyncClient(transport=transport, base_url="http://gateway") as raw,
        ):
            yield client, raw


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
