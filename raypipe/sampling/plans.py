"""The global order of one epoch's observations: a pure function of (dataset, seed, epoch).

Invariant: observation g of an epoch is the same on every rank and machine; ranks never
communicate. Kinds:
- `windows`: window w covers global tokens [w*T, w*T + T + 1) of the concatenated stream;
  windows are visited in Feistel order. O(1) memory.
- `documents`: one document per row (cropped to T + 1 or padded); Feistel order.
- `bestfit`: documents in Feistel order are cut into blocks of K; each block is packed
  (raypipe.sampling.pack: `fill`, the default, fills every row and keeps every token;
  `split` keeps documents whole where they fit and pads; `crop` is nanochat's); blocks are
  visited in order and the rows of block j in a Feistel order salted by j. Row counts per
  block are computed once per epoch: for `fill`, ceil(block tokens / (T + 1)) from one
  vectorized pass over the lengths in storage order (each document's block from the
  inverse permutation; no block packed; ~70 ns a document / threads, and the loader keeps
  the sums once per node: docs/scale.md); for the others by packing every block (O(N) in
  Python). A block's rows are packed on demand; the last 8 packed stay cached.
Shuffles: `global` (above) touches every shard in every stretch of the epoch. `shard_local`
(ShardGroups) cuts the shards into groups of consecutive shards; the observations of a group
are contiguous positions (groups in a Feistel order, observations inside a group in another),
so a rank reads one group (two for bestfit, whose blocks may straddle) at a time and, on
object storage, fetches each shard once per epoch. Its statistical cost: a batch mixes
documents of only G shards, and consecutive batches stay in one group for
(group tokens / global batch tokens) steps; windows also drop the < T + 1 tail tokens of each
group instead of the stream's.
Every plan reports what it trains, crops and drops of the tokens and how many positions it
pads (`report()`); the loader and the LLMBATCH writer warn once when the untrained tokens or
the padding pass 5%, with a hint that names another packing.
Cost: windows/documents: ~70 ns per observation to permute; bestfit: see
bench/packing_bench.py for planner documents per second, then O(1) per row.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.pack import PackedBlock, RowPieces, pack
from raypipe.sampling.permute import FeistelPermutation, GroupedPermutation

logger = logging.getLogger("raypipe")
MIN_ROWS_PER_BLOCK = 256
SumsMemo = Callable[[tuple, Callable[[], np.ndarray]], np.ndarray]
SUM_CHUNK_DOCUMENTS = 1 << 18  # documents permuted per numpy call when summing blocks
SUM_THREADS = max(1, min(8, os.cpu_count() or 1))  # threads of the block-sum pass
CACHED_BLOCKS = 8  # packed blocks a plan keeps (a step's rows span a few blocks)
WASTE_WARNING = 0.05  # warn once when an epoch would not train this share of the tokens


@dataclass(frozen=True)
class PackingReport:
    """What one epoch's rows make of the data: tokens trained (used), not trained (cropped
    from documents, dropped with whole rows), and positions that hold no token (padding).
    used + cropped + dropped = total_tokens; the rows hold used + padded positions."""

    rows: int
    used_tokens: int
    cropped_tokens: int
    padded_tokens: int
    dropped_tokens: int
    total_tokens: int

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> PackingReport:
        """The report an LLMBATCH manifest section records (see `as_options`)."""
        used, cropped, dropped = (int(options[key]) for key in
                                  ("used_tokens", "cropped_tokens", "dropped_tokens"))
        rows = int(options.get("num_batches", 0)) * int(options.get("batch_size", 0))
        return cls(rows, used, cropped, int(options["padded_tokens"]), dropped,
                   used + cropped + dropped)

    def as_options(self) -> dict[str, int]:
        return {"used_tokens": self.used_tokens, "cropped_tokens": self.cropped_tokens,
                "padded_tokens": self.padded_tokens, "dropped_tokens": self.dropped_tokens}

    @property
    def untrained_tokens(self) -> int:
        return self.cropped_tokens + self.dropped_tokens

    @property
    def untrained_fraction(self) -> float:
        """Tokens of the data not trained this epoch, per token of the data."""
        return self.untrained_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def positions(self) -> int:
        return self.used_tokens + self.padded_tokens

    @property
    def padding_fraction(self) -> float:
        """Positions of the rows that hold no token (GPU time spent on nothing)."""
        return self.padded_tokens / self.positions if self.positions else 0.0

    def warn_if_wasteful(self, what: str, mode: str, packing: str | None = None,
                         threshold: float = WASTE_WARNING) -> bool:
        """Log one warning when untrained tokens or padding pass `threshold` (each on its
        own line of the warning), with a hint that names a mode or packing other than
        (mode, packing), the one running; True when it warned."""
        problems = []
        if self.untrained_fraction > threshold:
            cause = "cropped" if self.cropped_tokens >= self.dropped_tokens else "dropped"
            problems.append(
                f"{self.untrained_fraction:.1%} of the tokens are not trained (cropped "
                f"{self.cropped_tokens:,}, dropped {self.dropped_tokens:,} of "
                f"{self.total_tokens:,}); hint: {waste_hint(cause, mode, packing)}")
        if self.padding_fraction > threshold:
            problems.append(
                f"{self.padding_fraction:.1%} of the positions are padding "
                f"({self.padded_tokens:,} of {self.positions:,}); hint: "
                f"{waste_hint('padding', mode, packing)}")
        if not problems:
            return False
        logger.warning("%s: %s", what, "; ".join(problems))
        return True

    def lines(self) -> list[str]:
        total, positions = max(self.total_tokens, 1), max(self.positions, 1)
        return [
            f"rows            {self.rows:,}",
            f"tokens in data  {self.total_tokens:,}",
            f"trained         {self.used_tokens:,} ({self.used_tokens / total:.2%} of the "
            "tokens)",
            f"untrained       {self.untrained_tokens:,} ({self.untrained_tokens / total:.2%}"
            f" of the tokens): cropped {self.cropped_tokens:,}, dropped "
            f"{self.dropped_tokens:,}",
            f"padding         {self.padded_tokens:,} ({self.padded_tokens / positions:.2%} "
            "of the positions)",
        ]

    def render(self) -> str:
        return "\n".join(self.lines())

    def summary_line(self) -> str:
        """The report in one line (the tokenize summary, inspect)."""
        total, positions = max(self.total_tokens, 1), max(self.positions, 1)
        return (f"trained {self.used_tokens / total:.2%} of the tokens, untrained "
                f"{self.untrained_tokens / total:.2%} (cropped {self.cropped_tokens / total:.2%}"
                f", dropped {self.dropped_tokens / total:.2%}), padding "
                f"{self.padded_tokens / positions:.2%} of the positions")


# the loader mode that serves pre-formed batches of a batch format (LLMBATCH), one batch
# per observation; the mode's name, not a format's
PREFORMED_MODE = "llmbatch"


def waste_hint(waste: str, mode: str, packing: str | None) -> str:
    """A way to waste less (`waste`: cropped, dropped or padding) than (mode, packing), the
    one running, does; never names it. PREFORMED_MODE: records written in whole batches."""
    if waste == "padding":
        if mode in ("bestfit", PREFORMED_MODE) and packing not in ("fill", "concat"):
            return "packing 'fill' fills every row with pieces of documents"
        if mode == "documents":
            return "mode 'bestfit' packs several documents per row"
        return "fewer, shorter rows (the data holds too few tokens to fill its rows)"
    if packing == "crop":
        return "packing 'fill' trains every token and pads under 1% of the positions"
    if mode == "documents":
        return "mode 'bestfit' trains every token (long documents are cut to fit rows)"
    if mode == PREFORMED_MODE:
        return "a smaller batch size drops fewer records at the end"
    return "shuffle 'global' drops only the stream's last partial row"


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

    def __init__(self, lengths: np.ndarray | DocumentLengths, seq_len: int, seed: int,
                 epoch: int, groups: ShardGroups | None = None, ordered: bool = False,
                 pad_to: int = 1):
        """`ordered`: documents in index order (evaluation), `pad_to`: the size rounded up
        to a multiple of it with empty observations (id -1: a row of padding), so no
        document falls into a dropped tail."""
        self.lengths = DocumentLengths.of(lengths)
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

    @cached_property
    def _report(self) -> PackingReport:
        kept = self.lengths.clipped_total(self.capacity)
        total = self.lengths.total
        return PackingReport(self.size, kept, total - kept, self.size * self.capacity - kept,
                             0, total)

    def report(self) -> PackingReport:
        return self._report


class BestFitPlan:
    kind = "bestfit"

    def __init__(self, lengths: np.ndarray | DocumentLengths, seq_len: int, seed: int,
                 epoch: int, block_documents: int = 4096, packing: str = "fill",
                 groups: ShardGroups | None = None, memo: SumsMemo | None = None,
                 separator: str = "bos"):
        """`memo(key, compute)`: returns compute() or what it returned before for `key`
        (a node-local cache of the block token sums, shared by the node's ranks);
        `separator`: which side of a document carries BOS/EOS (raypipe.sampling.pack)."""
        lengths = DocumentLengths.of(lengths)
        self.memo = memo
        self.lengths = lengths
        self.packing = packing
        self.separator = separator
        self.capacity = seq_len + 1
        self.seed, self.epoch = seed, epoch
        self.block_documents = block_size(lengths, self.capacity, block_documents, packing)
        self.document_order = document_permutation(len(lengths), seed, epoch, 3, groups)
        self.num_blocks = -(-len(lengths) // self.block_documents)
        self._cached: OrderedDict[int, PackedBlock] = OrderedDict()
        self._row_orders: dict[int, FeistelPermutation] = {}

    def block_documents_ids(self, block: int) -> np.ndarray:
        first = block * self.block_documents
        stop = min(first + self.block_documents, len(self.lengths))
        return self.document_order(np.arange(first, stop, dtype=np.int64))

    def pack(self, block: int) -> PackedBlock:
        """Block `block`'s rows; the last CACHED_BLOCKS blocks packed stay cached, so a
        rank that reads a block's rows over several batches packs it once."""
        packed = self._cached.get(block)
        if packed is None:
            ids = self.block_documents_ids(block)
            packed = self._cached[block] = pack(self.packing, ids, self.lengths[ids],
                                                self.capacity, self.separator)
            if len(self._cached) > CACHED_BLOCKS:
                self._cached.popitem(last=False)
        else:
            self._cached.move_to_end(block)
        return packed

    @cached_property
    def _summary(self) -> tuple[np.ndarray, PackingReport]:
        if self.packing == "fill":
            return self._fill_summary()
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
                               self.lengths.total)
        return np.cumsum(rows), report

    def _fill_summary(self) -> tuple[np.ndarray, PackingReport]:
        """Fill packing's rows follow from token sums alone: ceil(block tokens / capacity)
        per block, no block packed."""
        key = ("block-token-sums", self.seed, self.epoch, self.block_documents,
               len(self.lengths))
        sums = (self.memo(key, self.block_token_sums) if self.memo is not None
                else self.block_token_sums())
        rows = -(-sums // self.capacity)
        total = self.lengths.total
        positions = int(rows.sum()) * self.capacity
        report = PackingReport(int(rows.sum()), total, 0, positions - total, 0, total)
        return np.concatenate([[0], np.cumsum(rows)]).astype(np.int64), report

    def block_token_sums(self) -> np.ndarray:
        """Tokens of each block, in one vectorized pass over the lengths in storage order
        (a document's block is its position in the epoch's order // K, from the inverse
        permutation), a bounded number of documents at a time: no gather, no per-document
        array kept. (The shard-local order has no inverse: it gathers in position order.)"""
        per_block = self.block_documents
        inverse = getattr(self.document_order, "inverse", None)
        if inverse is None:
            return self._block_sums_in_order()

        def sums_of(piece: tuple[int, np.ndarray]) -> np.ndarray:
            first, lengths = piece
            blocks = inverse(np.arange(first, first + lengths.size, dtype=np.int64))
            return np.bincount(blocks // per_block, weights=lengths,  # exact below 2**53
                               minlength=self.num_blocks).astype(np.int64)

        pieces = ((first + start, lengths[start:start + SUM_CHUNK_DOCUMENTS])
                  for first, lengths in self.lengths.chunks()
                  for start in range(0, lengths.size, SUM_CHUNK_DOCUMENTS))
        sums = np.zeros(self.num_blocks, dtype=np.int64)
        with ThreadPoolExecutor(SUM_THREADS) as pool:  # numpy releases the GIL
            for partial in pool.map(sums_of, pieces):
                sums += partial
        return sums

    def _block_sums_in_order(self) -> np.ndarray:
        count, per_block = len(self.lengths), self.block_documents
        step = per_block * max(1, SUM_CHUNK_DOCUMENTS // per_block)
        sums = []
        for first in range(0, count, step):
            ids = self.document_order(np.arange(first, min(first + step, count),
                                                dtype=np.int64))
            lengths = self.lengths[ids]
            sums.append(np.add.reduceat(lengths, np.arange(0, lengths.size, per_block)))
        return np.concatenate(sums) if sums else np.zeros(0, dtype=np.int64)

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

    def rows(self, positions: np.ndarray) -> list[tuple[int, RowPieces]]:
        """For each position: (global row id, the row's pieces)."""
        blocks, local = self.row_ids(positions)
        return [(int(self.row_offsets[block]) + row, self.pack(block).row(row))
                for block, row in zip(blocks.tolist(), local.tolist(), strict=True)]


def block_size(lengths: DocumentLengths, capacity: int, block_documents: int,
               packing: str) -> int:
    """Documents per packing block. Fill packing pads less than one row per block (split's
    block ends do too), so their blocks hold at least MIN_ROWS_PER_BLOCK rows' worth of
    tokens on average (padding from block ends < 0.4%); crop keeps `block_documents` as it
    always had."""
    if packing not in ("fill", "split") or len(lengths) == 0:
        return block_documents
    mean = max(lengths.mean, 1.0)
    return max(block_documents, int(np.ceil(MIN_ROWS_PER_BLOCK * capacity / mean)))


class PreformedPlan:
    """LLMBATCH: whole pre-formed batches in a block shuffle (as ZeroBatch's loader does):
    blocks of `block_batches` consecutive batches are visited in a Feistel order per epoch,
    batches inside a block in file order (sequential reads); a partial last block stays
    last. O(1) memory."""

    kind = PREFORMED_MODE

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
MODES = ("windows", "bestfit", "documents", PREFORMED_MODE)


def make_plan(mode: str, num_tokens: int, lengths: object, seq_len: int, seed: int,
              epoch: int, block_documents: int = 4096, packing: str = "fill",
              groups: ShardGroups | None = None, memo: SumsMemo | None = None,
              separator: str = "bos") -> Plan:
    """The plan of one epoch. `lengths` (document lengths) may be a zero-argument callable,
    called only by the modes that need it; `groups` makes the shuffle shard-local; `memo`
    keeps bestfit's block sums and `separator` says where documents carry BOS/EOS (see
    BestFitPlan)."""
    if mode == "windows":
        return WindowPlan(num_tokens, seq_len, seed, epoch, groups)
    values = lengths() if callable(lengths) else lengths
    if mode == "bestfit":
        return BestFitPlan(values, seq_len, seed, epoch, block_documents, packing, groups,
                           memo, separator)
    if mode == "documents":
        return DocumentPlan(values, seq_len, seed, epoch, groups)
    raise ValueError(f"mode {mode!r} not among {list(MODES)}")
