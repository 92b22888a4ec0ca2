"""MixtureLoader: batches drawn from several tokenized datasets at fixed weights, with a state
that resumes exactly, at any world size.

Invariant: global step s takes G = world_size x batch_size rows. Their split between sources
is a pure function of the rows each source has served so far (`consumed`): every source is
owed weight x (rows so far + G) - consumed; the G rows go to the owed amounts by largest
remainder (ties to the first name). So after any number of steps every source's share of
rows is within one row of its weight (exact per global step up to rounding), every rank and
every resume computes the same split without communicating, and a new weight after a resume
steers the shares toward it from where each source stands. Inside a step the sources' rows
are spread evenly over each rank's rows (slot j goes to rank j mod W, as in TokenLoader). Each
source walks its own epochs (its plan per epoch as a TokenLoader of that dataset builds it);
its next row after the last of an epoch is the first of the next, so a small source repeats
and nothing of an epoch is dropped. A seq_len schedule or a seq_len changed on resume
begins a phase in every source where it stands (raypipe.sampling.schedule.Phase).
`state_dict()` = {weights, knobs, steps, per source: dataset fingerprint, epoch, position
in the epoch, rows consumed, stage base, seq_len phases}. Sources share one
tokenizer (same sha256) or the mixture is refused naming both. Cost per batch: one
allocation (O(sources)), one describe and fill per source present in the rank's rows, and
one row copy from a source's scratch buffer into the batch (bench/loader_bench.py
--mixture measures it against one source).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.errors import ConfigError, StateError
from raypipe.io.cache import CacheStats
from raypipe.io.states import MixtureState, SourcePosition
from raypipe.loader.batch import Batch
from raypipe.loader.options import LoaderOptions
from raypipe.loader.prefetch import batch_stream
from raypipe.loader.stats import LoaderStats, WaitStats, WaitSummary
from raypipe.loader.token_loader import TokenLoader, _rank_and_world
from raypipe.sampling.batches import BatchBuffers, BatchPlan, Filled, write_cu_seqlens
from raypipe.sampling.mixture import (
    MixtureSchedule,
    WeightStages,
    implied_phases,
    resumed_positions,
)
from raypipe.sampling.modes import knob_differences
from raypipe.sampling.schedule import BatchSchedule, Phases

logger = logging.getLogger("raypipe")


DESCRIBE_STEPS = 64  # steps whose rows are described together (one plan call per source)


@dataclass
class MixtureStep:
    """One global step for this rank: per batch row (source index, epoch, position), the
    per-source positions after the whole step, and per (source, epoch) the batch rows it
    fills with their description (set when the step's chunk is described)."""

    step: int
    rows: list[tuple[int, int, int]]
    after: dict[str, SourcePosition]
    phases: list[Phases]  # per batch row: the seq_len phases of its source's epoch plan
    groups: dict[tuple[int, int, Phases], tuple[list[int], BatchPlan]] = field(
        default_factory=dict)


class MixtureLoader:
    def __init__(self, paths: dict[str, str | Path], seq_len: int | None = None,
                 batch_size: int | None = None, *, weights: dict[str, float] | None = None,
                 stages: list[tuple[int, dict[str, float]]] | None = None,
                 options: LoaderOptions | None = None, **knobs: Any):
        """`paths`: {source name: dataset path or URI}; `weights`: {name: weight} (default:
        by tokens); `stages`: [(first global step, {name: weight}), ...], the weights that
        follow `weights` from those steps, each stage's shares balanced on its own rows;
        options as TokenLoader's (raypipe.loader.options)."""
        if not paths:
            raise ConfigError("mixture: no sources given")
        self.options = options = LoaderOptions.of(options, seq_len, batch_size, **knobs)
        if not options.plan_spec(0).loader_mode.mixes or options.metadata:
            raise ConfigError(f"mixture: sources are read as documents or windows; mode "
                              f"{options.mode!r} (pre-formed batches) and stream metadata "
                              "cannot be mixed")
        self.names = sorted(paths)
        self.rank, self.world_size = _rank_and_world(options.rank, options.world_size)
        self.mode, self.seed = options.mode, options.seed
        scheduled = self._batch_schedule(options)
        source_options = replace(options, rank=0, world_size=1, prefetch=1, batch_schedule=None,
                                 seq_len=options.first_seq_len, seq_len_schedule=None,
                                 batch_size=options.batch_size if scheduled is None
                                 else scheduled.largest // self.world_size)
        self.sources = [TokenLoader(paths[name], options=source_options)
                        for name in self.names]
        self._one_shuffle(options)
        self.batch_size = self.sources[0].batch_size
        self.batches = (scheduled or BatchSchedule.constant(self.world_size * self.batch_size)
                        ).with_seq_lens(list(options.seq_len_schedule or [])
                                        or [(0, self.sources[0].spec.seq_len)])
        self._check_tokenizers()
        self.stages = self._stages(weights, stages or [])
        self.device = options.torch_device()
        self.state_name: str | None = None
        self._builders: dict[tuple[int, int], Any] = {}
        self._scratches: dict[tuple[int, int], BatchBuffers] = {}
        self.steps = 0
        self.waits = WaitStats()
        self.positions = {name: SourcePosition(source.dataset.fingerprint, 0, 0, 0)
                          for name, source in zip(self.names, self.sources, strict=True)}

    def _one_shuffle(self, options: LoaderOptions) -> None:
        """Shuffle "auto" over sources some local, some on object storage: every source
        windowed (one shuffle for all; a state records one set of knobs)."""
        if options.shuffle == "auto" and len({source.spec.shuffle
                                                for source in self.sources}) > 1:
            for source in self.sources:
                source.use_shuffle("windowed", options.window_shards, options.lanes,
                                   "as another source of the mixture is on object storage")

    def _batch_schedule(self, options: LoaderOptions) -> BatchSchedule | None:
        """The global rows by step it was given (None: batch_size rows per rank)."""
        if not options.batch_schedule:
            return None
        if options.batch_size is not None:
            raise ConfigError("give batch_size (rows per rank, every step) or batch_schedule "
                              "(global rows by step), not both")
        return BatchSchedule.of(options.batch_schedule, self.world_size)

    def _check_tokenizers(self) -> None:
        first = self.sources[0].dataset.manifest.tokenizer
        for name, source in zip(self.names[1:], self.sources[1:], strict=True):
            other = source.dataset.manifest.tokenizer
            if other.sha256 != first.sha256:
                raise ConfigError(f"mixture: sources {self.names[0]!r} ({first.spec}, sha256 "
                                  f"{first.sha256[:12]}) and {name!r} ({other.spec}, sha256 "
                                  f"{other.sha256[:12]}) use different tokenizers")

    def _stages(self, weights: dict[str, float] | None,
                stages: list[tuple[int, dict[str, float]]]) -> WeightStages:
        tokens = {name: source.dataset.num_tokens
                  for name, source in zip(self.names, self.sources, strict=True)}
        return WeightStages.of(self.names, weights, tokens, stages)

    @property
    def seq_len(self) -> int:
        """T of the next step's rows (the seq_len schedule's, at its step)."""
        return self.batches.seq_len_at(self.steps) or self.sources[0].spec.seq_len

    @property
    def weights(self) -> np.ndarray:
        """The weights in force (those of the last step taken; before any, the first's)."""
        return self.stages.in_force(self.steps)

    @property
    def tokenizer(self) -> Any:
        """The sources' tokenizer (one for all)."""
        return self.sources[0].tokenizer

    @property
    def global_batch(self) -> int:
        """Rows of the next global step (the batch schedule's, at its step)."""
        return self.batches.at(self.steps)

    @property
    def weights_by_name(self) -> dict[str, float]:
        return dict(zip(self.names, self.weights.tolist(), strict=True))

    # ----- the schedule ---------------------------------------------------------------------
    def _schedule(self, until: int | None) -> Iterator[MixtureStep]:
        """Steps to `until` (None: without end) described DESCRIBE_STEPS at a time: one
        describe per (source, epoch)."""
        steps = self._steps(until)
        while chunk := list(itertools.islice(steps, DESCRIBE_STEPS)):
            self._describe(chunk)
            yield from chunk

    def _describe(self, chunk: list[MixtureStep]) -> None:
        wanted: dict[tuple[int, int, Phases], list[tuple[int, int, int]]] = {}
        for index, job in enumerate(chunk):
            for row, (source, epoch, position) in enumerate(job.rows):
                key = (source, epoch, job.phases[row])
                wanted.setdefault(key, []).append((index, row, position))
        for (source, epoch, phases), entries in wanted.items():
            positions = np.array([[position for _, _, position in entries]], dtype=np.int64)
            plan = self._builder(source, epoch, phases).describe(positions)[0]
            by_step: dict[int, list[int]] = {}
            for at, (index, _, _) in enumerate(entries):
                by_step.setdefault(index, []).append(at)
            for index, ats in by_step.items():
                rows = [entries[at][1] for at in ats]
                chunk[index].groups[(source, epoch, phases)] = (rows, BatchPlan(
                    plan.positions[ats], plan.observation_ids[ats],
                    [plan.rows[at] for at in ats]))

    def _builder(self, source: int, epoch: int, phases: Phases) -> Any:
        key = (source, epoch, phases)
        if key not in self._builders:
            if len(self._builders) > 4 * len(self.sources):
                self._builders.clear()
            self._builders[key] = self.sources[source].filler(epoch, phases)
        return self._builders[key]

    def _scratch(self, source: int, rows: int, seq_len: int, builder: Any) -> BatchBuffers:
        """A per-(source, row count, seq_len) buffer the source's rows are filled into
        first."""
        key = (source, rows, seq_len)
        if key not in self._scratches:
            self._scratches[key] = BatchBuffers.over(
                np.empty(BatchBuffers.size(rows, seq_len), dtype=np.int64), rows, seq_len)
            builder.prepare(self._scratches[key])
        return self._scratches[key]

    def _steps(self, until: int | None) -> Iterator[MixtureStep]:
        schedule = self.schedule()
        while until is None or schedule.step < until:
            step = schedule.step
            slots = [slot for slot in schedule.next_step() if slot.rank == self.rank]
            yield MixtureStep(step, [(slot.source, slot.epoch, slot.position) for slot in slots],
                              dict(zip(self.names, schedule.positions, strict=True)),
                              [slot.phases for slot in slots])

    def schedule(self) -> MixtureSchedule:
        """The schedule of the steps from where the mixture stands."""
        return MixtureSchedule(
            self.stages, self.world_size, self.batches,
            [lambda epoch, phases, source=source: source.plans(epoch, phases).size
             for source in self.sources],
            [self.positions[name] for name in self.names], self.steps,
            self.sources[0].spec.seq_len)

    # ----- filling a batch -----------------------------------------------------------------
    def _fill(self, job: MixtureStep, out: BatchBuffers) -> tuple[Filled, np.ndarray,
                                                                   np.ndarray]:
        observation_ids = np.empty(len(job.rows), dtype=np.int64)
        source_ids = np.array([source for source, _, _ in job.rows], dtype=np.int64)
        flags_by_row: list[np.ndarray] = [np.empty(0, bool)] * len(job.rows)
        seq_len = out.tokens.shape[1] - 1
        for (source, epoch, phases), (rows, plan) in job.groups.items():
            builder = self._builder(source, epoch, phases)
            scratch = self._scratch(source, len(rows), seq_len, builder)
            filled = builder.fill(plan, scratch)
            out.tokens[rows] = scratch.tokens
            out.position_ids[rows] = scratch.position_ids
            out.mask[rows] = scratch.mask
            observation_ids[rows] = plan.observation_ids
            starts = (scratch.position_ids == 0).sum(axis=1)
            flags = (filled.starts_document if filled.starts_document is not None
                     else np.ones(int(starts.sum()), bool))
            for row, piece in zip(rows, np.split(flags, np.cumsum(starts)[:-1]),
                                  strict=True):
                flags_by_row[row] = piece
        sequences = write_cu_seqlens(out, seq_len)
        return Filled(sequences, np.concatenate(flags_by_row)), observation_ids, source_ids

    # ----- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """Batches without end (each source cycles its epochs); stop after the steps you
        train. The state advances as each batch is taken; each step holds the batch
        schedule's rows (every rank its share)."""
        while True:
            yield from self._serve(self.batches.at(self.steps) // self.world_size,
                                   self.seq_len, self.batches.next_change(self.steps))

    @property
    def data_waits(self) -> WaitSummary:
        """How long the training thread waited for its batches (raypipe.loader.stats)."""
        return self.waits.summary()

    @property
    def stats(self) -> LoaderStats:
        """Waits per batch, and what the sources' caches fetched, summed, and hold against
        the budget (raypipe.loader.stats.LoaderStats)."""
        caches = [source.dataset.cache for source in self.sources
                  if source.dataset.cache is not None]
        if not caches:
            return LoaderStats(self.data_waits)
        fetched = CacheStats(*(sum(getattr(cache.stats, item.name) for cache in caches)
                               for item in fields(CacheStats)))
        return LoaderStats(self.data_waits, fetched, caches[0].budget_bytes,
                           caches[0].used_bytes())

    def _serve(self, rows: int, seq_len: int, until: int | None) -> Iterator[Any]:
        """The steps to `until` (None: without end), `rows` rows of `seq_len` per rank."""
        def fill(job: MixtureStep, views: BatchBuffers) -> tuple:
            return (job, *self._fill(job, views))

        def finish(views: BatchBuffers, meta: tuple) -> Batch:
            job, filled, observation_ids, source_ids = meta
            return Batch.of(views, filled, observation_ids=observation_ids,
                            positions=np.array([p for _, _, p in job.rows], dtype=np.int64),
                            epoch=-1, step=job.step, source_ids=source_ids,
                            mixture_state=job.after)

        prefetcher = batch_stream(self._schedule(until), fill, finish, rows,
                                  seq_len, self.options.dtype, self.device,
                                  self.options.prefetch, waits=self.waits)
        try:
            for batch in prefetcher:
                self.positions, self.steps = batch.mixture_state, batch.step + 1
                yield batch
        finally:
            prefetcher.close()

    # ----- state ----------------------------------------------------------------------------
    def knobs(self) -> dict[str, Any]:
        """The knobs that shape every source's observations (one set for all; seq_len: the
        next step's)."""
        return self.sources[0].plans.at_seq_len(self.seq_len).knobs_record()

    def state_dict(self) -> dict[str, Any]:
        return MixtureState(self.weights_by_name, self.knobs(), self.steps,
                            dict(self.positions)).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from any rank's `state_dict()` at any world size; new weights continue
        every source from its own position."""
        checked = MixtureState.from_dict(state)
        if sorted(checked.sources) != self.names:
            raise StateError(f"mixture state holds sources {sorted(checked.sources)}, this "
                             f"mixture has {self.names}")
        for name in self.names:
            fingerprint = self.positions[name].dataset
            if checked.sources[name].dataset != fingerprint:
                raise StateError(f"mixture source {name!r} changed since the checkpoint "
                                 f"(dataset {checked.sources[name].dataset!r}, now "
                                 f"{fingerprint!r})")
        for source in self.sources:
            source.adopt_shuffle(checked.knobs)
        saved_seq_len = checked.knobs.get("seq_len", self.seq_len)
        refused = knob_differences(checked.knobs, {**self.knobs(), "seq_len": saved_seq_len})
        if refused:
            raise StateError(f"mixture state made with other knobs than this mixture's: "
                             f"{refused} (these cannot change on a resume; seq_len, batch "
                             "size, world size and weights can)")
        saved = np.array([checked.weights[name] for name in self.names])
        self.steps = checked.steps
        if any(abs(checked.weights[n] - self.weights_by_name[n]) > 1e-12 for n in self.names):
            logger.info("mixture weights changed on resume: %s -> %s; every source continues "
                        "from its own position, the new weights' shares counted from here",
                        checked.weights, self.weights_by_name)
        implied = implied_phases(saved_seq_len, self.sources[0].spec.seq_len)
        positions = resumed_positions(self.stages, saved, checked.steps, [
            replace(checked.sources[name], phases=checked.sources[name].phases or implied)
            for name in self.names])
        self.positions = dict(zip(self.names, positions, strict=True))
        self._plan_the_change()

    def _plan_the_change(self) -> None:
        """A seq_len other than the state's: every source's rest of its epoch planned now
        (a mode that cannot is refused here, naming the change)."""
        schedule = self.schedule()
        try:
            schedule.rephase()
            for index, position in enumerate(schedule.positions):
                self.sources[index].plans(position.epoch, schedule.phases_of(position))
        except ConfigError as exc:
            raise StateError(f"mixture state: {exc}") from None

    def close(self) -> None:
        for source in self.sources:
            source.close()

