"""The tokenize job on Ray Data: one actor per core tokenizes and writes whole work units.

Invariant: the Ray layer only moves work units (WorkUnit dataclasses) in and small commit
records (UnitRecord) out (`ray.data.from_items(units).map_batches(UnitTokenizer,
batch_size=1)` over an actor pool);
all reading, tokenizing and writing is `raypipe.preprocess.unit.tokenize_unit`, so output is
byte-identical to the serial runner at any worker count. Each actor loads the tokenizer
once and tokenizes with one thread; token arrays never cross the object store. Actors ask
for 1 CPU each and nothing else is scheduled, so the pool never starves a read task (the
2-CPU deadlock of an actor pool holding every CPU while read tasks wait for one does not
arise: `from_items` has no read tasks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
import ray

from raypipe import _faults as faults
from raypipe.config import TokenizeConfig
from raypipe.errors import RaypipeError
from raypipe.io.manifest import UnitRecord, WorkUnit
from raypipe.preprocess.job import JobSummary, make_encoder, run_job
from raypipe.preprocess.unit import UnitSettings, tokenize_unit
from raypipe.ray.session import cluster_cpus, ensure_ray


class UnitTokenizer:
    """Ray Data callable class: tokenizer loaded once per actor."""

    def __init__(self, settings: UnitSettings):
        self.settings = settings
        self.encoder = make_encoder(settings)

    def __call__(self, batch: dict[str, np.ndarray]) -> pd.DataFrame:
        records: list[UnitRecord | RaypipeError] = []
        for unit in batch["unit"]:
            try:
                records.append(tokenize_unit(unit, self.settings, self.encoder))
            except RaypipeError as exc:  # bad input: no retry; raised as itself on the driver
                records.append(exc)
        # a pandas block holds the objects as they are (an Arrow block would try, fail and
        # log a conversion warning before pickling them)
        return pd.DataFrame({"record": records})


def ray_runner(num_workers: int | None, address: str | None = None) -> Any:
    """A unit runner that connects to (or starts) Ray only when there is work to run."""

    def run(units: list[WorkUnit], settings: UnitSettings) -> Iterable[UnitRecord]:
        _, run.startup_seconds = ensure_ray(address)
        workers = max(1, min(num_workers or cluster_cpus(), len(units)))
        remote_args: dict[str, Any] = {}
        if faults.environment():  # tests only: the workers see the same injected fault
            remote_args["runtime_env"] = {"env_vars": faults.environment()}
        dataset = ray.data.from_items([{"unit": u} for u in units],
                                      override_num_blocks=len(units)).map_batches(
            UnitTokenizer, fn_constructor_kwargs={"settings": settings},
            batch_size=1, num_cpus=1,
            compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=2),
            **remote_args)
        for row in dataset.iter_rows():
            if isinstance(row["record"], RaypipeError):
                raise row["record"]
            yield row["record"]
    run.startup_seconds = 0.0
    return run


def raypipe_cause(exc: BaseException) -> BaseException:
    """The RaypipeError inside a Ray task/UDF error chain (so the CLI prints one clear line),
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
    runner = ray_runner(config.num_workers, config.address)
    try:
        summary = run_job(config, runner)
    except Exception as exc:
        cause = raypipe_cause(exc)
        if cause is exc:
            raise
        raise cause from None
    summary.startup_seconds = runner.startup_seconds
    summary.run_seconds -= runner.startup_seconds
    return summary
