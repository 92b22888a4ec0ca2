"""The tokenize job on Ray: one actor per core tokenizes and writes whole work units.

Invariant: the Ray layer only moves work units (WorkUnit dataclasses) in and small commit
records (UnitRecord) out; all reading, tokenizing and writing is
`raypipe.preprocess.unit.tokenize_unit`, so output is byte-identical to the serial runner at
any worker count. Each actor (1 CPU) loads the tokenizer once (adopting the tiktoken
conversion the driver made for its self-check) and tokenizes with one thread; token arrays
never cross the object store. The driver hands each actor its next unit when the last one
commits (one unit in flight per actor, so the job's tail is at most one unit long). A killed
actor restarts; its unit goes back to the queue, UNIT_RETRIES times, then the job fails
naming the unit's file and row groups (committed units stay).

Why plain actors, not a Ray Data actor pool: the pool's streaming executor and map workers
took 3.2 s to start and a share of a core on the driver throughout; two plain actors take
0.6 s from `ray.init` to their first unit, and the driver sleeps in `ray.wait`. When
raypipe starts Ray itself (`RayRunner.connect`), the encoder's self-check runs on a thread
meanwhile. Measured end to end on 200 MB (bench/tokenize_bench.py): 30.2 s -> 23.3 s.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import ray

from raypipe import _faults as faults
from raypipe.config import TokenizeConfig
from raypipe.errors import InputError, RaypipeError
from raypipe.io.manifest import UnitRecord, WorkUnit
from raypipe.preprocess.encoder import DocumentEncoder
from raypipe.preprocess.job import JobSummary, make_encoder, run_job
from raypipe.preprocess.tiktoken_backend import Conversion, adopt, converted
from raypipe.preprocess.unit import UnitSettings, tokenize_unit
from raypipe.ray.session import cluster_cpus, ensure_ray

logger = logging.getLogger("raypipe")
UNIT_RETRIES = 3  # runs of a unit after its actor died, before the job fails


class UnitTokenizer:
    """A Ray actor: the tokenizer loaded once, whole units tokenized one after another."""

    def __init__(self, settings: UnitSettings):
        self.settings = settings
        self.encoder: DocumentEncoder | None = None

    def prepare(self, conversion: Conversion | None) -> None:
        """Load the encoder, adopting the driver's tiktoken conversion (from its self-check;
        converting a 50k vocabulary costs 0.3 s). A method, not a constructor argument: Ray
        warns about actors restarted from constructor arguments in the object store."""
        if conversion is not None:
            adopt(self.settings.tokenizer.sha256, conversion)
        self.encoder = make_encoder(self.settings)

    def ready(self) -> bool:
        return True

    def tokenize(self, unit: WorkUnit) -> UnitRecord | RaypipeError:
        if self.encoder is None:  # restarted after a crash: `prepare` is not sent again
            self.prepare(None)
        try:
            return tokenize_unit(unit, self.settings, self.encoder)
        except RaypipeError as exc:  # bad input: no retry; raised as itself on the driver
            return exc


class RayRunner:
    """A unit runner on Ray: connects to (or starts) Ray only when there is work to run."""

    def __init__(self, num_workers: int | None, address: str | None = None):
        self.num_workers = num_workers
        self.address = address
        self.startup_seconds = 0.0
        self.deaths: Counter[str] = Counter()  # unit name -> runs lost to a dead worker

    def connect(self) -> None:
        self.startup_seconds = ensure_ray(self.address, self.num_workers)

    def __call__(self, units: list[WorkUnit], settings: UnitSettings) -> Iterator[UnitRecord]:
        if not ray.is_initialized():
            self.connect()
        workers = max(1, min(self.num_workers or cluster_cpus(), len(units)))
        # actors always restart; the driver counts and retries each unit (run_units)
        options: dict[str, Any] = {"num_cpus": 1, "max_restarts": -1, "max_task_retries": 0}
        if faults.environment():  # tests only: the workers see the same injected fault
            options["runtime_env"] = {"env_vars": faults.environment()}
        actor_class = ray.remote(UnitTokenizer).options(**options)
        actors = [actor_class.remote(settings) for _ in range(workers)]
        conversion = ray.put(converted(settings.tokenizer.sha256))
        for actor in actors:
            actor.prepare.remote(conversion)
        try:
            yield from run_units(deque(units), actors, self.deaths)
        finally:
            for actor in actors:
                ray.kill(actor)


def run_units(queue: deque[WorkUnit], actors: list[Any],
              deaths: Counter[str]) -> Iterator[UnitRecord]:
    """Each actor takes the next unit from `queue` when its last one has committed; a unit
    whose actor died goes back to the front of the queue (counted in `deaths` and logged),
    UNIT_RETRIES times at most."""
    running: dict[Any, tuple[Any, WorkUnit]] = {}

    def hand_out(actor: Any) -> None:
        if queue:
            unit = queue.popleft()
            running[actor.tokenize.remote(unit)] = (actor, unit)

    for actor in actors:
        hand_out(actor)
    while running:
        [done], _ = ray.wait(list(running), num_returns=1)
        actor, unit = running.pop(done)
        try:
            result = ray.get(done)
        except ray.exceptions.RayActorError as exc:  # the actor restarts by itself
            deaths[unit.name] += 1
            reason = str(exc).splitlines()[0]
            if deaths[unit.name] > UNIT_RETRIES:
                raise InputError(f"{unit.location}: the worker tokenizing them died "
                                 f"{deaths[unit.name]} times (out of memory?): {reason}"
                                 ) from exc
            logger.warning("%s: the worker died (%s); running the unit again (%d of %d)",
                           unit.location, reason, deaths[unit.name], UNIT_RETRIES)
            queue.appendleft(unit)
            wait_until_restarted(actor)  # a call meanwhile would be refused, not run
            hand_out(actor)
            continue
        if isinstance(result, RaypipeError):
            raise result
        hand_out(actor)
        yield result


def wait_until_restarted(actor: Any, seconds: float = 300.0) -> None:
    """Return once `actor` answers again after its process died (Ray restarts it)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            ray.get(actor.ready.remote())
            return
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def raypipe_cause(exc: BaseException) -> BaseException:
    """The RaypipeError inside a Ray task error chain (so the CLI prints one clear line),
    or the exception itself."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RaypipeError) and type(seen).__module__.startswith("raypipe"):
            return seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return exc


def run_tokenize(config: TokenizeConfig) -> JobSummary:
    """Run the job inside the caller's Ray session, or a new one (left running); a rerun
    with nothing left to do never touches Ray."""
    runner = RayRunner(config.num_workers, config.address)
    try:
        summary = run_job(config, runner)
    except Exception as exc:
        cause = raypipe_cause(exc)
        if cause is exc:
            raise
        raise cause from None
    summary.startup_seconds = runner.startup_seconds
    summary.unit_retries = sum(runner.deaths.values())
    return summary
