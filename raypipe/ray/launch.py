"""Where a tokenize job runs: on Ray Data, or on local worker processes when no Ray is around.

Invariant: both runners run the same units through `tokenize_unit`, so where a job runs
never changes a byte of its output (executor is not part of the fingerprint). `auto` runs
on Ray whenever a user has one: a ray.data.Dataset input, an address (`--address`,
RAY_ADDRESS), a Ray session this process already holds (a plain `ray.init()` before the
job), or a cluster `ray start` recorded on this machine that answers (the one a plain
`ray.init()` would join). Anywhere else, a job on one machine runs on local processes,
without Ray's start (6-16 s to a Ray Data pipeline's first record on 2 cores, more than a
whole job of a few hundred MB) and without importing Ray. Cost of the choice: an
environment lookup, a look at `sys.modules`, and where Ray's record exists, one TCP connect
to its head (raypipe.ray.record).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from raypipe.config import TokenizeConfig
from raypipe.preprocess.job import JobSummary, run_job
from raypipe.ray.record import no_cluster_here, recorded_cluster

logger = logging.getLogger("raypipe")


def ray_session_running() -> bool:
    """Whether this process holds a Ray session (never imports Ray to find out)."""
    ray = sys.modules.get("ray")
    return ray is not None and getattr(ray, "is_initialized", lambda: False)()


def executor_for(config: TokenizeConfig, dataset: Any = None) -> tuple[str, str]:
    """("ray" or "local", why), for `config.executor` and the input."""
    if config.executor == "local":
        if dataset is not None:
            raise TypeError("executor 'local': a ray.data.Dataset input runs on Ray "
                            "(executor 'ray' or 'auto')")
        return "local", "asked for (--executor local)"
    if config.executor == "ray":
        return "ray", "asked for (--executor ray)"
    if dataset is not None:
        return "ray", "the input is a ray.data.Dataset"
    if config.address or os.environ.get("RAY_ADDRESS"):
        return "ray", "a Ray address is given"
    if ray_session_running():
        return "ray", "this process holds a Ray session"
    recorded = recorded_cluster()
    if recorded is not None:
        return "ray", f"the cluster `ray start` left here answers ({recorded})"
    return "local", no_cluster_here()


def run_tokenize(config: TokenizeConfig, dataset: Any = None) -> JobSummary:
    """Run the job where `executor_for` says: a file job on local processes, or on Ray Data
    (the caller's session, a cluster, or a local Ray raypipe starts and leaves running)."""
    where, why = executor_for(config, dataset)
    logger.info("raypipe: the units run on %s: %s", where, why)
    if where == "ray":
        from raypipe.ray.executor import run_on_ray

        return run_on_ray(config, dataset)
    from raypipe.preprocess.pool import ProcessPoolRunner

    runner = ProcessPoolRunner(config.num_workers)
    try:
        summary = run_job(config, runner)
    finally:  # a job that failed before its run (planning, the self-check) started them
        runner.close()
    return dataclasses.replace(summary, startup_seconds=runner.startup_seconds,
                               data_startup_seconds=runner.data_startup_seconds,
                               unit_retries=runner.retries, executor="local")


def leave_ray() -> None:
    """Stop the local Ray this process started, or disconnect from the cluster it connected
    to (`raypipe.ray.session.leave_ray`; imports nothing new)."""
    if "raypipe.ray.session" in sys.modules:
        from raypipe.ray.session import leave_ray as leave

        leave()
