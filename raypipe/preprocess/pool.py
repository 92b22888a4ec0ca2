"""Where a one-machine job's units run when no Ray is around: a pool of worker processes.

Invariant: the pool only moves work, as every runner does: each unit is read, tokenized and
written by `tokenize_unit` in a worker process, so the shards are the bytes Ray Data's
runner writes, at any worker count. A worker is a fresh interpreter running this module
(`python -m raypipe.preprocess.pool`): it never re-imports the caller's script and never
inherits the driver's threads, as a fork or spawn start would. It loads the encoder once,
from the settings the driver sends it once (the tokenizer's JSON and the driver's tiktoken
conversion), and takes one unit at a time over its stdin, answering over a private copy of
its stdout with the unit's record, its RaypipeError, or any other exception with its
traceback (raised as itself): frames of an 8-byte length and a pickle, between processes
of one job only (nothing read from disk is unpickled). The workers start when the runner
connects, so their interpreters start while the driver plans and self-checks; while the
check runs, each builds the encoder of the backend the check most likely picks (its
Warmup), and keeps it once the check agrees. Their count is `num_workers`, else the CPUs
this process may use (affinity and cgroup quota). A worker that dies (killed, out of
memory) is replaced and its unit run again; a unit that killed its worker UNIT_RETRIES + 1
times fails the job naming its file and rows, as on Ray. The first bad unit stops new
units; those in flight finish and commit before it is raised.
Cost on the driver: one frame out and one in per unit (a record's pickle: ~1.4 KB, ~35 us
to pickle and unpickle) and one `select` wake-up; per worker, its interpreter's start (its
imports overlap the plan), the settings' frame and, while the
check runs, a Warmup frame (each holds the tokenizer's JSON: 1-10 MB). Measured on 2
cores: see docs/benchmarks.md ("A job without Ray").
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from raypipe import _faults as faults
from raypipe.errors import RaypipeError
from raypipe.io.records import UnitRecord, WorkUnit
from raypipe.preprocess.encoding.tiktoken_backend import Conversion, adopt, converted
from raypipe.preprocess.runners import (
    Failures,
    FilesOnly,
    LaterSettings,
    Settings,
    encoder_for,
    settings_now,
    too_many_deaths,
    unit_outcome,
    warmed_up,
)
from raypipe.preprocess.unit import UnitSettings

FRAME_HEADER = struct.Struct("<Q")  # a frame: its pickle's length, then the pickle


def send_frame(stream: IO[bytes], message: Any) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(FRAME_HEADER.pack(len(payload)) + payload)
    stream.flush()


def receive_frame(stream: IO[bytes]) -> Any:
    """The next message, or EOFError where the other end closed (a worker that died)."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        raise EOFError
    size = FRAME_HEADER.unpack(header)[0]
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError
    return pickle.loads(payload)


@dataclass(frozen=True)
class JobSettings:
    """What a worker reads once, before its first unit."""

    settings: UnitSettings
    conversion: Conversion | None


@dataclass(frozen=True)
class Warmup:
    """The settings the job's self-check most likely returns, sent while it runs: a worker
    builds its encoder from them meanwhile, and keeps it if the JobSettings that follow
    ask for the same encoder."""

    settings: UnitSettings


@dataclass(frozen=True)
class UnitTask:
    """One unit for a worker, with how often it has been started (2 on: after a death)."""

    unit: WorkUnit
    attempt: int


CPU_QUOTA_FILE = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>"


def local_cpus(quota_file: str = CPU_QUOTA_FILE) -> int:
    """The CPUs this process may use: its affinity (where the system has one), no more than
    its cgroup's CPU quota rounded up (a container or pod limited to 4 CPUs on a 64-core
    host gets 4 workers, not 64 that the quota throttles)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        with open(quota_file) as handle:
            quota, period = handle.read().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, math.ceil(int(quota) / int(period))))


class WorkerFailure:
    """An exception a unit raised that is not bad input (a bug): the job raises it as itself
    (its worker's traceback attached), or as a RuntimeError where it does not pickle."""

    def __init__(self, location: str, trace: str, error: BaseException):
        self.location, self.trace = location, trace
        try:
            self.error: bytes | None = pickle.dumps(error)
        except Exception:  # noqa: BLE001  (its words still travel)
            self.error = None

    def exception(self) -> BaseException:
        error = pickle.loads(self.error) if self.error is not None else RuntimeError(
            f"{self.location}: the worker raised an error that does not pickle")
        error.add_note(f"raised by the worker tokenizing {self.location}:\n{self.trace}")
        return error


class Worker:
    """One worker process and the unit it runs (None: idle)."""

    def __init__(self) -> None:
        environment = {**os.environ, **faults.environment(), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "raypipe.preprocess.pool"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=environment, start_new_session=False)
        self.task: UnitTask | None = None
        self.has_settings = False

    def send(self, message: Any) -> None:
        """Send `message`; to a worker that has died, nothing (its death is found where
        its stdout ends, and its unit, if it was handed one, is run again)."""
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            send_frame(self.process.stdin, message)

    def receive(self) -> Any:
        assert self.process.stdout is not None
        return receive_frame(self.process.stdout)

    def stop(self, kill: bool = False) -> None:
        """Close its stdin (an idle worker exits) and reap it; `kill`: one that may still
        run a unit (the job stops short), or one that does not exit at once."""
        self.let_go(kill)
        self.reap()

    def let_go(self, kill: bool = False) -> None:
        """Tell it to exit (close its stdin), or kill it."""
        if kill:
            self.process.kill()
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()

    def reap(self) -> None:
        """Wait for it to exit (killed past 5 s), and close its stdout."""
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def stop_all(workers: list[Worker], kill: bool = False) -> None:
    """Stop `workers` side by side: each is told (or killed) before any is waited for."""
    for worker in workers:
        worker.let_go(kill)
    for worker in workers:
        worker.reap()


class ProcessPoolRunner(FilesOnly):
    """Runs a file job's units on `num_workers` local processes (default: this machine's
    CPUs, no more than there are units). Datasets need Ray."""

    def __init__(self, num_workers: int | None = None):
        self.num_workers = num_workers
        self.startup_seconds = 0.0
        self.data_startup_seconds = 0.0  # run launched -> its first record
        self.retries = 0
        self.workers: list[Worker] = []

    def connect(self) -> None:
        """Start the worker processes (their imports overlap the job's plan and check;
        those the plan leaves without a unit are stopped when the run starts)."""
        if not self.workers:
            started = time.perf_counter()
            self.workers = [Worker() for _ in range(self.num_workers or local_cpus())]
            self.startup_seconds = time.perf_counter() - started

    def close(self) -> None:
        """Stop the workers a job started but never ran (it failed first); none are left
        after a run, which stops its own."""
        stop_all(self.workers, kill=True)
        self.workers = []

    def startup_line(self) -> str | None:
        count = len(self.workers)
        return (f"{count} local worker process{'' if count == 1 else 'es'}, no Ray (pass "
                "--executor ray to run on Ray)")

    def run(self, units: list[WorkUnit], settings: Settings) -> Iterator[UnitRecord]:
        """Records of `units` as they commit; the first failure is raised once the units
        in flight have finished (and committed)."""
        self.connect()
        finished = False
        try:
            yield from self._run(units, settings)
            finished = True
        finally:  # all idle once finished; else (an error, an interrupt) stopped short
            stop_all(self.workers, kill=not finished)
            self.workers = []

    def _run(self, units: list[WorkUnit], settings: Settings) -> Iterator[UnitRecord]:
        launched = time.perf_counter()
        surplus = self.workers[max(1, len(units)):]
        self.workers = self.workers[:max(1, len(units))]
        stop_all(surplus, kill=True)  # more workers than units: they hold nothing yet
        guess = settings.guess() if isinstance(settings, LaterSettings) else None
        if guess is not None:  # the self-check runs: the workers build meanwhile
            for worker in self.workers:
                worker.send(Warmup(guess))
        ready = settings_now(settings)
        shared = JobSettings(ready, converted(ready.tokenizer.sha256))
        pending = deque(UnitTask(unit, 1) for unit in units)
        failures = Failures()
        with selectors.DefaultSelector() as selector:
            for worker in self.workers:
                self._dispatch(worker, pending, shared, failures)
                self._watch(selector, worker)
            while any(worker.task is not None for worker in self.workers):
                for key, _ in selector.select():
                    worker = key.data
                    if worker.task is None:  # an idle worker ended: it had nothing to do
                        selector.unregister(key.fileobj)
                        continue
                    record = self._collect(worker, pending, failures)
                    self.data_startup_seconds = self.data_startup_seconds or \
                        time.perf_counter() - launched
                    if worker.process.returncode is not None:  # died: a fresh one
                        selector.unregister(key.fileobj)
                        worker = self._replace(worker)
                        self._watch(selector, worker)
                    self._dispatch(worker, pending, shared, failures)
                    if record is not None:
                        yield record
        failures.raise_first()

    def _dispatch(self, worker: Worker, pending: deque[UnitTask], shared: JobSettings,
                  failures: Failures) -> None:
        """Hand `worker` the next unit (none once a unit has failed)."""
        if not pending or failures.errors:
            return
        if not worker.has_settings:
            worker.send(shared)
            worker.has_settings = True
        worker.task = pending.popleft()
        worker.send(worker.task)

    def _collect(self, worker: Worker, pending: deque[UnitTask], failures: Failures
                 ) -> UnitRecord | None:
        """The outcome of `worker`'s unit: its record, or None (a failure, kept; or a death:
        the unit goes back to the front of the queue, its attempt counted)."""
        task = worker.task
        assert task is not None
        worker.task = None
        try:
            outcome = worker.receive()
        except EOFError:
            worker.process.wait()
            self.retries += 1
            error = too_many_deaths(task.unit, task.attempt + 1)  # also a worker that
            if error is not None:  # cannot start: the job ends, it is not retried for ever
                failures.add(error)
            else:
                pending.appendleft(UnitTask(task.unit, task.attempt + 1))
            return None
        if isinstance(outcome, RaypipeError | WorkerFailure):
            failures.add(outcome.exception() if isinstance(outcome, WorkerFailure)
                         else outcome)
            return None
        return outcome

    def _replace(self, dead: Worker) -> Worker:
        dead.stop()
        worker = Worker()
        self.workers[self.workers.index(dead)] = worker
        return worker

    @staticmethod
    def _watch(selector: selectors.BaseSelector, worker: Worker) -> None:
        selector.register(worker.process.stdout, selectors.EVENT_READ, worker)


def serve(inbox: IO[bytes], outbox: IO[bytes]) -> None:
    """A worker's life: the job's settings, then units until the driver closes its stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    encoder = settings = warm = None
    while True:
        try:
            message = receive_frame(inbox)
        except EOFError:
            return
        if isinstance(message, Warmup):
            warm = warmed_up(message.settings)
            continue
        if isinstance(message, JobSettings):
            if message.conversion is not None:
                adopt(message.settings.tokenizer.sha256, message.conversion)
            settings, encoder, warm = message.settings, encoder_for(message.settings, warm), None
            continue
        assert settings is not None and encoder is not None, "a unit before the settings"
        try:
            outcome: Any = unit_outcome(message.unit, message.attempt, settings, encoder)
        except Exception as exc:  # noqa: BLE001  (a bug, not bad input: the job fails)
            outcome = WorkerFailure(message.unit.location, traceback.format_exc(), exc)
        send_frame(outbox, outcome)


def main() -> None:
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a library's print cannot corrupt it
    serve(sys.stdin.buffer, outbox)


if __name__ == "__main__":  # run as a script, this module is __main__: the driver's
    from raypipe.preprocess.pool import main as serve_as_module  # pickles name the module

    serve_as_module()
