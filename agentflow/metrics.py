"""Gateway metrics in Prometheus form.

One `GatewayMetrics` per app (its own registry, so several apps in one process never
collide). Agents observe latencies and count turns as they happen; the gauges that
describe a state (episodes by status, parked sessions, engine queues) are read when
`/metrics` is scraped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("agentflow_turns", "Turns persisted, by kind", ["kind"], registry=r)
        self.generate_seconds = Histogram(
            "agentflow_generate_seconds",
            "Engine time per policy turn",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.env_seconds = Histogram(
            "agentflow_env_step_seconds",
            "Env time per step",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.episodes = Gauge("agentflow_episodes", "Episodes by status", ["status"], registry=r)
        self.parked_sessions = Gauge(
            "agentflow_parked_sessions",
            "Sessions whose KV is released while their env works",
            registry=r,
        )
        self.engine_queue = Gauge(
            "agentflow_engine_queue_depth",
            "Requests waiting for a decode slot",
            ["run"],
            registry=r,
        )
        self.engine_running = Gauge(
            "agentflow_engine_running", "Requests decoding now", ["run"], registry=r
        )
        self.engine_up = Gauge(
            "agentflow_engine_up",
            "1 when the run's engine answered the scrape in time, else 0",
            ["run"],
            registry=r,
        )
        self.chat_requests = Counter(
            "agentflow_chat_requests",
            "OpenAI-compatible requests of black-box agents, by API and outcome",
            ["api", "outcome"],
            registry=r,
        )
        self.trainer = Gauge(
            "agentflow_trainer_metric",
            "The latest trainer step's metrics (reward, loss, staleness, ...), by run",
            ["run", "name"],
            registry=r,
        )
        self.trainer_version = Gauge(
            "agentflow_trainer_weight_version",
            "The weight version the latest trainer step produced",
            ["run"],
            registry=r,
        )

    def record_step(self, run_id: str, version: int, metrics: Mapping[str, object]) -> None:
        """A trainer step's finite numbers, as gauges."""
        self.trainer_version.labels(run=run_id).set(version)
        for name, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                if math.isfinite(value):
                    self.trainer.labels(run=run_id, name=name).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
