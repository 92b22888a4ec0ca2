"""Connect to Ray: the caller's session, a cluster (`address` / RAY_ADDRESS), or a local one.

Invariant: raypipe never shuts down a session it did not start. Cost: starting a local
session is 2-5 s on 2 cores (reported separately as start-up in summaries).
"""

from __future__ import annotations

import os
import time

import ray


def ensure_ray(address: str | None = None) -> tuple[bool, float]:
    """Make sure Ray is initialized; return (started_here, seconds spent starting)."""
    if ray.is_initialized():
        return False, 0.0
    started = time.perf_counter()
    kwargs: dict = {"log_to_driver": True}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        kwargs["address"] = address
    ray.init(**kwargs)
    return True, time.perf_counter() - started


def cluster_cpus() -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))
