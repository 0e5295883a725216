"""`LoopServer` (the gateway under Ray, the dashboard, env servers as actors) keeps idle
keep-alive connections as `agentflow serve` does (tests/integration/test_serve.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from agentflow.api.loop_server import LoopServer

pytestmark = pytest.mark.integration


async def test_an_idle_connection_outlives_a_stock_clients_pool() -> None:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"status": "ok"}

    stock_expiry = httpx.Limits().keepalive_expiry
    assert stock_expiry is not None
    # A pool that keeps the connection longer than a stock one, to see whether the server
    # closes it first (the pool would then open another, from another local port).
    limits = httpx.Limits(keepalive_expiry=stock_expiry + 60)
    async with (
        LoopServer(app, "127.0.0.1", 0) as server,
        httpx.AsyncClient(limits=limits) as client,
    ):
        url = f"http://127.0.0.1:{server.port}/ping"
        first = await client.get(url)
        first_port = _client_port(first)
        await asyncio.sleep(stock_expiry + 1)
        second = await client.get(url)
        second_port = _client_port(second)
    assert first.status_code == second.status_code == 200
    assert second_port == first_port  # the same connection


def _client_port(response: httpx.Response) -> int:
    """The local port of the connection a response came on (while it is open)."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])
