"""Inference engines as Ray actors, behind the gateway as one `EnginePool`.

Each actor (`EngineHost`) holds one engine in its own process, in a bundle of the run's
placement group (`placement.engine_cpus` / `engine_gpus` each, `strategy`): the local
engine, an SGLang server it starts on its node and GPUs
(`agentflow.placement.sglang_server`), or a vLLM server it starts from `[engine.launch]`
(`agentflow.inference.vllm_pool.launch_one`); a server lives and dies with its actor.
The gateway talks to it through `RayEngine`, an `Engine` whose calls are actor calls. An
actor that exits (killed, out of memory, its node gone) surfaces as `EngineLost`, and the
pool builds a new actor in the same bundle, loaded with the run's newest weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from agentflow.errors import AgentFlowError, EngineLost, EngineUnavailable
from agentflow.inference.base import (
    Engine,
    EngineInfo,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    WeightUpdate,
)
from agentflow.inference.pool import EnginePool
from agentflow.inference.vllm import VLLMEngine
from agentflow.inference.vllm_server import VLLMServer
from agentflow.placement.cluster import LOOPBACK, connect, import_ray
from agentflow.placement.sglang_server import SGLangServer
from agentflow.run_config import (
    PlacementConfig,
    RunConfig,
    SGLangEngineConfig,
    VLLMEngineConfig,
)

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0  # building an engine loads its model
_GROUP_TIMEOUT_S = 120.0  # the cluster's room for the engines (an autoscaler may add it)
_CLOSE_TIMEOUT_S = 30.0


def engine_seed(seed: int, index: int, generation: int) -> int:
    """Each engine of a pool, and each replacement, samples from its own stream."""
    return seed * 1_000_003 + index * 1_009 + generation


class EngineHost:
    """The body of an engine actor: the run's local engine, in this process."""

    def __init__(
        self,
        config_document: dict[str, Any],
        index: int,
        generation: int,
        served_model: str | None = None,
    ) -> None:
        from agentflow.inference.factory import build_engine

        self.engine: Engine
        config = RunConfig.model_validate(config_document)
        self.index, self.generation = index, generation
        self.server: SGLangServer | None = None
        self._closing = False  # a server stopped by close() is not a death
        # The engine itself, not another pool: this actor is one member.
        alone = config.model_copy(update={"placement": PlacementConfig()})
        if isinstance(config.engine, VLLMEngineConfig):
            from agentflow.inference.factory import build_template
            from agentflow.inference.vllm_pool import launch_one, served_model_path

            model_path = served_model or served_model_path(config)
            served, self.max_context = launch_one(
                alone, build_template(config), model_path, index, host=_serving_host(config)
            )
            assert isinstance(served.server, VLLMServer)
            self.engine = served  # it stops its server when it closes
            _exit_with(served.server, lambda: self._closing)
            return
        if isinstance(config.engine, SGLangEngineConfig):
            self.server = SGLangServer(config, _serving_host(config))
            url = self.server.start()
            self.server.exit_with_server()
            engine_config = config.engine.model_copy(update={"urls": [url], "behind_router": False})
            alone = alone.model_copy(update={"engine": engine_config})
            self.engine, self.max_context = build_engine(alone)
            return
        import torch
        from transformers.utils import logging as hf_logging

        from agentflow.inference.local import LocalEngine
        from agentflow.modeling import import_model_classes

        hf_logging.disable_progress_bar()  # the driver's output is the run's progress
        torch.set_num_threads(max(1, int(config.placement.engine_cpus)))
        import_model_classes()
        engine, self.max_context = build_engine(alone)
        if isinstance(engine, LocalEngine):
            engine.reseed(engine_seed(config.seed, index, generation))
        self.engine = engine

    async def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "max_context": self.max_context}

    async def server_url(self) -> str | None:
        """The SGLang or vLLM server this actor started, if it started one."""
        if isinstance(self.engine, VLLMEngine):
            return self.engine.url
        return self.server.url if self.server is not None else None

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        return await self.engine.generate(req)

    async def open_session(self, session_id: str | None) -> str:
        return await self.engine.open_session(session_id)

    async def close_session(self, session_id: str) -> None:
        await self.engine.close_session(session_id)

    async def abort(self, rid: str) -> None:
        await self.engine.abort(rid)

    async def pause(self, mode: PauseMode) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, update: WeightUpdate) -> int:
        return await self.engine.update_weights(update)

    async def info(self) -> EngineInfo:
        info = await self.engine.info()
        info.extra.update(index=self.index, generation=self.generation)
        return info

    async def accepts_images(self) -> bool:
        return await self.engine.accepts_images()

    async def close(self) -> None:
        self._closing = True
        try:
            await self.engine.close()
        finally:
            if self.server is not None:
                self.server.stop()


def _exit_with(server: VLLMServer, closing: Callable[[], bool]) -> None:
    """End this actor's process when its vLLM server exits (a thread waits for it): the
    gateway sees a lost engine and the pool starts a new actor, as for any engine that
    dies. Stopping the server on `close` is not a death."""
    process = server.process
    assert process is not None

    def watch() -> None:
        code = process.wait()
        if not closing():
            log.error("the vLLM server exited with %s; its engine actor ends too", code)
            server.stop()  # what its processes left behind (their shared memory)
            os._exit(1)

    threading.Thread(target=watch, name="vllm-server-watch", daemon=True).start()


def _serving_host(config: RunConfig) -> str:
    """Where this actor's server listens: loopback on a 'local' cluster, else the node's
    address, which the gateway reaches."""
    if config.placement.ray == "local":
        return LOOPBACK
    return str(import_ray().util.get_node_ip_address())


class RayEngine:
    """An `Engine` whose calls go to one engine actor."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name
        self._ray = import_ray()

    async def _call(self, method: str, *args: Any) -> Any:
        exceptions = self._ray.exceptions
        try:
            return await getattr(self.actor, method).remote(*args)
        except exceptions.RayActorError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EngineLost(f"{self.name} is gone ({reason})") from None
        except exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, AgentFlowError):  # the engine's own error, as it raised it
                raise cause from None
            raise EngineUnavailable(f"{self.name}: {cause or exc}") from None

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        result: GenerateResult = await self._call("generate", req)
        return result

    async def open_session(self, session_id: str | None = None) -> str:
        return str(await self._call("open_session", session_id))

    async def close_session(self, session_id: str) -> None:
        await self._call("close_session", session_id)

    async def abort(self, rid: str) -> None:
        await self._call("abort", rid)

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        await self._call("pause", PauseMode(mode))

    async def resume(self) -> None:
        await self._call("resume")

    async def update_weights(self, update: WeightUpdate) -> int:
        return int(await self._call("update_weights", update))

    async def info(self) -> EngineInfo:
        info: EngineInfo = await self._call("info")
        return info

    async def accepts_images(self) -> bool:
        return bool(await self._call("accepts_images"))

    async def close(self) -> None:
        """Close the engine, then end the actor (its bundle is free for another)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._call("close"), _CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            self._ray.kill(self.actor, no_restart=True)


class RayEnginePool(EnginePool):
    """The run's engine actors, and the placement group that holds their bundles."""

    def __init__(
        self,
        engines: list[Engine],
        *,
        config: RunConfig,
        group: Any,
        served_model: str | None = None,
    ) -> None:
        super().__init__(
            engines,
            replace=self._start_replacement,
            max_replacements=config.placement.max_engine_replacements,
        )
        self.config = config
        self.group = group
        self.served_model = served_model

    async def _start_replacement(self, index: int, generation: int) -> Engine:
        return await start_engine(self.config, self.group, index, generation, self.served_model)

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            with contextlib.suppress(Exception):
                import_ray().util.remove_placement_group(self.group)


def _actor_options(config: RunConfig, group: Any, index: int, generation: int) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    placement = config.placement
    return {
        "num_cpus": placement.engine_cpus,
        "num_gpus": placement.engine_gpus,
        "max_restarts": 0,  # the pool replaces it, with the run's newest weights
        # Every live episode may have a request or a session call in flight at once.
        "max_concurrency": 2 * config.rollout.max_concurrency + 64,
        "name": None,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index
        ),
    }


async def start_engine(
    config: RunConfig, group: Any, index: int, generation: int, served_model: str | None = None
) -> RayEngine:
    """Start engine actor `index` (its `generation`-th) and wait until it serves.
    `served_model`: the checkpoint a vLLM actor's server loads (made once by the driver)."""
    ray = import_ray()
    remote = ray.remote(EngineHost).options(**_actor_options(config, group, index, generation))
    actor = remote.remote(config.model_dump(mode="json"), index, generation, served_model)
    engine = RayEngine(actor, f"engine actor {index}.{generation}")
    try:
        await asyncio.wait_for(engine._call("ready"), _READY_TIMEOUT_S)
    except (AgentFlowError, TimeoutError) as exc:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        raise EngineUnavailable(f"engine actor {index} did not start: {exc}") from None
    return engine


def engine_bundles(placement: PlacementConfig) -> list[dict[str, float]]:
    bundle = {"CPU": placement.engine_cpus}
    if placement.engine_gpus:
        bundle["GPU"] = placement.engine_gpus
    return [dict(bundle) for _ in range(placement.engines)]


def place_engines(config: RunConfig) -> tuple[RayEnginePool, int]:
    """The run's engine actors in a placement group, as one pool; blocks until all
    serve (call it from a thread). Returns the pool and the engines' context length."""
    placement = config.placement
    served_model = None
    if isinstance(config.engine, VLLMEngineConfig):
        # One untied copy for every actor, made here rather than by each (they would race
        # on one directory); a cluster of several nodes needs the run directory shared.
        from agentflow.inference.vllm_pool import served_model_path

        served_model = served_model_path(config)

    ray = connect(
        placement.ray,
        num_cpus=placement.engines * placement.engine_cpus + placement.trainer_cpus,
        object_store_mb=placement.object_store_mb,
    )
    group = ray.util.placement_group(engine_bundles(placement), strategy=placement.strategy)
    try:
        ray.get(group.ready(), timeout=_GROUP_TIMEOUT_S)
    except Exception as exc:
        ray.util.remove_placement_group(group)
        raise EngineUnavailable(
            f"the cluster cannot hold {placement.engines} engine actors "
            f"({engine_bundles(placement)[0]} each, {placement.strategy}; it has "
            f"{ray.available_resources()} free): {type(exc).__name__}"
        ) from None

    async def start_all() -> list[RayEngine]:
        started = await asyncio.gather(
            *(start_engine(config, group, i, 0, served_model) for i in range(placement.engines)),
            return_exceptions=True,
        )
        engines = [e for e in started if isinstance(e, RayEngine)]
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            for engine in engines:
                await engine.close()
            raise failed[0]
        return engines

    try:
        engines = asyncio.run(start_all())
        max_context = int(ray.get(engines[0].actor.ready.remote())["max_context"])
    except BaseException:
        ray.util.remove_placement_group(group)
        raise
    log.info("placed %d engine actors", len(engines))
    pool = RayEnginePool(list(engines), config=config, group=group, served_model=served_model)
    return pool, max_context
