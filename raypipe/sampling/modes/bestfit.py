"""`bestfit` (the default): documents packed into rows, every target true.

Invariant: documents in Feistel order are cut into blocks of K; each block is packed
(raypipe.sampling.pack: `fill`, the default, fills every row and keeps every token;
`split` keeps documents whole where they fit and pads; `crop` is nanochat's); blocks are
visited in order and the rows of block j in a Feistel order salted by j. Row counts per
block are computed once per epoch: for `fill`, ceil(block tokens / (T + 1)) from one
vectorized pass over the lengths in storage order (each document's block from the
inverse permutation; no block packed, and the loader keeps the sums once per node:
docs/scale.md); for the others by packing every block (O(N) in
Python). A block's rows are packed on demand; the last 8 packed stay cached. A row's pieces
are sequences of their own (position_ids restart, cu_seqlens); the target that crosses into
a piece is masked unless the piece before ends its document and this one starts its own, so
no target with mask 1 joins two documents falsely (the packing's cut rule puts a separator
a reader sees at every other join: raypipe.sampling.pack). A seq_len change inside an epoch
continues the plan (`ContinuedPlan`): the unserved rows of the block at the position, taken
apart into token ranges and packed again at the new seq_len, then the later documents in
new blocks, so every token the plan had not served is served once; cost O(one block) plus
the later blocks' sums (a slice of the node's when the block size holds, else one pass;
docs/scale.md measures it at 10^8 documents).
Documents excluded from a step on (raypipe.sampling.exclusions) continue the plan the same
way, the remainder's ranges of excluded documents dropped. Under a windowed shuffle of
several lanes each lane has served a prefix of its rows, so each continues on its own over
its own runs of the order (`LanedBestFitPlan`). A plan under exclusions packs
each block without them and takes their tokens off the block sums, O(excluded). Cost: see
bench/packing_bench.py for planner documents per second, then O(1) per row; ~70 us to fill
a batch of 8 x 2049.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from raypipe.errors import ConfigError
from raypipe.formats import PACKING_BY_DATA, packing_for_data
from raypipe.sampling.balance import NO_BALANCE, RowCostModel, cost_model, cost_order
from raypipe.sampling.buffers import (
    BatchBuffers,
    DescribedRows,
    Filled,
    TokenSource,
    write_boundaries,
)
from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.modes.base import (
    BatchFiller,
    LoaderMode,
    ModeKnobs,
    PlanInputs,
    knob,
    register,
)
from raypipe.sampling.pack import (
    OVERLONGS,
    PACKINGS,
    PackedBlock,
    RowPieces,
    pack,
    separator_of,
)
from raypipe.sampling.permute import FeistelPermutation
from raypipe.sampling.plans import (
    DocumentOrder,
    LanedPlan,
    LaneOrder,
    PackingReport,
    ShardGroups,
    ShardWindows,
    SumsMemo,
    continued_order,
    continued_runs,
    document_permutation,
    lane_bounds,
    lane_starts,
    next_window_blocks,
)

MIN_ROWS_PER_BLOCK = 256
SUM_CHUNK_DOCUMENTS = 1 << 18  # documents permuted per numpy call when summing blocks
SUM_THREADS = max(1, min(8, os.cpu_count() or 1))  # threads of the block-sum pass
GATHER_SHARE = 4  # a plan of under 1/4 of the documents sums its own ranges' lengths
CACHED_BLOCKS = 8  # packed blocks a plan keeps (a step's rows span a few blocks)
PIECES_RULE = "separated"  # the cut rule of raypipe.sampling.pack (states record it)
SHUFFLED_ROWS, BY_COST = "shuffled", "by_cost"
BLOCK_ORDERS = (SHUFFLED_ROWS, BY_COST)  # a packing block's rows: shuffled, or by cost


class BestFitPlan:
    kind = "bestfit"

    def __init__(self, lengths: np.ndarray | DocumentLengths, seq_len: int, seed: int,
                 epoch: int, block_documents: int = 4096, packing: str = "fill",
                 groups: ShardGroups | ShardWindows | None = None,
                 memo: SumsMemo | None = None,
                 separator: str = "bos", overlong: str = "cut", first_document: int = 0,
                 excluded: np.ndarray | None = None, excluded_key: str = "",
                 order: DocumentOrder | None = None, row_cost: RowCostModel | None = None,
                 ranges: np.ndarray | None = None):
        """`memo(key, compute)`: returns compute() or what it returned before for `key`
        (a node-local cache of the block token sums, shared by the node's ranks);
        `separator`: which side of a document carries BOS/EOS (raypipe.sampling.pack);
        `first_document`: the plan packs the epoch's documents from this position of its
        document order on (the rest of an epoch whose seq_len changed: ContinuedPlan);
        `excluded`: documents left out (ascending; raypipe.sampling.exclusions), named in
        memo keys by `excluded_key`: each block packs its other documents, and the block
        sums lose their tokens, O(excluded); `order`: the epoch's document order (default:
        its Feistel order; the rest of an epoch that units joined: plans.continued_order);
        `row_cost`: a block's rows in order of this model's cost (`block_order` by_cost),
        up in even blocks and down in odd ones, else shuffled; `ranges`: the runs [first,
        end) of the document order it packs, ascending (default: [first_document, all));
        a lane's rest of an epoch (`LanedPlan`) packs its own windows' runs."""
        lengths = DocumentLengths.of(lengths)
        count = len(lengths)
        self.ranges = (np.array([[first_document, count]], dtype=np.int64) if ranges is None
                       else np.asarray(ranges, dtype=np.int64).reshape(-1, 2))
        flat = self.ranges.reshape(-1)
        if (np.diff(flat) < 0).any() or (flat.size and not 0 <= flat[0] <= flat[-1] <= count):
            raise ValueError(f"ranges {self.ranges.tolist()}: runs of [0, {count}), ascending")
        self.first_document = int(flat[0]) if flat.size else count
        # it packs part of the epoch's order (not every document from position 0)
        self.partial = self.ranges.tolist() != [[0, count]]
        self.excluded = (np.zeros(0, dtype=np.int64) if excluded is None
                         else np.asarray(excluded, dtype=np.int64))
        self.excluded_key = excluded_key
        self.memo = memo
        self.lengths = lengths
        self.packing = packing
        self.separator = separator
        self.overlong = overlong
        self.capacity = seq_len + 1
        self.seed, self.epoch = seed, epoch
        self.row_cost = row_cost
        self.block_documents = block_size(lengths, self.capacity, block_documents, packing)
        self.document_order = order if order is not None else document_permutation(
            len(lengths), seed, epoch, 3, groups)
        if len(self.document_order) != len(lengths):
            raise ValueError(f"an order of {len(self.document_order)} documents for a plan "
                             f"of {len(lengths)}")
        self.lane_count = groups.lanes if isinstance(groups, ShardWindows) else 1
        self.nearby_lanes = isinstance(groups, ShardWindows) and groups.nearby
        self.lane_ranks = groups.ranks_per_lane if isinstance(groups, ShardWindows) else 1
        # where each block begins in the document order (blocks end where windows do)
        self._cut_blocks()
        self._cached: OrderedDict[int, PackedBlock] = OrderedDict()
        self._row_orders: dict[int, Callable[[np.ndarray], np.ndarray]] = {}
        self._block_costs: dict[tuple[int, int, int], np.ndarray] = {}

    def _cut_blocks(self) -> None:
        """Where each block begins and ends in the document order (in each of its ranges);
        `uniform`: one range to the end and every block holds block_documents (the last
        fewer)."""
        starts, ends = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
        for first, end in self.ranges.tolist():
            cut = block_starts(end, self.block_documents, first, self.document_order)
            starts.append(cut)
            ends.append(np.append(cut[1:], end).astype(np.int64))
        self.block_starts = np.concatenate(starts).astype(np.int64)
        self.block_ends = np.concatenate(ends).astype(np.int64)
        self.uniform = (not hasattr(self.document_order, "window_starts")
                        and len(self.ranges) == 1 and self.ranges[0, 1] == len(self.lengths))
        self.num_blocks = len(self.block_starts)

    def block_documents_ids(self, block: int) -> np.ndarray:
        """The documents block `block` packs, in the epoch's order (the excluded left out)."""
        first, stop = int(self.block_starts[block]), int(self.block_ends[block])
        ids = self.document_order(np.arange(first, stop, dtype=np.int64))
        return ids[~np.isin(ids, self.excluded)] if self.excluded.size else ids

    @cached_property
    def kept_total(self) -> int:
        """Tokens of the epoch's documents but the excluded."""
        excluded = self.lengths[self.excluded].sum() if self.excluded.size else 0
        return self.lengths.total - int(excluded)

    def pack(self, block: int) -> PackedBlock:
        """Block `block`'s rows; the last CACHED_BLOCKS blocks packed stay cached, so a
        rank that reads a block's rows over several batches packs it once."""
        packed = self._cached.get(block)
        if packed is None:
            ids = self.block_documents_ids(block)
            packed = self._cached[block] = pack(self.packing, ids, self.lengths[ids],
                                                self.capacity, self.separator, self.overlong)
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
        used = cropped = dropped = padded = repeated = 0
        for block in range(self.num_blocks):
            packed = self.pack(block)
            rows[block + 1] = packed.num_rows
            used += packed.used_tokens
            cropped += packed.cropped_tokens
            dropped += packed.dropped_tokens
            padded += packed.padded_tokens
            repeated += packed.repeated_tokens
        total = used + cropped + dropped if self.partial else self.kept_total
        report = PackingReport(int(rows.sum()), used, cropped, padded, dropped, total,
                               repeated_tokens=repeated)
        return np.cumsum(rows), report

    def _fill_summary(self) -> tuple[np.ndarray, PackingReport]:
        """Fill packing's rows follow from token sums alone: ceil(block tokens / capacity)
        per block, no block packed."""
        sums = self.kept_block_sums()
        rows = -(-sums // self.capacity)
        total = int(sums.sum()) if self.partial else self.kept_total
        positions = int(rows.sum()) * self.capacity
        report = PackingReport(int(rows.sum()), total, 0, positions - total, 0, total)
        return np.concatenate([[0], np.cumsum(rows)]).astype(np.int64), report

    def kept_block_sums(self) -> np.ndarray:
        """The block token sums through the memo. A plan that starts at a block boundary of
        the whole epoch's blocks of its size (the rest of an epoch after a seq_len change
        that kept the block size) slices the whole epoch's sums: no pass over the lengths
        where the node holds them."""
        per_block, count = self.block_documents, len(self.lengths)
        whole_bounds = np.append(
            self.block_starts if not self.partial else
            block_starts(count, per_block, 0, self.document_order), count).astype(np.int64)
        at = np.searchsorted(whole_bounds, self.ranges)
        order_key = getattr(self.document_order, "key", "")  # a joined order: its own
        if not order_key and (whole_bounds[np.minimum(at, whole_bounds.size - 1)]
                              == self.ranges).all():
            key = ("block-token-sums", self.seed, self.epoch, per_block, count,
                   *([self.excluded_key] if self.excluded_key else []))
            whole = (self.memo(key, self.whole_epoch_sums) if self.memo is not None
                     else self.whole_epoch_sums())
            return np.concatenate([whole[first:end] for first, end in at.tolist()]
                                  + [np.zeros(0, dtype=np.int64)]).astype(np.int64)
        where = (self.first_document if len(self.ranges) == 1 and self.ranges[0, 1] == count
                 else hashlib.sha256(self.ranges.tobytes()).hexdigest()[:16])
        key = ("block-token-sums", self.seed, self.epoch, per_block, count, where,
               *([self.excluded_key] if self.excluded_key else []),
               *([order_key] if order_key else []))
        return (self.memo(key, self.block_token_sums) if self.memo is not None
                else self.block_token_sums())

    def whole_epoch_sums(self) -> np.ndarray:
        """The block token sums of the whole epoch (from its first document)."""
        if not self.partial:
            return self.block_token_sums()
        return replace_ranges(self, np.array([[0, len(self.lengths)]])).block_token_sums()

    def block_token_sums(self) -> np.ndarray:
        """Tokens of each block, in one vectorized pass over the lengths in storage order
        (a document's block is its position in the epoch's order // K, from the inverse
        permutation), a bounded number of documents at a time: no gather, no per-document
        array kept; the excluded documents' tokens taken off after, O(excluded). A plan
        of a small part of the order (a lane's rest of an epoch) sums its own ranges'
        documents instead (`_gathered_sums`), so L lanes cost one pass, not L."""
        inside = int((self.ranges[:, 1] - self.ranges[:, 0]).sum())
        if self.partial and inside * GATHER_SHARE < len(self.lengths):
            return self._gathered_sums()
        inverse = self.document_order.inverse

        def sums_of(piece: tuple[int, np.ndarray]) -> np.ndarray:
            first, lengths = piece
            return self._sums_by_block(np.arange(first, first + lengths.size,
                                                 dtype=np.int64), lengths, inverse)

        pieces = ((first + start, lengths[start:start + SUM_CHUNK_DOCUMENTS])
                  for first, lengths in self.lengths.chunks()
                  for start in range(0, lengths.size, SUM_CHUNK_DOCUMENTS))
        sums = np.zeros(self.num_blocks, dtype=np.int64)
        with ThreadPoolExecutor(SUM_THREADS) as pool:  # numpy releases the GIL
            for partial in pool.map(sums_of, pieces):
                sums += partial
        if self.excluded.size:  # the excluded documents' tokens are no block's
            sums -= self._sums_by_block(self.excluded, self.lengths[self.excluded], inverse)
        return sums

    def _gathered_sums(self) -> np.ndarray:
        """Tokens of each block from its ranges' documents, their lengths gathered through
        the order a chunk at a time: O(documents in its ranges)."""
        sums = np.zeros(self.num_blocks, dtype=np.int64)
        for first, end in self.ranges.tolist():
            for start in range(first, end, SUM_CHUNK_DOCUMENTS):
                places = np.arange(start, min(start + SUM_CHUNK_DOCUMENTS, end),
                                   dtype=np.int64)
                ids = self.document_order(places)
                lengths = np.asarray(self.lengths[ids], dtype=np.int64)
                if self.excluded.size:
                    lengths = np.where(np.isin(ids, self.excluded), 0, lengths)
                blocks = np.searchsorted(self.block_starts, places, side="right") - 1
                sums += np.bincount(blocks, weights=lengths,
                                    minlength=self.num_blocks).astype(np.int64)
        return sums

    def _sums_by_block(self, documents: np.ndarray, lengths: np.ndarray, inverse: Any
                       ) -> np.ndarray:
        """Tokens of `documents` (their `lengths`) summed by the block each falls in
        (documents outside the plan's ranges are none of its blocks')."""
        places = inverse(documents)
        if self.uniform:
            kept = places >= self.first_document
            blocks = (places[kept] - self.first_document) // self.block_documents
        else:
            blocks = np.searchsorted(self.block_starts, places, side="right") - 1
            kept = (blocks >= 0) & (places < self.block_ends[np.maximum(blocks, 0)]
                                    if self.num_blocks else np.zeros(places.size, bool))
            blocks = blocks[kept]
        return np.bincount(blocks, weights=lengths[kept],  # exact below 2**53
                           minlength=self.num_blocks).astype(np.int64)

    @property
    def row_offsets(self) -> np.ndarray:
        return self._summary[0]

    @property
    def size(self) -> int:
        return int(self.row_offsets[-1])

    def report(self) -> PackingReport:
        return self._summary[1]

    def block_costs(self, block: int, model: RowCostModel, seq_len: int) -> np.ndarray:
        """float64[rows of block `block`]: each row's cost under `model` (the last few
        blocks' kept)."""
        key = (block, id(model), seq_len)
        if key not in self._block_costs:
            if len(self._block_costs) >= CACHED_BLOCKS:
                self._block_costs.pop(next(iter(self._block_costs)))
            packed = self.pack(block)
            self._block_costs[key] = model.row_costs(packed.row_offsets, packed.take, seq_len)
        return self._block_costs[key]

    def row_costs(self, positions: np.ndarray, model: RowCostModel, seq_len: int
                  ) -> np.ndarray:
        """float64[positions.size]: the cost of the row at each position."""
        blocks, local = self.row_ids(positions)
        costs = np.empty(local.size, dtype=np.float64)
        for block in np.unique(blocks).tolist():
            chosen = blocks == block
            costs[chosen] = self.block_costs(block, model, seq_len)[local[chosen]]
        return costs

    def _row_order(self, block: int) -> Callable[[np.ndarray], np.ndarray]:
        """Place in the block -> row of the block: shuffled (a Feistel permutation), or by
        cost (ties shuffled)."""
        if block not in self._row_orders:
            if len(self._row_orders) >= CACHED_BLOCKS:
                self._row_orders.pop(next(iter(self._row_orders)))
            count = int(self.row_offsets[block + 1] - self.row_offsets[block])
            shuffled = FeistelPermutation(count, self.seed, self.epoch, salt=1000 + block)
            self._row_orders[block] = shuffled
            if self.row_cost is not None:
                costs = self.block_costs(block, self.row_cost, self.capacity - 1)
                ranked = cost_order(costs, shuffled(np.arange(count, dtype=np.int64)),
                                    descending=block % 2 == 1)
                self._row_orders[block] = ranked.__getitem__
        return self._row_orders[block]

    @cached_property
    def lanes(self) -> LaneOrder | None:
        """The lanes a windowed shuffle reads side by side (None: one). A plan of part of
        an epoch is one lane's (`LanedBestFitPlan` reads the lanes of the rest of an epoch)."""
        if self.lane_count <= 1:
            return None
        if self.partial:
            raise ValueError("a plan of part of an epoch reads one lane")
        return LaneOrder(lane_bounds(self.document_order.window_starts, self.lane_count,
                                     self._row_at_order), self.nearby_lanes, self.lane_ranks)

    def _row_at_order(self, order_positions: np.ndarray) -> np.ndarray:
        """The first row of the block that begins at each document-order position."""
        return self.row_offsets[np.searchsorted(self.block_starts, order_positions)]

    def observations(self, positions: np.ndarray) -> np.ndarray:
        """The rows (in block order) the epoch's positions read: through the lanes."""
        return positions if self.lanes is None else self.lanes(positions)

    def row_ids(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block, row id within the block) of each position; one permutation call per
        block touched."""
        positions = self.observations(np.asarray(positions, dtype=np.int64))
        blocks = np.searchsorted(self.row_offsets, positions, side="right") - 1
        local = positions - self.row_offsets[blocks]
        for block in np.unique(blocks).tolist():
            chosen = blocks == block
            local[chosen] = self._row_order(block)(local[chosen])
        return blocks, local

    def counted_tokens(self, positions: np.ndarray) -> int:
        """Tokens the report counts for the rows at `positions` (their pieces)."""
        return sum(int(row.take.sum()) for _, row in self.rows(positions))

    def units_ahead(self, position: int) -> np.ndarray | None:
        """The next window's blocks in the lane of position `position` (windowed; None for
        another order)."""
        if self.uniform or not self.num_blocks or position >= self.size:
            return None if self.uniform else np.empty(0, dtype=np.int64)
        row = int(self.observations(np.array([position], dtype=np.int64))[0])
        block = int(np.searchsorted(self.row_offsets, row, side="right")) - 1
        run = int(np.searchsorted(self.ranges[:, 0], self.block_starts[block],
                                  side="right")) - 1
        return next_window_blocks(self.document_order, int(self.block_starts[block]),
                                  self.lanes, row, int(self.ranges[run, 1]))

    def repeated_tokens(self, positions: np.ndarray) -> int:
        """Of those, the tokens placed a second time (overlong `split`: the first token of
        every later piece of a document longer than a row, the only pieces with start > 0
        under split packing)."""
        if self.overlong != "split":
            return 0
        return sum(int((row.starts > 0).sum()) for _, row in self.rows(positions))

    def rows(self, positions: np.ndarray) -> list[tuple[int, RowPieces]]:
        """For each position: (global row id, the row's pieces)."""
        blocks, local = self.row_ids(positions)
        return [(int(self.row_offsets[block]) + row, self.pack(block).row(row))
                for block, row in zip(blocks.tolist(), local.tolist(), strict=True)]

    def remaining(self, position: int) -> Remainder:
        """What the plan (of one lane) has not served once positions [0, position) are:
        the unserved rows' pieces of the block `position` falls in (merged per document),
        then every document of the blocks after it. O(one block)."""
        if self.lanes is not None:
            raise ValueError("a plan of several lanes: lane_remainders")
        return self._remaining_rows(position, self.num_blocks)

    def lane_remainders(self, position: int) -> list[Remainder]:
        """What each lane has not served once positions [0, position) are (one lane: one
        remainder): a lane serves a prefix of its rows (plans.LaneOrder.served)."""
        if self.lanes is None:
            return [self.remaining(position)]
        bounds, served = self.lanes.bounds, self.lanes.served(position)
        stops = np.searchsorted(self.block_starts, lane_starts(
            self.document_order.window_starts, self.lane_count)[1:])
        return [self._remaining_rows(int(bounds[lane] + served[lane]), int(stops[lane]))
                for lane in range(self.lanes.lanes)]

    def _remaining_rows(self, row: int, stop_block: int) -> Remainder:
        """What rows from `row` (of block order) up to block `stop_block` hold: the pieces
        of the unserved rows of the block `row` falls in, then the document ranges of the
        blocks after it, up to `stop_block`."""
        if row >= self.row_offsets[stop_block]:
            return Remainder.none(np.zeros((0, 2), dtype=np.int64))
        block = int(np.searchsorted(self.row_offsets, row, side="right")) - 1
        local = row - int(self.row_offsets[block])
        if local == 0:
            return Remainder.none(self._block_ranges(block, stop_block))
        count = int(self.row_offsets[block + 1] - self.row_offsets[block])
        packed = self.pack(block)
        rows = [packed.row(row) for row in
                self._row_order(block)(np.arange(local, count, dtype=np.int64)).tolist()]
        return Remainder.of_rows(rows, self._block_ranges(block + 1, stop_block))

    def _block_ranges(self, first: int, stop: int) -> np.ndarray:
        """[k, 2]: the runs of the document order blocks [first, stop) pack (adjacent
        blocks' joined)."""
        starts, ends = self.block_starts[first:stop], self.block_ends[first:stop]
        if not starts.size:
            return np.zeros((0, 2), dtype=np.int64)
        breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
        return np.stack([starts[np.concatenate([[0], breaks])],
                         ends[np.concatenate([breaks - 1, [starts.size - 1]])]], axis=1)


@dataclass(frozen=True)
class Remainder:
    """The documents an epoch's plan (or one lane of it) has not served at a position:
    token ranges of the documents partly or wholly in its unserved rows of the block at
    that position (`documents`, `starts`, `counts`, in the plan's numbering), and every
    document of the runs `ranges` ([k, 2]: [first, end) of the epoch's document order)."""

    documents: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    ranges: np.ndarray

    @classmethod
    def none(cls, ranges: np.ndarray) -> Remainder:
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, empty, ranges)

    @classmethod
    def of_rows(cls, rows: list[RowPieces], ranges: np.ndarray) -> Remainder:
        """The token ranges `rows` hold, one per run of a document's tokens (pieces that
        meet or overlap, as overlong `split`'s do by one token, are one range)."""
        if not rows:
            return cls.none(ranges)
        documents = np.concatenate([row.documents for row in rows]).astype(np.int64)
        starts = np.concatenate([row.starts for row in rows]).astype(np.int64)
        ends = starts + np.concatenate([row.take for row in rows]).astype(np.int64)
        order = np.lexsort((starts, documents))
        documents, starts, ends = documents[order], starts[order], ends[order]
        begins = np.flatnonzero(np.concatenate(
            [[True], (documents[1:] != documents[:-1]) | (starts[1:] > ends[:-1])]))
        return cls(documents[begins], starts[begins],
                   np.maximum.reduceat(ends, begins) - starts[begins], ranges)

    @property
    def tokens(self) -> int:
        return int(self.counts.sum())

    def first(self, count: int) -> int:
        """The first place of the order it holds whole (`count`: the order's length, where
        it holds none)."""
        return int(self.ranges[0, 0]) if len(self.ranges) else count

    def without(self, excluded: np.ndarray) -> Remainder:
        """The remainder but the ranges of `excluded` documents."""
        if not excluded.size or not self.documents.size:
            return self
        kept = ~np.isin(self.documents, excluded)
        return Remainder(self.documents[kept], self.starts[kept], self.counts[kept],
                         self.ranges)


HEAD_SALT = 999  # the Feistel salt of a continued plan's re-planned rows


class ContinuedPlan:
    """The rest of an epoch after a seq_len change: the `Remainder` of the plan before,
    re-planned at the new seq_len. Its head is the remainder's token ranges packed as one
    block (each range a document to the packing; pieces keep their document's numbering,
    so a piece starts its document only where its range does), its rows in a Feistel order;
    its tail a BestFitPlan of the epoch's documents from `first_document` on. Every token
    the plan before had not served is in exactly one of its rows, and no other."""

    kind = "bestfit"

    def __init__(self, remainder: Remainder, tail: BestFitPlan):
        self.tail, self.remainder = tail, remainder
        self.lengths, self.capacity = tail.lengths, tail.capacity
        self.head, self.head_later = self._pack_head(remainder, tail)
        self.head_rows = self.head.num_rows
        self.head_order = (FeistelPermutation(self.head_rows, tail.seed, tail.epoch,
                                              salt=HEAD_SALT) if self.head_rows else None)

    @staticmethod
    def _pack_head(remainder: Remainder, tail: BestFitPlan) -> tuple[PackedBlock, np.ndarray]:
        """The remainder's ranges packed (in document numbering), and per piece whether it
        is a later piece of its range (overlong `split`: its first token placed again)."""
        count = remainder.documents.size
        if count == 0:
            empty = np.zeros(0, dtype=np.int64)
            return PackedBlock(np.zeros(1, dtype=np.int64), empty, empty, empty,
                               np.zeros(0, dtype=bool), 0, 0, 0), np.zeros(0, dtype=bool)
        packed = pack(tail.packing, np.arange(count, dtype=np.int64), remainder.counts,
                      tail.capacity, tail.separator, tail.overlong)
        ranges = packed.doc_ids
        documents = remainder.documents[ranges]
        range_ends = remainder.starts + remainder.counts == tail.lengths[remainder.documents]
        return replace(packed, doc_ids=documents, starts=remainder.starts[ranges] + packed.starts,
                       ends_document=packed.ends_document & range_ends[ranges]), \
            packed.starts > 0

    @property
    def size(self) -> int:
        return self.head_rows + self.tail.size

    def report(self) -> PackingReport:
        """What its rows make of the tokens left when it began."""
        head, tail = self.head, self.tail.report()
        return PackingReport(
            self.head_rows + tail.rows, head.used_tokens + tail.used_tokens,
            head.cropped_tokens + tail.cropped_tokens, head.padded_tokens + tail.padded_tokens,
            head.dropped_tokens + tail.dropped_tokens, self.remainder.tokens + tail.total_tokens,
            repeated_tokens=head.repeated_tokens + tail.repeated_tokens)

    def rows(self, positions: np.ndarray) -> list[tuple[int, RowPieces]]:
        """For each position: (row id in this plan, the row's pieces)."""
        positions = np.asarray(positions, dtype=np.int64)
        in_head = positions < self.head_rows
        rows: list[tuple[int, RowPieces] | None] = [None] * positions.size
        if in_head.any():
            ids = self.head_order(positions[in_head])
            for at, row in zip(np.flatnonzero(in_head).tolist(), ids.tolist(), strict=True):
                rows[at] = (row, self.head.row(row))
        if not in_head.all():
            tail = self.tail.rows(positions[~in_head] - self.head_rows)
            for at, (row, pieces) in zip(np.flatnonzero(~in_head).tolist(), tail, strict=True):
                rows[at] = (self.head_rows + row, pieces)
        return rows  # type: ignore[return-value]

    def counted_tokens(self, positions: np.ndarray) -> int:
        return sum(int(row.take.sum()) for _, row in self.rows(positions))

    def row_costs(self, positions: np.ndarray, model: RowCostModel, seq_len: int
                  ) -> np.ndarray:
        """float64[positions.size]: the cost of the row at each position (head or tail)."""
        positions = np.asarray(positions, dtype=np.int64)
        in_head = positions < self.head_rows
        costs = np.empty(positions.size, dtype=np.float64)
        if in_head.any():
            head = model.row_costs(self.head.row_offsets, self.head.take, seq_len)
            costs[in_head] = head[self.head_order(positions[in_head])]
        if not in_head.all():
            costs[~in_head] = self.tail.row_costs(positions[~in_head] - self.head_rows, model,
                                                  seq_len)
        return costs

    def repeated_tokens(self, positions: np.ndarray) -> int:
        """Tokens placed a second time in the rows at `positions` (overlong `split`)."""
        if self.tail.overlong != "split":
            return 0
        in_head = positions < self.head_rows
        offsets = self.head.row_offsets
        head = sum(int(self.head_later[offsets[row]:offsets[row + 1]].sum())
                   for row in (self.head_order(positions[in_head]).tolist()
                               if in_head.any() else []))
        return head + self.tail.repeated_tokens(positions[~in_head] - self.head_rows)

    def remaining(self, position: int) -> Remainder:
        """What is left at `position`: the head's unserved rows and the whole tail, or the
        tail's remainder."""
        if position >= self.head_rows:
            return self.tail.remaining(position - self.head_rows)
        rows = [self.head.row(row) for row in
                self.head_order(np.arange(position, self.head_rows, dtype=np.int64)).tolist()]
        return Remainder.of_rows(rows, self.tail.ranges)

    def lane_remainders(self, position: int) -> list[Remainder]:
        return [self.remaining(position)]

    @property
    def document_order(self) -> DocumentOrder:
        return self.tail.document_order

    def units_ahead(self, position: int) -> np.ndarray | None:
        """The tail's next window (from the head: its first)."""
        return self.tail.units_ahead(max(position - self.head_rows, 0))


class LanedBestFitPlan(LanedPlan):
    """bestfit's rest of an epoch in several lanes (plans.LanedPlan): lane l is a
    ContinuedPlan (its unserved rows' pieces packed again, then its later windows, and its
    share of the joined units' windows); every token each lane had not served is in
    exactly one row of its continuation, and no other."""

    kind = "bestfit"

    def rows(self, positions: np.ndarray) -> list[tuple[int, RowPieces]]:
        """For each position: (row id in this plan, the row's pieces)."""
        rows: list[tuple[int, RowPieces] | None] = [None] * len(positions)
        for lane, where, local in self.by_lane(positions):
            for at, (row, pieces) in zip(where.tolist(), self.plans[lane].rows(local),
                                         strict=True):
                rows[at] = (int(self.offsets[lane]) + row, pieces)
        return rows  # type: ignore[return-value]

    def repeated_tokens(self, positions: np.ndarray) -> int:
        return sum(self.plans[lane].repeated_tokens(local)
                   for lane, _, local in self.by_lane(positions))

    def row_costs(self, positions: np.ndarray, model: RowCostModel, seq_len: int
                  ) -> np.ndarray:
        costs = np.empty(len(positions), dtype=np.float64)
        for lane, where, local in self.by_lane(positions):
            costs[where] = self.plans[lane].row_costs(local, model, seq_len)
        return costs


def replace_ranges(plan: BestFitPlan, ranges: np.ndarray) -> BestFitPlan:
    """`plan`'s shape over other runs of its order (no block packed, nothing summed)."""
    other = copy.copy(plan)
    other.ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    other.first_document = int(other.ranges[0, 0]) if other.ranges.size else len(plan.lengths)
    other.partial = other.ranges.tolist() != [[0, len(plan.lengths)]]
    other._cut_blocks()
    other._cached, other._row_orders, other._block_costs = OrderedDict(), {}, {}
    other.__dict__.pop("_summary", None)
    other.__dict__.pop("lanes", None)
    return other


def block_starts(end: int, per_block: int, first: int, order: Any) -> np.ndarray:
    """Where each packing block begins in an epoch's document order, in [first, end):
    every `per_block` documents, and (a windowed order) at each window's start too, so
    no block straddles two windows and a reader holds one window at a time."""
    cuts = getattr(order, "window_starts", None)
    if cuts is None:
        return np.arange(first, end, per_block, dtype=np.int64)
    starts = np.concatenate([np.arange(begin, stop, per_block, dtype=np.int64)
                             for begin, stop in zip(cuts[:-1], cuts[1:], strict=True)]
                            + [np.zeros(0, dtype=np.int64)])
    starts = starts[(starts > first) & (starts < end)]
    return np.concatenate([[first] if first < end else [], starts]).astype(np.int64)


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


class Piece(NamedTuple):
    """One piece of a packed row: `count` tokens from token `first` of `shard`; whether it
    starts and ends its document."""

    shard: int
    first: int
    count: int
    starts_document: bool
    ends_document: bool


class BestFitFiller(BatchFiller[list[Piece]]):
    """Rows are lists of pieces, located for all rows of all steps in one pass."""

    def __init__(self, source: TokenSource, plan: BestFitPlan, seq_len: int, pad_id: int = 0,
                 boundaries: bool = True):
        self.source, self.plan, self.seq_len = source, plan, seq_len
        self.pad_id, self.boundaries = pad_id, boundaries

    def describe(self, positions: np.ndarray) -> list[DescribedRows[list[Piece]]]:
        steps, batch = positions.shape
        rows_of = self.plan.rows(positions.reshape(-1))
        pieces = [row for _, row in rows_of]
        documents = np.concatenate([row.documents for row in pieces])
        shards, firsts, _ = self.source.locate_documents(documents)
        starts = np.concatenate([row.starts for row in pieces])
        located = [Piece(*piece) for piece in zip(
            shards.tolist(), (firsts + starts).tolist(),
            np.concatenate([row.take for row in pieces]).tolist(), (starts == 0).tolist(),
            np.concatenate([row.ends_document for row in pieces]).tolist(), strict=True)]
        rows, at = [], 0
        for row in pieces:
            rows.append(located[at:at + len(row.take)])
            at += len(row.take)
        ids = np.array([row_id for row_id, _ in rows_of], dtype=np.int64).reshape(steps, batch)
        units = self.source.units_by_step(documents, [
            sum(len(row.take) for row in pieces[i * batch:(i + 1) * batch])
            for i in range(steps)])
        return [DescribedRows(positions[i], ids[i], rows[i * batch:(i + 1) * batch], units[i])
                for i in range(steps)]

    def token_ranges(self, plan: DescribedRows[list[Piece]]) -> list[list[tuple[int, int, int]]]:
        return [[(piece.shard, piece.first, piece.count) for piece in row]
                for row in plan.rows]

    def units_ahead(self, position: int) -> np.ndarray | None:
        return self.plan.units_ahead(position)

    def fetch_units(self, positions: np.ndarray) -> np.ndarray:
        doc_ids = [row.documents for _, row in self.plan.rows(positions.reshape(-1))]
        return self.source.units_of_documents(np.concatenate(doc_ids) if doc_ids
                                               else np.empty(0, np.int64))

    def fill(self, plan: DescribedRows[list[Piece]], buffers: BatchBuffers) -> Filled:
        """Pieces back to back, each a sequence of its own; the target that crosses into a
        piece is masked unless the piece before ends its document and this one starts its
        own; a row's unfilled tail is padding: pad_id tokens, masked targets, a sequence of
        its own (attention never crosses a piece)."""
        tokens, starts, flags = self.source.tokens, [], []
        width = self.seq_len + 1
        for row, pieces in enumerate(plan.rows):
            out, mask, at, ended = buffers.tokens[row], buffers.mask[row], 0, True
            mask[:] = 1
            for shard, first, count, starts_document, ends_document in pieces:
                out[at:at + count] = tokens[shard][first:first + count]
                if at and not (ended and starts_document):
                    mask[at - 1] = 0
                ended = ends_document
                if at < self.seq_len:
                    starts.append(row * self.seq_len + at)
                    flags.append(starts_document)
                at += count
            if at < width:  # padding: targets from position at - 1 on are not real
                out[at:] = self.pad_id
                mask[max(at - 1, 0):] = 0
                if at < self.seq_len:
                    starts.append(row * self.seq_len + at)
                    flags.append(False)
        count = write_boundaries(np.array(starts, dtype=np.int64), buffers, self.seq_len)
        return Filled(count, np.array(flags, dtype=bool))

    def segments(self, positions: np.ndarray) -> list[RowPieces]:
        return [RowPieces(self.source.global_documents(row.documents), row.starts, row.take,
                            row.ends_document)
                for _, row in self.plan.rows(positions.reshape(-1))]

    def row_costs(self, positions: np.ndarray, model: RowCostModel, seq_len: int
                  ) -> np.ndarray:
        """From the packed blocks' rows, a block's costs computed once."""
        return self.plan.row_costs(positions.reshape(-1), model, seq_len)


@dataclass(frozen=True)
class BestFitKnobs(ModeKnobs):
    """bestfit's knobs: the documents a block packs at least, the packing, and split
    packing's rule for a document longer than a row ("auto": decided by the data)."""

    block_documents: int = knob(4096, "bestfit: documents per packing block (at least)")
    packing: str = knob(PACKING_BY_DATA, "bestfit: fill (every token, full rows), split "
                        "(every token, documents whole where they fit, padded), crop "
                        "(nanochat's) or auto (split for chat data, fill for text)",
                        (*PACKINGS, PACKING_BY_DATA))
    overlong: str = knob(PACKING_BY_DATA, "bestfit, split packing, a document longer than "
                         "a row: split (pieces overlapping by one token: every target "
                         "once), cut (pieces edge to edge), truncate (its first row), drop; "
                         "auto: split for chat data, cut for text",
                         (*OVERLONGS, PACKING_BY_DATA))
    block_order: str = knob(SHUFFLED_ROWS, "bestfit: the order of a packing block's rows: "
                            "shuffled, or by_cost (needs a balance: up and down by turns, "
                            "so a step's rows cost about the same, for one row a rank at "
                            "long context; a block of more documents groups more steps)",
                            BLOCK_ORDERS)

    def __post_init__(self) -> None:
        if self.block_order not in BLOCK_ORDERS:
            raise ConfigError(f"block_order: {self.block_order!r} not among "
                              f"{list(BLOCK_ORDERS)}")
        for name, allowed in (("packing", PACKINGS), ("overlong", OVERLONGS)):
            if getattr(self, name) not in (*allowed, PACKING_BY_DATA):
                raise ConfigError(f"{name}: {getattr(self, name)!r} not among "
                                  f"{[*allowed, PACKING_BY_DATA]}")
        if self.overlong not in ("cut", PACKING_BY_DATA) and self.packing not in (
                "split", PACKING_BY_DATA):
            raise ConfigError(f"overlong={self.overlong!r} is a rule of split packing (a "
                              f"document longer than a row), not of {self.packing!r}")
        if self.block_documents < 1:
            raise ConfigError(f"block_documents: {self.block_documents} must be >= 1")

    def for_data(self, chat: bool) -> BestFitKnobs:
        """"auto" resolved: for chat data packing "split" (a conversation that fits a row is
        never cut) and overlong "split" (a longer one in overlapping pieces: no trained
        token lost); for text "fill" and "cut"."""
        packing = packing_for_data(self.packing, chat)
        overlong = self.overlong if self.overlong != PACKING_BY_DATA else (
            "split" if chat and packing == "split" else "cut")
        if overlong != "cut" and packing != "split":
            raise ConfigError(f"overlong={overlong!r} is a rule of split packing, not of "
                              f"{packing!r} (chat data packs with split unless told)")
        return replace(self, packing=packing, overlong=overlong)


class BestFitMode(LoaderMode):
    name = "bestfit"
    packed = True
    continues_plans = True
    excludes = True
    continues_lanes = True
    Knobs = BestFitKnobs

    def knobs(self, spec: Any) -> dict[str, Any]:
        return {"block_documents": spec.knobs.block_documents, "packing": spec.packing,
                "pieces": PIECES_RULE, "overlong": spec.resolved_overlong,
                "block_order": spec.knobs.block_order}

    def check_spec(self, spec: Any) -> None:
        if spec.knobs.block_order == BY_COST and spec.balance == NO_BALANCE:
            raise ConfigError("block_order='by_cost' orders rows by a cost model: give "
                              "balance (e.g. 'attention')")

    def plan(self, spec: Any, inputs: PlanInputs, epoch: int, first_document: int = 0,
             order: DocumentOrder | None = None, ranges: np.ndarray | None = None
             ) -> BestFitPlan:
        dataset = inputs.dataset
        row_cost = (cost_model(spec.balance, spec.balance_hidden)
                    if spec.knobs.block_order == BY_COST else None)
        return BestFitPlan(inputs.lengths(), spec.seq_len, spec.seed, epoch,
                           spec.knobs.block_documents, spec.packing, inputs.groups,
                           inputs.memo, separator_of(dataset.bos_id, dataset.eos_id),
                           spec.resolved_overlong, first_document, inputs.excluded,
                           inputs.excluded_key, order, row_cost, ranges)

    def continue_plan(self, spec: Any, inputs: PlanInputs, epoch: int, before: Any,
                      position: int) -> ContinuedPlan | LanedBestFitPlan:
        """The rest of `before` from `position` at spec.seq_len without the documents
        `inputs` excludes: the partly served block's unserved pieces packed again, then the
        later documents in new blocks, in before's order (with the documents that joined
        the epoch, where `inputs` holds more: shuffled in among them, or under a windowed
        shuffle in windows after before's). Under several lanes, each lane continues on
        its own (a `LanedBestFitPlan`), the joined windows shared out between them."""
        remainders = [remainder.without(inputs.excluded)
                      for remainder in before.lane_remainders(position)]
        base = before.document_order
        count = len(inputs.lengths())
        first = remainders[0].first(len(base))
        order = continued_order(base, first, count, spec.seed, epoch, inputs.groups)
        lanes = len(remainders)
        if lanes == 1:
            ranges = continued_runs(remainders[0].ranges, first, base, order, 0, 1)
            return ContinuedPlan(remainders[0], self.plan(spec, inputs, epoch, order=order,
                                                          ranges=ranges))
        one_lane = replace(inputs, groups=replace(inputs.groups, lanes=1))
        return LanedBestFitPlan(nearby=before.lanes.nearby,
                                ranks_per_lane=before.lanes.ranks_per_lane, plans=[
            ContinuedPlan(remainder, self.plan(
                spec, one_lane, epoch, order=order,
                ranges=continued_runs(remainder.ranges, remainder.first(len(base)), base,
                                      order, lane, lanes)))
            for lane, remainder in enumerate(remainders)])

    def filler(self, source: Any, plan: Any, seq_len: int, pad_id: int = 0,
               boundaries: bool = True) -> BestFitFiller:
        return BestFitFiller(source, plan, seq_len, pad_id, boundaries)

    def prepares_next_epoch(self, spec: Any) -> bool:
        return spec.packing == "fill"  # its plan is one pass over the lengths: do it early

    def waste_hint(self, waste: str, packing: str | None) -> str:
        if waste == "padding":
            if packing not in ("fill", "concat"):
                return "packing 'fill' fills every row with pieces of documents"
            return super().waste_hint(waste, packing)
        if packing == "crop":
            return "packing 'fill' trains every token and pads under 1% of the positions"
        if packing == "split":  # cropped or dropped under split: overlong truncate or drop
            return ("overlong 'split' trains every token of a document longer than a row, "
                    "in pieces that overlap by one token")
        return super().waste_hint(waste, packing)


BESTFIT = register(BestFitMode())
