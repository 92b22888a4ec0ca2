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
  44.5% (bimodal), 44% against 64% (long-tailed, T = 2048).
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

Every target is true (`separator`, the side of a document that carries the token a reader
sees between documents: "bos" where documents start with BOS, "eos" where they only end
with EOS). A piece that does not start its document begins at its row's start, or right
after an EOS that ends the piece before it; every other piece in a row starts with its BOS
or follows an EOS. So a reader that splits a row at BOS, EOS and the row start sees each
part as a slice of one document, and no separator position is ever spent. This holds
because the side where documents are cut follows the separator: under "bos" a long
document's partial piece is its head (its full rows follow) and `fill` cuts the tail of a
piece into a row, so every piece a row takes whole starts its document and the cut tail, at
most one per row, goes first; under "eos" the partial piece is the tail (after the full
rows) and `fill` cuts a piece's head into a row, so every piece but that head, at most one
per row and placed last, ends its document. (Without BOS or EOS in the data no reader can
see a boundary; the pieces and masks still hold.) `ends_document` says which pieces reach
their document's end: a target that crosses from a piece into the next one is true only
when the first ends its document and the next starts its own (the loader masks the rest).
Every piece is a sequence of its own to the loader (position_ids, cu_seqlens), and it
starts a document when its start is 0. All are pure functions of (ids, lengths, capacity,
separator). Cost: about a microsecond a document (split: one bisect, pop and insort on a
sorted list of open rows per piece, full-row pieces vectorized; fill: one bisect more per
piece it moves; docs/benchmarks.md); memory O(block).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass, replace

import numpy as np

PACKINGS = ("fill", "split", "crop")
# what split packing does with a document longer than a row (docs/packing.md): `cut` into
# row-sized pieces edge to edge (a later piece's first token is no target: text's rule
# from the start), `split` into row-sized pieces that overlap by one token (each later piece
# starts with the token before it as its first input: every target trained once), its first
# row kept and the rest cropped (`truncate`), or the document left out (`drop`)
OVERLONGS = ("cut", "split", "truncate", "drop")
SEPARATORS = ("bos", "eos")


def separator_of(bos_id: int | None, eos_id: int | None) -> str:
    """The side of a document that carries a separator: "bos" when documents start with BOS
    (with or without EOS), "eos" when they only end with EOS; "bos" when they have neither
    (no reader can see a boundary then; the loader's masks and cu_seqlens still hold)."""
    return "eos" if bos_id is None and eos_id is not None else "bos"


@dataclass(frozen=True)
class PackedBlock:
    """Rows as CSR: row r is segments row_offsets[r]:row_offsets[r+1]; segment s is tokens
    [starts[s], starts[s] + take[s]) of document `doc_ids[s]` (starts are 0 under crop);
    `ends_document[s]`: the segment reaches its document's last token."""

    row_offsets: np.ndarray
    doc_ids: np.ndarray
    starts: np.ndarray
    take: np.ndarray
    ends_document: np.ndarray
    used_tokens: int
    cropped_tokens: int
    dropped_tokens: int
    padded_tokens: int = 0
    repeated_tokens: int = 0  # overlong `split`: tokens placed twice (inputs only, again)

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    def row(self, index: int) -> RowPieces:
        """The pieces of row `index`, in row order."""
        first, stop = self.row_offsets[index], self.row_offsets[index + 1]
        return RowPieces(self.doc_ids[first:stop], self.starts[first:stop],
                         self.take[first:stop], self.ends_document[first:stop])


@dataclass(frozen=True)
class RowPieces:
    """What one row holds, the one description every part of raypipe uses: piece i is
    tokens [starts[i], starts[i] + take[i]) of document `documents[i]`, at columns
    [columns[i], columns[i] + take[i]) of the row's tokens; `ends_document[i]` when the
    piece reaches its document's last token; columns past the pieces are padding. The
    documents are numbered as their maker says: a packing plan's rows in the plan's
    numbering, a filler's `segments` in the dataset's (global) one. A batch format stores
    a row's `columns` and flags (raypipe.formats.RecordPieces), not its documents."""

    documents: np.ndarray
    starts: np.ndarray
    take: np.ndarray
    ends_document: np.ndarray

    @property
    def starts_document(self) -> np.ndarray:
        return self.starts == 0

    @property
    def columns(self) -> np.ndarray:
        """Where each piece starts in the row."""
        return np.concatenate([[0], np.cumsum(self.take)[:-1]]).astype(np.int64)

    @property
    def true_joins(self) -> np.ndarray:
        """Per piece after the first: the target that crosses into it is true (the piece
        before ends its document and this one starts its own)."""
        return self.ends_document[:-1] & self.starts_document[1:]

    @property
    def length(self) -> int:
        return int(self.take.sum())


def pack(packing: str, doc_ids: np.ndarray, lengths: np.ndarray, capacity: int,
         separator: str = "bos", overlong: str = "cut") -> PackedBlock:
    """`overlong`: split packing's rule for documents longer than a row (OVERLONGS)."""
    if separator not in SEPARATORS:
        raise ValueError(f"separator {separator!r} not among {list(SEPARATORS)}")
    if overlong not in OVERLONGS or (overlong != "cut" and packing != "split"):
        raise ValueError(f"overlong {overlong!r}: one of {list(OVERLONGS)}, and only 'cut' "
                         f"under {packing!r} packing")
    if packing == "fill":
        return pack_fill(doc_ids, lengths, capacity, separator)
    if packing == "split" and overlong != "cut":
        return pack_overlong(doc_ids, lengths, capacity, separator, overlong)
    if packing == "split":
        return pack_split(doc_ids, lengths, capacity, separator)
    if packing == "crop":
        return pack_crop(doc_ids, lengths, capacity)
    raise ValueError(f"packing {packing!r} not among {list(PACKINGS)}")


def pack_split(doc_ids: np.ndarray, lengths: np.ndarray, capacity: int,
               separator: str = "bos") -> PackedBlock:
    """Split long documents into row-sized pieces, best-fit-decreasing pack the rest."""
    pieces = Pieces.of(lengths, capacity, separator)
    row_of_item = _best_fit_decreasing(pieces.rest[pieces.items].tolist(), capacity)
    return pieces.assemble(doc_ids, pieces.whole_rests(pieces.items), row_of_item)


def pack_overlong(doc_ids: np.ndarray, lengths: np.ndarray, capacity: int,
                  separator: str, overlong: str) -> PackedBlock:
    """Split packing under overlong `split`, `truncate` or `drop` (see OVERLONGS). Under
    `split` a document of L > capacity tokens becomes n = ceil((L - 1) / (capacity - 1))
    pieces that overlap by one token: packed as a document of L + n - 1 tokens cut edge to
    edge (the same rows and places), whose piece k then starts k tokens earlier in the real
    document. Truncated documents never end their document (no target joins them to the
    next piece); cropped and dropped tokens are counted."""
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths > capacity
    if overlong == "split":
        if capacity < 2:
            raise ValueError(f"overlong 'split' needs rows of >= 2 tokens, not {capacity}")
        pieces_of = np.where(over, -(-(lengths - 1) // (capacity - 1)), 1)
        packed = pack_split(doc_ids, lengths + pieces_of - 1, capacity, separator)
        index = index_in_block(packed.doc_ids, doc_ids)
        starts = real_starts(packed.starts, lengths[index], over[index], capacity, separator)
        repeated = int((pieces_of - 1).sum())
        return replace(packed, starts=starts, ends_document=starts + packed.take
                       == lengths[index], used_tokens=packed.used_tokens - repeated,
                       repeated_tokens=repeated)
    kept = np.where(over, capacity if overlong == "truncate" else 0, lengths)
    packed = pack_split(doc_ids, kept, capacity, separator)
    cut = over[index_in_block(packed.doc_ids, doc_ids)]
    lost = int((lengths - kept).sum())
    return replace(packed, ends_document=packed.ends_document & ~cut,
                   cropped_tokens=lost if overlong == "truncate" else 0,
                   dropped_tokens=lost if overlong == "drop" else 0)


def index_in_block(packed_ids: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
    """Each packed segment's document as an index into the block's `doc_ids`."""
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    order = np.argsort(doc_ids, kind="stable")
    return order[np.searchsorted(doc_ids[order], packed_ids)]


def real_starts(starts: np.ndarray, lengths: np.ndarray, over: np.ndarray, capacity: int,
                separator: str) -> np.ndarray:
    """Overlong `split`: each segment's start in its document of L + n - 1 tokens -> in
    the real one of L (`lengths`, `over`: per segment) where piece k starts k tokens
    earlier. Under "bos" the head piece (the rest r) comes first, so the pieces start at
    0, r, r + c, ...; under "eos" at 0, c, 2c, ..."""
    pieces_of = -(-(lengths - 1) // (capacity - 1))
    rest = (lengths + pieces_of - 1) % capacity
    shift = (capacity - rest) % capacity if separator == "bos" else 0
    before = (starts + shift) // capacity  # pieces of the document before this one
    return np.where(over, starts - before, starts).astype(np.int64)


def pack_fill(doc_ids: np.ndarray, lengths: np.ndarray, capacity: int,
              separator: str = "bos") -> PackedBlock:
    """Split packing, then every row filled: exactly ceil(block tokens / capacity) rows.

    After best-fit decreasing, the ceil(rest / capacity) fullest rows are kept and the
    others dissolved into a pool. Each kept row's room, largest room first, takes the
    largest pool piece that fits, while one does; then the last `room` tokens of the
    smallest pool piece ("bos"; its first `room` tokens under "eos": a cut; the rest stays in
    the pool, still the smallest).
    The pool fits the kept rooms (their sum is >= its tokens), so every row is full but
    the rooms left once the pool is empty: less than one row's worth per block.
    Cuts fall where no whole piece fits, mostly on documents already cut, and a gap takes a
    document's end, so a cut costs context only to the few tokens after it."""
    pieces = Pieces.of(lengths, capacity, separator)
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
    pool = pieces.whole_rests(pieces.items[~kept])
    placed = _fill_rooms(capacity - filled[by_fill[:needed]], *(part.tolist() for part in pool),
                         cut_tail=separator == "bos")
    placed_rows, *placed_segments = np.array(placed, dtype=np.int64).reshape(-1, 4).T
    segments = tuple(np.concatenate([kept_part, placed_part]) for kept_part, placed_part in
                     zip(pieces.whole_rests(pieces.items[kept]), placed_segments,
                         strict=True))
    rows = np.concatenate([kept_rank[row_of_item[kept]], placed_rows])
    return pieces.assemble(doc_ids, segments, rows)


def _fill_rooms(rooms: np.ndarray, items: list[int], starts: list[int],
                sizes: list[int], cut_tail: bool = True) -> list[tuple[int, int, int, int]]:
    """Place pool pieces (item, start, size) into rows with `rooms` (row = index); return
    (row, item, start, take) segments. A cut takes the piece's last `room` tokens
    (`cut_tail`) or its first. See pack_fill."""
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
            key = keys[0]  # none fits: `room` tokens of the smallest piece
            size, index = key >> 32, key & mask
            if cut_tail:
                placed.append((row, items[index], starts[index] + size - room, room))
            else:
                placed.append((row, items[index], starts[index], room))
                starts[index] += room
            keys[0] = ((size - room) << 32) | index
            room = 0
        if not keys:
            break
    return placed


def continued_pieces(lengths: np.ndarray, capacity: int) -> int:
    """Pieces that begin a row inside their document when documents longer than a row are
    cut into row-sized pieces (split packing): no target predicts their first token."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(np.maximum(-(-lengths // capacity) - 1, 0).sum())


@dataclass(frozen=True)
class Pieces:
    """A block's documents as row-sized pieces: document i has `full[i]` full rows and a rest
    of `rest[i]` tokens; `items` lists the documents with a rest, largest rest first (ties
    in the block's order). Under separator "bos" the rest is the document's head and the
    full rows follow it (a piece that is not the head then fills a row alone, at its start);
    under "eos" the full rows come first and the rest is the tail."""

    full: np.ndarray
    rest: np.ndarray
    items: np.ndarray
    capacity: int
    separator: str

    @classmethod
    def of(cls, lengths: np.ndarray, capacity: int, separator: str = "bos") -> Pieces:
        lengths = np.asarray(lengths, dtype=np.int64)
        full = lengths // capacity
        rest = lengths - full * capacity
        items = np.flatnonzero(rest > 0)
        return cls(full, rest, items[np.lexsort((items, -rest[items]))], capacity, separator)

    @property
    def lengths(self) -> np.ndarray:
        return self.full * self.capacity + self.rest

    def rest_starts(self, items: np.ndarray) -> np.ndarray:
        if self.separator == "bos":
            return np.zeros(len(items), dtype=np.int64)
        return self.full[items] * self.capacity

    def whole_rests(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Segments (document index, start, take) of these documents' whole rests."""
        return items, self.rest_starts(items), self.rest[items]

    def assemble(self, doc_ids: np.ndarray,
                 segments: tuple[np.ndarray, np.ndarray, np.ndarray],
                 row_of_segment: np.ndarray) -> PackedBlock:
        """The block: first the full rows (one piece each), then the rows of `segments`
        ((document index, start, take), rows numbered from 0), each row in separator order
        (`row_order`)."""
        capacity = self.capacity
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        full_docs = np.repeat(np.arange(len(self.full)), self.full)
        piece_index = np.arange(full_docs.size) - np.repeat(np.cumsum(self.full) - self.full,
                                                            self.full)
        full_starts = piece_index * capacity
        if self.separator == "bos":
            full_starts = full_starts + self.rest[full_docs]
        items, starts, take = segments
        lengths = self.lengths
        ends = starts + take == lengths[items]
        order = np.lexsort((*row_order(starts == 0, ends, self.separator), row_of_segment))
        items, starts, take, ends = items[order], starts[order], take[order], ends[order]
        open_rows = int(row_of_segment.max()) + 1 if row_of_segment.size else 0
        counts = np.bincount(row_of_segment, minlength=open_rows)
        row_offsets = np.concatenate([np.arange(full_docs.size + 1),
                                      full_docs.size + np.cumsum(counts)]).astype(np.int64)
        total = int(lengths.sum())
        rows = full_docs.size + open_rows
        return PackedBlock(row_offsets, doc_ids[np.concatenate([full_docs, items])],
                           np.concatenate([full_starts, starts]).astype(np.int64),
                           np.concatenate([np.full(full_docs.size, capacity, np.int64),
                                           take]).astype(np.int64),
                           np.concatenate([full_starts + capacity == lengths[full_docs], ends]),
                           total, 0, 0, rows * capacity - total)


def row_order(starts_document: np.ndarray, ends_document: np.ndarray,
              separator: str) -> tuple[np.ndarray, np.ndarray]:
    """np.lexsort keys (last is primary) that order one row's pieces: under "bos" the piece
    that does not start its document first, then whole documents, then heads; under "eos"
    tails first, then whole documents, then the piece that does not end its document."""
    starts, stops_short = starts_document.astype(np.int8), (~ends_document).astype(np.int8)
    if separator == "bos":
        return stops_short, starts
    return starts, stops_short


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


def pack_crop(doc_ids: np.ndarray, lengths: np.ndarray, capacity: int) -> PackedBlock:
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
    take = np.array(out_take, dtype=np.int64)
    length_of = dict(zip(doc_ids.tolist(), np.asarray(lengths).tolist(), strict=True))
    whole = np.array([length_of[doc] for doc in out_ids], dtype=np.int64) == take
    return PackedBlock(np.array(offsets, dtype=np.int64), np.array(out_ids, dtype=np.int64),
                       np.zeros(len(out_ids), dtype=np.int64), take, whole.astype(bool),
                       rows * capacity, cropped, dropped)
