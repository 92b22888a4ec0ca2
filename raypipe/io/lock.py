"""One job per output at a time: an exclusive lock file next to the unit records.

Invariant: a job holds `<output>/.raypipe-lock.json` (created with O_EXCL: {host, pid,
started_at}) from before it touches the output until it ends; a second job is refused with
a one-line error naming the holder. A lock whose holder is a dead process on this host (a
killed driver) is taken over; a lock held from another host cannot be checked from here
and is refused with the path to remove if that job is known to be dead. Cost: one file
create and one unlink per job.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from raypipe.errors import ConfigError

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


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _try_create(path: Path) -> bool:
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)
    return True


@contextmanager
def output_lock(directory: Path) -> Iterator[None]:
    """Hold the lock of the output `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    for _ in range(3):
        if _try_create(path):
            break
        holder = _holder(path)
        same_host = holder.get("host") == socket.gethostname()
        pid = holder.get("pid")
        if same_host and isinstance(pid, int) and not _alive(pid):
            logger.warning("%s: taking over the lock of a job that died (pid %s)", directory,
                           pid)
            path.unlink(missing_ok=True)
            continue
        where = "this host" if same_host else f"host {holder.get('host')!r}"
        since = time.strftime("%H:%M:%S", time.localtime(holder.get("started_at", 0)))
        raise ConfigError(f"{directory}: another raypipe job is writing this output (pid "
                          f"{pid} on {where}, since {since}); wait for it, or remove {path} "
                          "if that job is dead")
    else:
        raise ConfigError(f"{path}: could not take the output's lock")
    try:
        yield
    finally:
        if _holder(path).get("pid") == os.getpid():
            path.unlink(missing_ok=True)
