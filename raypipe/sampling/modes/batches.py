"""`batches`: the pre-formed batches of a batch format (LLMBATCH), one per observation, and
the record plans that made them (its former name still selects it: raypipe.sampling.state_compat).

Invariant: the loader serves whole batches in a block shuffle (as ZeroBatch's loader does):
blocks of `block_batches` consecutive batches are visited in a Feistel order per epoch,
batches inside a block in file order (sequential reads); a partial last block stays last;
one rank takes one batch per step. Under the shard-local shuffle (`auto` on a bucket whose
node cache holds less than the dataset) the blocks are shuffled within groups of
consecutive shards, one group after another (`GroupedBlocks`), so a node fetches each
shard once an epoch; a batch's rows were drawn from the whole corpus when it was packed.
Masks and sequences come from the file's `.pieces` sidecar (raypipe.formats.llmbatch),
never from a token scan (older files: a BOS/EOS scan). The records themselves are the
rows of an epoch-0 plan over the dataset's documents (`record_plan`: the one definition of
what each LLMBATCH packing is, shared by the packer and `raypipe trace`), record r of the
output being plan position r. Cost: one memmap slice per batch (+ B lengths and its
pieces); O(1) memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError
from raypipe.io.manifest_compat import current_packing
from raypipe.sampling.buffers import (
    BatchBuffers,
    DescribedRows,
    Filled,
    TokenSource,
    scan_boundaries,
    write_boundaries,
)
from raypipe.sampling.lengths import DocumentLengths, dataset_lengths
from raypipe.sampling.modes.base import (
    BatchFiller,
    LoaderMode,
    ModeKnobs,
    PlanInputs,
    PlanSpec,
    get_mode,
    knob,
    register,
)
from raypipe.sampling.pack import RowPieces
from raypipe.sampling.permute import FeistelPermutation, GroupedPermutation
from raypipe.sampling.plans import PackingReport, ShardGroups

# an LLMBATCH packing -> (the loader mode whose epoch-0 plan makes its records, that mode's
# packing)
RECORD_PLANS = {"fill": ("bestfit", "fill"), "split": ("bestfit", "split"),
                "crop": ("bestfit", "crop"),
                "concat": ("windows", None)}


def record_plan(dataset: TokenDataset, packing: str, record_len: int, seed: int,
                lengths: DocumentLengths | None = None, pad_id: int = 0
                ) -> tuple[Any, BatchFiller]:
    """The plan whose positions are an LLMBATCH output's records (rows of `record_len`
    tokens), and its filler (no boundaries: a record stores its pieces instead)."""
    mode_name, mode_packing = RECORD_PLANS[current_packing(packing)]
    mode = get_mode(mode_name)
    knobs = {} if mode_packing is None else {"packing": mode_packing}
    spec = PlanSpec.of(mode_name, record_len - 1, seed=seed, **knobs).for_data(
        dataset.has_loss_mask)  # chat data: overlong conversations in overlapping pieces
    if lengths is None:
        lengths = dataset_lengths(dataset, node_cache=False)
    plan = mode.plan(spec, PlanInputs(dataset, lambda: lengths), 0)
    return plan, mode.filler(TokenSource(dataset), plan, record_len - 1, pad_id,
                             boundaries=False)


class BatchesPlan:
    """Whole pre-formed batches in a block shuffle (see the module); under a shard-local
    shuffle (`groups`: batches where each group of shards starts), one group after another
    in a Feistel order, each group's blocks shuffled among themselves."""

    def __init__(self, num_batches: int, batch_size: int, record_len: int, seed: int,
                 epoch: int, block_batches: int = 64,
                 batch_tokens: Callable[[int], int] | None = None,
                 groups: np.ndarray | None = None):
        self.size = num_batches
        self.batch_tokens = batch_tokens  # a batch's real tokens (padding aside), by id
        self.batch_size, self.record_len = batch_size, record_len
        self.block_batches = block_batches
        self.seed, self.epoch = seed, epoch
        self.full_blocks = num_batches // block_batches
        self.block_order = FeistelPermutation(self.full_blocks, seed, epoch, salt=4)
        self.groups = None if groups is None else GroupedBlocks(
            np.asarray(groups, dtype=np.int64), block_batches, seed, epoch)

    def batches(self, positions: np.ndarray) -> np.ndarray:
        if self.groups is not None:
            return self.groups(np.asarray(positions, dtype=np.int64))
        blocks, offsets = np.divmod(positions, self.block_batches)
        result = positions.copy()
        inside = blocks < self.full_blocks
        result[inside] = self.block_order(blocks[inside]) * self.block_batches + offsets[inside]
        return result

    def counted_tokens(self, positions: np.ndarray) -> int:
        """The real tokens (padding aside) of the batches at `positions`, read from the
        batches: for a drop-last tail, under one global step of batches."""
        ids = self.batches(np.asarray(positions, dtype=np.int64))
        if self.batch_tokens is None:
            return int(ids.size) * self.batch_size * self.record_len
        return sum(self.batch_tokens(int(index)) for index in ids.tolist())

    def report(self) -> PackingReport:
        tokens = self.size * self.batch_size * self.record_len
        return PackingReport(self.size * self.batch_size, tokens, 0, 0, 0, tokens)


class BlocksInOrder:
    """Batches [0, size) of one group in blocks of `block_batches`: the full blocks in a
    Feistel order, the partial last block last, batches inside a block in file order; a
    bijection with its inverse."""

    def __init__(self, size: int, block_batches: int, seed: int, epoch: int, salt: int):
        self.block_batches = block_batches
        self.blocks = FeistelPermutation(size // block_batches, seed, epoch, salt)

    def _map(self, values: np.ndarray, step: Callable[[np.ndarray], np.ndarray]
             ) -> np.ndarray:
        blocks, offsets = np.divmod(values, self.block_batches)
        inside = blocks < len(self.blocks)
        out = values.copy()
        out[inside] = step(blocks[inside]) * self.block_batches + offsets[inside]
        return out

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return self._map(positions, self.blocks)

    def inverse(self, batches: np.ndarray) -> np.ndarray:
        return self._map(batches, self.blocks.inverse)


class GroupedBlocks(GroupedPermutation):
    """Batches [starts[g], starts[g + 1]) are group g: groups are visited in a Feistel order
    per epoch, and each group's batches in `BlocksInOrder`. Consecutive positions stay in
    one group (its shards) until it is exhausted. Memory O(groups); a call costs one
    Feistel call per group it touches."""

    GROUP_SALT, BLOCK_SALT = 5, 6

    def __init__(self, starts: np.ndarray, block_batches: int, seed: int, epoch: int):
        self.block_batches = block_batches
        super().__init__(np.diff(starts), seed, epoch, self.GROUP_SALT)

    def _within(self, group: int) -> BlocksInOrder:  # type: ignore[override]
        if group not in self._inner:
            if len(self._inner) > 64:
                self._inner.clear()
            self._inner[group] = BlocksInOrder(  # type: ignore[assignment]
                int(self.sizes[group]), self.block_batches, self.seed, self.epoch,
                self.BLOCK_SALT * 7919 + group)
        return self._inner[group]  # type: ignore[return-value]


class BatchesFiller(BatchFiller[int]):
    """A batch is one pre-formed [B, T] block, copied out of its mmap slice."""

    def __init__(self, dataset: BatchDataset, plan: BatchesPlan, seq_len: int,
                 pad_id: int = 0, boundaries: bool = True):
        self.dataset, self.plan, self.boundaries = dataset, plan, boundaries
        self.pad_id = pad_id
        self.padded = dataset.padded_tokens > 0

    def fetch_units(self, positions: np.ndarray) -> np.ndarray:
        ids = self.plan.batches(positions.reshape(-1))
        return np.unique(np.searchsorted(self.dataset.batch_offsets, ids, side="right") - 1)

    def describe(self, positions: np.ndarray) -> list[DescribedRows[int]]:
        ids = self.plan.batches(positions.reshape(-1)).reshape(positions.shape)
        return [DescribedRows(positions[i], ids[i], ids[i].tolist()) for i in range(len(ids))]

    def fill(self, plan: DescribedRows[int], buffers: BatchBuffers) -> Filled:
        index = plan.rows[0]
        buffers.tokens[...] = self.dataset.batch(index)
        padding = None
        if self.padded:  # the format says where padding is: masked, then pad_id
            padding = self.dataset.padding(index, buffers.tokens)
            np.logical_not(padding[:, 1:], out=buffers.mask)
            buffers.tokens[padding] = self.pad_id
        pieces = self.dataset.pieces(index)
        if pieces is not None:  # the file says where its pieces are
            filled = self._fill_pieces(pieces, padding, buffers)
        elif not self.boundaries:
            filled = Filled(buffers.tokens.shape[0])
        else:
            filled = scan_boundaries(buffers, self.dataset.bos_id, self.dataset.eos_id)
        loss_mask = self.dataset.loss_mask(index)
        if loss_mask is not None:  # chat data: only the trained targets
            buffers.mask &= loss_mask[:, 1:].astype(buffers.mask.dtype)
        return filled

    def _fill_pieces(self, pieces: Any, padding: np.ndarray | None,
                     buffers: BatchBuffers) -> Filled:
        """Masks and sequences from the file's pieces: the target into a piece is masked
        unless it is a true join; every piece (and a record's padding) is a sequence."""
        if padding is None:
            buffers.mask[...] = 1
        records, columns = pieces.records, pieces.columns
        false = pieces.false_joins
        buffers.mask[records[false], columns[false] - 1] = 0
        if not self.boundaries:
            return Filled(buffers.tokens.shape[0])
        seq_len = buffers.position_ids.shape[1]
        inside = columns < seq_len
        starts = [records[inside] * seq_len + columns[inside]]
        flags = [pieces.starts_document[inside]]
        if padding is not None:
            real = seq_len + 1 - padding.sum(axis=1)
            padded = np.flatnonzero(real < seq_len)
            starts.append(padded * seq_len + real[padded])
            flags.append(np.zeros(padded.size, dtype=bool))
        flat = np.concatenate(starts)
        order = np.argsort(flat, kind="stable")
        count = write_boundaries(flat[order], buffers, seq_len)
        return Filled(count, np.concatenate(flags)[order])

    @cached_property
    def _records(self) -> BatchFiller:
        """The record plan's filler over the document shards the records were packed from."""
        dataset, options = self.dataset, self.dataset.options
        if options.source_format is None or options.source_format not in \
                dataset.manifest.formats:
            raise ConfigError(f"{dataset.root}: tracing LLMBATCH records needs the document "
                              "shards they were packed from (format "
                              f"{options.source_format!r}), which this output lacks")
        if dataset.num_batches and dataset.pieces(0) is None:
            raise ConfigError(f"{dataset.root}: LLMBATCH records of an older release "
                              "(no .pieces sidecar) were cut by another rule; convert them "
                              "again to trace them")
        return record_plan(dataset.documents(), options.packing, options.record_len,
                           options.seed)[1]

    def segments(self, positions: np.ndarray) -> list[RowPieces]:
        batch = self.dataset.batch_size
        records = (self.plan.batches(positions.reshape(-1))[:, None] * batch
                   + np.arange(batch)).reshape(-1)
        return self._records.segments(records)


@dataclass(frozen=True)
class BatchesKnobs(ModeKnobs):
    """The pre-formed batches' knob: how many consecutive batches a shuffled block holds."""

    block_batches: int = knob(64, "batches: batches per shuffled block")

    def __post_init__(self) -> None:
        if self.block_batches < 1:
            raise ConfigError(f"block_batches: {self.block_batches} must be >= 1")


class BatchesMode(LoaderMode):
    """Pre-formed batches of a batch format (LLMBATCH), one per rank per step."""

    name = "batches"
    serves = "batches"
    schedules = False
    balances = False
    mixes = False  # a batch's rows are fixed: a mixture cannot split a step between sources
    splits = ("all",)
    windowed = False
    Knobs = BatchesKnobs

    def open_dataset(self, store: Any, format_name: str | None, cache: Any,
                     manifest: Any = None) -> Any:
        dataset = super().open_dataset(store, format_name, cache, manifest)
        if dataset.cache is None:
            for index in range(dataset.num_shards):
                dataset.reader(index)  # every local file checked up front
        return dataset

    def fit(self, dataset: Any, spec: Any, batch_size: int | None) -> tuple[Any, int]:
        """The batches' own shape: seq_len and batch_size left out (0 / None) take it, and
        others are refused."""
        shape = (dataset.record_len - 1, dataset.batch_size)
        if (spec.seq_len or shape[0], batch_size or shape[1]) != shape:
            raise ConfigError(f"{dataset.root}: {dataset.format_name} batches are "
                              f"[{shape[1]}, {shape[0] + 1}] records, i.e. seq_len={shape[0]}, "
                              f"batch_size={shape[1]}; got seq_len={spec.seq_len}, "
                              f"batch_size={batch_size}")
        return replace(spec.for_data(False), seq_len=shape[0]), shape[1]

    def observations_per_step(self, batch_size: int) -> int:
        return 1  # one pre-formed batch

    def shard_groups(self, dataset: Any, group_shards: int,
                     shards: int | None = None) -> ShardGroups:
        """Groups of `group_shards` consecutive shards, counted in batches."""
        batches = np.array([shard.batches for shard in dataset.shards[:shards]], np.int64)
        return ShardGroups.of(batches * dataset.batch_size * dataset.record_len, batches,
                              group_shards)

    def rows_from(self, dataset: Any, spec: Any) -> tuple[None, Any]:
        return None, dataset  # the batches themselves; no split

    def token_source(self, rows: Any) -> None:
        return None  # pre-formed batches, not cut from documents

    def plan(self, spec: Any, inputs: PlanInputs, epoch: int) -> BatchesPlan:
        dataset = inputs.dataset
        groups = inputs.groups.documents if isinstance(inputs.groups, ShardGroups) else None
        return BatchesPlan(dataset.num_batches, inputs.batch_size, spec.seq_len + 1,
                           spec.seed, epoch, spec.knobs.block_batches,
                           lambda index: int((~dataset.padding(index)).sum()), groups)

    def filler(self, source: Any, plan: Any, seq_len: int, pad_id: int = 0,
               boundaries: bool = True) -> BatchesFiller:
        return BatchesFiller(source, plan, seq_len, pad_id, boundaries)

    def waste_hint(self, waste: str, packing: str | None) -> str:
        if waste == "padding" and packing not in ("fill", "concat"):
            return "packing 'fill' fills every row with pieces of documents"
        if waste != "padding" and packing == "crop":
            return "packing 'fill' trains every token and pads under 1% of the positions"
        if waste == "padding":
            return super().waste_hint(waste, packing)
        return "a smaller batch size drops fewer records at the end"


BATCHES = register(BatchesMode())
