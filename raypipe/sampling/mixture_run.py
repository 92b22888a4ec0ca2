"""A mixture's run: weighted sources, each a `Run` of world size 1, owned in one place; the
MixtureLoader serves it and `raypipe trace` replays it.

Invariant: `MixtureRun` holds every source's position and the steps taken, and is the one
place that opens a mixture (one shuffle and one tokenizer for all sources), resumes it from
a state (the state's checks are raypipe.sampling.run's, written once), walks its steps
(raypipe.sampling.mixture's `MixtureSchedule`: each step's rows split between the sources
by weight, every source within one row of its weight after every step, a pure function of
the rows each has served) and describes each rank's rows, one describe per source, epoch
and phases for DESCRIBE_STEPS steps. Its data may change on a resume: a source added begins
at its first row, one dropped serves nothing more (a weight stage begins there, the change
recorded in the state), and each source keeps its own exclusions
(raypipe.sampling.exclusions) and its own data: units its output gained join it as a
one-dataset run's do (raypipe.sampling.growth), on a resume or while it follows a running
job. Cost: O(sources + rows) a step, ~17 us a step
skipped (raypipe.sampling.mixture).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.errors import ConfigError, StateError
from raypipe.io.states import (
    DROPPED_DATASET,
    MixtureLeg,
    MixtureState,
    SourceChange,
    SourcePosition,
    UnitsAdded,
)
from raypipe.io.store import Store
from raypipe.sampling.balance import assign_rows
from raypipe.sampling.blocks import WindowLayout
from raypipe.sampling.buffers import DescribedRows
from raypipe.sampling.data_changes import planned_again
from raypipe.sampling.epochs import PlanSpec
from raypipe.sampling.mixture import (
    MixtureSchedule,
    ScheduledRow,
    WeightStages,
    restage,
    resumed_positions,
)
from raypipe.sampling.modes import BatchFiller
from raypipe.sampling.run import (
    DESCRIBE_STEPS,
    Run,
    StepRow,
    check_knobs,
)
from raypipe.sampling.schedule import (
    BatchSchedule,
    Cursor,
    Phases,
    batch_shape,
    phases_of_rows,
)
from raypipe.sampling.state_compat import implied_phases, upgraded

logger = logging.getLogger("raypipe")

__all__ = ["MixtureRun", "MixtureStep"]


@dataclass
class MixtureStep:
    """One global step for one rank: per batch row (source index, epoch, position), the
    sources' positions after the whole step, per row the seq_len phases of its source's
    epoch plan, and per (source, epoch, phases) the rows it fills with their description."""

    step: int
    rows: list[tuple[int, int, int]]
    after: dict[str, SourcePosition]
    phases: list[Phases]
    groups: dict[tuple[int, int, Phases], tuple[list[int], DescribedRows]] = field(
        default_factory=dict)


class MixtureRun:
    """A mixture's run for one rank: its sources (`Run`s of world size 1, sorted by name),
    weights by stage, global rows and seq_len by step, and every source's position."""

    def __init__(self, names: list[str], sources: list[Run], world_size: int,
                 batches: BatchSchedule, stages: WeightStages, rank: int = 0):
        self.names, self.sources, self.world_size = names, sources, world_size
        self.batches, self.stages, self.rank = batches, stages, rank
        self.steps = 0
        self.positions = {name: SourcePosition(source.dataset.fingerprint, 0, 0, 0)
                          for name, source in zip(names, sources, strict=True)}
        self.changes: list[SourceChange] = []  # sources added and dropped on resumes
        # the run's legs (None: resumed from a state that did not record them), and the
        # data records of the sources dropped, kept for a replay of the steps before
        self.history: list[MixtureLeg] | None = [self.leg(0)]
        self.dropped_records: dict[str, dict[str, Any]] = {}
        self._fillers: dict[tuple[int, int, Phases], BatchFiller] = {}

    @classmethod
    def open(cls, paths: dict[str, str | Path], spec: PlanSpec, world_size: int,
             batch_size: int | None, *, weights: dict[str, float] | None = None,
             stages: list[tuple[int, dict[str, float]]] | None = None, rank: int = 0,
             batch_schedule: Any = None, seq_len_schedule: Any = None,
             manifests: dict[str, Any] | None = None, **source_options: Any) -> MixtureRun:
        """`paths`: {source name: dataset}; `weights` (None: by tokens) then `stages`;
        `manifests`: {source name: the manifest to open it by} (a running job's:
        raypipe.io.live; default: each output's own); `source_options`: Run.open's
        (format_name, cache_dir, ...), every source's."""
        if not paths:
            raise ConfigError("mixture: no sources given")
        if not spec.loader_mode.mixes:
            raise ConfigError(f"mixture: sources are read as documents or windows; mode "
                              f"{spec.mode!r} (pre-formed batches) cannot be mixed")
        scheduled, batch_size = batch_shape(batch_size, batch_schedule, world_size)
        names = sorted(paths)
        remote = [not Store(paths[name]).local for name in names]
        sources = [Run.open(paths[name], spec, 1, batch_size, rank=rank,
                            manifest=(manifests or {}).get(name),
                            budget_sources=max(sum(remote), 1), **source_options)
                   for name in names]  # (each logs on the mixture's rank 0 alone)
        # one shuffle and one layout for all (a state records one set of knobs): the source
        # on object storage whose blocks fetch the most for their cut bytes (chat data's
        # mask, MDS samples' headers; the first of equals) resolved them for its part of
        # the node cache, so every source's windows fit theirs (else the first source)
        first = max((source for source, on_bucket in zip(sources, remote, strict=True)
                     if on_bucket), default=sources[0],
                    key=lambda source: getattr(source.dataset, "fetched_per_cut_byte", 1.0))
        for source in sources:
            source.adopt_sibling(first)
        check_tokenizers(names, sources)
        batches = (scheduled or BatchSchedule.constant(world_size * sources[0].batch_size)
                   ).with_seq_lens(list(seq_len_schedule or [])
                                   or [(0, sources[0].spec.seq_len)])
        tokens = {name: source.dataset.num_tokens
                  for name, source in zip(names, sources, strict=True)}
        return cls(names, sources, world_size, batches,
                   WeightStages.of(names, weights, tokens, stages or []), rank)

    @classmethod
    def of_leg(cls, leg: MixtureLeg, spec: PlanSpec, **source_options: Any) -> MixtureRun:
        """The run a leg of a mixture's history was opened as (`raypipe trace --history`)."""
        run = cls.open(dict(leg.datasets), spec, leg.world_size, None,
                       weights=leg.stage_weights[0],
                       batch_schedule=[(row[0], row[1]) for row in leg.batches],
                       seq_len_schedule=[(row[0], row[2]) for row in leg.batches],
                       **source_options)
        run.stages = WeightStages(tuple(leg.stage_starts), tuple(  # the very weights
            np.array([weights[name] for name in run.names], dtype=np.float64)
            for weights in leg.stage_weights))
        return run

    def leg(self, step: int) -> MixtureLeg:
        """This run's shape as a leg of its history from global step `step`."""
        return MixtureLeg(
            step, self.world_size,
            {name: str(source.dataset.root) for name, source in zip(self.names, self.sources,
                                                                    strict=True)},
            list(self.stages.starts),
            [dict(zip(self.names, weights.tolist(), strict=True))
             for weights in self.stages.weights],
            [[first, batch, seq_len or self.sources[0].spec.seq_len]
             for first, batch, seq_len in self.batches.stages()])

    def adopt_history_data(self, final: MixtureState, names: Collection[str]) -> None:
        """Serve sources `names`' data as the `final` state of a run records it (units
        added and exclusions each from its own step): in a replay, every source of its
        first leg, and each source a later leg adds."""
        dropped = {name: change for change in final.changes or () for name in change.dropped}
        for name, source in zip(self.names, self.sources, strict=True):
            if name not in names:
                continue
            fingerprint = (final.sources[name].dataset if name in final.sources
                           else dropped[name].fingerprint_of(name))
            source.data_changes.adopt_data_of(fingerprint, (final.views or {}).get(name),
                                 (final.units_added or {}).get(name, ()), Cursor(0, 0, 0, ()),
                                 grow=False, source=name)
            source.planned.reset_exclusions()
            for record in (final.exclusions or {}).get(name, ()):
                source.planned.adopt_exclusion(record)
            self.positions[name] = replace(self.positions[name],
                                           dataset=source.dataset.fingerprint)
        self._fillers.clear()

    def advance(self, step: int) -> None:
        """Stand at global step `step` (no earlier than where the run stands), counting the
        rows of the steps before it alone."""
        schedule = self.schedule()
        schedule.skip(step - self.steps)
        self.positions = dict(zip(self.names, schedule.positions, strict=True))
        self.steps = schedule.step

    def state_at(self, step: int) -> MixtureState:
        """The state the run would save at global step `step`, the run left where it
        stands."""
        positions, steps = self.positions, self.steps
        try:
            self.advance(step)
            return self.state()
        finally:
            self.positions, self.steps = positions, steps

    @property
    def seq_len(self) -> int:
        return self.batches.seq_len_at(self.steps) or self.sources[0].spec.seq_len

    @property
    def global_batch(self) -> int:
        """Rows of the next global step (the batch schedule's, at its step)."""
        return self.batches.at(self.steps)

    def next_stretch(self) -> tuple[int, int, int | None]:
        """The steps from here of one shape: (rows of a rank's batch, seq_len, the step
        the shape changes at, None: never)."""
        return (self.global_batch // self.world_size, self.seq_len,
                self.batches.next_change(self.steps))

    @property
    def weights(self) -> np.ndarray:
        """The weights in force (those of the last step taken; before any, the first's)."""
        return self.stages.in_force(self.steps)

    @property
    def weights_by_name(self) -> dict[str, float]:
        return dict(zip(self.names, self.weights.tolist(), strict=True))

    def schedule(self) -> MixtureSchedule:
        """The schedule of the steps from where the mixture stands."""
        return MixtureSchedule(
            self.stages, self.world_size, self.batches,
            [source.planned.plan_size for source in self.sources],
            [self.positions[name] for name in self.names], self.steps,
            self.sources[0].spec.seq_len,
            [(source.planned.schedule.exclusion_starts, source.planned.schedule.join_starts)
             for source in self.sources])

    def filler(self, source: int, epoch: int, phases: Phases) -> BatchFiller:
        """Source `source`'s filler of epoch `epoch` under `phases` (the latest few kept)."""
        key = (source, epoch, phases)
        if key not in self._fillers:
            if len(self._fillers) > 4 * len(self.sources):
                self._fillers.clear()
            self._fillers[key] = self.sources[source].filler(epoch, phases)
        return self._fillers[key]

    # ----- steps ------------------------------------------------------------------------
    def rank_steps(self, until: int | None, together: int = DESCRIBE_STEPS
                   ) -> Iterator[MixtureStep]:
        """This rank's steps to `until` (None: without end), described `together` at a
        time (one describe per source, epoch and phases; a loader reading ahead takes a
        few before each step it serves, so no step waits behind a long description)."""
        schedule = self.schedule()

        def steps() -> Iterator[MixtureStep]:
            while until is None or schedule.step < until:
                step = schedule.step
                slots = [slot for slot in self._next_slots(schedule)
                         if slot.rank == self.rank]
                yield MixtureStep(step, [(slot.source, slot.epoch, slot.position)
                                         for slot in slots],
                                  dict(zip(self.names, schedule.positions, strict=True)),
                                  [slot.phases for slot in slots])

        walk = steps()
        while chunk := list(itertools.islice(walk, together)):
            self._describe(chunk)
            yield from chunk

    def _next_slots(self, schedule: MixtureSchedule) -> list[ScheduledRow]:
        """The schedule's next global step, rank-major (slot i x world + r is row i of
        rank r), its rows spread over the ranks by what they cost under `balance`: the
        step holds the same rows either way."""
        slots = schedule.next_step()
        model = self.sources[0].planned.cost_model
        if model is None:
            return slots
        costs = np.empty(len(slots), dtype=np.float64)
        by_plan: dict[tuple[int, int, Phases], list[int]] = {}
        for at, slot in enumerate(slots):
            by_plan.setdefault((slot.source, slot.epoch, slot.phases), []).append(at)
        for key, ats in by_plan.items():
            positions = np.array([[slots[at].position for at in ats]], dtype=np.int64)
            costs[ats] = self.filler(*key).row_costs(positions, model, self.seq_len)
        order = assign_rows(costs, self.world_size).tolist()
        return [replace(slots[at], rank=index % self.world_size,
                        row=index // self.world_size) for index, at in enumerate(order)]

    def _describe(self, chunk: list[MixtureStep]) -> None:
        wanted: dict[tuple[int, int, Phases], list[tuple[int, int, int]]] = {}
        for index, job in enumerate(chunk):
            for row, (source, epoch, position) in enumerate(job.rows):
                wanted.setdefault((source, epoch, job.phases[row]), []).append(
                    (index, row, position))
        for key, entries in wanted.items():
            positions = np.array([[position for _, _, position in entries]], dtype=np.int64)
            plan = self.filler(*key).describe(positions)[0]
            by_step: dict[int, list[int]] = {}
            for at, (index, _, _) in enumerate(entries):
                by_step.setdefault(index, []).append(at)
            for index, ats in by_step.items():
                chunk[index].groups[key] = ([entries[at][1] for at in ats], DescribedRows(
                    plan.positions[ats], plan.observation_ids[ats],
                    [plan.rows[at] for at in ats]))

    def took(self, step: int, after: dict[str, SourcePosition]) -> None:
        """Global step `step` was served: the sources stand at `after`."""
        self.positions, self.steps = after, step + 1

    def step_rows(self, step: int, steps: int, ranks: Any) -> Iterator[StepRow]:
        """What each row of `ranks` holds in `steps` steps from `step` steps after where
        the mixture stands (`raypipe trace`: counts alone up to there)."""
        schedule = self.schedule()
        schedule.skip(step)
        for _ in range(steps):
            number = schedule.step
            for slot in self._next_slots(schedule):
                if slot.rank in ranks:
                    pieces = self.filler(slot.source, slot.epoch, slot.phases).segments(
                        np.array([[slot.position]]))[0]
                    yield StepRow(number, slot.rank, slot.row, slot.epoch, pieces,
                                  self.sources[slot.source].planned.document_dataset,
                                  self.names[slot.source])

    def window_layouts(self) -> list[WindowLayout]:
        """Its sources' windowed plans of blocks read from object storage (Run's)."""
        return [layout for source in self.sources for layout in source.window_layouts()]

    # ----- state ------------------------------------------------------------------------
    def knobs(self) -> dict[str, Any]:
        """The knobs that shape every source's observations (seq_len: the next step's)."""
        return self.sources[0].planned.plans.at_seq_len(self.seq_len).knobs_record()

    def state(self) -> MixtureState:
        exclusions = {name: tuple(source.planned.exclusions.records)
                      for name, source in zip(self.names, self.sources, strict=True)
                      if len(source.planned.exclusions)}
        added = {name: source.data_changes.data.added
                 for name, source in zip(self.names, self.sources, strict=True)
                 if source.data_changes.data.added}
        views = {name: source.data_changes.data.view
                 for name, source in zip(self.names, self.sources, strict=True)}
        for name, records in self.dropped_records.items():
            for kind, held in (("exclusions", exclusions), ("units_added", added),
                               ("views", views)):
                if records.get(kind):
                    held[name] = records[kind]
        return MixtureState(self.weights_by_name, self.knobs(), self.steps,
                            dict(self.positions), changes=tuple(self.changes) or None,
                            exclusions=exclusions or None, views=views,
                            units_added=added or None,
                            history=None if self.history is None else tuple(self.history))

    def exclude(self, by_source: dict[str, tuple[np.ndarray, int, int]]) -> None:
        """Leave documents of each named source out from the next step on: {source:
        (its document numbers, names given for it, names that matched none)}; as a
        one-dataset run's `exclude`, source by source (its rest of the epoch planned again
        where it stands now)."""
        for name, (documents, named, not_found) in sorted(by_source.items()):
            source = self.sources[self.names.index(name)]
            record = source.planned.exclude(self.steps, documents, named, not_found)
            if record is None:
                continue
            try:
                planned_again(f"mixture source {name!r}: exclude",
                              lambda: self.rephased(self.schedule()))
            except StateError:
                source.planned.take_back_exclusion()
                raise
            if self.rank == 0:
                source.planned.exclusions.log(record, f"mixture source {name!r} "
                                                      f"({source.dataset.root})")

    def resume(self, state: dict[str, Any] | MixtureState, grow: bool = True) -> None:
        """Stand where `state` (any rank's, any world size) stands; weights other than the
        state's begin a stage there, every source continuing from its own position; a source
        the state lacks is added (from its first row), one it holds and this mixture lacks
        is dropped, recorded as a change; each source's exclusions are the state's, and
        its data (`grow`: with the units its output gained since joining)."""
        saved = (state if isinstance(state, MixtureState)
                 else MixtureState.from_dict(upgraded(state)))
        added = [name for name in self.names if name not in saved.sources]
        dropped = sorted(name for name in saved.sources if name not in self.names)
        if len(added) == len(self.names):
            raise StateError(f"mixture state holds sources {sorted(saved.sources)}, this "
                             f"mixture has {self.names}: none in common (a source kept, "
                             "with its dataset unchanged, is what a resume continues)")
        for name, source in zip(self.names, self.sources, strict=True):
            if name in saved.sources:  # its data as the state had it, units added joining
                where = saved.sources[name]
                source.data_changes.adopt_data_of(where.dataset, (saved.views or {}).get(name),
                                     (saved.units_added or {}).get(name, ()),
                                     self.cursor_of(where, saved.steps), grow,
                                     source=name)
            source.adopt_shuffle(saved.knobs)
        self._fillers.clear()
        check_knobs("the mixture state", saved.knobs, self.knobs(),
                    "seq_len, batch size, world size, weights and sources")
        self.steps = saved.steps
        self.changes = list(saved.changes or ())
        self.resume_history(saved, dropped)
        for name, source in zip(self.names, self.sources, strict=True):
            source.planned.reset_exclusions()
            for record in (saved.exclusions or {}).get(name, ()) if name in saved.sources \
                    else ():  # (a source added again begins afresh)
                source.planned.adopt_exclusion(record)
        implied = implied_phases(saved.knobs.get("seq_len", self.seq_len),
                                 self.sources[0].spec.seq_len)
        kept = [replace(saved.sources[name], phases=saved.sources[name].phases or implied,
                        dataset=source.dataset.fingerprint)  # (units may have joined it)
                if name in saved.sources else self.positions[name]
                for name, source in zip(self.names, self.sources, strict=True)]
        if added or dropped:
            self.change_sources(added, dropped, saved)
            positions = restage(kept)
        else:
            if not np.allclose([saved.weights[name] for name in self.names], self.weights,
                               rtol=0, atol=1e-12):
                logger.info("mixture weights changed on resume: %s -> %s; every source "
                            "continues from its own position, the new weights' shares "
                            "counted from here", saved.weights, self.weights_by_name)
            positions = resumed_positions(
                self.stages, np.array([saved.weights[name] for name in self.names]),
                saved.steps, kept)
        self.positions = dict(zip(self.names, positions, strict=True))
        schedule = self.schedule()
        planned_again("mixture state", lambda: self.rephased(schedule))

    def resume_history(self, saved: MixtureState, dropped: list[str]) -> None:
        """The state's legs and this one from its step (None where the state records
        none); the data records of the sources it dropped and those dropped now kept, but
        those of a source added again (it begins afresh)."""
        self.history = None if saved.history is None else [
            *(leg for leg in saved.history if leg.step < saved.steps), self.leg(saved.steps)]
        self.dropped_records = {
            name: {kind: (getattr(saved, kind) or {}).get(name)
                   for kind in ("exclusions", "units_added", "views")}
            for name in {*saved.dropped(), *dropped} - set(self.names)}

    def join_units(self, name: str, output: Any, key: str) -> UnitsAdded | None:
        """Add the units of source `name`'s kept order `key` it does not hold (`output`: a
        manifest holding them, a running job's: raypipe.io.live) from the next step on, where
        the source stands (DataChanges.join_units); every source's rest planned again now. The
        record, or None where none was added."""
        source, where = self.sources[self.names.index(name)], self.positions[name]
        record = source.data_changes.join_units(output, key, self.cursor_of(where, self.steps),
                                   lambda: self.rephased(self.schedule()))
        self._fillers.clear()
        self.positions[name] = replace(where, dataset=source.dataset.fingerprint)
        return record

    def cursor_of(self, where: SourcePosition, step: int) -> Cursor:
        """Where a source standing at `where` is before global step `step`."""
        return Cursor(where.epoch, where.position, step,
                      phases_of_rows(where.phases, self.seq_len))

    def rephased(self, schedule: MixtureSchedule) -> None:
        """Plan every source's rest of its epoch under the phases of the schedule's next
        step (a change a source cannot plan raises here, not at the first batch)."""
        schedule.rephase()
        for index, position in enumerate(schedule.positions):
            self.sources[index].planned.plan(position.epoch, schedule.phases_of(position))

    def change_sources(self, added: list[str], dropped: list[str], saved: MixtureState
                       ) -> None:
        """Record (and, rank 0, log) the sources added and dropped at the state's step: an
        added source begins at its first row, a dropped one serves nothing more, and the
        weights now in force begin a stage there (each source's share counted from it)."""
        roots = {name: str(source.dataset.root)
                 for name, source in zip(self.names, self.sources, strict=True)}
        change = SourceChange(saved.steps, added, dropped,
                              {**{name: DROPPED_DATASET + saved.sources[name].dataset
                                  for name in dropped},
                               **{name: roots[name] for name in added}},
                              self.weights_by_name)
        self.changes.append(change)
        if self.rank == 0:
            logger.warning("mixture sources changed on resume at step %d: %s; the weights "
                           "%s hold from here, every kept source continuing from its own "
                           "position", saved.steps, "; ".join(
                               [f"{name} added ({roots[name]}), from its first row"
                                for name in added]
                               + [f"{name} dropped (served {saved.sources[name].consumed:,}"
                                  " rows; nothing more)" for name in dropped]),
                           self.weights_by_name)


def check_tokenizers(names: list[str], sources: list[Run]) -> None:
    """Sources share one tokenizer (the same sha256), or the mixture is refused naming
    both."""
    first = sources[0].dataset.manifest.tokenizer
    for name, source in zip(names[1:], sources[1:], strict=True):
        other = source.dataset.manifest.tokenizer
        if other.sha256 != first.sha256:
            raise ConfigError(f"mixture: sources {names[0]!r} ({first.spec}, sha256 "
                              f"{first.sha256[:12]}) and {name!r} ({other.spec}, sha256 "
                              f"{other.sha256[:12]}) use different tokenizers")
