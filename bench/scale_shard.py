"""The controller shard's side of `bench/scale.py --controllers N`: imported first in
each shard (`preload`), it registers the simulated env; `runtime` builds the shard's
share of the simulated engines as `build_controller` builds them for one controller."""

from __future__ import annotations

from typing import Any

from agentflow.agents.runtime import PolicyRuntime
from agentflow.inference.pool import EnginePool
from agentflow.rollout.runtime_setup import policy_runtime
from agentflow.run_config import RunConfig
from agentflow.tokenization.bytes import ByteTokenizer
from agentflow.tokenization.chat import chat_template_for
from bench.scale_sim import EngineModel, SimEngine, register_env

register_env()


def runtime(
    config: RunConfig, index: int, count: int, *, engines: int, engine: dict[str, Any]
) -> PolicyRuntime:
    """Shard `index` of `count`'s runtime over its share of `engines` simulated engines."""
    mine = engines // count + (1 if index < engines % count else 0)
    model = EngineModel(**engine)
    pool = EnginePool([SimEngine(model, seed=index * 100_000 + i) for i in range(max(1, mine))])
    return policy_runtime(config, pool, chat_template_for(ByteTokenizer()), model.max_context)
