"""Manage the workers behind an `sglang-router` (0.3.2) at run time.

The router's `/workers` API is asynchronous: `POST /workers {url}` answers 202 with a
`worker_id` and registers the worker in the background (health check, metadata
discovery), and `DELETE /workers/{id}` answers 202 and removes it later. `add` and `remove`
therefore wait until `GET /workers` shows the change, so a caller can route to the new
worker (or be sure nothing goes to the old one) as soon as they return.

The router forwards only `/generate` (and a few read routes) to workers; control routes
such as `/pause_generation` or `/update_weights_from_disk` answer 404 there, so the
engine client sends those to every worker URL listed here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
from pydantic import BaseModel

from agentflow.errors import EngineRequestError, EngineUnavailable
from agentflow.inference.sglang_http import RetryPolicy, call, expect_dict


class RouterWorker(BaseModel):
    id: str
    url: str
    is_healthy: bool


class RouterWorkers:
    def __init__(
        self,
        router_url: str,
        *,
        client: httpx.AsyncClient | None = None,
        policy: RetryPolicy | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._url = router_url.rstrip("/")
        self._own_client = client is None
        self._client = client or httpx.AsyncClient()
        self._policy = policy or RetryPolicy()
        self._timeout_s = timeout_s

    async def list_workers(self) -> list[RouterWorker]:
        answer = expect_dict(
            await call(
                self._client,
                "GET",
                f"{self._url}/workers",
                policy=self._policy,
                timeout_s=self._timeout_s,
            ),
            "GET /workers",
        )
        return [RouterWorker.model_validate(w) for w in answer.get("workers", [])]

    async def add(self, url: str, *, wait_s: float = 30.0) -> str:
        """Register `url`; return its worker id once the router routes to it."""
        answer = expect_dict(
            await call(
                self._client,
                "POST",
                f"{self._url}/workers",
                policy=self._policy,
                timeout_s=self._timeout_s,
                body={"url": url},
            ),
            "POST /workers",
        )
        worker_id = str(answer["worker_id"])
        await self._wait(
            lambda ws: any(w.url == url and w.is_healthy for w in ws),
            wait_s,
            f"worker {url} to become healthy behind the router",
        )
        return worker_id

    async def remove(self, worker_id: str, *, wait_s: float = 30.0) -> None:
        """Deregister a worker; return once the router no longer lists it."""
        await call(
            self._client,
            "DELETE",
            f"{self._url}/workers/{worker_id}",
            policy=self._policy,
            timeout_s=self._timeout_s,
        )
        await self._wait(
            lambda ws: all(w.id != worker_id for w in ws),
            wait_s,
            f"worker {worker_id} to leave the router",
        )

    async def worker_id(self, url: str) -> str:
        for worker in await self.list_workers():
            if worker.url == url.rstrip("/"):
                return worker.id
        raise EngineRequestError(f"the router lists no worker at {url}")

    async def _wait(
        self, done: Callable[[list[RouterWorker]], bool], wait_s: float, what: str
    ) -> None:
        deadline = time.monotonic() + wait_s
        delay = 0.02
        while True:
            if done(await self.list_workers()):
                return
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"timed out after {wait_s}s waiting for {what}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def close(self) -> None:
        if self._own_client:
            await self._client.aclose()
