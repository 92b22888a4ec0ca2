"""Connect to Ray: the caller's session, a cluster (`address` / RAY_ADDRESS), or a local one.

Invariant: raypipe never shuts down a session it did not start. A local session raypipe
starts itself has no dashboard (a core-second of start-up; `ray start --head` first to
have one) and `num_cpus` CPUs (all cores when None; a plain
`ray.init()` would join a cluster `ray start` left on this machine instead, and so does this,
unless that cluster's record is stale: a head that does not accept a connection within
RECORD_PROBE_SECONDS is named in one warning and a local session starts instead).
`leave_ray` stops such a session, or disconnects from the cluster raypipe connected this
process to (the CLI calls it once the summary is printed); an exiting interpreter does
either through Ray's own exit hook, which is slower (`stop_autoscaler_monitor`). Probing a
`ray start` record is one TCP connect per job (refused at once on loopback, at most
RECORD_PROBE_SECONDS where the address drops packets). Cost: starting a local session is
3-5 s on 2 cores (reported separately as start-up in summaries); the stop and leave
figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Any

import ray

from raypipe import interrupts
from raypipe.ray.record import answering, cluster_record, ray_address_file, unanswered

logger = logging.getLogger("raypipe")
_started_here: set[str] = set()  # GCS addresses of the local sessions this process started
_connected_here: set[str] = set()  # ... of the running clusters this process connected to

# Ray's notices that nobody running raypipe can act on, dropped from its logs: logger ->
# message starts (a local Ray's auth token, made once per machine and used on loopback;
# Ray Data's progress bars, which raypipe replaces with its own progress line)
RAY_NOTICES = {
    "ray._private.authentication.authentication_token_setup": (
        "Generated new authentication token", "Token authentication is enabled for this"),
    "ray.data._internal.progress": ("Progress bars disabled",),
}


class DropNotices(logging.Filter):
    """Drops records whose message starts with one of `starts`."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


# Ray Data's notices that are false once raypipe stops on SIGINT/SIGTERM (the Dataset whose
# iteration was closed reports itself finished)
RAY_NOTICES_WHEN_STOPPING = {
    "ray.data._internal.execution.streaming_executor": ("✔️ Dataset",),
}


class DropNoticesWhenStopping(DropNotices):
    """Drops records whose message starts with one of `starts` while the process stops."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not interrupts.stopping() or super().filter(record)


def quiet_ray_notices() -> None:
    """Install the RAY_NOTICES filters (once per process)."""
    for notices, kind in ((RAY_NOTICES, DropNotices),
                          (RAY_NOTICES_WHEN_STOPPING, DropNoticesWhenStopping)):
        for name, starts in notices.items():
            target = logging.getLogger(name)
            if not any(type(each) is kind for each in target.filters):
                target.addFilter(kind(starts))


def ensure_ray(address: str | None = None, num_cpus: int | None = None,
               dashboard: bool = False) -> float:
    """Make sure Ray is initialized; return the seconds spent connecting or starting.
    `dashboard`: a local Ray starts with its dashboard, whose State API Ray Train's
    controller polls (without it, a warning every few seconds that no one can act on)."""
    quiet_ray_notices()
    if ray.is_initialized():
        return 0.0
    started = time.perf_counter()
    address = address or os.environ.get("RAY_ADDRESS")
    try:
        with interrupts.deferred():  # Ray's start-up unwound halfway crashed (exit 139)
            if address:
                ray.init(address=address, log_to_driver=True)
                _connected_here.add(current_gcs_address())
            else:
                start_or_join_local(num_cpus, dashboard)
                if node_processes():  # started here, not a `ray start` cluster joined
                    _started_here.add(current_gcs_address())
                    atexit.unregister(stop_autoscaler_monitor)  # once, however many
                    atexit.register(stop_autoscaler_monitor)  # before Ray's hook (LIFO)
                else:
                    _connected_here.add(current_gcs_address())
            interrupts.reinstall()  # ray.init set its own SIGTERM handler
    except interrupts.Interrupted:
        shutdown_local_ray()  # what started here stops here
        raise
    return time.perf_counter() - started


def stale_cluster_record() -> str | None:
    """A one-line warning if the cluster `ray start` recorded on this machine (the address
    a plain `ray.init()` would join) does not accept a connection within
    RECORD_PROBE_SECONDS; None where there is no record or it answers. A dead head whose
    record stayed (its processes stopped by pid) would otherwise have `ray.init()` retry
    its address for minutes."""
    address = cluster_record()
    if address is None or answering(address) is not None:
        return None
    failure = unanswered(address)
    return (f"the Ray cluster recorded in {ray_address_file()} ({address}) does not answer "
            f"({failure}); starting a local Ray instead: pass --address (or RAY_ADDRESS) to "
            "join a cluster, or delete that file if the cluster is gone")


def start_or_join_local(num_cpus: int | None, dashboard: bool = False) -> None:
    stale = stale_cluster_record()
    if stale is not None:
        logger.warning("%s", stale)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard,
                 log_to_driver=True)
        return
    recorded = cluster_record()
    reached = None if recorded is None else answering(recorded)
    if reached is not None and reached != recorded:  # a loopback head (--node-ip-address
        ray.init(address=reached, log_to_driver=True)  # 127.0.0.1) Ray recorded by the
        logger.info("joined the Ray cluster `ray start` recorded at %s, on %s", recorded,
                    reached)  # machine's address, which it does not listen on
        return
    if num_cpus is None:
        ray.init(include_dashboard=dashboard, log_to_driver=True)
        return
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=dashboard, log_to_driver=True)
    except ValueError as exc:  # a cluster `ray start` left here: joined, CPUs are its own
        if "existing cluster" not in str(exc):
            raise
        ray.init(include_dashboard=dashboard, log_to_driver=True)
        logger.info("joined the Ray cluster `ray start` left on this machine (its own "
                    "%d CPUs; num_workers %d still caps the map tasks)", cluster_cpus(),
                    num_cpus)


def node_processes() -> dict[str, list[Any]]:
    """Ray's private record of the processes this driver started for its node (process
    type -> records holding a `Popen`); empty when it joined a running cluster, or if a
    later Ray renames the record (then sessions are stopped by Ray's exit hook only)."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(worker, "_global_node", None)
    processes = getattr(node, "all_processes", None)
    return processes if isinstance(processes, dict) else {}


def current_gcs_address() -> str | None:
    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


def started_here() -> bool:
    """Whether the Ray session this process is connected to is one raypipe started."""
    return ray.is_initialized() and current_gcs_address() in _started_here


def shutdown_local_ray() -> None:
    """Stop the local Ray session raypipe started in this process; leave others alone."""
    if not started_here():
        return
    stop_autoscaler_monitor()
    _started_here.discard(current_gcs_address())
    ray.shutdown()


def leave_ray() -> None:
    """Leave the Ray session raypipe brought this process into: stop the local one it
    started (`shutdown_local_ray`), or disconnect from the running cluster it connected to
    (`ray.shutdown()` there only disconnects; the cluster, its detached actors and other
    drivers run on). A session the caller started is left alone. Log lines a worker writes
    after the job's last record may not reach this process (Ray's exit hook waits 0.5 s for
    them): the units report through their records, not their logs."""
    if started_here():
        shutdown_local_ray()
    elif ray.is_initialized() and current_gcs_address() in _connected_here:
        _connected_here.discard(current_gcs_address())
        ray.shutdown()


def stop_autoscaler_monitor() -> None:
    """SIGKILL the autoscaler monitor of the local session raypipe started.

    Ray's shutdown (ray 2.60, `Node.kill_all_processes`) stops the GCS before the monitor;
    the monitor's SIGTERM handler then reports its own termination to the dead GCS and hangs
    until Ray SIGKILLs it a second later: 1.0 of the 1.35 s `ray.shutdown()` takes. A local
    session has no nodes to scale, and SIGKILL skips the handler (no "autoscaler failed"
    error sent to drivers).
    """
    if not started_here():
        return
    for record in node_processes().get("monitor", []):
        process = getattr(record, "process", None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=5)


def cluster_cpus() -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


WORKER_NICENESS = 15  # Ray's default niceness for its worker processes (`worker_niceness`)
RAY_NICENESS_VARIABLE = "RAY_worker_niceness"  # Ray's spelling of that setting's variable


def worker_niceness() -> int:
    """The niceness Ray runs its workers at: its `worker_niceness` setting, as Ray reads it
    from the environment (RAY_worker_niceness), else Ray's default."""
    try:
        return int(os.environ.get(RAY_NICENESS_VARIABLE, WORKER_NICENESS))
    except ValueError:
        return WORKER_NICENESS
