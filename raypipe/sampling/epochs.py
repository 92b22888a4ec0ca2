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
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError
from raypipe.io.cache import ShardCache, node_cached_array
from raypipe.io.store import Store
from raypipe.sampling.batches import TokenSource
from raypipe.sampling.lengths import DocumentLengths, dataset_lengths
from raypipe.sampling.loss_masks import LossMaskedFiller, LossMasks
from raypipe.sampling.modes import BatchFiller, PlanInputs, PlanSpec, document_split
from raypipe.sampling.plans import ShardGroups, SumsMemo
from raypipe.sampling.schedule import BatchSchedule, Segment

__all__ = ["EpochPlans", "PlanSpec", "PlannedDataset", "document_split"]



class EpochPlans:
    """The plans of one opened dataset under one spec; the latest epoch's plan is kept.

    `lengths` gives the document lengths the plans number (called only by the modes that
    need them); `stream_tokens` the tokens windows are cut from (a split's, or all);
    `step_observations` the observations of one global step (a validation epoch is padded
    to a whole number of them); `memo` keeps bestfit's block sums."""

    def __init__(self, spec: PlanSpec, dataset: TokenDataset | BatchDataset,
                 lengths: Callable[[], DocumentLengths], stream_tokens: int | None = None,
                 step_observations: int = 1, memo: SumsMemo | None = None,
                 batch_size: int = 1):
        self.spec, self.dataset = spec, dataset
        self.inputs = PlanInputs(dataset, lengths, stream_tokens, step_observations,
                                 batch_size, memo, self.groups())
        self._latest: tuple[int, Any] | None = None

    def groups(self) -> ShardGroups | None:
        """The shard groups of a shard-local shuffle (None for a global one)."""
        if self.spec.shuffle == "global":
            return None
        return ShardGroups.of(self.dataset.shard_token_counts,
                              self.dataset.shard_document_counts, self.spec.group_shards)

    def build(self, epoch: int) -> Any:
        """Epoch `epoch`'s plan, built afresh (not kept)."""
        return self.spec.loader_mode.plan(self.spec, self.inputs, epoch)

    def __call__(self, epoch: int) -> Any:
        """Epoch `epoch`'s plan (kept until another epoch is asked for)."""
        if self._latest is None or self._latest[0] != epoch:
            self._latest = (epoch, self.build(epoch))
        return self._latest[1]


class PlannedDataset:
    """One dataset opened under a spec for one world size: the documents its plans number
    (a split's, or all), the token source rows are read from, its epoch plans, and the
    positions each rank takes per step (position p + i*W + r is observation i of rank r at
    the step starting at p). What TokenLoader and `raypipe trace` share."""

    def __init__(self, dataset: TokenDataset | BatchDataset, spec: PlanSpec,
                 world_size: int, batch_size: int, cache_dir: str | Path | None = None,
                 memo: SumsMemo | None = None, schedule: BatchSchedule | None = None):
        """`memo`: where plan arrays are kept (default: once per node, `node_memo`);
        `schedule`: the global batch of each step (default: W x `batch_size` every step)."""
        self.dataset, self.spec = dataset, spec
        self.world_size, self.batch_size, self.cache_dir = world_size, batch_size, cache_dir
        self.schedule = schedule or BatchSchedule.constant(self.global_batch)
        # the split its plans number, and what the mode's filler reads rows from
        self.split, self.rows = spec.loader_mode.rows_from(dataset, spec)
        self.source: TokenSource | None = (self.rows if isinstance(self.rows, TokenSource)
                                           else None)  # documents' tokens, where rows read them
        self._lengths: DocumentLengths | None = None
        self.plans = EpochPlans(spec, dataset, self.document_lengths,
                                None if self.source is None else self.stream_tokens(),
                                self.global_batch, memo or self.node_memo, batch_size)

    def node_memo(self, key: tuple, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """A plan's arrays kept once per node (raypipe.io.cache.node_cached_array), keyed
        by the dataset's fingerprint, the documents its plans number and the shuffle: the
        node's ranks, and `raypipe trace`, compute each once."""
        spec = self.spec
        split = None if self.split is None else (self.split.name, self.split.fraction)
        identity = [self.dataset.fingerprint, self.dataset.format_name, split, spec.shuffle,
                    spec.group_shards, *key]
        digest = hashlib.sha256(json.dumps(identity, default=str).encode()).hexdigest()[:32]
        return node_cached_array(digest, compute, self.cache_dir)

    @classmethod
    def open(cls, path: str | Path, spec: PlanSpec, world_size: int, batch_size: int | None,
             format_name: str | None = None, cache_dir: str | Path | None = None,
             cache_bytes: int | str | None = None, memo: SumsMemo | None = None,
             batch_schedule: list[tuple[int, int]] | None = None) -> PlannedDataset:
        """Open `path` (a directory or URI: shards through the node cache) for `spec`; a
        pre-formed dataset fixes seq_len and batch_size (0 / None take its own).
        `batch_schedule`: [(first step, global batch), ...] instead of `batch_size` (rows
        per rank: its largest stage's, for the buffers)."""
        schedule = None
        if batch_schedule:
            if batch_size is not None:
                raise ConfigError("give batch_size (rows per rank, every step) or "
                                  "batch_schedule (global rows by step), not both")
            if spec.split == "validation":
                raise ConfigError("batch_schedule: a validation split serves every held-out "
                                  "document at one batch size; give it batch_size")
            schedule = BatchSchedule.of(batch_schedule, world_size)
            batch_size = schedule.largest // world_size
        store = Store(path)
        cache = None if store.local else ShardCache(cache_dir, cache_bytes)
        dataset = spec.loader_mode.open_dataset(store, format_name, cache)
        spec, batch_size = spec.loader_mode.fit(dataset, spec, batch_size)
        if schedule is not None and spec.loader_mode.observations_per_step(batch_size) == 1:
            raise ConfigError(f"batch_schedule: mode {spec.mode!r} serves pre-formed batches "
                              "of the size they were written with")
        return cls(dataset, spec, world_size, batch_size, cache_dir, memo, schedule)

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

    def plan(self, epoch: int) -> Any:
        return self.plans(epoch)

    def filler(self, epoch: int, pad_id: int = 0, boundaries: bool | None = None
               ) -> BatchFiller:
        """The mode's filler of epoch `epoch` (boundaries: the mode's default when None)."""
        mode = self.spec.loader_mode
        filler = mode.filler(self.rows, self.plan(epoch), self.seq_len, pad_id,
                             mode.boundaries_by_default if boundaries is None else boundaries)
        if self.source is not None and self.dataset.has_loss_mask:
            return LossMaskedFiller(filler, LossMasks(self.source))
        return filler

    def rank_positions(self, step_start: int, rank: int, global_batch: int | None = None
                       ) -> np.ndarray:
        """[1, k]: the positions rank `rank` takes in the step that starts at `step_start`
        (`global_batch`: that step's, by default every step's)."""
        per_rank = (self.observations_per_step if global_batch is None
                    else global_batch // self.world_size)
        offsets = np.arange(per_rank, dtype=np.int64) * self.world_size
        return (step_start + offsets + rank)[None, :]

    def epoch_size(self, epoch: int) -> int:
        """Observations of epoch `epoch` (its plan's size)."""
        return self.plan(epoch).size

    def steps_in(self, epoch: int) -> int:
        """Steps of epoch `epoch` at the first global batch of the schedule."""
        return self.plan(epoch).size // self.global_batch

    def segments(self, epoch: int, position: int, step: int, one_epoch: bool = False
                 ) -> Iterator[Segment]:
        """The runs of steps of one global batch from (epoch, position, step) on (`one_epoch`:
        to the end of `epoch`; raypipe.sampling.schedule: drop-last at each epoch's end)."""
        return self.schedule.segments(self.epoch_size, epoch, position, step, one_epoch)

    def locate(self, epoch: int | None, position: int | None, step: int | None,
               steps_taken: int | None = None) -> tuple[int, int, int]:
        """(epoch, position, global step number) of global step `step` from the start of
        training; given a state at (epoch, position) that had taken `steps_taken` steps (None:
        counted from the schedule), of the step after it, or `step` steps after that one."""
        if epoch is None or position is None:
            return self.schedule.walk(self.epoch_size, 0, 0, 0, step or 0)
        if steps_taken is None:
            steps_taken = self.schedule.steps_before(self.epoch_size, epoch, position)
        return self.schedule.walk(self.epoch_size, epoch, position, steps_taken, step or 0)

    @cached_property
    def document_dataset(self) -> TokenDataset:
        """The documents rows are cut from (a pre-formed output: the shards its records were
        packed from)."""
        return self.dataset.documents()
