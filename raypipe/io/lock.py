"""One job per output at a time: an exclusive lock file next to the unit records, a lease.

Invariant: a job holds `<output>/.raypipe-lock.json` (a `LockRecord`: host, boot id, pid,
the process's start time, renewed_at) from before it touches the output until it ends,
rewriting `renewed_at` every LEASE_SECONDS / 3 on a thread; a second job is refused with a
one-line error naming the holder. A rerun exists to recover from a crashed, OOM-killed or
preempted driver, so a holder is judged by more than its pid:
- on this host (same boot id), it is alive only if /proc shows its pid running (not a
  zombie: nothing reaps orphans in many containers) with the recorded start time (pids are
  reused: pid_max is 32,768 here, and Ray starts processes by the thousand);
- on this host before a reboot (another boot id), it is dead;
- on another host (object storage, a shared disk), it cannot be seen: its lock is a lease,
  taken over with a warning once `renewed_at` is LEASE_SECONDS old (hosts' clocks must agree
  within that).
A dead holder's lock is taken over with a warning. Object storage has no exclusive create:
there the lock is written, read back and checked to be ours, which catches a second job
unless both start within one round trip (an advisory lock; a cluster runs one job per
output by construction of `ray job submit`). Cost: one file create (or PUT + GET), a small
rewrite every 20 s, and one delete per job.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raypipe.errors import ConfigError
from raypipe.io.manifest_compat import upgrade_lock_record
from raypipe.io.store import Store

LOCK_NAME = ".raypipe-lock.json"
LEASE_SECONDS = 60.0  # a holder on another host that has not renewed for this long is dead
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
logger = logging.getLogger("raypipe")


def boot_id() -> str | None:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return None


def process_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of `pid` from /proc; None if there is
    no such process, or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
    return fields[0], int(fields[19])


@dataclass(frozen=True)
class LockRecord:
    """Who holds an output's lock (the lock file's contents)."""

    host: str
    pid: int
    started_at: float
    renewed_at: float = 0.0
    boot_id: str | None = None
    process_start: int | None = None  # clock ticks since boot, from /proc

    @classmethod
    def mine(cls) -> LockRecord:
        now = time.time()
        found = process_start(os.getpid())
        return cls(socket.gethostname(), os.getpid(), now, now, boot_id(),
                   found[1] if found else None)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LockRecord:
        data = upgrade_lock_record(data)
        return cls(str(data.get("host")), int(data.get("pid", -1)),
                   float(data.get("started_at", 0.0)), float(data["renewed_at"]),
                   data.get("boot_id"), data.get("process_start"))

    @property
    def expires(self) -> bool:
        """Whether its lease runs out unless renewed (a record from before leases: never,
        raypipe.io.manifest_compat)."""
        return math.isfinite(self.renewed_at)

    def renewed(self) -> LockRecord:
        return LockRecord(self.host, self.pid, self.started_at, time.time(), self.boot_id,
                          self.process_start)

    def same_holder(self, other: LockRecord) -> bool:
        return (self.host, self.pid, self.started_at) == (other.host, other.pid,
                                                          other.started_at)

    def why_dead(self) -> str | None:
        """Why the holder is known to be dead (None: alive, or not knowable from here)."""
        if self.host != socket.gethostname():
            age = time.time() - self.renewed_at
            if age > LEASE_SECONDS:
                return f"its lease expired: not renewed for {age:.0f} s"
            return None  # renewing
        if self.boot_id and boot_id() and self.boot_id != boot_id():
            return "this host rebooted since"
        found = process_start(self.pid)
        if found is None:
            return None if _signal_reaches(self.pid) else f"pid {self.pid} has exited"
        state, started = found
        if state in ("Z", "X"):
            return f"pid {self.pid} is a zombie (exited, not reaped)"
        if self.process_start is not None and started != self.process_start:
            return f"pid {self.pid} is now another process"
        return None


def _signal_reaches(pid: int) -> bool:
    """Where /proc is missing: whether `pid` exists at all."""
    if Path("/proc/self/stat").exists():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _holder(store: Store) -> LockRecord | None:
    try:
        return LockRecord.from_json(json.loads(store.read_bytes(LOCK_NAME)))
    except (OSError, ValueError, TypeError):
        return None


def _try_create(store: Store, record: LockRecord) -> bool:
    if not store.local:
        if store.exists(LOCK_NAME):
            return False
        store.write_json(LOCK_NAME, asdict(record))
        holder = _holder(store)
        return holder is not None and holder.same_holder(record)
    try:
        fd = os.open(store.root / LOCK_NAME, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        json.dump(asdict(record), handle)
    return True


class LeaseRenewal:
    """Rewrites our lock's `renewed_at` every LEASE_SECONDS / 3 until stopped (only while
    the lock is still ours)."""

    def __init__(self, store: Store, record: LockRecord):
        self.store, self.record = store, record
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._renew, name="raypipe-lock-lease",
                                       daemon=True)

    def _renew(self) -> None:
        while not self.stopped.wait(LEASE_SECONDS / 3):
            holder = _holder(self.store)
            if holder is None or not holder.same_holder(self.record):
                logger.warning("%s: the output's lock is no longer this job's", self.store)
                return
            try:
                self.store.write_json(LOCK_NAME, asdict(self.record.renewed()))
            except OSError as exc:  # a transient storage error: the next round retries
                logger.warning("%s: renewing the output's lock failed: %s", self.store, exc)

    def __enter__(self) -> LeaseRenewal:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()


def check_output_location(store: Store) -> None:
    """Refuse a local output that is a file, or that raypipe could not create or write,
    creating nothing: a job asks before it starts anything (a local Ray: seconds)."""
    if not store.local:
        return
    root = store.root
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{store}: the output is a file, not a directory")
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{store}: cannot create the output directory: {existing} is a "
                          "file")
    if not os.access(existing, os.W_OK | os.X_OK):  # a read-only mount refuses root too
        raise ConfigError(f"{store}: the output directory is not writable (a read-only file "
                          "system, or no permission); give one raypipe can write")


def _prepare_directory(store: Store) -> None:
    check_output_location(store)
    if not store.local:
        return
    try:
        store.root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{store}: cannot create the output directory: "
                          f"{exc.strerror or exc}") from exc


def _take(store: Store, record: LockRecord) -> None:
    """Create the lock, taking over a dead holder's; refuse a live (or unknowable) one."""
    lock_uri = store.uri_of(LOCK_NAME)
    for _ in range(3):
        if _try_create(store, record):
            return
        holder = _holder(store)
        if holder is None:  # unreadable or gone between our create and read: try again
            time.sleep(0.05)
            continue
        why_dead = holder.why_dead()
        if why_dead is not None:
            logger.warning("%s: taking over the lock of a job that is gone (pid %s on %s: "
                           "%s)", store, holder.pid, holder.host, why_dead)
            store.delete(LOCK_NAME)
            continue
        same_host = holder.host == socket.gethostname()
        where = "this host" if same_host else f"host {holder.host!r}"
        since = time.strftime("%H:%M:%S", time.localtime(holder.started_at))
        lease = "" if same_host or not holder.expires else (
            f"; its lease is taken over once {LEASE_SECONDS:.0f} s pass without renewal")
        raise ConfigError(f"{store}: another raypipe job is writing this output (pid "
                          f"{holder.pid} on {where}, since {since}{lease}); wait for it, or "
                          f"remove {lock_uri} if that job is dead")
    raise ConfigError(f"{lock_uri}: could not take the output's lock")


@contextmanager
def output_lock(store: Store) -> Iterator[None]:
    """Hold the lock of the output `store`, renewing its lease."""
    _prepare_directory(store)
    record = LockRecord.mine()
    _take(store, record)
    try:
        with LeaseRenewal(store, record):
            yield
    finally:
        holder = _holder(store)
        if holder is not None and holder.same_holder(record):
            store.delete(LOCK_NAME)
