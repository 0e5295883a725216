"""Joining (or starting) the Ray cluster a run is placed on."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from agentflow.errors import InvalidInput

log = logging.getLogger(__name__)

_lock = threading.Lock()
LOOPBACK = "127.0.0.1"


def import_ray() -> Any:
    """The `ray` module, or a clear error naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise InvalidInput(
            "placement.ray needs Ray: pip install 'agentflow[ray]'", field=("placement", "ray")
        ) from None
    return ray


def connect(address: str, *, num_cpus: float | None = None, object_store_mb: int = 1024) -> Any:
    """Join the cluster at `address` ('auto', host:port, ray://...), or start one on this
    machine for 'local' (on loopback, with `num_cpus` logical CPUs); once per process:
    later calls reuse the connection. Returns the `ray` module."""
    ray = import_ray()
    # No usage report leaves the machine; the cluster's own logs stay on it.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with _lock:
        if ray.is_initialized():
            return ray
        options: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": True,
            "logging_level": logging.WARNING,
            "configure_logging": False,
        }
        if address == "local":
            # Logical CPUs are bookkeeping on one machine: four per core (or what the run
            # asks for, if more), so a gateway can place several runs side by side.
            cpus = max(4.0 * (os.cpu_count() or 1), num_cpus or 0.0)
            ray.init(
                address="local",  # a new cluster, never one `ray start` left running here
                num_cpus=int(cpus + 0.999),
                object_store_memory=object_store_mb * 1024 * 1024,
                _node_ip_address=LOOPBACK,
                **options,
            )
        else:
            try:
                ray.init(address=address, **options)
            except ConnectionError as exc:
                raise InvalidInput(
                    f"no Ray cluster answers at {address!r}: {exc}", field=("placement", "ray")
                ) from None
        log.info("ray: connected (%s), resources %s", address, ray.cluster_resources())
        return ray


def node_address() -> str:
    """The address other nodes reach this process at (loopback on a 'local' cluster)."""
    ray = import_ray()
    return str(ray.util.get_node_ip_address())


def disconnect() -> None:
    ray = import_ray()
    with _lock:
        if ray.is_initialized():
            ray.shutdown()
