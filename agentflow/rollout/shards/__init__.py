"""Controller shards: one run's episodes played by several processes that share its
database (`rollout.controllers`; docs/architecture.md, "Controller shards").
`coordinator.ShardedRun` in the gateway, `worker` in each shard, `wire` between them."""
