"""A run's vLLM engine: servers that already run (`engine.urls`) or that this process
starts (`[engine.launch]`), each checked before the run takes it, one `EnginePool` when
there are several (routed by session, so an episode keeps one server's prefix cache) or
when they were launched here (a launched server that dies is started again and brought
to the run's newest weights by the pool).

Checked at the start, each a refusal naming the server:
- it answers `/v1/models` (else: the URL and what went wrong);
- it serves the run's checkpoint (`root` is `model.path`), unless `check_model = false`;
- its tokenizer is the run's: a probe text encodes to the same ids on both sides.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from agentflow.errors import EngineError, InvalidInput
from agentflow.inference.base import Engine
from agentflow.inference.pool import EnginePool
from agentflow.inference.vllm import VLLMEngine, VLLMSettings
from agentflow.inference.vllm_checkpoint import is_tied, untie_head
from agentflow.inference.vllm_server import VLLMServer
from agentflow.inference.vllm_wire import VLLM_VERSION
from agentflow.run_config import RunConfig, VLLMEngineConfig
from agentflow.tokenization.chat import ChatTemplate

log = logging.getLogger(__name__)


def run_directory(config: RunConfig) -> Path:
    return Path(config.trainer.run_dir) / config.name


# Plain text of several scripts, no special tokens: two different vocabularies part here.
VOCAB_PROBE = "AgentFlow checks the vocabulary: 0123456789, ünïcödé, 中文, emoji 🙂."


def build_vllm_engine(config: RunConfig, template: ChatTemplate) -> tuple[Engine, int]:
    engine_config = config.engine
    assert isinstance(engine_config, VLLMEngineConfig)
    model_path = served_model_path(config)
    servers: list[VLLMServer] = []
    if engine_config.launch is not None:
        servers = _launch_all(config, model_path)
        urls = [s.url for s in servers]
    else:
        urls = [str(u).rstrip("/") for u in engine_config.urls]
    try:
        contexts = [_check_server(url, config, template, model_path) for url in urls]
    except BaseException:
        for server in servers:
            server.stop()
        raise
    engines: list[Engine] = [
        _engine(config, url, servers[i] if servers else None, model_path)
        for i, url in enumerate(urls)
    ]
    max_context = min(contexts)
    if len(engines) == 1 and not servers:
        return engines[0], max_context
    replace = None
    if engine_config.launch is not None:

        async def replace(index: int, generation: int) -> Engine:
            import asyncio

            server = _server(config, model_path, index)
            try:
                url = await asyncio.to_thread(server.start)
            except asyncio.CancelledError:  # the pool closed: the start gives up, ends it
                await asyncio.to_thread(server.stop)
                raise
            log.warning("vLLM server %d started again (generation %d): %s", index, generation, url)
            return _engine(config, url, server, model_path)

    return EnginePool(engines, replace=replace), max_context


def served_model_path(config: RunConfig) -> str:
    """The checkpoint the run's servers serve: `model.path`, or, for servers launched
    here from a tied checkpoint, an untied copy in the run directory (made with vLLM's
    own python, which has what it takes to read and write the tensors; vllm_checkpoint.py
    says why). Servers that already run must serve an untied checkpoint already."""
    engine_config = config.engine
    assert isinstance(engine_config, VLLMEngineConfig)
    if not config.model.path:
        raise InvalidInput(
            "a vllm engine serves a checkpoint: model.path is empty", field=("model", "path")
        )
    model_path = str(Path(config.model.path).resolve())
    if not is_tied(model_path):
        return model_path
    if engine_config.launch is not None:
        served = run_directory(config) / "vllm" / "served-model"
        return str(untie_head(model_path, served, python=engine_config.launch.python))
    raise InvalidInput(
        f"{model_path} ties its output head to its input embedding, and vLLM "
        f"{VLLM_VERSION} loses that tie when it reloads weights (the head would "
        "stay at the first version); serve an untied copy: `agentflow engine "
        "untie-head CHECKPOINT --out DIR`, start the servers from DIR and set "
        "model.path to DIR",
        field=("model", "path"),
    )


def launch_one(
    config: RunConfig, template: ChatTemplate, model_path: str, index: int, *, host: str
) -> tuple[VLLMEngine, int]:
    """One server of `[engine.launch]` listening on `host`, started and checked, and the
    engine that owns it (an engine actor's: `agentflow.placement.engines`); its context
    length. `model_path` is `served_model_path(config)`."""
    engine_config = config.engine
    assert isinstance(engine_config, VLLMEngineConfig) and engine_config.launch is not None
    on_host = engine_config.model_copy(
        update={"launch": engine_config.launch.model_copy(update={"host": host})}
    )
    config = config.model_copy(update={"engine": on_host})
    server = _server(config, model_path, index)
    url = server.start()
    try:
        max_context = _check_server(url, config, template, model_path)
    except BaseException:
        server.stop()
        raise
    return _engine(config, url, server, model_path), max_context


def _server(config: RunConfig, model_path: str, index: int) -> VLLMServer:
    engine_config = config.engine
    assert isinstance(engine_config, VLLMEngineConfig) and engine_config.launch is not None
    launch = engine_config.launch
    return VLLMServer(
        launch,
        model_path,
        port=launch.port + index if launch.port else 0,
        served_model_name=engine_config.served_model_name,
        log_dir=run_directory(config) / "vllm",
    )


def _launch_all(config: RunConfig, model_path: str) -> list[VLLMServer]:
    engine_config = config.engine
    assert isinstance(engine_config, VLLMEngineConfig) and engine_config.launch is not None
    servers = [_server(config, model_path, i) for i in range(engine_config.launch.servers)]
    with ThreadPoolExecutor(max_workers=len(servers)) as starting:
        futures = [starting.submit(s.start) for s in servers]
        errors = [f.exception() for f in futures]
    failed = [e for e in errors if e is not None]
    if failed:
        for server in servers:
            server.stop()
        raise failed[0]
    return servers


def _engine(config: RunConfig, url: str, server: VLLMServer | None, model_path: str) -> VLLMEngine:
    engine_config = config.engine
    assert isinstance(engine_config, VLLMEngineConfig)
    return VLLMEngine(
        VLLMSettings(
            url=url,
            served_model=engine_config.served_model_name,
            generate_timeout_s=engine_config.timeout_s,
            max_connections=config.rollout.max_concurrency + 16,
            reference_checkpoint=model_path,
        ),
        server=server,
    )


def _get(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    try:
        if body is None:
            response = httpx.get(f"{url}{path}", timeout=30.0)
        else:
            response = httpx.post(f"{url}{path}", json=body, timeout=30.0)
    except httpx.HTTPError as exc:
        raise InvalidInput(
            f"the vLLM server at {url} does not answer: {type(exc).__name__}: {exc}",
            field=("engine", "urls"),
        ) from exc
    if response.status_code != 200:
        raise InvalidInput(
            f"the vLLM server at {url} answered {path} with HTTP {response.status_code}: "
            f"{response.text[:300]}",
            field=("engine", "urls"),
        )
    return response.json()


def _check_server(url: str, config: RunConfig, template: ChatTemplate, model_path: str) -> int:
    """Refuse a server that is not this run's (see the module docstring); its context
    length otherwise."""
    engine_config = config.engine
    assert isinstance(engine_config, VLLMEngineConfig)
    models = _get(url, "/v1/models").get("data") or []
    if not models:
        raise InvalidInput(f"the vLLM server at {url} serves no model", field=("engine", "urls"))
    card = models[0]
    root = str(card.get("root") or "")
    served = os.path.realpath(root) if root.startswith("/") else root
    if engine_config.check_model and served != model_path:
        raise InvalidInput(
            f"the vLLM server at {url} serves {root!r}, and this run's model is "
            f"{model_path!r} (engine.check_model = false to skip this check)",
            field=("model", "path"),
        )
    probe: dict[str, Any] = {"prompt": VOCAB_PROBE, "add_special_tokens": False}
    if engine_config.served_model_name:
        probe["model"] = engine_config.served_model_name
    theirs = _get(url, "/tokenize", probe).get("tokens")
    ours = template.tokenizer.encode(VOCAB_PROBE)
    if theirs != ours:
        raise InvalidInput(
            f"the vLLM server at {url} has another vocabulary than the run's model "
            f"{model_path!r}: {VOCAB_PROBE!r} is {str(theirs)[:120]} there and "
            f"{str(ours)[:120]} here",
            field=("model", "path"),
        )
    context = int(card.get("max_model_len") or 0)
    if context <= 0:
        raise EngineError(f"the vLLM server at {url} reports no max_model_len")
    return context
