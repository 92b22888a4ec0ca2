"""Test-only fault injection: crash, kill, pause or fail with ENOSPC at named points.

Invariant: a fault is configured only through the environment variable RAYPIPE_TEST_FAULT (a
JSON object; tests set it, normal use never does, and no config or manifest carries it);
without it every `point()` call is one environment lookup and nothing else. A fault fires at
most once per marker file, in whichever process reaches its point first (a Ray actor, or the
driver), so a retried unit or a rerun proceeds; with `"always": true` it fires every time (a
unit that kills every worker it runs on), appending each pid to the marker. Points:
`unit.rows` (after `after_rows` rows of a unit), `shard.commit` (before a shard's files are
renamed), `megatron.after_bin` (.bin renamed, .idx not), `megatron.mid_index` (half the .idx
temp written), `unit.before_record` (shards committed, record not),
`manifest.before_rename`, `manifest.after_rename`, `write` (any shard write: ENOSPC).
Actions: `kill` (SIGKILL this process), `exit` (os._exit, no cleanup), `raise`, `enospc`
(OSError 28), `pause` (write this pid to the marker and sleep: the test kills it), `delay` (sleep
`seconds` and go on: a slow job, as a loader following it sees one).
With `"in": "worker"` a fault fires only in a Ray worker (whose environment, from
`environment()`, says so), never on the driver (a fault in a shared code path such as
`tokenize_unit` would otherwise fire in a test's own serial run).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

ENVIRONMENT_VARIABLE = "RAYPIPE_TEST_FAULT"
SCOPE_VARIABLE = "RAYPIPE_TEST_FAULT_SCOPE"  # "worker" in processes a runner started
_PARSED: tuple[str, dict[str, Any]] | None = None


class InjectedFault(RuntimeError):
    """Raised by a fault with action `raise`."""


def active() -> dict[str, Any] | None:
    """The fault spec from the environment, parsed once per distinct value."""
    global _PARSED
    raw = os.environ.get(ENVIRONMENT_VARIABLE)
    if not raw:
        return None
    if _PARSED is None or _PARSED[0] != raw:
        _PARSED = (raw, json.loads(raw))
    return _PARSED[1]


def environment() -> dict[str, str]:
    """The variables a worker process needs to see the same fault (empty in normal use)."""
    raw = os.environ.get(ENVIRONMENT_VARIABLE)
    return {ENVIRONMENT_VARIABLE: raw, SCOPE_VARIABLE: "worker"} if raw else {}


def point(name: str, unit: str = "", rows: int = 0, path: object = None) -> None:
    spec = active()
    if spec is None or spec.get("point") != name:
        return
    if spec.get("unit") and spec["unit"] not in unit:
        return
    if spec.get("in") == "worker" and os.environ.get(SCOPE_VARIABLE) != "worker":
        return
    if rows < spec.get("after_rows", 0):
        return
    marker = Path(spec["marker"])
    try:
        with open(marker, "a" if spec.get("always") else "x") as handle:  # always, or once
            handle.write(f"{os.getpid()}\n" if spec.get("always") else str(os.getpid()))
    except FileExistsError:
        return
    if spec.get("action") == "delay":  # a slow unit, not a fault: nothing else happens
        time.sleep(float(spec.get("seconds", 0.1)))
        return
    _act(spec.get("action", "raise"), name, path)


def _act(action: str, name: str, path: object) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "exit":
        os._exit(137)
    if action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    if action == "pause":
        time.sleep(600)
    raise InjectedFault(f"injected fault at {name}")
