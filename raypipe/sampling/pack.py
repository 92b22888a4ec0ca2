"""Packing documents into rows of `capacity` tokens, from document lengths alone.

Three packings of one block of documents (given in their shuffled order):

- `fill` (the default): `split`, then every row filled. A block of S tokens becomes exactly
  ceil(S / capacity) rows: all full but the rooms left at the end, less than one row's worth
  per block (< 0.4% of the positions at >= 256 rows per block). Whatever best fit cannot
  fill with whole documents takes the end of a document from the emptiest rows, whose head
  stays whole for a later row. Every token is in exactly one row, once.
  Why the default: pretraining pays for every position of every row, and a padded position
  is GPU time that trains nothing (a third of it on a corpus whose lengths sit between T/2
  and T, under `split`). Concatenation (Megatron, nanoGPT) pads nothing too, but cuts a
  document at every row boundary; `fill` cuts only where no whole document fits, and its
  rows also follow from token sums alone (the epoch plan packs no block to count them).
  Measured (bench/packing_bench.py, docs/packing.md) at T = 512, 2048 and 8192: padding
  <= 0.03% of the positions on long-tailed, narrow, bimodal and uniform corpora (split:
  up to 33%); documents cut 32.5% against concatenation's 67.5% (narrow), 5.7% against
  44.5% (bimodal), 44% against 65% (long-tailed, T = 2048).
- `split` (for whole documents): a document longer than a row is cut into row-sized pieces
  (the last one shorter); every piece and short document is then placed by best-fit
  decreasing (largest first, into the open row with the least room that holds it, else a
  new row). Nothing is cropped or dropped; whatever a row cannot fill is padding (counted;
  the loader masks it). After Ding et al. 2024, "Fewer Truncations Improve Language
  Modeling".
- `crop` (opt-in, nanochat-compatible): every row is exactly `capacity` tokens and starts at
  a document's start (with BOS-prefixed documents, with BOS); row by row the largest
  remaining document that fits goes in first, and when none fits the shortest remaining
  one is cropped to fill the row (its tail is not used this epoch). A block's last row, if
  it cannot be filled, is dropped. Used + cropped + dropped tokens = the block's tokens.

Within a row of `fill` or `split`, a piece that ends a cut document comes first, then whole
documents, then pieces that stop before their document's end; every piece is a sequence of
its own to the loader (position_ids, cu_seqlens), and it starts a document when its start
is 0. All are pure functions of (ids, lengths, capacity). Cost, measured on 2 cores per
document: split ~0.3-0.7 us (one bisect, pop and insort on a sorted list of open rows per
piece, full-row pieces vectorized), fill ~0.6-1.7 us (split, plus one bisect per piece it
moves), crop ~1.4 us; memory O(block).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass

import numpy as np

PACKINGS = ("fill", "split", "crop")


@dataclass(frozen=True)
class PackedBlock:
    """Rows as CSR: row r is segments row_offsets[r]:row_offsets[r+1]; segment s is tokens
    [starts[s], starts[s] + take[s]) of document `doc_ids[s]` (starts are 0 under crop)."""

    row_offsets: np.ndarray
    doc_ids: np.ndarray
    starts: np.ndarray
    take: np.ndarray
    used_tokens: int
    cropped_tokens: int
    dropped_tokens: int
    padded_tokens: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document ids, start in each document, tokens taken) of row `index`."""
        first, stop = self.row_offsets[index], self.row_offsets[index + 1]
        return self.doc_ids[first:stop], self.starts[first:stop], self.take[first:stop]


def pack(packing: str, doc_ids: np.ndarray, lengths: np.ndarray, capacity: int) -> PackedBlock:
    if packing == "fill":
        return pack_fill(doc_ids, lengths, capacity)
    if packing == "split":
        return pack_split(doc_ids, lengths, capacity)
    if packing == "crop":
        return pack_block(doc_ids, lengths, capacity)
    raise ValueError(f"packing {packing!r} not among {list(PACKINGS)}")


def pack_split(doc_ids: np.ndarray, lengths: np.ndarray, capacity: int) -> PackedBlock:
    """Split long documents into row-sized pieces, best-fit-decreasing pack the rest."""
    pieces = Pieces.of(lengths, capacity)
    row_of_item = _best_fit_decreasing(pieces.rest[pieces.items].tolist(), capacity)
    return pieces.assemble(doc_ids, pieces.whole_rests(pieces.items, capacity), row_of_item,
                           capacity)


def pack_fill(doc_ids: np.ndarray, lengths: np.ndarray, capacity: int) -> PackedBlock:
    """Split packing, then every row filled: exactly ceil(block tokens / capacity) rows.

    After best-fit decreasing, the ceil(rest / capacity) fullest rows are kept and the
    others dissolved into a pool. Each kept row's room, largest room first, takes the
    largest pool piece that fits, while one does; then the last `room` tokens of the
    smallest pool piece (a cut: the piece's head stays in the pool, still the smallest).
    The pool fits the kept rooms (their sum is >= its tokens), so every row is full but
    the rooms left once the pool is empty: less than one row's worth per block.
    Cuts fall where no whole piece fits, mostly on documents already cut, and a gap takes a
    document's end, so a cut costs context only to the few tokens after it."""
    pieces = Pieces.of(lengths, capacity)
    sizes = pieces.rest[pieces.items]
    row_of_item = _best_fit_decreasing(sizes.tolist(), capacity)
    open_rows = int(row_of_item.max()) + 1 if row_of_item.size else 0
    filled = np.bincount(row_of_item, weights=sizes, minlength=open_rows).astype(np.int64)
    needed = -(-int(sizes.sum()) // capacity)
    by_fill = np.lexsort((np.arange(open_rows), -filled))  # fullest first, then row number
    kept_rank = np.empty(open_rows, dtype=np.int64)
    kept_rank[by_fill] = np.arange(open_rows)
    kept = kept_rank[row_of_item] < needed
    # kept rows are renumbered by fill rank; the pool's pieces go into their rooms
    pool = pieces.whole_rests(pieces.items[~kept], capacity)
    placed = _fill_rooms(capacity - filled[by_fill[:needed]], *(part.tolist() for part in pool))
    placed_rows, *placed_segments = np.array(placed, dtype=np.int64).reshape(-1, 4).T
    segments = tuple(np.concatenate([kept_part, placed_part]) for kept_part, placed_part in
                     zip(pieces.whole_rests(pieces.items[kept], capacity), placed_segments,
                         strict=True))
    rows = np.concatenate([kept_rank[row_of_item[kept]], placed_rows])
    return pieces.assemble(doc_ids, segments, rows, capacity)


def _fill_rooms(rooms: np.ndarray, items: list[int], starts: list[int],
                sizes: list[int]) -> list[tuple[int, int, int, int]]:
    """Place pool pieces (item, start, size) into rows with `rooms` (row = index); return
    (row, item, start, take) segments. See pack_fill."""
    mask = (1 << 32) - 1
    keys = sorted((size << 32) | index for index, size in enumerate(sizes))
    placed: list[tuple[int, int, int, int]] = []
    order = np.lexsort((np.arange(rooms.size), -rooms)).tolist()
    for row in order:
        room = int(rooms[row])
        while room and keys:
            at = bisect_right(keys, (room << 32) | mask) - 1
            if at >= 0:  # the largest piece that fits, whole
                key = keys.pop(at)
                size, index = key >> 32, key & mask
                placed.append((row, items[index], starts[index], size))
                room -= size
                continue
            key = keys[0]  # none fits: the smallest piece's last `room` tokens
            size, index = key >> 32, key & mask
            placed.append((row, items[index], starts[index] + size - room, room))
            keys[0] = ((size - room) << 32) | index
            room = 0
        if not keys:
            break
    return placed


@dataclass(frozen=True)
class Pieces:
    """A block's documents as row-sized pieces: document i has `full[i]` full rows
    (tokens [k * capacity, (k + 1) * capacity)) and a rest of `rest[i]` tokens starting at
    full[i] * capacity; `items` lists the documents with a rest, largest rest first (ties
    in the block's order)."""

    full: np.ndarray
    rest: np.ndarray
    items: np.ndarray

    @classmethod
    def of(cls, lengths: np.ndarray, capacity: int) -> Pieces:
        lengths = np.asarray(lengths, dtype=np.int64)
        full = lengths // capacity
        rest = lengths - full * capacity
        items = np.flatnonzero(rest > 0)
        return cls(full, rest, items[np.lexsort((items, -rest[items]))])

    def whole_rests(self, items: np.ndarray, capacity: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Segments (document index, start, take) of these documents' whole rests."""
        return items, self.full[items] * capacity, self.rest[items]

    def assemble(self, doc_ids: np.ndarray,
                 segments: tuple[np.ndarray, np.ndarray, np.ndarray],
                 row_of_segment: np.ndarray, capacity: int) -> PackedBlock:
        """The block: first the full rows (one piece each), then the rows of `segments`
        ((document index, start, take), rows numbered from 0). Within a row, a piece that
        ends its document but does not start it comes first, then whole documents, then
        pieces that do not reach their document's end, so a reader that finds sequences by
        BOS or EOS sees as many of them as the row allows."""
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        full_docs = np.repeat(np.arange(len(self.full)), self.full)
        piece_index = np.arange(full_docs.size) - np.repeat(np.cumsum(self.full) - self.full,
                                                            self.full)
        items, starts, take = segments
        ends_document = starts + take == self.full[items] * capacity + self.rest[items]
        kind = np.where(starts > 0, np.where(ends_document, 0, 2), np.where(ends_document, 1, 2))
        order = np.lexsort((kind, row_of_segment))
        items, starts, take = items[order], starts[order], take[order]
        open_rows = int(row_of_segment.max()) + 1 if row_of_segment.size else 0
        counts = np.bincount(row_of_segment, minlength=open_rows)
        row_offsets = np.concatenate([np.arange(full_docs.size + 1),
                                      full_docs.size + np.cumsum(counts)]).astype(np.int64)
        total = int((self.full * capacity + self.rest).sum())
        rows = full_docs.size + open_rows
        return PackedBlock(row_offsets, doc_ids[np.concatenate([full_docs, items])],
                           np.concatenate([piece_index * capacity, starts]).astype(np.int64),
                           np.concatenate([np.full(full_docs.size, capacity, np.int64),
                                           take]).astype(np.int64),
                           total, 0, 0, rows * capacity - total)


def _best_fit_decreasing(sizes: list[int], capacity: int) -> np.ndarray:
    """Row of each item (sizes in decreasing order): the open row with the least room that
    holds it (the lowest row number among equals), else a new row. Open rows live in one
    sorted list of keys room << 32 | row; a full row leaves the list. Items larger than half
    a row each open a row of their own (every open row already holds one such item, so none
    has room for another): that prefix is placed without the loop."""
    big = 0
    while big < len(sizes) and 2 * sizes[big] > capacity:
        big += 1
    rooms = capacity - np.array(sizes[:big], dtype=np.int64)
    open_rows = np.flatnonzero(rooms > 0)
    keys = np.sort((rooms[open_rows] << 32) | open_rows).tolist()
    rows = list(range(big))
    mask = (1 << 32) - 1
    append, pop = rows.append, keys.pop
    opened = big
    for size in sizes[big:]:
        at = bisect_left(keys, size << 32)
        if at == len(keys):
            row, room = opened, capacity - size
            opened += 1
        else:
            key = pop(at)
            row, room = key & mask, (key >> 32) - size
        append(row)
        if room:
            insort(keys, (room << 32) | row)
    return np.array(rows, dtype=np.int64)


def pack_block(doc_ids: np.ndarray, lengths: np.ndarray, capacity: int) -> PackedBlock:
    """Crop packing of documents (given in their shuffled order) into rows of `capacity`
    tokens."""
    order = np.lexsort((np.arange(len(lengths)), lengths))  # by length, then shuffled order
    remaining_lengths: list[int] = lengths[order].tolist()
    remaining_ids: list[int] = doc_ids[order].tolist()
    offsets, out_ids, out_take = [0], [], []
    cropped = dropped = 0
    while remaining_lengths:
        room = capacity
        row_start = len(out_ids)
        while room > 0 and remaining_lengths:
            index = bisect_right(remaining_lengths, room) - 1
            if index >= 0:
                length = remaining_lengths.pop(index)
                out_ids.append(remaining_ids.pop(index))
                out_take.append(length)
                room -= length
            else:
                length = remaining_lengths.pop(0)
                out_ids.append(remaining_ids.pop(0))
                out_take.append(room)
                cropped += length - room
                room = 0
        if room > 0:  # ran out of documents: the partial last row is dropped
            dropped += sum(out_take[row_start:])
            del out_ids[row_start:], out_take[row_start:]
        else:
            offsets.append(len(out_ids))
    rows = len(offsets) - 1
    return PackedBlock(np.array(offsets, dtype=np.int64), np.array(out_ids, dtype=np.int64),
                       np.zeros(len(out_ids), dtype=np.int64), np.array(out_take, dtype=np.int64),
                       rows * capacity, cropped, dropped)
