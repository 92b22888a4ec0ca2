"""`bestfit` (the default): documents packed into rows, every target true.

Invariant: documents in Feistel order are cut into blocks of K; each block is packed
(raypipe.sampling.pack: `fill`, the default, fills every row and keeps every token;
`split` keeps documents whole where they fit and pads; `crop` is nanochat's); blocks are
visited in order and the rows of block j in a Feistel order salted by j. Row counts per
block are computed once per epoch: for `fill`, ceil(block tokens / (T + 1)) from one
vectorized pass over the lengths in storage order (each document's block from the
inverse permutation; no block packed; ~70 ns a document / threads, and the loader keeps
the sums once per node: docs/scale.md); for the others by packing every block (O(N) in
Python). A block's rows are packed on demand; the last 8 packed stay cached. A row's pieces
are sequences of their own (position_ids restart, cu_seqlens); the target that crosses into
a piece is masked unless the piece before ends its document and this one starts its own, so
no target with mask 1 joins two documents falsely (the packing's cut rule puts a separator
a reader sees at every other join: raypipe.sampling.pack). Cost: see
bench/packing_bench.py for planner documents per second, then O(1) per row; ~70 us to fill
a batch of 8 x 2049 (bench/loader_bench.py).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from raypipe.errors import ConfigError
from raypipe.formats import PACKING_BY_DATA, packing_for_data
from raypipe.sampling.batches import (
    BatchBuffers,
    BatchPlan,
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
from raypipe.sampling.pack import OVERLONGS, PACKINGS, PackedBlock, RowPieces, pack, separator_of
from raypipe.sampling.permute import FeistelPermutation
from raypipe.sampling.plans import PackingReport, ShardGroups, SumsMemo, document_permutation

MIN_ROWS_PER_BLOCK = 256
SUM_CHUNK_DOCUMENTS = 1 << 18  # documents permuted per numpy call when summing blocks
SUM_THREADS = max(1, min(8, os.cpu_count() or 1))  # threads of the block-sum pass
CACHED_BLOCKS = 8  # packed blocks a plan keeps (a step's rows span a few blocks)
PIECES_RULE = "separated"  # the cut rule of raypipe.sampling.pack since 0.5 (states record it)


class BestFitPlan:
    kind = "bestfit"

    def __init__(self, lengths: np.ndarray | DocumentLengths, seq_len: int, seed: int,
                 epoch: int, block_documents: int = 4096, packing: str = "fill",
                 groups: ShardGroups | None = None, memo: SumsMemo | None = None,
                 separator: str = "bos", overlong: str = "cut"):
        """`memo(key, compute)`: returns compute() or what it returned before for `key`
        (a node-local cache of the block token sums, shared by the node's ranks);
        `separator`: which side of a document carries BOS/EOS (raypipe.sampling.pack)."""
        lengths = DocumentLengths.of(lengths)
        self.memo = memo
        self.lengths = lengths
        self.packing = packing
        self.separator = separator
        self.overlong = overlong
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
        report = PackingReport(int(rows.sum()), used, cropped, padded, dropped,
                               self.lengths.total, repeated_tokens=repeated)
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

    def counted_tokens(self, positions: np.ndarray) -> int:
        """Tokens the report counts for the rows at `positions` (their pieces)."""
        return sum(int(row.take.sum()) for _, row in self.rows(positions))

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

    def describe(self, positions: np.ndarray) -> list[BatchPlan[list[Piece]]]:
        steps, batch = positions.shape
        rows_of = self.plan.rows(positions.reshape(-1))
        pieces = [row for _, row in rows_of]
        shards, firsts, _ = self.source.locate_documents(
            np.concatenate([row.documents for row in pieces]))
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
        return [BatchPlan(positions[i], ids[i], rows[i * batch:(i + 1) * batch])
                for i in range(steps)]

    def token_ranges(self, plan: BatchPlan[list[Piece]]) -> list[list[tuple[int, int, int]]]:
        return [[(piece.shard, piece.first, piece.count) for piece in row]
                for row in plan.rows]

    def shards(self, positions: np.ndarray) -> np.ndarray:
        doc_ids = [row.documents for _, row in self.plan.rows(positions.reshape(-1))]
        return self.source.shards_of_documents(np.concatenate(doc_ids) if doc_ids
                                               else np.empty(0, np.int64))

    def fill(self, plan: BatchPlan[list[Piece]], buffers: BatchBuffers) -> Filled:
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

    def __post_init__(self) -> None:
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
    Knobs = BestFitKnobs
    knobs_before = {
        "packing": ("crop", ("pieces",)),  # before 0.2: crop packing only (no pieces)
        "pieces": ("edges", ()),  # before 0.5: pieces cut edge to edge, another rule
        "overlong": ("cut", ()),  # before 0.6: a document over a row cut edge to edge
    }

    def knobs(self, spec: Any) -> dict[str, Any]:
        return {"block_documents": spec.knobs.block_documents, "packing": spec.packing,
                "pieces": PIECES_RULE, "overlong": spec.resolved_overlong}

    def plan(self, spec: Any, inputs: PlanInputs, epoch: int) -> BestFitPlan:
        dataset = inputs.dataset
        return BestFitPlan(inputs.lengths(), spec.seq_len, spec.seed, epoch,
                           spec.knobs.block_documents, spec.packing, inputs.groups,
                           inputs.memo, separator_of(dataset.bos_id, dataset.eos_id),
                           spec.resolved_overlong)

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
