"""`SGLangEngine`: the `Engine` protocol over HTTP, for SGLang 0.5.23 and sglang-router 0.3.2.

Where requests go:

- `/generate` goes to `url`: one SGLang server, or an sglang-router in front of several.
  Behind `sglang-router --policy manual`, the request's `routing_key` travels in the
  `x-smg-routing-key` header, and every request with the same key lands on the same worker,
  which is what sessions need (a session's KV and request tree live on one server).
- Control routes (sessions, abort, pause/continue, weight updates, `/model_info`) go to
  every worker: the router answers 404 to all of them. The workers are `worker_urls`, or,
  with `behind_router`, whatever the router's `GET /workers` lists at the time of the call.
  A session is opened on every worker under one id, so whichever worker its routing key
  picks already knows it.

Partial rollouts: with `resubmit_aborted`, a request that comes back with finish_reason
`abort` (a `pause(abort)` for a weight update, say) is sent again once this client has
resumed the engine, as `input_ids + partial output` with `max_new_tokens` reduced by what
was produced, under the same rid and session parent; the pieces are stitched so the caller
sees one result whose version spans show which weights made which tokens. A request this
client aborted itself (`abort(rid)`) is never resubmitted. When another process paused the
servers, the resubmission goes out at once and the server holds it until it continues.
A greedy continuation is token for token what an uninterrupted request would give; a
seeded one restarts its seed, so its tokens differ from an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Awaitable
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from agentflow.errors import EngineRequestError, EngineUnavailable
from agentflow.inference import sglang_wire as wire
from agentflow.inference.base import (
    EngineInfo,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    TokenObserver,
    WeightGroup,
    WeightUpdate,
)
from agentflow.inference.sglang_http import (
    RetryPolicy,
    call,
    call_stream,
    expect_dict,
    expect_success,
)
from agentflow.inference.sglang_router import RouterWorkers


class SGLangSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="where /generate goes: an SGLang server or an sglang-router")
    worker_urls: tuple[str, ...] = Field(
        default=(), description="servers that take control routes; empty: `url` itself"
    )
    behind_router: bool = Field(
        default=False, description="`url` is a router: find the workers with GET /workers"
    )
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    generate_timeout_s: float = Field(default=600.0, gt=0, description="per /generate attempt")
    control_timeout_s: float = Field(default=30.0, gt=0, description="per control attempt")
    weight_update_timeout_s: float = Field(
        default=1800.0, gt=0, description="per weight-update attempt (it blocks until loaded)"
    )
    session_capacity: int = Field(
        default=1 << 20, ge=1, description="`capacity_of_str_len` sent to /open_session"
    )
    resubmit_aborted: bool = Field(
        default=False, description="continue requests aborted by a pause (partial rollout)"
    )
    max_resubmits: int = Field(default=16, ge=0, description="resubmissions per request")
    vocab_size: int = Field(
        default=0, ge=0, description="what info() reports: SGLang's routes do not say"
    )
    resume_wait_s: float = Field(
        default=3600.0, gt=0, description="how long an aborted request waits for resume()"
    )
    accepts_images: bool | None = Field(
        default=None,
        description="the served model takes images; None: ask /model_info "
        "(`has_image_understanding`) once",
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="HTTP connections to the servers: at least the generations in flight "
        "(the run's concurrent episodes), or requests queue in the client's pool",
    )
    connections_per_client: int = Field(
        default=16,
        ge=1,
        description="connections per pooled client: one httpx pool of hundreds of "
        "connections spends seconds of CPU a round assigning them (bench/gateway_overhead.py "
        "--pool), so generations spread over several small ones",
    )

    def http_limits(self) -> httpx.Limits:
        """The limits of each of the `clients()` pools."""
        per = min(self.max_connections, self.connections_per_client)
        return httpx.Limits(max_connections=per, max_keepalive_connections=per)

    def clients(self) -> int:
        return -(-self.max_connections // self.connections_per_client)


class SGLangEngine:
    """Talks to SGLang servers; see the module docstring for where each call goes."""

    def __init__(self, settings: SGLangSettings, *, client: httpx.AsyncClient | None = None):
        self.settings = settings
        self._url = settings.url.rstrip("/")
        self._own_client = client is None
        # Generations go round-robin over small pools (`connections_per_client`); control
        # calls use the first. An injected client is used alone.
        self._generate_clients = (
            [client]
            if client is not None
            else [
                httpx.AsyncClient(limits=settings.http_limits()) for _ in range(settings.clients())
            ]
        )
        self._next_client = itertools.count()
        self._client = self._generate_clients[0]
        self._router = RouterWorkers(
            self._url,
            client=self._client,
            policy=settings.retry,
            timeout_s=settings.control_timeout_s,
        )
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._in_flight: set[str] = set()
        self._aborted_by_caller: set[str] = set()  # never resubmit these
        self._version: int | None = None
        self._images: bool | None = settings.accepts_images

    # ---- generation -------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        return await self.generate_observed(req, None)

    async def generate_observed(
        self, req: GenerateRequest, observer: TokenObserver | None
    ) -> GenerateResult:
        """`generate`; with `observer`, streamed (`/generate` with `stream: true`) and
        shown the tokens chunk by chunk (`StreamingEngine`)."""
        self._in_flight.add(req.rid)
        try:
            return await self._generate_resubmitting(req, observer)
        finally:
            self._in_flight.discard(req.rid)
            self._aborted_by_caller.discard(req.rid)

    async def _generate_resubmitting(
        self, req: GenerateRequest, observer: TokenObserver | None
    ) -> GenerateResult:
        result = await self._generate_once(req, observer)
        resubmits = 0
        while (
            result.finish_reason == "abort"
            and self.settings.resubmit_aborted
            and req.rid not in self._aborted_by_caller
            and resubmits < self.settings.max_resubmits
        ):
            remaining = req.sampling.max_new_tokens - len(result.output_ids)
            if remaining <= 0:
                return result.model_copy(update={"finish_reason": "length"})
            await self._wait_resumed(req.rid)
            if req.rid in self._aborted_by_caller:
                break
            more = req.model_copy(
                update={
                    "input_ids": req.input_ids + tuple(result.output_ids),
                    "sampling": req.sampling.model_copy(update={"max_new_tokens": remaining}),
                }
            )
            result = wire.stitch(result, await self._generate_once(more, observer))
            resubmits += 1
        return result

    async def _generate_once(
        self, req: GenerateRequest, observer: TokenObserver | None = None
    ) -> GenerateResult:
        headers = {wire.ROUTING_KEY_HEADER: req.routing_key} if req.routing_key else None
        clients = self._generate_clients
        client = clients[next(self._next_client) % len(clients)]

        # A timed-out attempt may still run on the server, holding the rid: free it.
        def free_rid() -> Awaitable[object]:
            return self._broadcast("/abort_request", {"rid": req.rid}, retry=False)

        if observer is not None:
            streamed = wire.StreamedAnswer()

            def on_chunk(chunk: dict[str, Any]) -> None:
                ids, logprobs = streamed.add(chunk)
                if ids:
                    observer(ids, logprobs)

            await call_stream(
                client,
                f"{self._url}/generate",
                policy=self.settings.retry,
                timeout_s=self.settings.generate_timeout_s,
                body=wire.generate_body(req, stream=True),
                on_chunk=on_chunk,
                headers=headers,
                before_retry=free_rid,
            )
            return wire.parse_generate(streamed.answer(), req.rid)
        answer = await call(
            client,
            "POST",
            f"{self._url}/generate",
            policy=self.settings.retry,
            timeout_s=self.settings.generate_timeout_s,
            body=wire.generate_body(req),
            headers=headers,
            before_retry=free_rid,
        )
        return wire.parse_generate(answer, req.rid)

    async def _wait_resumed(self, rid: str) -> None:
        try:
            async with asyncio.timeout(self.settings.resume_wait_s):
                await self._resumed.wait()
        except TimeoutError:
            raise EngineUnavailable(
                f"request {rid} was aborted and the engine was not resumed within "
                f"{self.settings.resume_wait_s}s"
            ) from None

    # ---- control routes, sent to every worker -------------------------------------------

    async def worker_urls(self) -> list[str]:
        if self.settings.worker_urls:
            return [u.rstrip("/") for u in self.settings.worker_urls]
        if self.settings.behind_router:
            urls = [w.url.rstrip("/") for w in await self._router.list_workers()]
            if not urls:
                raise EngineUnavailable(f"the router at {self._url} lists no workers")
            return urls
        return [self._url]

    async def _broadcast(
        self,
        path: str,
        body: dict[str, Any] | None,
        *,
        timeout_s: float | None = None,
        retry: bool = True,
    ) -> list[Any]:
        urls = await self.worker_urls()
        return list(
            await asyncio.gather(
                *(
                    call(
                        self._client,
                        "POST",
                        f"{u}{path}",
                        policy=self.settings.retry,
                        timeout_s=timeout_s or self.settings.control_timeout_s,
                        body=body,
                        retry=retry,
                    )
                    for u in urls
                )
            )
        )

    async def open_session(self, session_id: str | None = None) -> str:
        # Name it here: each worker must hold the session under the same id.
        body = wire.open_session_body(
            self.settings.session_capacity, session_id or uuid.uuid4().hex
        )
        answers = await self._broadcast("/open_session", body)
        if len({str(a) for a in answers}) != 1 or not isinstance(answers[0], str):
            raise EngineUnavailable(f"workers answered /open_session with {answers!r}")
        return answers[0]

    async def close_session(self, session_id: str) -> None:
        await self._broadcast("/close_session", wire.close_session_body(session_id))

    async def abort(self, rid: str) -> None:
        if rid in self._in_flight:
            self._aborted_by_caller.add(rid)
        await self._broadcast("/abort_request", {"rid": rid})

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self._resumed.clear()
        await self._broadcast("/pause_generation", {"mode": PauseMode(mode).value})

    async def resume(self) -> None:
        await self._broadcast("/continue_generation", {})
        self._resumed.set()

    async def current_version(self) -> int:
        answer = expect_dict(await self._get_first("/model_info"), "/model_info")
        return wire.version_from_wire(answer.get("weight_version"))

    async def update_weights(self, update: WeightUpdate) -> int:
        """Load a safetensors directory on every worker (`/update_weights_from_disk`), or
        receive a trainer's broadcast over a group the workers joined
        (`/update_weights_from_distributed`, one call per bucket, the cache flushed with
        the last).

        Tensors held in this process reach SGLang through CUDA IPC instead:
        `update_weights_from_tensor`.
        """
        if update.broadcast is not None:
            return await self._receive_broadcast(update)
        if update.path is None:
            raise EngineRequestError(
                "SGLangEngine loads weights from a directory or a trainer's broadcast; send "
                "in-memory tensors with update_weights_from_tensor"
            )
        version = update.version if update.version is not None else await self._next_version()
        answers = await self._broadcast(
            "/update_weights_from_disk",
            wire.disk_update_body(update.path, version),
            timeout_s=self.settings.weight_update_timeout_s,
        )
        for answer in answers:
            expect_success(answer, "/update_weights_from_disk")
        self._version = version
        return version

    async def _receive_broadcast(self, update: WeightUpdate) -> int:
        assert update.broadcast is not None
        version = update.version if update.version is not None else await self._next_version()
        buckets = update.broadcast.buckets
        for k, bucket in enumerate(buckets):
            # Sequential: each call returns when the trainer's broadcast of that bucket has
            # ended, and the trainer sends the buckets in this order.
            await self.update_weights_from_distributed(
                names=bucket.names,
                dtypes=bucket.dtypes,
                shapes=bucket.shapes,
                group_name=update.broadcast.group_name,
                version=version,
                flush_cache=k == len(buckets) - 1,
            )
        return version

    async def weight_group_ranks(self) -> int:
        """Every worker's tensor-parallel size (`/server_info`), added up."""
        return sum([await self._tp_size(url) for url in await self.worker_urls()])

    async def join_weight_group(self, group: WeightGroup) -> None:
        """Every worker joins `group`, its ranks after the previous worker's, all at once
        (the group forms only when every rank and the trainer have joined)."""
        urls = await self.worker_urls()
        offsets, offset = [], group.rank_offset
        for url in urls:
            offsets.append(offset)
            offset += await self._tp_size(url)
        await asyncio.gather(
            *(
                self.init_weights_update_group(
                    master_address=group.master_address,
                    master_port=group.master_port,
                    rank_offset=first,
                    world_size=group.world_size,
                    group_name=group.group_name,
                    backend=group.backend,
                    worker_url=url,
                )
                for url, first in zip(urls, offsets, strict=True)
            )
        )

    async def _tp_size(self, url: str) -> int:
        info = expect_dict(
            await call(
                self._client,
                "GET",
                f"{url}/server_info",
                policy=self.settings.retry,
                timeout_s=self.settings.control_timeout_s,
            ),
            "/server_info",
        )
        return int(info.get("tp_size") or 1)

    async def _next_version(self) -> int:
        return (self._version if self._version is not None else await self.current_version()) + 1

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        worker_url: str | None = None,
    ) -> None:
        """Ask one worker to join the trainer's broadcast group (the trainer is rank 0)."""
        url = (worker_url or (await self.worker_urls())[0]).rstrip("/")
        body = wire.distributed_group_body(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        answer = await call(
            self._client,
            "POST",
            f"{url}/init_weights_update_group",
            policy=self.settings.retry,
            timeout_s=self.settings.weight_update_timeout_s,
            body=body,
            retry=False,  # joining a process group twice would hang the group
        )
        expect_success(answer, "/init_weights_update_group")

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: int,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> int:
        """Tell every worker to receive one bucket; returns when the trainer's broadcast ends.

        Not retried: a worker that missed a broadcast cannot get it back by asking again.
        """
        body = wire.distributed_update_body(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            version=version,
            flush_cache=flush_cache,
            load_format=load_format,
        )
        await self._post_weights("/update_weights_from_distributed", body)
        self._version = version
        return version

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        version: int,
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> int:
        """Hand CUDA IPC tensors (one payload per TP rank) to workers on this node."""
        body = wire.tensor_update_body(
            serialized_named_tensors,
            version=version,
            load_format=load_format,
            flush_cache=flush_cache,
        )
        await self._post_weights("/update_weights_from_tensor", body)
        self._version = version
        return version

    async def _post_weights(self, path: str, body: dict[str, Any]) -> None:
        urls = await self.worker_urls()
        answers = await asyncio.gather(
            *(
                call(
                    self._client,
                    "POST",
                    f"{u}{path}",
                    policy=self.settings.retry,
                    timeout_s=self.settings.weight_update_timeout_s,
                    body=body,
                    retry=False,
                )
                for u in urls
            )
        )
        for answer in answers:
            expect_success(answer, path)

    async def _get_first(self, path: str) -> Any:
        url = (await self.worker_urls())[0]
        return await call(
            self._client,
            "GET",
            f"{url}{path}",
            policy=self.settings.retry,
            timeout_s=self.settings.control_timeout_s,
        )

    async def health(self) -> bool:
        """True when `url` (server or router) answers /health with 200."""
        try:
            await call(
                self._client,
                "GET",
                f"{self._url}/health",
                policy=self.settings.retry,
                timeout_s=self.settings.control_timeout_s,
                retry=False,
            )
        except (EngineUnavailable, EngineRequestError):
            return False
        return True

    async def accepts_images(self) -> bool:
        """Whether the served model understands images: the settings, else what the
        first worker's `/model_info` says (asked once; every worker serves one model)."""
        if self._images is None:
            model = expect_dict(await self._get_first("/model_info"), "/model_info")
            self._images = bool(model.get("has_image_understanding"))
        return self._images

    async def info(self) -> EngineInfo:
        model = expect_dict(await self._get_first("/model_info"), "/model_info")
        server = expect_dict(await self._get_first("/server_info"), "/server_info")
        return EngineInfo(
            model=str(model.get("model_path", "")),
            vocab_size=self.settings.vocab_size,
            max_context=int(server.get("context_length") or 0),
            weight_version=wire.version_from_wire(model.get("weight_version")),
            accepts_images=await self.accepts_images(),
            extra={"workers": len(await self.worker_urls()), "server_info": server},
        )

    async def close(self) -> None:
        if self._own_client:
            for client in self._generate_clients:
                await client.aclose()
