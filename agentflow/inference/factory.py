"""Build a run's policy engine and chat template from its config.

torch is imported only for the `local` engine, and only when a run starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentflow.errors import InvalidInput
from agentflow.inference.base import Engine
from agentflow.modeling import MODEL_INIT_FILE
from agentflow.run_config import (
    LocalEngineConfig,
    RunConfig,
    SGLangEngineConfig,
    VLLMEngineConfig,
    check_device,
)
from agentflow.tokenization import load_tokenizer
from agentflow.tokenization.bytes import ByteTokenizer
from agentflow.tokenization.chat import ChatTemplate, HFChatTemplate, chat_template_for
from agentflow.tokenization.hf import HFTokenizer


def build_template(config: RunConfig) -> ChatTemplate:
    """The checkpoint's own tokenizer and template, or the byte ones for a model this
    project built (from `model.init`, or saved with its `ModelInit` beside the weights)."""
    path = config.model.path
    if path and not (Path(path) / "config.json").is_file():
        raise InvalidInput(
            f"no HF-format checkpoint at {path!r} (config.json missing)",
            field=("model", "path"),
        )
    if not path or _built_here(Path(path)):
        return chat_template_for(ByteTokenizer())
    tokenizer = load_tokenizer(path)
    if not isinstance(tokenizer, HFTokenizer):
        return chat_template_for(tokenizer)
    return HFChatTemplate(
        tokenizer,
        template=config.model.template_text(),
        template_kwargs=config.model.chat_template_kwargs,
        tool_call_style=config.model.tool_call_format,
    )


def _built_here(path: Path) -> bool:
    init_file = path / MODEL_INIT_FILE
    if not init_file.is_file():
        return False
    return json.loads(init_file.read_text()).get("tokenizer") == "bytes"


def build_engine(config: RunConfig) -> tuple[Engine, int]:
    """One engine of the run's `[engine]` and its context length: the local engine in
    this process, or the client of SGLang or vLLM servers (vLLM's started here when the
    config says `[engine.launch]`). A run placed on Ray (`[placement]
    ray`) gets a pool of engine actors instead (`agentflow.placement.engines`), each of
    which builds its engine here."""
    engine_config = config.engine
    if isinstance(engine_config, LocalEngineConfig):
        from agentflow.inference.local import LocalEngine

        check_device(engine_config.device, ("engine", "device"))
        options = {
            "max_batch_size": engine_config.max_batch_size,
            "kv_budget_tokens": engine_config.kv_budget_tokens,
            "device": engine_config.device,
        }
        if config.model.path:
            local = LocalEngine.from_pretrained(config.model.path, **options)
        else:
            local = LocalEngine.from_init(config.model.init, seed=config.seed, **options)
        return local, local.max_context
    if isinstance(engine_config, SGLangEngineConfig):
        from agentflow.inference.sglang import SGLangEngine, SGLangSettings

        # The config's parse already requires model.path with sglang.
        urls = [str(u).rstrip("/") for u in engine_config.urls]
        settings = SGLangSettings(
            url=urls[0],
            worker_urls=tuple(urls[1:]),
            behind_router=len(urls) == 1 and engine_config.behind_router,
            generate_timeout_s=engine_config.timeout_s,
            resubmit_aborted=config.rollout.partial_rollout,
            # Every live episode may be generating at once, plus control calls.
            max_connections=config.rollout.max_concurrency + 16,
        )
        return SGLangEngine(settings), engine_config.max_context
    if isinstance(engine_config, VLLMEngineConfig):
        from agentflow.inference.vllm_pool import build_vllm_engine

        return build_vllm_engine(config, build_template(config))
    raise InvalidInput(f"unknown engine type {engine_config!r}", field=("engine",))
