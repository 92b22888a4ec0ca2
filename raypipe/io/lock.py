"""One job per output at a time: an exclusive lock file next to the unit records.

Invariant: a job holds `<output>/.raypipe-lock.json` (created with O_EXCL: {host, pid,
started_at}) from before it touches the output until it ends; a second job is refused with
a one-line error naming the holder. A lock whose holder is a dead process on this host (a
killed driver) is taken over; a lock held from another host cannot be checked from here
and is refused with the path to remove if that job is known to be dead. Object storage
has no exclusive create: there the lock is written, read back and checked to be ours, which
catches a second job unless both start within one round trip (an advisory lock; a cluster
runs one job per output by construction of `ray job submit`). Cost: one file create (or
PUT + GET) and one delete per job.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from raypipe.errors import ConfigError
from raypipe.io.store import Store

LOCK_NAME = ".raypipe-lock.json"
logger = logging.getLogger("raypipe")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _holder(store: Store) -> dict:
    try:
        return json.loads(store.read_bytes(LOCK_NAME))
    except (OSError, ValueError):
        return {}


def _try_create(store: Store) -> bool:
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
    if not store.local:
        if store.exists(LOCK_NAME):
            return False
        store.write_json(LOCK_NAME, record)
        return _holder(store) == record
    try:
        fd = os.open(store.root / LOCK_NAME, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)
    return True


def _ours(store: Store) -> bool:
    holder = _holder(store)
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


@contextmanager
def output_lock(store: Store) -> Iterator[None]:
    """Hold the lock of the output `store`."""
    if store.local:
        if store.root.exists() and not store.root.is_dir():
            raise ConfigError(f"{store}: the output is a file, not a directory")
        try:
            store.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{store}: cannot create the output directory: "
                              f"{exc.strerror or exc}") from exc
    lock_uri = store.uri_of(LOCK_NAME)
    for _ in range(3):
        if _try_create(store):
            break
        holder = _holder(store)
        same_host = holder.get("host") == socket.gethostname()
        pid = holder.get("pid")
        if same_host and isinstance(pid, int) and not _alive(pid):
            logger.warning("%s: taking over the lock of a job that died (pid %s)", store,
                           pid)
            store.delete(LOCK_NAME)
            continue
        where = "this host" if same_host else f"host {holder.get('host')!r}"
        since = time.strftime("%H:%M:%S", time.localtime(holder.get("started_at", 0)))
        raise ConfigError(f"{store}: another raypipe job is writing this output (pid "
                          f"{pid} on {where}, since {since}); wait for it, or remove "
                          f"{lock_uri} if that job is dead")
    else:
        raise ConfigError(f"{lock_uri}: could not take the output's lock")
    try:
        yield
    finally:
        if _ours(store):
            store.delete(LOCK_NAME)
