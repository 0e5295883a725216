"""Registers the scripted env the shard tests play, in the test's process and, preloaded
(`RunManager(shard_options={"preload": [...]})`), in each shard's."""

from __future__ import annotations

from envs import registry
from tests.integration.rollout.scripted_envs import BrokenEnv, SlowEnv

SHARD_ENV = "test/ShardSlow-v0"
SHARD_ENV_B = "test/ShardSlowB-v0"  # the same env under another id: a second env of a mix
BROKEN_SHARD_ENV = "test/ShardBroken-v0"

registry.register(SHARD_ENV, SlowEnv, replace=True)
registry.register(SHARD_ENV_B, SlowEnv, replace=True)
registry.register(BROKEN_SHARD_ENV, BrokenEnv, replace=True)
