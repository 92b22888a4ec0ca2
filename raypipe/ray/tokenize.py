"""The tokenize job on Ray Data: one actor per core tokenizes and writes whole work units.

Invariant: the Ray layer only moves work-unit descriptions in and small commit records out
(`ray.data.from_items(units).map_batches(UnitTokenizer, batch_size=1)` over an actor pool);
all reading, tokenizing and writing is `raypipe.core.unit.tokenize_unit`, so output is
byte-identical to the serial runner at any worker count. Each actor loads the tokenizer
once and tokenizes with one thread; token arrays never cross the object store. Actors ask
for 1 CPU each and nothing else is scheduled, so the pool never starves a read task (the
2-CPU deadlock in NOTES-RAY.md does not arise: `from_items` has no read tasks).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import ray

from raypipe.config import TokenizeConfig
from raypipe.core.job import JobSummary, make_encoder, run_job
from raypipe.core.plan import WorkUnit
from raypipe.core.unit import UnitSettings, tokenize_unit
from raypipe.errors import RaypipeError
from raypipe.ray.session import cluster_cpus, ensure_ray


class UnitTokenizer:
    """Ray Data callable class: tokenizer loaded once per actor."""

    def __init__(self, settings: dict[str, Any]):
        self.settings = UnitSettings.from_dict(settings)
        self.encoder = make_encoder(self.settings)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        records = []
        for unit_json in batch["unit"]:
            unit = WorkUnit.from_dict(json.loads(unit_json))
            records.append(json.dumps(tokenize_unit(unit, self.settings, self.encoder)))
        return {"record": np.array(records, dtype=object)}


def ray_runner(num_workers: int | None, address: str | None = None) -> Any:
    """A unit runner that connects to (or starts) Ray only when there is work to run."""

    def run(units: list[WorkUnit], settings: UnitSettings) -> Iterable[dict[str, Any]]:
        _, run.startup_seconds = ensure_ray(address)
        workers = max(1, min(num_workers or cluster_cpus(), len(units)))
        items = [{"unit": json.dumps(u.to_dict())} for u in units]
        dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            UnitTokenizer, fn_constructor_kwargs={"settings": settings.to_dict()},
            batch_size=1, num_cpus=1,
            compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=2))
        for row in dataset.iter_rows():
            yield json.loads(row["record"])
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
