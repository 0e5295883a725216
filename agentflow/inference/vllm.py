"""`VLLMEngine`: the `Engine` protocol over one vLLM 0.32 server's HTTP routes.

vLLM keeps no sessions: this client does. A session is the contexts (prompt + output) of
its finished requests by rid, and a request that continues one sends the whole context
again; the server's prefix cache finds the shared part (`cached_tokens` says how much),
which is why a session must keep hitting one server (`EnginePool` routes by session).

- Generation: `/inference/v1/generate`, token ids in and out, the sampled tokens'
  log-probs, and vLLM's own `weight_versions` spans.
- Pause: the project's `retract` and `in_place` are vLLM's `keep` (requests stay in the
  server and go on at `/resume` on the weights loaded then, so their spans split at the
  update); after a reload under `retract` they are preempted with the prefix cache
  (`/reset_prefix_cache?reset_running_requests=true`), so their KV is computed again by
  the new weights, where `in_place` keeps it. `abort` is `abort` (running requests end
  with their partial output; the run's `PolicyRuntime` resubmits them).
- Weights: from a directory only (`/collective_rpc reload_weights`, then
  `/update_weight_version`), checked against the served model's tensors first, because
  a failed reload ends vLLM's engine (`vllm_wire.compare_checkpoints`).
- A server that stops answering raises `EngineLost`, so a pool moves its sessions to a
  live server (or replaces a server it launched) and the agent sends the turn again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from agentflow.errors import (
    EngineError,
    EngineLost,
    EngineRequestError,
    EngineUnavailable,
    NotFound,
)
from agentflow.inference import vllm_wire as wire
from agentflow.inference.base import (
    EngineInfo,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    WeightUpdate,
    next_weight_version,
)
from agentflow.inference.sglang_http import RetryPolicy, call, expect_dict
from agentflow.inference.sglang_wire import version_from_wire

log = logging.getLogger(__name__)


class ServerProcess(Protocol):
    """A server this client's owner started: stopped with the engine."""

    def alive(self) -> bool: ...

    def stop(self) -> None: ...


class VLLMSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="the server, `http://host:port`")
    served_model: str | None = Field(default=None, description="`--served-model-name`")
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    generate_timeout_s: float = Field(default=600.0, gt=0, description="per generation")
    control_timeout_s: float = Field(default=30.0, gt=0)
    weight_update_timeout_s: float = Field(default=1800.0, gt=0)
    vocab_size: int = Field(default=0, ge=0, description="what info() reports")
    max_connections: int = Field(default=1024, ge=1, description="generations in flight")
    connections_per_client: int = Field(default=16, ge=1, description="see SGLangSettings")
    reference_checkpoint: str | None = Field(
        default=None,
        description="a local directory of the served model's tensors, against which a new "
        "version is checked before vLLM loads it; None: the server's own model directory "
        "when it is readable here",
    )


class VLLMEngine:
    """One vLLM server; see the module docstring."""

    def __init__(
        self,
        settings: VLLMSettings,
        *,
        server: ServerProcess | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.settings = settings
        self.server = server
        self._url = settings.url.rstrip("/")
        self._own_client = client is None
        per = min(settings.max_connections, settings.connections_per_client)
        limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
        count = -(-settings.max_connections // settings.connections_per_client)
        self._clients = (
            [client]
            if client is not None
            else [httpx.AsyncClient(limits=limits) for _ in range(count)]
        )
        self._next_client = itertools.count()
        self._sessions: dict[str, dict[str, tuple[int, ...]]] = {}
        self._version: int | None = None
        self._paused: PauseMode | None = None
        self._running = 0
        self._served: wire.TensorShapes | None = None
        self.prefix_cache_resets_refused = 0
        self._closed = False

    @property
    def url(self) -> str:
        return self._url

    # ---- generation -------------------------------------------------------------------

    def _context(self, req: GenerateRequest) -> tuple[int, ...]:
        if req.session is None or req.session.parent_rid is None:
            if req.session is not None and req.session.session_id not in self._sessions:
                raise EngineRequestError(f"unknown session {req.session.session_id!r}")
            return req.input_ids
        contexts = self._sessions.get(req.session.session_id)
        if contexts is None:
            raise EngineRequestError(f"unknown session {req.session.session_id!r}")
        parent = contexts.get(req.session.parent_rid)
        if parent is None:
            raise EngineRequestError(
                f"unknown parent rid {req.session.parent_rid!r} in session "
                f"{req.session.session_id!r}"
            )
        offset = req.session.offset
        if offset is not None and offset > len(parent):
            raise EngineRequestError(
                f"offset {offset} is past the parent's context of {len(parent)} tokens"
            )
        return (parent if offset is None else parent[:offset]) + req.input_ids

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if req.image_data:
            raise EngineRequestError("the vLLM engine serves text models here: no image_data")
        context = self._context(req)
        if not context:
            raise EngineRequestError("a generation needs at least one context token")
        version = self._version if self._version is not None else 0
        client = self._clients[next(self._next_client) % len(self._clients)]
        self._running += 1
        try:
            answer = await self._call(
                "POST",
                wire.GENERATE_ROUTE,
                body=wire.generate_body(
                    req.rid, list(context), req.sampling, self.settings.served_model
                ),
                timeout_s=self.settings.generate_timeout_s,
                client=client,
                # A keep-alive connection the server closed as the request went out fails
                # with a read error; the retry first aborts the rid, in case an attempt
                # did reach the server (the server keeps one request per id).
                before_retry=lambda: self._call(
                    "POST",
                    "/abort_requests",
                    body={"request_ids": [wire.internal_id(req.rid)]},
                    retry=False,
                ),
            )
        finally:
            self._running -= 1
        result = wire.parse_generate(
            answer,
            req.rid,
            prompt_tokens=len(context),
            top_k=req.sampling.top_logprobs,
            version=version,
        )
        if req.session is not None:
            contexts = self._sessions.get(req.session.session_id)
            if contexts is not None:  # closed meanwhile: nothing to keep
                contexts[req.rid] = context + tuple(result.output_ids)
        return result

    async def open_session(self, session_id: str | None = None) -> str:
        sid = session_id or uuid.uuid4().hex
        if sid in self._sessions:
            raise EngineRequestError(f"session {sid!r} is already open")
        self._sessions[sid] = {}
        return sid

    async def close_session(self, session_id: str) -> None:
        if self._sessions.pop(session_id, None) is None:
            raise NotFound(f"unknown session {session_id!r}")

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_requests", body={"request_ids": [wire.internal_id(rid)]})

    # ---- pause, weights ---------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        mode = PauseMode(mode)
        vllm_mode = "abort" if mode is PauseMode.ABORT else "keep"
        await self._call("POST", f"/pause?mode={vllm_mode}")
        self._paused = mode

    async def resume(self) -> None:
        await self._call("POST", "/resume")
        self._paused = None

    async def current_version(self) -> int:
        answer = expect_dict(await self._call("GET", "/weight_info"), "/weight_info")
        return version_from_wire(answer.get("weight_version"))

    async def update_weights(self, update: WeightUpdate) -> int:
        """Reload from `update.path` on the server, then label the version. A directory
        whose tensors do not fit the served model is refused here, naming them."""
        if update.path is None:
            raise EngineRequestError(
                "the vLLM engine loads weights from a directory: publish with "
                '`weights.sync = "disk"`'
            )
        current = self._version if self._version is not None else await self.current_version()
        version = next_weight_version(current, update)
        served = await asyncio.to_thread(self._served_tensors)
        if served is not None:
            new = await asyncio.to_thread(wire.checkpoint_tensors, update.path)
            try:
                wire.compare_checkpoints(served, new, update.path)
            except EngineError as exc:
                raise EngineRequestError(str(exc)) from None
        try:
            await self._call(
                "POST",
                "/collective_rpc",
                body=wire.reload_body(update.path),
                timeout_s=self.settings.weight_update_timeout_s,
                retry=False,
            )
        except EngineRequestError:
            raise
        except EngineLost:
            raise
        except EngineUnavailable as exc:
            raise EngineRequestError(f"vLLM did not load {update.path}: {exc}") from exc
        await self._call("POST", "/update_weight_version", body=wire.version_body(version))
        self._version = version
        await self._reset_prefix_cache()
        return version

    async def _reset_prefix_cache(self) -> None:
        """Cached prefixes were computed by the old weights, so the cache is emptied.
        Paused with `retract`, the kept requests are preempted too
        (`reset_running_requests`): they go back to the queue and their KV is computed
        again, on the new weights, when they resume. With `in_place` they keep their KV,
        and vLLM refuses the reset while they hold blocks: then the old prefixes stay
        until evicted, counted in `info().extra`."""
        retract = self._paused is PauseMode.RETRACT
        query = "?reset_running_requests=true" if retract else ""
        answer = await self._call("POST", f"/reset_prefix_cache{query}")
        if isinstance(answer, dict) and answer.get("success") is False:
            self.prefix_cache_resets_refused += 1
            log.info("vLLM at %s kept its prefix cache (requests hold blocks)", self._url)

    def _served_tensors(self) -> wire.TensorShapes | None:
        if self._served is None:
            reference = self.settings.reference_checkpoint
            if reference is None:
                return None
            self._served = wire.checkpoint_tensors(reference)
        return self._served

    # ---- info ---------------------------------------------------------------------------

    async def model_card(self) -> dict[str, Any]:
        """The served model as `/v1/models` lists it (`root`, `max_model_len`)."""
        answer = expect_dict(await self._call("GET", "/v1/models"), "/v1/models")
        models = answer.get("data") or []
        if not models:
            raise EngineError(f"vLLM at {self._url} serves no model")
        return dict(models[0])

    async def accepts_images(self) -> bool:
        return False

    async def info(self) -> EngineInfo:
        card = await self.model_card()
        return EngineInfo(
            model=str(card.get("root") or card.get("id") or ""),
            vocab_size=self.settings.vocab_size,
            max_context=int(card.get("max_model_len") or 0),
            weight_version=await self.current_version(),
            running=self._running,
            paused=self._paused is not None,
            sessions=len(self._sessions),
            extra={
                "url": self._url,
                "server": "vllm",
                "prefix_cache_resets_refused": self.prefix_cache_resets_refused,
            },
        )

    async def close(self) -> None:
        self._closed = True
        try:
            if self._own_client:
                for client in self._clients:
                    await client.aclose()
        finally:
            if self.server is not None:
                await asyncio.to_thread(self.server.stop)

    # ---- one call -----------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        retry: bool = True,
        client: httpx.AsyncClient | None = None,
        before_retry: Callable[[], Awaitable[object]] | None = None,
    ) -> Any:
        """One call; a server that is gone is `EngineLost`, naming it."""
        try:
            return await call(
                client or self._clients[0],
                method,
                f"{self._url}{path}",
                policy=self.settings.retry,
                timeout_s=timeout_s or self.settings.control_timeout_s,
                body=body,
                retry=retry,
                before_retry=before_retry,
            )
        except EngineRequestError:
            raise
        except EngineUnavailable as exc:
            if await self._gone():
                raise EngineLost(f"the vLLM server at {self._url} is gone: {exc}") from exc
            raise
        except RuntimeError as exc:
            # A call still retrying when its engine was found dead and closed (by the
            # pool, from another request) meets a closed client: the engine is lost.
            if self._closed:
                raise EngineLost(f"the vLLM server at {self._url} is gone ({exc})") from exc
            raise

    async def _gone(self) -> bool:
        """Whether the server is dead rather than slow: its process ended (one this side
        started), or nothing answers on its port."""
        if self._closed or (self.server is not None and not self.server.alive()):
            return True
        try:
            await self._clients[0].get(f"{self._url}/health", timeout=5.0)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            return False
        return False
