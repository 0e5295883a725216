"""What a run's scheduler plays with, built from its config: the policy runtime (engine,
chat template, sampling), the newest published weights loaded into it, and the in-process
agents. The gateway's `RunManager` and a controller shard (`agentflow.rollout.shards`)
build them the same way."""

from __future__ import annotations

import logging
import random
import uuid
from pathlib import Path
from typing import cast

from agentflow.agents.base import Agent
from agentflow.agents.runtime import PolicyRuntime
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.db.runs import IN_PROCESS_URI, RunStore
from agentflow.errors import InvalidInput, WeightsNotFound
from agentflow.inference.base import (
    BROADCAST_URI_PREFIX,
    Engine,
    PauseMode,
    SamplingParams,
    WeightUpdate,
)
from agentflow.metrics import GatewayMetrics
from agentflow.plugins import load_function
from agentflow.run_config import RunConfig
from agentflow.tokenization.chat import ChatTemplate

log = logging.getLogger(__name__)


def build_runtime(config: RunConfig) -> PolicyRuntime:
    """The run's engine (in this process, a client of servers, or Ray engine actors) and
    the runtime around it. Loading a local model blocks: call it in a thread."""
    from agentflow.inference.factory import build_engine, build_template
    from agentflow.modeling import import_model_classes

    import_model_classes()  # runs recovering together build engines in parallel threads

    template = build_template(config)
    engine: Engine
    if config.placement.ray:  # a pool of engine actors; Ray is imported only then
        from agentflow.placement.engines import place_engines

        engine, max_context = place_engines(config)
    else:
        engine, max_context = build_engine(config)
    return policy_runtime(config, engine, template, max_context)


def policy_runtime(
    config: RunConfig, engine: Engine, template: ChatTemplate, max_context: int
) -> PolicyRuntime:
    """The runtime of `config`'s agent over `engine` (its sampling, partial rollout,
    interrupt mode and chat history)."""
    return PolicyRuntime(
        engine,
        template,
        config.name,
        SamplingParams(
            temperature=config.agent.temperature,
            max_new_tokens=config.agent.max_new_tokens,
            stop_token_ids=template.stop_ids,
        ),
        max_context,
        partial_rollout=config.rollout.partial_rollout,
        interrupt=PauseMode(config.rollout.interrupt),
        history=config.model.chat_history,
    )


async def load_newest_weights(
    runs: RunStore, run_id: uuid.UUID, runtime: PolicyRuntime, *, trainer_in_process: bool
) -> int:
    """A run that served published weights before (a restart after a crash, a resume, a
    controller shard started later) serves the newest of them again, loaded from where
    they were published, before its engine takes a request; its tokens then carry that
    version, not 0. Returns the version its engine serves."""
    newest = await runs.newest_weights(run_id)
    if newest is None:
        return 0
    lost = f"its newest weights (version {newest.version}) "
    if newest.uri == IN_PROCESS_URI:
        if trainer_in_process:
            return 0  # that trainer republishes its checkpoint before it trains on
        raise WeightsNotFound(
            lost + "were handed over inside a trainer process that is gone; no directory holds them"
        )
    if newest.uri.startswith(BROADCAST_URI_PREFIX):
        # Broadcast weights live only in the engines (and the trainer's checkpoint).
        serving = (await runtime.engine.info()).weight_version
        if serving != newest.version:
            log.warning(
                "run %s: its engine serves weight version %d, not the newest broadcast "
                "one (%d); the trainer's next publish replaces them",
                run_id,
                serving,
                newest.version,
            )
        return serving
    if not Path(newest.uri).is_dir():
        raise WeightsNotFound(lost + f"are no longer at {newest.uri}")
    update = WeightUpdate(path=newest.uri, version=newest.version)
    await runtime.engine.update_weights(update)
    log.info("run %s: loaded weight version %d from %s", run_id, newest.version, newest.uri)
    return newest.version


def whitebox_agent(
    config: RunConfig, *, metrics: GatewayMetrics | None = None, stream: int = 0
) -> WhiteBoxAgent:
    """The token-level agent of `config` (`stream`: which controller shard, so shards of
    one run draw different RTPO branch points from the same seed)."""
    rtpo = config.trainer.algorithm == "rtpo"
    seed = config.seed if stream == 0 else f"{config.seed}/{stream}"
    return WhiteBoxAgent(
        park_after_s=config.rollout.park_after_s,
        system_prompt=config.agent.system_prompt,
        metrics=metrics,
        branches=config.rtpo.branches if rtpo else 0,
        branch_turns=config.rtpo.branch_turns,
        rng=random.Random(seed),
    )


def python_agent(config: RunConfig) -> Agent:
    """`agent.entry_point`'s factory, called with the agent config once per run."""
    path = config.agent.entry_point
    assert path is not None  # the config validator requires it
    field = ("agent", "entry_point")
    factory = load_function(path, field=field)
    try:
        agent = factory(config.agent)
    except Exception as exc:  # noqa: BLE001 - the run does not start, naming the field
        raise InvalidInput(
            f"agent factory {path}: {type(exc).__name__}: {exc}", field=field
        ) from exc
    if not callable(getattr(agent, "run", None)):
        raise InvalidInput(
            f"agent factory {path} returned an instance of {type(agent).__name__!r}, "
            "which has no async run(episode) method",
            field=field,
        )
    return cast(Agent, agent)
