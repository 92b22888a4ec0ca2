"""Ray's C++ lines that nobody running raypipe can act on, dropped from the driver's stderr
while a Ray Data job over a user's Dataset or a Ray Train run (jobs/train.py) runs.

Invariant: inside `dropping_ray_noise()` file descriptor 2 is a pipe whose reader thread
forwards every chunk to the real stderr at once, in order, except the lines matching
`DROPPED` (today one: Ray Data's actor pools, and Ray Train's PreemptionWatcher, get
their constructor arguments by object reference, and Ray's core worker logs each such
actor at error level, ray-project/ray#57733; the references live as long as the job, so a
restarted actor still finds them). Leaving the block restores fd 2 and drains the pipe
before anything else is printed, so nothing is lost or reordered: a traceback raised
inside is printed after it. Python-level writes
(`sys.stderr`, logging) take the same path. Cost: one thread and one pipe per job; a chunk
is scanned only for the dropped line's marker.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

DROPPED = re.compile(rb"[^\n]*core_worker\.cc:\d+: Actor with class name: [^\n]*has "
                     rb"constructor arguments in the object store and max_restarts > 0[^\n]*"
                     rb"\n?")
MARKER = b"has constructor arguments in the object store"
DRAIN_SECONDS = 10.0


def _write_all(target: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(target, view):]


def _pump(source: int, target: int) -> None:
    """Forward chunks from `source` to `target` until EOF, dropping DROPPED lines; an
    unfinished last line that holds the marker waits for its end."""
    pending = b""
    while chunk := os.read(source, 1 << 16):
        data = pending + chunk
        line_start = data.rfind(b"\n") + 1
        cut = line_start if MARKER in data[line_start:] else len(data)
        data, pending = data[:cut], data[cut:]
        if MARKER in data:
            data = DROPPED.sub(b"", data)
        if data:
            _write_all(target, data)
    if pending:
        _write_all(target, DROPPED.sub(b"", pending))
    os.close(source)


@contextmanager
def dropping_ray_noise() -> Iterator[None]:
    """fd 2 through the filter while inside (a no-op where fd 2 cannot be replaced)."""
    try:
        sys.stderr.flush()
        original = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    reader, writer = os.pipe()
    os.dup2(writer, 2)
    os.close(writer)
    thread = threading.Thread(target=_pump, args=(reader, original), daemon=True,
                              name="raypipe-stderr")
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original, 2)  # the pipe's last write end closes: the reader drains, ends
        thread.join(DRAIN_SECONDS)
        if not thread.is_alive():
            os.close(original)
