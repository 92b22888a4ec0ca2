"""SIGINT and SIGTERM as one clean way out of a command.

Invariant: once `install()` ran (the CLI does it first), SIGINT (Ctrl-C) and SIGTERM (a
preempted node, a Kubernetes pod stop, `ray job stop`) raise `Interrupted` in the main
thread, a BaseException that `except Exception` never swallows, so the command unwinds its
`finally` blocks (Ray stopped, writers aborted) and the CLI prints one line and exits
128 + the signal number (130, 143). A signal that arrives inside `deferred()` (Ray's
start-up: its C++ core worker crashed with exit status 139 when unwound halfway) is held
and raised when the section ends. A second signal while the first unwinds exits at once
(`os._exit`), for a user who will not wait. Nothing committed is touched: commits are
atomic renames (or whole uploads) and a half-written unit is swept by the rerun. Cost: none
until a signal arrives.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The command was asked to stop by `signum`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class _State:
    installed = False
    depth = 0  # open deferred() sections
    held: int | None = None  # a signal that arrived inside one
    raised: int | None = None  # the signal being handled (a second one exits at once)


def _handle(signum: int, frame: FrameType | None) -> None:
    if _State.raised is not None:
        os._exit(128 + signum)
    if _State.depth:
        _State.held = _State.held or signum
        return
    _State.raised = signum
    raise Interrupted(signum)


def install() -> None:
    """Route SIGINT and SIGTERM to `Interrupted` (main thread only; elsewhere a no-op).
    Call again after a library that sets its own handlers (Ray's `init` sets SIGTERM's)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        signal.signal(signum, _handle)
    _State.installed = True


@contextmanager
def handled() -> Iterator[None]:
    """`install()` for the block, then the handlers and state from before it (a command
    called from other code leaves that code's signal handling as it found it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    was_installed = _State.installed
    install()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _State.installed = was_installed
        reset()


def reinstall() -> None:
    """Take the signals back if `install()` ran in this process."""
    if _State.installed:
        install()


@contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then raise `Interrupted` for it."""
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
        if not _State.depth and _State.held is not None and _State.raised is None:
            signum, _State.held = _State.held, None
            _State.raised = signum
            raise Interrupted(signum)


def stopping() -> bool:
    """Whether this process is unwinding from SIGINT or SIGTERM."""
    return _State.raised is not None


def reset() -> None:
    """Forget a handled signal (a process that goes on after one: tests)."""
    _State.held = _State.raised = None
