"""What changes a run's data, owned apart from where it stands: the units it serves (as a
state had them, and those the output gained since: on a resume, or while following a
running job), the documents it excludes, and the refusals of what its mode or shuffle
cannot serve.

Invariant: a change takes effect from the run's next step and leaves the steps already
taken as they were; a change that cannot be planned where the run stands is refused
before the run moves (`planned_again`), leaving the run as it was. The run's data
(`RunData`: its units in its order, raypipe.sampling.growth) changes only here, and a
new PlannedDataset is made only for it (`use_data`). Cost: one re-plan of the rest of the
epoch per change (raypipe.sampling.epochs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from raypipe.errors import ConfigError, StateError
from raypipe.io.states import LoaderState, UnitsAdded
from raypipe.sampling.exclusions import Exclusion
from raypipe.sampling.growth import RunData
from raypipe.sampling.schedule import Cursor, phases_of_rows

logger = logging.getLogger("raypipe")
JOIN_LINE_SECONDS = 60.0  # units joining are a warning at most this often (else INFO)


def check_dataset(saved: str, dataset: Any, source: str | None = None) -> None:
    """Refuse a state made for another dataset (or mixture source) than `dataset`."""
    if saved != dataset.fingerprint:
        named = f"mixture source {source!r} ({dataset.root})" if source else dataset.root
        raise StateError(f"{named} changed since the checkpoint (a shard or the manifest): "
                         f"the state was made for dataset {saved!r}, it is now "
                         f"{dataset.fingerprint!r}")


def check_data(fingerprint: str, view: str | None, data: RunData,
               source: str | None = None) -> None:
    """Refuse data other than a state's (its dataset `fingerprint`, its unit order `view`),
    naming the unit rewritten since where the output kept its files' digests
    (raypipe.io.views); `source`: a mixture's source name."""
    if fingerprint != data.dataset.fingerprint and view is not None:
        unit = data.rewritten()
        if unit is not None:
            raise StateError(f"{data.dataset.root}: unit {unit} of the run's data was "
                             "rewritten since the checkpoint (its "
                             f"{data.dataset.format_name} files differ from those the output "
                             "kept): its documents would be other tokens under the same "
                             "numbers; restore it, or start a new run")
    check_dataset(fingerprint, data.dataset, source)


def planned_again(what: str, plan: Callable[[], Any]) -> None:
    """Plan the rest of an epoch after a seq_len change now: a mode that cannot is refused
    here, naming the change, not at the first batch."""
    try:
        plan()
    except ConfigError as exc:
        raise StateError(f"{what}: {exc}") from None


class DataChanges:
    """The data half of one Run (`run`): its data (`data`), and what adds units to it,
    excludes documents from it, and refuses what the run cannot serve."""

    def __init__(self, run: Any):
        self.run = run
        # the units of the output the run serves, in its order (raypipe.sampling.growth)
        self.data = RunData.of(run.planned.dataset)
        self._joins_said = -JOIN_LINE_SECONDS  # when rank 0 last warned of units joining

    def exclude(self, by_source: dict[str | None, tuple[np.ndarray, int, int]]
                ) -> Exclusion | None:
        """Leave documents out from the next step on: `by_source[None]` = (the dataset's
        document numbers, names given, names that matched none), as a mixture's `exclude`
        takes each source's. The rest of the epoch is planned again without them, and every
        later epoch is planned without them; what was not found or excluded already is
        counted in the exclusion and the log (rank 0). None where none is left to
        exclude."""
        documents, named, not_found = by_source[None]
        record = self.run.planned.exclude(self.run.steps, documents, named, not_found)
        if record is not None:
            cursor = self.run.planned.schedule.phases_at(self.run.cursor())
            try:
                planned_again(f"{self.run.dataset.root}: exclude", lambda: self.run.planned.plan(
                    cursor.epoch, cursor.phases))
            except StateError:
                self.run.planned.take_back_exclusion()
                raise
        if self.run.rank == 0:
            if record is None:
                logger.info("%s: none of the %d document(s) named is left to exclude",
                            self.run.dataset.root, named if named is not None else len(documents))
            else:
                self.run.planned.exclusions.log(record, str(self.run.dataset.root))
        return record

    def adopt_data(self, saved: LoaderState, grow: bool = True) -> None:
        """Serve the data as `saved` had it (raypipe.sampling.growth), refusing data that
        changed; with `grow`, the units the output gained since are added (`adopt_data_of`)."""
        phases = phases_of_rows(saved.phases, saved.knobs.get("seq_len", self.run.spec.seq_len))
        self.adopt_data_of(saved.dataset, saved.view, saved.units_added or (),
                           Cursor(saved.epoch, saved.position, saved.steps or 0, phases), grow)

    def adopt_data_of(self, fingerprint: str, view: str | None,
                      added: tuple[UnitsAdded, ...], at: Cursor,
                      grow: bool = True, source: str | None = None) -> None:
        """Serve the data a state had (its dataset `fingerprint`, unit order `view` and
        units `added`: its units in its order), refusing data that changed; with `grow`,
        the units the output gained since are added where `units_join` says (`grown`), at
        `at`: where the run stands (a mixture's: source `source`)."""
        if (view in (None, self.data.view) and not added) or \
                not self.run.spec.loader_mode.excludes:  # (whole documents only: below)
            if view not in (None, self.data.view) and fingerprint != self.run.dataset.fingerprint:
                self.refuse_growth()  # the output changed, and the mode cannot follow
            check_data(fingerprint, view, self.data, source)
            return  # the output as the run had it
        try:
            data = self.data.as_saved(view, added)
        except StateError:
            if fingerprint == self.run.dataset.fingerprint or self.data.keeps(view):
                raise
            named = f"mixture source {source!r} ({self.run.dataset.root})" if source else \
                self.run.dataset.root
            raise StateError(f"{named}: the state is another dataset's: it was made for "
                             f"dataset {fingerprint!r} (unit order {view}), and this output, "
                             f"dataset {self.run.dataset.fingerprint!r}, never kept that order"
                             ) from None
        check_data(fingerprint, view, data, source)
        if grow:
            data = self.grown(data, at) or data
        if data is not self.data:
            self.use_data(data)

    def grown(self, data: RunData, at: Cursor, key: str | None = None) -> RunData | None:
        """`data` with the units of the output's order `key` (None: its own) it does not
        hold added at the step of `at`, where the run stands: served from the next epoch,
        and under units_join "epoch" joining the rest of this one; from this one where it
        has served nothing yet (`Cursor.begun`: a phase a join began counts as begun); None
        where none was added."""
        if not data.fresh(key):
            return None
        self.refuse_growth()
        step, epoch = at.step, at.epoch
        joins = self.run.units_join == "epoch" and at.begun
        grown = data.grown(step, epoch + at.begun, joins, key)
        if grown is not None and self.run.rank == 0:
            record = grown.added[-1]
            how = ("their blocks read as windows after the epoch's own"
                   if self.run.spec.shuffle == "windowed" else
                   "shuffled in among what it had not served")
            log = self._join_line()
            log("%s: the output gained %d unit(s); their %s documents are "
                           "numbered after the run's %s and %s", self.run.dataset.root,
                           record.units - len(data.names()),
                           f"{record.documents - data.dataset.num_documents:,}",
                           f"{data.dataset.num_documents:,}",
                           f"join the rest of epoch {epoch} from step {step}, {how}"
                           if joins else f"are served from epoch {record.epoch} on "
                           f"(units_join {self.run.units_join!r})")
        return grown

    def _join_line(self) -> Callable[..., None]:
        """How to log units joining: a warning at most once a JOIN_LINE_SECONDS (a
        followed job's units join often), INFO between."""
        now = time.monotonic()
        if now - self._joins_said <= JOIN_LINE_SECONDS:
            return logger.info
        self._joins_said = now
        return logger.warning

    def use_data(self, data: RunData) -> None:
        """Plan `data` from now on, under the run's schedule and exclusions."""
        before, self.data = self.run.planned, data
        self.run.planned = before.with_data(data)
        if before.dataset is not data.dataset:
            before.dataset.close()  # its open shards, and fetches in flight

    def join_units(self, output: Any, key: str, at: Cursor | None = None,
                   check: Callable[[], None] | None = None) -> UnitsAdded | None:
        """Add the units of the output's kept order `key` the run does not hold (`output`:
        a manifest of the run's output holding them: a running job's, raypipe.io.live),
        from the next step on (`grown`; `at`: where the run stands, default its cursor);
        the rest of the epoch is planned again now (`check`: how, default this run's), and
        a refusal leaves the run as it was. The record, or None where none was added."""
        data = self.data.with_output(output)
        grown = self.grown(data, at or self.run.cursor(), key=key)
        if grown is None:
            self.data = data
            return None
        before = (self.data, self.run.planned)
        self.use_data(grown)

        def plan_here() -> None:
            cursor = self.run.planned.schedule.phases_at(self.run.cursor())
            self.run.planned.plan(cursor.epoch, cursor.phases)

        try:
            planned_again(f"{self.run.dataset.root}: units joined", check or plan_here)
        except StateError:
            self.data, self.run.planned = before
            raise
        return grown.added[-1]

    def refuse_growth(self, what: str = "the output gained units since the checkpoint",
                      instead: str = "resume on the data as it was, or start a new run"
                      ) -> None:
        """Units added are numbered after the run's documents: a mode whose plans are not
        made of whole documents, or a split drawn by the data's fingerprint, cannot serve
        them (`what`: how they came; `instead`: what the user can do)."""
        mode = self.run.spec.loader_mode
        if not mode.excludes:
            raise StateError(f"{self.run.dataset.root}: {what}, and mode {mode.name!r} cannot "
                             "serve them (its rows are not made of whole documents); "
                             f"{instead}")
        if self.run.planned.split is not None:
            raise StateError(f"{self.run.dataset.root}: {what}, and split {self.run.spec.split!r} "
                             "draws its documents by the data's fingerprint, which they "
                             f"change; {instead}")

    def refuse_following(self, what: str) -> None:
        """A loader following a running job (`what`: which): refuse a mode or split that
        cannot serve added units, or a shuffle that cannot take them into the epoch."""
        self.refuse_growth(what, "give a mode whose rows are whole documents, and split "
                           "'all'")
        self.refuse_joins(what)

    def refuse_joins(self, what: str) -> None:
        """Units that join the epoch in progress (units_join "epoch") need a shuffle that
        can take them (raypipe.sampling.plans.continued_order): said now, not at the
        first join."""
        spec = self.run.spec
        if self.run.units_join != "epoch":
            return
        if (spec.shuffle == "windowed" and spec.lanes > 1
                and not spec.loader_mode.continues_lanes):
            raise ConfigError(f"{self.run.dataset.root}: {what}, and units cannot join an epoch "
                              f"in progress under a windowed shuffle of {spec.lanes} lanes "
                              "(the rows served are no prefix of the plan): give lanes=1 "
                              "(each node then reads every window), or units_join="
                              "'next_epoch' (they join at the next epoch)")
        if spec.shuffle == "shard_local":
            raise ConfigError(f"{self.run.dataset.root}: {what}, and units cannot join an epoch "
                              "in progress under shuffle 'shard_local': give shuffle "
                              "'global' or 'windowed', or units_join='next_epoch'")
