"""The global order of one epoch's observations: a pure function of (dataset, seed, epoch).

Invariant: observation g of an epoch is the same on every rank and machine; ranks never
communicate. Kinds:
- `windows`: window w covers global tokens [w*T, w*T + T + 1) of the concatenated stream;
  windows are visited in Feistel order. O(1) memory.
- `documents`: one document per row (cropped to T + 1 or padded); Feistel order.
- `bestfit`: documents in Feistel order are cut into blocks of K; each block is packed
  (raypipe.sampling.pack: `split`, the default, keeps every token; `crop` is nanochat's);
  blocks are visited in order and the rows of block j in a Feistel order salted by j. Row
  counts per block are computed once per epoch (O(N) time, O(N/K) memory); a block's rows
  are re-packed on demand and cached, so a rank holds one block.
Shuffles: `global` (above) touches every shard in every stretch of the epoch. `shard_local`
(ShardGroups) cuts the shards into groups of consecutive shards; the observations of a group
are contiguous positions (groups in a Feistel order, observations inside a group in another),
so a rank reads one group (two for bestfit, whose blocks may straddle) at a time and, on
object storage, fetches each shard once per epoch. Its statistical cost: a batch mixes
documents of only G shards, and consecutive batches stay in one group for
(group tokens / global batch tokens) steps; windows also drop the < T + 1 tail tokens of each
group instead of the stream's.
Every plan reports what it keeps, crops, pads and drops (`report()`); the loader and the
LLMBATCH writer warn once when that waste passes 5%.
Cost: windows/documents: ~70 ns per observation to permute; bestfit: see
bench/packing_bench.py for planner documents per second, then O(1) per row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from raypipe.sampling.pack import PackedBlock, pack
from raypipe.sampling.permute import FeistelPermutation, GroupedPermutation

logger = logging.getLogger("raypipe")
MIN_ROWS_PER_BLOCK = 256
WASTE_WARNING = 0.05  # warn once when an epoch would not train this share of the tokens


@dataclass(frozen=True)
class PackingReport:
    rows: int
    used_tokens: int
    cropped_tokens: int
    padded_tokens: int
    dropped_tokens: int
    total_tokens: int

    @property
    def crop_fraction(self) -> float:
        return self.cropped_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def waste_fraction(self) -> float:
        """Tokens of the data not trained this epoch, plus padding, per token of the data."""
        wasted = self.cropped_tokens + self.dropped_tokens + self.padded_tokens
        return wasted / self.total_tokens if self.total_tokens else 0.0

    def warn_if_wasteful(self, what: str, threshold: float = WASTE_WARNING) -> bool:
        """Log one warning when the waste passes `threshold`; True when it did."""
        if self.waste_fraction <= threshold:
            return False
        logger.warning(
            "%s: %.1f%% of the tokens are not trained (cropped %s, dropped %s, padded %s of "
            "%s); packing='split' keeps every token", what, 100 * self.waste_fraction,
            f"{self.cropped_tokens:,}", f"{self.dropped_tokens:,}", f"{self.padded_tokens:,}",
            f"{self.total_tokens:,}")
        return True

    def render(self) -> str:
        total = max(self.total_tokens, 1)
        return "\n".join([
            f"rows            {self.rows:,}",
            f"tokens in data  {self.total_tokens:,}",
            f"used            {self.used_tokens:,} ({self.used_tokens / total:.2%})",
            f"cropped         {self.cropped_tokens:,} ({self.cropped_tokens / total:.2%})",
            f"padded          {self.padded_tokens:,} ({self.padded_tokens / total:.2%})",
            f"dropped         {self.dropped_tokens:,} ({self.dropped_tokens / total:.2%})",
        ])


SHUFFLES = ("global", "shard_local")


@dataclass(frozen=True)
class ShardGroups:
    """The shard-local shuffle's groups of `group_shards` consecutive shards: the global
    token and document offsets where each group starts, and the totals at the end."""

    tokens: np.ndarray
    documents: np.ndarray

    @classmethod
    def of(cls, shard_tokens: np.ndarray, shard_documents: np.ndarray,
           group_shards: int) -> ShardGroups:
        if group_shards < 1:
            raise ValueError(f"group_shards must be >= 1, got {group_shards}")
        count = len(shard_tokens)
        bounds = np.append(np.arange(0, count, group_shards), count)
        tokens = np.concatenate([[0], np.cumsum(shard_tokens)]).astype(np.int64)
        documents = np.concatenate([[0], np.cumsum(shard_documents)]).astype(np.int64)
        return cls(tokens[bounds], documents[bounds])

    @property
    def document_counts(self) -> np.ndarray:
        return np.diff(self.documents)


def document_permutation(count: int, seed: int, epoch: int, salt: int,
                         groups: ShardGroups | None) -> FeistelPermutation | GroupedPermutation:
    if groups is None:
        return FeistelPermutation(count, seed, epoch, salt=salt)
    return GroupedPermutation(groups.document_counts, seed, epoch, salt=salt)


class WindowPlan:
    kind = "windows"

    def __init__(self, total_tokens: int, seq_len: int, seed: int, epoch: int,
                 groups: ShardGroups | None = None):
        self.seq_len = seq_len
        self.total_tokens = total_tokens
        self.group_tokens: np.ndarray | None = None
        if groups is None:
            self.size = max(0, (total_tokens - 1) // seq_len)
            self.permutation: FeistelPermutation | GroupedPermutation = FeistelPermutation(
                self.size, seed, epoch, salt=1)
            return
        counts = np.maximum(0, (np.diff(groups.tokens) - 1) // seq_len)
        self.size = int(counts.sum())
        self.group_tokens = groups.tokens[:-1]
        self.permutation = GroupedPermutation(counts, seed, epoch, salt=1)

    def window_starts(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(window ids, global token offsets) of the observations at `positions`."""
        ids = self.permutation(positions)
        if self.group_tokens is None:
            return ids, ids * self.seq_len
        assert isinstance(self.permutation, GroupedPermutation)
        group = np.searchsorted(self.permutation.starts, ids, side="right") - 1
        local = ids - self.permutation.starts[group]
        return ids, self.group_tokens[group] + local * self.seq_len

    def report(self) -> PackingReport:
        used = self.size * self.seq_len
        return PackingReport(self.size, used, 0, 0, self.total_tokens - used, self.total_tokens)


class DocumentPlan:
    kind = "documents"

    def __init__(self, lengths: np.ndarray, seq_len: int, seed: int, epoch: int,
                 groups: ShardGroups | None = None, ordered: bool = False, pad_to: int = 1):
        """`ordered`: documents in index order (evaluation), `pad_to`: the size rounded up
        to a multiple of it with empty observations (id -1: a row of padding), so no
        document falls into a dropped tail."""
        self.lengths = lengths
        self.capacity = seq_len + 1
        self.count = len(lengths)
        self.size = -(-self.count // pad_to) * pad_to
        self.ordered = ordered
        self.permutation = None if ordered else document_permutation(self.count, seed, epoch,
                                                                     2, groups)

    def documents(self, positions: np.ndarray) -> np.ndarray:
        inside = positions < self.count
        ids = np.full(positions.shape, -1, dtype=np.int64)
        ids[inside] = (positions[inside] if self.permutation is None
                       else self.permutation(positions[inside]))
        return ids

    def report(self) -> PackingReport:
        kept = np.minimum(self.lengths, self.capacity)
        total = int(self.lengths.sum())
        empty_rows = self.size - self.count
        return PackingReport(self.size, int(kept.sum()), total - int(kept.sum()),
                             int((self.capacity - kept).sum()) + empty_rows * self.capacity,
                             0, total)


class BestFitPlan:
    kind = "bestfit"

    def __init__(self, lengths: np.ndarray, seq_len: int, seed: int, epoch: int,
                 block_documents: int = 4096, packing: str = "split",
                 groups: ShardGroups | None = None):
        self.lengths = lengths
        self.packing = packing
        self.capacity = seq_len + 1
        self.seed, self.epoch = seed, epoch
        self.block_documents = block_size(lengths, self.capacity, block_documents, packing)
        self.document_order = document_permutation(len(lengths), seed, epoch, 3, groups)
        self.num_blocks = -(-len(lengths) // self.block_documents)
        self._cached: tuple[int, PackedBlock] | None = None
        self._row_orders: dict[int, FeistelPermutation] = {}

    def block_documents_ids(self, block: int) -> np.ndarray:
        first = block * self.block_documents
        stop = min(first + self.block_documents, len(self.lengths))
        return self.document_order(np.arange(first, stop, dtype=np.int64))

    def pack(self, block: int) -> PackedBlock:
        if self._cached is None or self._cached[0] != block:
            ids = self.block_documents_ids(block)
            self._cached = (block, pack(self.packing, ids, self.lengths[ids], self.capacity))
        return self._cached[1]

    @cached_property
    def _summary(self) -> tuple[np.ndarray, PackingReport]:
        rows = np.zeros(self.num_blocks + 1, dtype=np.int64)
        used = cropped = dropped = padded = 0
        for block in range(self.num_blocks):
            packed = self.pack(block)
            rows[block + 1] = packed.num_rows
            used += packed.used_tokens
            cropped += packed.cropped_tokens
            dropped += packed.dropped_tokens
            padded += packed.padded_tokens
        report = PackingReport(int(rows.sum()), used, cropped, padded, dropped,
                               int(self.lengths.sum()))
        return np.cumsum(rows), report

    @property
    def row_offsets(self) -> np.ndarray:
        return self._summary[0]

    @property
    def size(self) -> int:
        return int(self.row_offsets[-1])

    def report(self) -> PackingReport:
        return self._summary[1]

    def _row_order(self, block: int) -> FeistelPermutation:
        if block not in self._row_orders:
            count = int(self.row_offsets[block + 1] - self.row_offsets[block])
            self._row_orders = {block: FeistelPermutation(count, self.seed, self.epoch,
                                                          salt=1000 + block)}
        return self._row_orders[block]

    def row_ids(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block, row id within the block) of each position; one permutation call per
        block touched."""
        blocks = np.searchsorted(self.row_offsets, positions, side="right") - 1
        local = positions - self.row_offsets[blocks]
        for block in np.unique(blocks).tolist():
            chosen = blocks == block
            local[chosen] = self._row_order(block)(local[chosen])
        return blocks, local

    def rows(self, positions: np.ndarray
             ) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """For each position: (global row id, document ids, start in each document, tokens
        taken from each)."""
        blocks, local = self.row_ids(positions)
        out = []
        for block, row in zip(blocks.tolist(), local.tolist(), strict=True):
            doc_ids, starts, take = self.pack(block).row(row)
            out.append((int(self.row_offsets[block]) + row, doc_ids, starts, take))
        return out


def block_size(lengths: np.ndarray, capacity: int, block_documents: int, packing: str) -> int:
    """Documents per packing block. Split packing pads at most part of one row per block, so
    its blocks hold at least MIN_ROWS_PER_BLOCK rows' worth of tokens on average (padding
    from block ends <= ~0.2%); crop keeps `block_documents` as it always had."""
    if packing != "split" or len(lengths) == 0:
        return block_documents
    mean = max(float(np.mean(lengths)), 1.0)
    return max(block_documents, int(np.ceil(MIN_ROWS_PER_BLOCK * capacity / mean)))


class PreformedPlan:
    """LLMBATCH: whole pre-formed batches in a block shuffle (as ZeroBatch's loader does):
    blocks of `block_batches` consecutive batches are visited in a Feistel order per epoch,
    batches inside a block in file order (sequential reads); a partial last block stays
    last. O(1) memory."""

    kind = "llmbatch"

    def __init__(self, num_batches: int, batch_size: int, record_len: int, seed: int,
                 epoch: int, block_batches: int = 64):
        self.size = num_batches
        self.batch_size, self.record_len = batch_size, record_len
        self.block_batches = block_batches
        self.full_blocks = num_batches // block_batches
        self.block_order = FeistelPermutation(self.full_blocks, seed, epoch, salt=4)

    def batches(self, positions: np.ndarray) -> np.ndarray:
        blocks, offsets = np.divmod(positions, self.block_batches)
        result = positions.copy()
        inside = blocks < self.full_blocks
        result[inside] = self.block_order(blocks[inside]) * self.block_batches + offsets[inside]
        return result

    def report(self) -> PackingReport:
        tokens = self.size * self.batch_size * self.record_len
        return PackingReport(self.size * self.batch_size, tokens, 0, 0, 0, tokens)


Plan = WindowPlan | BestFitPlan | DocumentPlan | PreformedPlan
MODES = ("windows", "bestfit", "documents", "llmbatch")


def make_plan(mode: str, num_tokens: int, lengths: object, seq_len: int, seed: int,
              epoch: int, block_documents: int = 4096, packing: str = "split",
              groups: ShardGroups | None = None) -> Plan:
    """The plan of one epoch. `lengths` (document lengths) may be a zero-argument callable,
    called only by the modes that need it; `groups` makes the shuffle shard-local."""
    if mode == "windows":
        return WindowPlan(num_tokens, seq_len, seed, epoch, groups)
    values = lengths() if callable(lengths) else lengths
    if mode == "bestfit":
        return BestFitPlan(values, seq_len, seed, epoch, block_documents, packing, groups)
    if mode == "documents":
        return DocumentPlan(values, seq_len, seed, epoch, groups)
    raise ValueError(f"mode {mode!r} not among {list(MODES)}")
