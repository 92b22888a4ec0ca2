"""Connect to Ray: the caller's session, a cluster (`address` / RAY_ADDRESS), or a local one.

Invariant: raypipe never shuts down a session it did not start. A local session raypipe
starts itself has no dashboard (it costs 1 core-second and 1-2 s of start-up on 2 cores;
`ray start --head` first to have one) and `num_cpus` CPUs (all cores when None; a plain
`ray.init()` would join a cluster `ray start` left on this machine instead, and so does this). Cost:
starting a local session is 3-4 s on 2 cores (reported separately as start-up in
summaries).
"""

from __future__ import annotations

import logging
import os
import time

import ray

logger = logging.getLogger("raypipe")


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> tuple[bool, float]:
    """Make sure Ray is initialized; return (started_here, seconds spent starting)."""
    if ray.is_initialized():
        return False, 0.0
    started = time.perf_counter()
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    elif num_cpus is None:
        ray.init(include_dashboard=False, log_to_driver=True)
    else:
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
        except ValueError as exc:  # a cluster `ray start` left here: joined, CPUs are its own
            if "existing cluster" not in str(exc):
                raise
            ray.init(include_dashboard=False, log_to_driver=True)
            logger.info("joined the Ray cluster `ray start` left on this machine (its own "
                        "%d CPUs; num_workers %d still caps the actors)", cluster_cpus(),
                        num_cpus)
    return True, time.perf_counter() - started


def cluster_cpus() -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))
