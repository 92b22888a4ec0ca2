"""The epoch plans a loader runs, built in one place for the loader and the tools.

Invariant: `PlanSpec` (raypipe.sampling.modes) holds every knob that shapes the
observations of an epoch, validated once against its mode; `EpochPlans` turns a spec and an
opened dataset into the plan of any epoch through the mode's plugin, a pure function of
(dataset, spec, epoch), so the loader, a resumed loader at another world size, `raypipe
pack-report` and `raypipe trace` number the same observations. `PlanSpec.knobs_record()` is
exactly what a loader state records to refuse a resume under other knobs. Cost: one plan
object per epoch asked for (the latest is kept); what a plan costs is in its mode's module.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError, StateError
from raypipe.io.cache import ShardCache, configured_budget, node_cached_array
from raypipe.io.records import Manifest
from raypipe.io.store import Store
from raypipe.sampling.balance import RowCostModel, cost_model, rank_rows
from raypipe.sampling.blocks import (
    WHOLE_SHARDS,
    Blocks,
    WindowBudget,
    block_sizes,
    cut_blocks,
    whole_shards,
)
from raypipe.sampling.buffers import TokenSource
from raypipe.sampling.exclusions import Exclusion, RunExclusions
from raypipe.sampling.lengths import DocumentLengths, dataset_lengths
from raypipe.sampling.loss_masks import LossMaskedFiller, LossMasks
from raypipe.sampling.modes import BatchFiller, EpochPlan, PlanInputs, PlanSpec, document_split
from raypipe.sampling.plans import (
    SPREAD_LANE_ENDS,
    ShardGroups,
    ShardWindows,
    SumsMemo,
    window_blocks_for,
)
from raypipe.sampling.resolve import SHUFFLE_LAYOUT, RunFacts, resolve
from raypipe.sampling.schedule import (
    BatchSchedule,
    Cursor,
    Phase,
    Phases,
    Segment,
    batch_shape,
)

__all__ = ["EpochPlans", "PlanSpec", "PlannedDataset", "document_split"]



KEPT_PLANS = 4  # plans kept: an epoch's phases are built on the phase before each


class EpochPlans:
    """The plans of one opened dataset under one spec; the latest few plans are kept. An
    epoch whose seq_len changed inside it has one plan per phase (raypipe.sampling.schedule
    .Phase): each the mode's `continue_plan` of the one before.

    `lengths` gives the document lengths the plans number (called only by the modes that
    need them), `shard_documents` how many of them each shard holds (default: every
    document); `stream_tokens` the tokens windows are cut from (a split's, or all);
    `step_observations` the observations of one global step (a validation epoch is padded
    to a whole number of them); `memo` keeps bestfit's block sums."""

    def __init__(self, spec: PlanSpec, dataset: TokenDataset | BatchDataset,
                 lengths: Callable[[], DocumentLengths], stream_tokens: int | None = None,
                 step_observations: int = 1, memo: SumsMemo | None = None,
                 batch_size: int = 1, shard_documents: np.ndarray | None = None,
                 exclusions: RunExclusions | None = None,
                 served: Callable[[int, int], int | None] = lambda epoch, joined: None):
        """`served(epoch, joined)`: how many of the documents (the first) epoch `epoch`
        serves once the run's first `joined` joins of units are in force (None: all; fewer
        where the run's data gained units it serves from later)."""
        self.spec = resolve(spec, RunFacts(dataset.cache is None, budget=window_budget(dataset)))
        self.dataset = dataset
        self.shard_documents = shard_documents  # None: every document of each shard
        self._lengths, self._memo = lengths, memo
        self.inputs = PlanInputs(dataset, lengths, stream_tokens, step_observations,
                                 batch_size, memo, self.groups())
        self.exclusions = exclusions  # the run's (None: none can be made)
        self.served = served
        self._kept: dict[tuple[int, Phases], Any] = {}

    def groups(self, shards: int | None = None) -> ShardGroups | ShardWindows | None:
        """The layout of a shard-local or windowed shuffle over the first `shards` shards
        (None: all; None for a global shuffle)."""
        spec = self.spec
        if spec.shuffle == "shard_local":
            return spec.loader_mode.shard_groups(self.dataset, spec.group_shards, shards)
        if spec.shuffle != "windowed":
            return None
        blocks = self.blocks()
        if shards is not None:
            kept = blocks.in_shards(shards)
            blocks = Blocks(blocks.starts[:kept + 1], blocks.shards[:kept])
        lanes = max(spec.lanes, 1)
        return ShardWindows(blocks, window_blocks_for(len(blocks), spec.window_blocks, lanes),
                            lanes, spec.lane_ends != SPREAD_LANE_ENDS, max(spec.lane_ranks, 1))

    def blocks(self) -> Blocks:
        """The windowed shuffle's blocks of the documents the plans number (one a shard
        under block_bytes WHOLE_SHARDS; else cut from the lengths, once per node)."""
        counts = (self.dataset.shard_document_counts if self.shard_documents is None
                  else self.shard_documents)
        block_bytes = self.spec.block_bytes or WHOLE_SHARDS
        if block_bytes >= WHOLE_SHARDS:
            return whole_shards(counts)
        itemsize = self.dataset.block_itemsize

        def cut() -> np.ndarray:
            return cut_blocks(self._lengths(), counts, itemsize, block_bytes).starts

        starts = (cut() if self._memo is None
                  else self._memo(("blocks", block_bytes, itemsize), cut))
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return Blocks(starts, np.searchsorted(offsets, starts[:-1], side="right") - 1)

    def block_sizes(self) -> np.ndarray:
        """The bytes of each block's tokens (`blocks`), once per node (the plan cache)."""
        blocks, itemsize = self.blocks(), self.dataset.block_itemsize

        def sized() -> np.ndarray:
            return block_sizes(self._lengths(), blocks, itemsize)

        if self._memo is None:
            return sized()
        return self._memo(("block sizes", self.spec.block_bytes, itemsize, len(blocks)), sized)

    def build(self, epoch: int, phases: Phases = ()) -> EpochPlan:
        """Epoch `epoch`'s plan under `phases` (none: at the spec's seq_len), built afresh
        (its earlier phases' plans taken from those kept)."""
        mode = self.spec.loader_mode
        if len(phases) <= 1:
            spec = self.spec if not phases else self.at_seq_len(phases[0].seq_len)
            return mode.plan(spec, self.inputs_of(phases[0] if phases else Phase(0), epoch),
                             epoch)
        before, phase = self(epoch, phases[:-1]), phases[-1]
        if not 0 < phase.begins <= before.size:
            raise ConfigError(f"epoch {epoch}: a phase begins at observation "
                              f"{phase.begins}, outside its plan of {before.size}")
        if phase.seq_len != phases[-2].seq_len:
            mode.refuse_a_seq_len_change(f"seq_len: {phases[-2].seq_len} -> {phase.seq_len} "
                                         f"inside epoch {epoch} (at observation "
                                         f"{phase.begins} of {before.size})")
        return mode.continue_plan(self.at_seq_len(phase.seq_len),
                                  self.inputs_of(phase, epoch), epoch, before, phase.begins)

    def forget(self) -> None:
        """Drop the plans kept (the exclusions they were made under changed)."""
        self._kept.clear()

    def inputs_of(self, phase: Phase, epoch: int) -> PlanInputs:
        """What a mode plans `phase` of epoch `epoch` from: the inputs, of the documents
        the epoch serves in that phase, without those of the run's first `phase.excluded`
        exclusions."""
        inputs = self.inputs_of_epoch(epoch, phase.joined)
        if not phase.excluded:
            return inputs
        if self.exclusions is None or phase.excluded > len(self.exclusions):
            raise ConfigError(f"a phase excludes the documents of {phase.excluded} "
                              "exclusion(s), more than the run records")
        self.spec.loader_mode.refuse_an_exclusion("documents excluded")
        excluded = self.exclusions.in_plan(phase.excluded)
        served = self.served(epoch, phase.joined)
        return replace(inputs, excluded=excluded if served is None
                       else excluded[excluded < served])

    def inputs_of_epoch(self, epoch: int, joined: int = 0) -> PlanInputs:
        """The inputs of the documents epoch `epoch` serves under `joined` joins: the
        first `served(epoch, joined)` (whole shards: a unit's), or all."""
        served = self.served(epoch, joined)
        if served is None:
            return self.inputs
        counts = (self.dataset.shard_document_counts if self.shard_documents is None
                  else self.shard_documents)
        shards = int(np.searchsorted(np.cumsum(counts), served, side="left")) + 1 \
            if served else 0
        lengths = self.inputs.lengths
        return replace(self.inputs, lengths=lambda: lengths().prefix(served),
                       groups=self.groups(min(shards, len(counts))))

    def at_seq_len(self, seq_len: int) -> PlanSpec:
        return self.spec if seq_len == self.spec.seq_len else replace(self.spec,
                                                                       seq_len=seq_len)

    def __call__(self, epoch: int, phases: Phases = ()) -> EpochPlan:
        """Epoch `epoch`'s plan under `phases` (kept, with the latest few others)."""
        if len(phases) == 1 and phases[0] == Phase(self.spec.seq_len):
            phases = ()
        key = (epoch, phases)
        if key not in self._kept:
            plan = self.build(epoch, phases)
            if len(self._kept) >= KEPT_PLANS:
                self._kept.pop(next(iter(self._kept)))
            self._kept[key] = plan
        return self._kept[key]


def window_budget(dataset: TokenDataset | BatchDataset,
                  budget_bytes: int | str | None = None, sources: int = 1,
                  ranks: int | None = None) -> WindowBudget:
    """What sizes a windowed shuffle's windows for `dataset`: the node cache's budget (its
    cache's, else as configured), the node's ranks (`ranks`: what the loader's ranks
    agreed, raypipe.loader.node_facts; None: LOCAL_WORLD_SIZE, as torchrun and Ray Train
    set it), the bytes of its index files (every rank reads them all), whether
    a block of a shard can be read alone (the same on local disk as on a bucket, so a
    local copy resolves the blocks a bucket run does), the dataset's bytes, its largest
    shard's (a shard-local group's size) and its shards (how many blocks a window mixes);
    `sources`: the datasets on object storage whose
    windows share the cache (a mixture's)."""
    index = dataset.index_bytes_read
    budget = (dataset.cache.budget_bytes if dataset.cache is not None
              else configured_budget(budget_bytes))
    ranged = bool(getattr(dataset, "reads_blocks_alone", False))
    shard_bytes = [sum(entry.bytes for entry in shard.files) for shard in dataset.shards]
    return WindowBudget(budget, ranks or node_ranks(), index, ranged, sources,
                        sum(shard_bytes), max(shard_bytes, default=0), len(shard_bytes),
                        float(getattr(dataset, "fetched_per_cut_byte", 1.0)))


def node_ranks() -> int:
    """The training ranks of this node that share its cache (LOCAL_WORLD_SIZE; 1)."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


class PlannedDataset:
    """One dataset opened under a spec for one world size: the documents its plans number
    (a split's, or all), the token source rows are read from, its epoch plans, and the
    positions each rank takes per step (position p + i*W + r is observation i of rank r at
    the step starting at p). What TokenLoader and `raypipe trace` share."""

    def __init__(self, dataset: TokenDataset | BatchDataset, spec: PlanSpec,
                 world_size: int, batch_size: int, cache_dir: str | Path | None = None,
                 memo: SumsMemo | None = None, schedule: BatchSchedule | None = None,
                 served_from: tuple[tuple[int, int], ...] = (),
                 joins: tuple[tuple[int, int], ...] = (),
                 budget_bytes: int | str | None = None, budget_sources: int = 1,
                 node_ranks: int | None = None):
        """`memo`: where plan arrays are kept (default: once per node, `node_memo`);
        `schedule`: the global batch of each step (default: W x `batch_size` every step);
        `served_from`: ((first epoch, documents it and the later ones serve), ...) of a
        run whose data gained units (none: every epoch serves every document); `joins`:
        ((step, documents served from it), ...) where added units joined the epoch in
        progress (each begins a phase: raypipe.sampling.schedule); `budget_bytes`: the
        node cache's, which sizes a windowed shuffle's blocks (a local dataset's too, so a
        local copy cuts the blocks a bucket run does; default as the cache's), shared by
        `budget_sources` datasets on object storage (a mixture's); `node_ranks`: the ranks
        sharing it that every rank plans with (None: LOCAL_WORLD_SIZE)."""
        self.dataset = dataset
        self.budget_bytes, self.budget_sources = budget_bytes, budget_sources
        self.node_ranks = node_ranks
        self.served_from, self.joins = served_from, joins
        self.world_size, self.batch_size, self.cache_dir = world_size, batch_size, cache_dir
        self.spec = spec = resolve(spec, self.facts)
        schedule = replace(schedule or BatchSchedule.constant(self.global_batch),
                           join_starts=tuple(step for step, _ in joins))
        # seq_len by step: the schedule's, else the spec's at every step
        self.schedule = (schedule if schedule.seq_lens
                         else schedule.with_seq_lens([(0, spec.seq_len)]))
        # the split its plans number, and what the mode's filler reads rows from
        self.split, self.rows = spec.loader_mode.rows_from(dataset, spec)
        # the documents' tokens, where rows read them (None: pre-formed batches)
        self.source: TokenSource | None = spec.loader_mode.token_source(self.rows)
        self._lengths: DocumentLengths | None = None
        # the documents left out, each set from its step on (the plans' numbering: the split's)
        self.exclusions = RunExclusions(int(getattr(dataset, "num_documents", 0)),
                                        None if self.split is None else self.split.ids)
        self.memo = memo or self.node_memo
        self.plans = self.epoch_plans()
        self.fetch_blocks()

    def epoch_plans(self) -> EpochPlans:
        """The plans of its epochs under its spec."""
        return EpochPlans(self.spec, self.dataset, self.document_lengths,
                          None if self.source is None else self.stream_tokens(),
                          self.global_batch, self.memo, self.batch_size,
                          self.shard_documents(), self.exclusions, self.served_in)

    def adopt_spec(self, spec: PlanSpec) -> None:
        """Plan under `spec` (resolved: raypipe.sampling.resolve) from now on: the same
        data, world, schedule and exclusions; only the shuffle and its layout may differ
        (a resumed state's, a mixture's sibling's), so only the plans are made again."""
        changed = {item.name for item in fields(PlanSpec)
                   if getattr(spec, item.name) != getattr(self.spec, item.name)}
        if changed - {"shuffle", *SHUFFLE_LAYOUT}:
            raise ValueError(f"adopt_spec changes only the shuffle, not {sorted(changed)}")
        self.spec = spec
        self.plans = self.epoch_plans()
        self.fetch_blocks()

    def with_data(self, data: Any) -> PlannedDataset:
        """This run's planned data over `data` (a RunData: units joined, a manifest grown):
        the same spec, world, schedule, cache and budget; the exclusions made so far
        carried over."""
        planned = PlannedDataset(data.dataset, self.spec, self.world_size, self.batch_size,
                                 self.cache_dir, schedule=self.schedule,
                                 served_from=data.served_from, joins=data.joins,
                                 budget_bytes=self.budget_bytes,
                                 budget_sources=self.budget_sources,
                                 node_ranks=self.node_ranks)
        for record in self.exclusions.records:  # (their steps are in the schedule)
            planned.exclusions.adopt(record)
        return planned

    @property
    def facts(self) -> RunFacts:
        """What its spec is resolved against (raypipe.sampling.resolve): the data's storage,
        the world size, the node cache's budget for this dataset's part of it."""
        return RunFacts(self.dataset.cache is None, self.world_size,
                        window_budget(self.dataset, self.budget_bytes, self.budget_sources,
                                      self.node_ranks))

    def fetch_blocks(self) -> None:
        """On object storage under a windowed shuffle of blocks, the dataset fetches the
        plans' blocks (raypipe.dataset.ShardSet.use_blocks), not whole shards."""
        spec = self.spec
        if (spec.shuffle != "windowed" or spec.block_bytes >= WHOLE_SHARDS
                or getattr(self.dataset, "cache", None) is None):
            return
        blocks = self.plans.blocks()
        starts = blocks.starts[:-1]
        self.dataset.use_blocks(blocks.shards, starts if self.split is None
                                else self.split.ids[starts],
                                self.facts.budget.for_lanes(spec.lane_ranks).hold_bytes)

    def served_in(self, epoch: int, joined: int = 0) -> int | None:
        """How many of the documents (the first) epoch `epoch` serves under the run's
        first `joined` joins; None: all."""
        served = None
        for first, documents in self.served_from:
            if first <= epoch:
                served = documents
        for _, documents in self.joins[:joined]:
            served = max(served or 0, documents)
        total = getattr(self.dataset, "num_documents", None)
        return None if served is None or served == total else served

    def shard_documents(self) -> np.ndarray | None:
        """How many of the documents the plans number each shard holds (a split's), or
        None (every document; also a pre-formed dataset, which numbers batches)."""
        if self.split is None:
            return None
        starts = np.concatenate([[0], np.cumsum(self.dataset.shard_document_counts)])
        return np.diff(np.searchsorted(self.split.ids, starts)).astype(np.int64)

    def node_memo(self, key: tuple, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """A plan's arrays kept once per node (raypipe.io.cache.node_cached_array), keyed
        by the dataset's fingerprint, the documents its plans number and the shuffle: the
        node's ranks, and `raypipe trace`, compute each once."""
        spec = self.spec
        split = None if self.split is None else (self.split.name, self.split.fraction)
        identity = [self.dataset.fingerprint, self.dataset.format_name, split, spec.shuffle,
                    spec.layout(), *key]
        digest = hashlib.sha256(json.dumps(identity, default=str).encode()).hexdigest()[:32]
        return node_cached_array(digest, compute, self.cache_dir)

    @classmethod
    def open(cls, path: str | Path, spec: PlanSpec, world_size: int, batch_size: int | None,
             format_name: str | None = None, cache_dir: str | Path | None = None,
             cache_bytes: int | str | None = None, memo: SumsMemo | None = None,
             batch_schedule: list[tuple[int, int]] | None = None,
             seq_len_schedule: list[tuple[int, int]] | None = None,
             manifest: Manifest | None = None, budget_sources: int = 1,
             node_ranks: int | None = None) -> PlannedDataset:
        """Open `path` (a directory or URI: shards through the node cache) for `spec`; a
        pre-formed dataset fixes seq_len and batch_size (0 / None take its own).
        `batch_schedule`: [(first step, global batch), ...] instead of `batch_size` (rows
        per rank: its largest stage's, for the buffers); `seq_len_schedule`: [(first step,
        seq_len), ...] (the spec's seq_len: its first stage's); `manifest`: the output's to
        open (default: its manifest.json; a running job's: raypipe.io.live);
        `budget_sources`: datasets on object storage sharing the node cache (a mixture's);
        `node_ranks`: the ranks sharing it every rank plans with (None: LOCAL_WORLD_SIZE)."""
        if seq_len_schedule:
            spec = replace(spec, seq_len=int(seq_len_schedule[0][1]))
        if batch_schedule and spec.split == "validation":
            raise ConfigError("batch_schedule: a validation split serves every held-out "
                              "document at one batch size; give it batch_size")
        schedule, batch_size = batch_shape(batch_size, batch_schedule, world_size)
        store = Store(path)
        cache = None if store.local else ShardCache(cache_dir, cache_bytes)
        dataset = spec.loader_mode.open_dataset(store, format_name, cache, manifest)
        spec, batch_size = spec.loader_mode.fit(dataset, spec, batch_size)
        if (schedule is not None or seq_len_schedule) and not spec.loader_mode.schedules:
            raise ConfigError(f"batch_schedule, seq_len_schedule: mode {spec.mode!r} serves "
                              "pre-formed batches of the shape they were written with")
        if seq_len_schedule:
            schedule = (schedule or BatchSchedule.constant(world_size * batch_size)
                        ).with_seq_lens(seq_len_schedule)
        return cls(dataset, spec, world_size, batch_size, cache_dir, memo, schedule,
                   budget_bytes=cache_bytes, budget_sources=budget_sources,
                   node_ranks=node_ranks)

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def observations_per_step(self) -> int:
        """Observations one rank takes per step: rows, or one pre-formed batch."""
        return self.spec.loader_mode.observations_per_step(self.batch_size)

    @property
    def global_batch(self) -> int:
        """Observations consumed per global step."""
        return self.world_size * self.observations_per_step

    def stream_tokens(self) -> int:
        """Tokens of the stream windows are cut from: the dataset's, or a split's."""
        if self.source is not None and self.source.stream_offsets is not None:
            return int(self.source.stream_offsets[-1])
        return self.dataset.num_tokens

    def document_lengths(self) -> DocumentLengths:
        """Lengths of the documents the plans number: a split's (one array), or every
        document's (a map of the node's lengths file, so the rank keeps no per-document
        array: raypipe.sampling.lengths.dataset_lengths)."""
        if self._lengths is None:
            every = dataset_lengths(self.dataset, self.cache_dir)
            self._lengths = (every if self.split is None
                             else DocumentLengths.of(every[self.split.ids]))
        return self._lengths

    @property
    def first_phases(self) -> Phases:
        """The phases an epoch begins with at step 0: one, at the schedule's first seq_len."""
        return self.phases_from(0)

    def phases_from(self, step: int) -> Phases:
        """The phases an epoch that begins at step `step` begins with: one, at that step's
        seq_len, exclusions and joins."""
        return (Phase(self.schedule.seq_len_at(step) or self.seq_len, 0,
                      self.schedule.exclusions_at(step), self.schedule.joins_at(step)),)

    def exclude(self, step: int, documents: np.ndarray, named: int | None = None,
                not_found: int = 0) -> Exclusion | None:
        """Leave `documents` (the dataset's numbers) out from global step `step` on: an
        exclusion of the run (raypipe.sampling.exclusions), recorded with what of them was
        not found or excluded already; None where none is left to exclude."""
        self.spec.loader_mode.refuse_an_exclusion(f"{self.dataset.root}: documents excluded")
        record = self.exclusions.add(step, documents, named, not_found)
        if record is not None:
            self.schedule = self.schedule.with_exclusion(step)
        return record

    def take_back_exclusion(self) -> None:
        """Undo the last `exclude` (its rest of the epoch could not be planned)."""
        self.exclusions.pop()
        self.plans.forget()
        self.schedule = replace(self.schedule,
                                exclusion_starts=self.schedule.exclusion_starts[:-1])

    def reset_exclusions(self) -> None:
        """Forget every exclusion (a resume makes its state's instead)."""
        self.exclusions = self.plans.exclusions = RunExclusions(self.exclusions.count,
                                                                self.exclusions.split_ids)
        self.plans.forget()
        self.schedule = replace(self.schedule, exclusion_starts=())

    def adopt_exclusion(self, record: Exclusion) -> None:
        """Make an exclusion a state records, as it was made."""
        self.spec.loader_mode.refuse_an_exclusion(f"{self.dataset.root}: documents excluded")
        try:
            self.exclusions.adopt(record)
        except ValueError as exc:
            raise StateError(f"{self.dataset.root}: {exc}") from None
        self.schedule = self.schedule.with_exclusion(record.step)

    def plan(self, epoch: int, phases: Phases = ()) -> EpochPlan:
        return self.plans(epoch, phases)

    def plan_size(self, epoch: int, phases: Phases = ()) -> int:
        """Observations of epoch `epoch`'s plan under `phases`."""
        return self.plan(epoch, phases).size

    def filler(self, epoch: int, pad_id: int = 0, boundaries: bool | None = None,
               phases: Phases = ()) -> BatchFiller:
        """The mode's filler of epoch `epoch` under `phases` (boundaries: the mode's
        default when None)."""
        mode = self.spec.loader_mode
        seq_len = phases[-1].seq_len if phases else self.seq_len
        filler = mode.filler(self.rows, self.plan(epoch, phases), seq_len, pad_id,
                             mode.boundaries_by_default if boundaries is None else boundaries)
        if self.source is not None and self.dataset.has_loss_mask:
            return LossMaskedFiller(filler, LossMasks(self.source))
        return filler

    def rank_steps(self, segment: Segment, first: int, stop: int, rank: int,
                   world_size: int | None = None) -> np.ndarray:
        """[stop - first, k]: the positions rank `rank` takes in steps [first, stop) of
        `segment` (`world_size`: of the world that took them, by default this one: a replay
        across resizes). A step is `global_batch` consecutive positions whatever the
        balance; without one, rank r takes its i-th row at i x world + r, with one, as
        the rows' costs spread them (raypipe.sampling.balance.rank_rows)."""
        world = world_size or self.world_size
        starts = segment.step_start(first) + segment.global_batch * np.arange(
            max(stop - first, 0), dtype=np.int64)[:, None]
        if self.cost_model is None:
            return starts + rank + world * np.arange(segment.global_batch // world,
                                                     dtype=np.int64)
        steps = starts + np.arange(segment.global_batch, dtype=np.int64)
        costs = self.filler(segment.epoch, phases=segment.phases).row_costs(
            steps, self.cost_model, segment.seq_len).reshape(steps.shape)
        return starts + rank_rows(costs, world, rank)

    @cached_property
    def cost_model(self) -> RowCostModel | None:
        """What a row costs under the `balance` knob (None: rows in the plan's order)."""
        return cost_model(self.spec.balance, self.spec.balance_hidden)

    def left_at(self, epoch: int, phases: Phases, position: int) -> tuple[int, int]:
        """(observations, tokens) of epoch `epoch`'s plan under `phases` from `position`
        to its end: what an epoch that ends there leaves untrained (drop-last)."""
        plan = self.plan(epoch, phases)
        positions = np.arange(position, plan.size, dtype=np.int64)
        counted = getattr(plan, "counted_tokens", None)
        return positions.size, (counted(positions) if counted and positions.size else 0)

    def epoch_tokens(self) -> int:
        """Tokens an epoch serves from: its documents' (a split's, or all; a document
        format's), or a batch format's real tokens as its packing recorded them (0 where
        the file predates that record)."""
        if self.split is None:
            return self.dataset.served_tokens
        return self.document_lengths().total

    def steps_in(self, epoch: int) -> int:
        """Steps of epoch `epoch` at the first global batch of the schedule."""
        return self.plan(epoch).size // self.global_batch

    def segments(self, cursor: Cursor, one_epoch: bool = False) -> Iterator[Segment]:
        """The runs of steps of one global batch and seq_len from `cursor` on (`one_epoch`:
        to the end of its epoch; raypipe.sampling.schedule: drop-last at each epoch's end)."""
        return self.schedule.segments(self.plan_size, cursor, one_epoch)

    def locate(self, epoch: int | None, position: int | None, step: int | None,
               steps_taken: int | None = None, phases: Phases = ()) -> Cursor:
        """The cursor of global step `step` from the start of training; given a state at
        (epoch, phases, position) that had taken `steps_taken` steps (None: counted from
        the schedule), of the step after it, or `step` steps after that one."""
        if epoch is None or position is None:
            return self.schedule.walk(self.plan_size, Cursor(0, 0, 0, self.first_phases),
                                      step or 0)
        phases = phases or self.first_phases
        if steps_taken is None:
            steps_taken = self.schedule.steps_before(self.plan_size, epoch, position, phases)
        return self.schedule.walk(self.plan_size, Cursor(epoch, position, steps_taken, phases),
                                  step or 0)

    @cached_property
    def document_dataset(self) -> TokenDataset:
        """The documents rows are cut from (a pre-formed output: the shards its records were
        packed from)."""
        return self.dataset.documents()
