"""What every loader mode fills batches with: host buffers, global token access, rows.

Invariant: for global positions g (this rank's share of a global step), row i of the output
holds observation g_i of the epoch plan: T + 1 tokens read straight from the shard memmaps
(no shard is ever loaded whole), inputs = row[:-1], targets = row[1:]; `position_ids`
restart at 0 at every sequence start and `cu_seqlens` lists the sequence starts over the
flattened [B, T] inputs (flash-attention varlen style), so attention can stay inside
pieces of documents. `RowPieces` is what a row holds in the dataset's terms (document,
token range, columns), the record `raypipe trace` prints. The modes themselves
(raypipe.sampling.modes) describe and fill (bench/loader_bench.py times them).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from raypipe.dataset import TokenDataset
from raypipe.sampling.pack import RowPieces

RowT = TypeVar("RowT")
SEGMENT_BOUNDS_CACHED = 64  # shards whose document starts span_segments keeps


@dataclass
class BatchBuffers:
    """Views into one flat host buffer: tokens [B, T+1], position_ids [B, T],
    cu_seqlens [B*T + 1], mask [B, T] (documents mode: 1 where the target is real)."""

    tokens: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    mask: np.ndarray

    @staticmethod
    def layout(batch_size: int, seq_len: int) -> list[tuple[str, tuple[int, ...]]]:
        flat = batch_size * seq_len
        return [("tokens", (batch_size, seq_len + 1)), ("position_ids", (batch_size, seq_len)),
                ("cu_seqlens", (flat + 1,)), ("mask", (batch_size, seq_len))]

    @classmethod
    def size(cls, batch_size: int, seq_len: int) -> int:
        return sum(int(np.prod(shape)) for _, shape in cls.layout(batch_size, seq_len))

    @classmethod
    def over(cls, flat: Any, batch_size: int, seq_len: int) -> BatchBuffers:
        """Views of a flat numpy array or torch tensor."""
        views, offset = {}, 0
        for name, shape in cls.layout(batch_size, seq_len):
            count = int(np.prod(shape))
            views[name] = flat[offset:offset + count].reshape(shape)
            offset += count
        return cls(**views)


@dataclass
class Filled:
    """What filling a batch produced: the number of sequences (cu_seqlens[:n + 1] is valid)
    and, per sequence, whether it begins at a document's start (None where unknown)."""

    sequences: int
    starts_document: np.ndarray | None = None


@dataclass
class DescribedRows(Generic[RowT]):
    """What one batch holds, computed ahead: positions, observation ids, and one typed row
    description per row (the mode's own row type)."""

    positions: np.ndarray
    observation_ids: np.ndarray
    rows: list[RowT]
    # the dataset's units of fetch its rows read, where the mode found them while it
    # described the rows (None: ask the filler's `fetch_units`)
    units: np.ndarray | None = None


def segments_in(bounds: np.ndarray, first_document: int, start: int, stop: int
                ) -> RowPieces:
    """The pieces of documents first_document + i (tokens [bounds[i], bounds[i + 1]))
    that the span [start, stop) covers, in the coordinates of `bounds`."""
    first = max(int(np.searchsorted(bounds, start, side="right")) - 1, 0)
    last = min(int(np.searchsorted(bounds, stop, side="left")), bounds.size - 1)
    begins, ends = bounds[first:last], bounds[first + 1:last + 1]
    lows = np.maximum(begins, start)
    highs = np.minimum(ends, stop)
    return RowPieces(np.arange(first, last, dtype=np.int64) + first_document,
                       (lows - begins).astype(np.int64), (highs - lows).astype(np.int64),
                       ends <= stop)


def takes_in(bounds: np.ndarray, starts: np.ndarray, stops: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """`segments_in` for many spans [starts[i], stops[i]) at once, token counts only:
    (pieces per span, every piece's token count, span by span)."""
    first = np.maximum(np.searchsorted(bounds, starts, side="right") - 1, 0)
    last = np.minimum(np.searchsorted(bounds, stops, side="left"), bounds.size - 1)
    counts = np.maximum(last - first, 0)
    ends = np.cumsum(counts)
    documents = np.repeat(first - (ends - counts), counts) + np.arange(ends[-1] if ends.size
                                                                       else 0)
    take = (np.minimum(bounds[documents + 1], np.repeat(stops, counts))
            - np.maximum(bounds[documents], np.repeat(starts, counts)))
    return counts, take.astype(np.int64)


def joined(parts: list[RowPieces]) -> RowPieces:
    """One row's segments from consecutive parts."""
    if len(parts) == 1:
        return parts[0]
    return RowPieces(*(np.concatenate([getattr(part, name) for part in parts])
                         for name in ("documents", "starts", "take", "ends_document")))


def shard_array(dataset: TokenDataset, shard: int, attribute: str) -> np.ndarray:
    """One array of a shard's reader as a plain ndarray view (slicing a np.memmap subclass
    costs ~1 us more per slice); tokens read a block at a time (raypipe.io.ranged) or
    checked as they are read (raypipe.io.checksums) come as they are, sliced the same way
    (never copied whole: that would read, and check, every token)."""
    array = getattr(dataset.reader(shard), attribute)
    if not isinstance(array, np.ndarray):
        return array  # type: ignore[return-value]
    return np.asarray(array).view(np.ndarray)


class ShardArrays:
    """`arrays[shard]`: a shard opens through the dataset on first use (on object storage,
    fetched into the cache first); its array is then kept until the dataset closes any
    shard, which drops them all (so no closed shard stays mapped). Cost of an access: one
    method call and one dict lookup."""

    def __init__(self, dataset: TokenDataset, attribute: str):
        self.dataset, self.attribute = dataset, attribute
        self.views: dict[int, np.ndarray] = {}
        self.seen_closes = 0

    def __getitem__(self, shard: int) -> np.ndarray:
        if self.seen_closes != self.dataset.closes:
            self.views.clear()
            self.seen_closes = self.dataset.closes
        view = self.views.get(shard)
        if view is None:
            view = self.views[shard] = shard_array(self.dataset, shard, self.attribute)
        return view


class TokenSource:
    """Global token and document access over a dataset's shard memmaps."""

    def __init__(self, dataset: TokenDataset, document_ids: np.ndarray | None = None):
        """`document_ids`: the global ids of a split's documents (plans then number
        documents within the split); None: every document."""
        self.dataset = dataset
        self.document_ids = document_ids
        # the stream windows are cut from: the global one unless a split restricts it to
        # its documents back to back (`restrict_stream`)
        self.stream_starts: np.ndarray | None = None
        self.stream_offsets: np.ndarray | None = None
        self.token_offsets = np.concatenate([[0], np.cumsum(dataset.shard_token_counts)])
        self.document_offsets = np.concatenate([[0], np.cumsum(dataset.shard_document_counts)])
        # shards open on first use (a map each, no file descriptor held)
        self.tokens = ShardArrays(dataset, "tokens")
        self._bounds: OrderedDict[int, np.ndarray] = OrderedDict()

    def shards_of_tokens(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The shards that stream spans [start, start + length) start and end in."""
        first = np.searchsorted(self.token_offsets, self.to_global(starts), side="right") - 1
        last = np.searchsorted(self.token_offsets, self.to_global(starts + length - 1),
                               side="right") - 1
        return np.unique(np.concatenate([first, last]))

    def global_documents(self, doc_ids: np.ndarray) -> np.ndarray:
        """A plan's document ids -> global ids (-1, an empty observation, stays -1)."""
        if self.document_ids is None:
            return doc_ids
        return np.where(doc_ids >= 0, self.document_ids[np.maximum(doc_ids, 0)], -1)

    def units_of_documents(self, doc_ids: np.ndarray) -> np.ndarray:
        """The dataset's units of fetch (shards, or blocks) that hold these documents."""
        return np.unique(self.unit_of_each(doc_ids))

    def unit_of_each(self, doc_ids: np.ndarray) -> np.ndarray:
        """The unit of fetch of each document (-1, an empty observation, left out)."""
        ids = self.global_documents(doc_ids)
        return self.dataset.unit_of_each(ids[ids >= 0])

    def units_by_step(self, doc_ids: np.ndarray, per_step: list[int]) -> list[np.ndarray]:
        """The units of fetch of each step's documents (`per_step`: how many of
        `doc_ids`, in order, each step reads)."""
        units = self.unit_of_each(doc_ids)
        bounds = np.concatenate([[0], np.cumsum(per_step)]).astype(np.int64)
        return [np.unique(units[bounds[i]:bounds[i + 1]]) for i in range(len(per_step))]

    def restrict_stream(self, document_starts: np.ndarray, lengths: np.ndarray) -> None:
        """Windows over a split: the stream becomes the concatenation of the split's
        documents (their global first tokens and lengths); offsets then count in it."""
        self.stream_starts = document_starts.astype(np.int64)
        self.stream_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def to_global(self, offsets: np.ndarray) -> np.ndarray:
        """Stream offsets -> global token offsets (the identity without a split)."""
        if self.stream_offsets is None:
            return offsets
        document = np.searchsorted(self.stream_offsets, offsets, side="right") - 1
        return self.stream_starts[document] + offsets - self.stream_offsets[document]

    def copy_windows(self, starts: list[int], out: np.ndarray) -> None:
        """out[i] = stream tokens [starts[i], starts[i] + out.shape[1]): one shard lookup
        for all rows, then a slice copy per row (a row crossing shards, or a split's stream,
        goes the long way): ~3 us a row of 2049 tokens."""
        if self.stream_offsets is not None:
            for row, start in enumerate(starts):
                self.copy_split_span(start, out[row])
            return
        width = out.shape[1]
        shards = self.token_offsets.searchsorted(starts, side="right") - 1
        firsts = np.asarray(starts, dtype=np.int64) - self.token_offsets[shards]
        for row, (shard, first) in enumerate(zip(shards.tolist(), firsts.tolist(), strict=True)):
            tokens = self.tokens[shard]
            if first + width <= tokens.size:
                out[row] = tokens[first:first + width]
            else:
                self.copy_global(starts[row], out[row])

    def copy_split_span(self, start: int, out: np.ndarray) -> None:
        """out[:] = tokens [start, start + len(out)) of the split's documents back to back."""
        assert self.stream_offsets is not None and self.stream_starts is not None
        filled = 0
        document = int(np.searchsorted(self.stream_offsets, start, side="right")) - 1
        while filled < out.size:
            local = start + filled - int(self.stream_offsets[document])
            count = min(out.size - filled,
                        int(self.stream_offsets[document + 1] - self.stream_offsets[document])
                        - local)
            self.copy_global(int(self.stream_starts[document]) + local,
                             out[filled:filled + count])
            filled += count
            document += 1

    def copy_global(self, start: int, out: np.ndarray) -> None:
        """out[:] = global tokens [start, start + len(out)), crossing shards as needed."""
        shard = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
        local = start - int(self.token_offsets[shard])
        tokens = self.tokens[shard]
        if local + out.size <= tokens.size:
            out[:] = tokens[local:local + out.size]
            return
        filled = 0
        while filled < out.size:
            tokens = self.tokens[shard]
            count = min(out.size - filled, tokens.size - local)
            out[filled:filled + count] = tokens[local:local + count]
            filled += count
            shard, local = shard + 1, 0

    def span_segments(self, start: int, width: int) -> RowPieces:
        """The documents stream span [start, start + width) holds (a split's stream, or
        the global one), from document lengths alone (index files: no token read)."""
        stop = start + width
        if self.stream_offsets is not None:
            assert self.document_ids is not None
            local = segments_in(self.stream_offsets, 0, start, stop)
            return RowPieces(self.document_ids[local.documents], local.starts, local.take,
                               local.ends_document)
        parts = []
        shard = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
        while shard < len(self.token_offsets) - 1 and self.token_offsets[shard] < stop:
            parts.append(segments_in(self._document_bounds(shard),
                                     int(self.document_offsets[shard]), start, stop))
            shard += 1
        return joined(parts)

    def span_takes(self, starts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """What `span_segments` says of each span [start, start + width), its pieces'
        token counts only, for all spans at once: (row_offsets, take) in CSR form (span i
        is pieces row_offsets[i]:[i + 1]), a shard's document starts read once for all."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        stops = starts + width
        if self.stream_offsets is not None:
            counts, take = takes_in(self.stream_offsets, starts, stops)
            return np.concatenate([[0], np.cumsum(counts)]), take
        first = self.token_offsets.searchsorted(starts, side="right") - 1
        last = self.token_offsets.searchsorted(stops - 1, side="right") - 1
        spans, takes = [], []
        for shard in range(int(first.min(initial=0)), int(last.max(initial=-1)) + 1):
            inside = np.flatnonzero((first <= shard) & (last >= shard))
            if not inside.size:
                continue
            low, high = self.token_offsets[shard], self.token_offsets[shard + 1]
            counts, take = takes_in(self._document_bounds(shard),
                                    np.maximum(starts[inside], low),
                                    np.minimum(stops[inside], high))
            spans.append(np.repeat(inside, counts))
            takes.append(take)
        span = np.concatenate(spans) if spans else np.empty(0, np.int64)
        order = np.argsort(span, kind="stable")  # a span's pieces in shard order
        counts = np.bincount(span, minlength=starts.size)
        take = np.concatenate(takes)[order] if takes else np.empty(0, np.int64)
        return np.concatenate([[0], np.cumsum(counts)]), take

    def _document_bounds(self, shard: int) -> np.ndarray:
        """Global token offsets of a shard's documents' starts (+ its end), from its index;
        the last SEGMENT_BOUNDS_CACHED shards asked for are kept."""
        bounds = self._bounds.get(shard)
        if bounds is None:
            lengths = self.dataset.shard_document_lengths(shard)
            bounds = np.concatenate([[0], np.cumsum(lengths)]) + self.token_offsets[shard]
            self._bounds[shard] = bounds
            if len(self._bounds) > SEGMENT_BOUNDS_CACHED:
                self._bounds.popitem(last=False)
        return bounds

    def locate_documents(self, doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first token, token count) of each document of a plan (an empty
        observation, id -1, is 0 tokens)."""
        return self.locate_global(self.global_documents(doc_ids))

    def locate_global(self, doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first token, token count) of global documents (-1: none, 0 tokens)."""
        empty = doc_ids < 0
        doc_ids = np.where(empty, 0, doc_ids)
        shards = np.searchsorted(self.document_offsets, doc_ids, side="right") - 1
        local = doc_ids - self.document_offsets[shards]
        firsts = np.empty(len(doc_ids), dtype=np.int64)
        counts = np.empty(len(doc_ids), dtype=np.int64)
        for shard in np.unique(shards).tolist():
            chosen = shards == shard
            firsts[chosen], counts[chosen] = self.dataset.reader(shard).locate(local[chosen])
        counts[empty] = 0
        return shards, firsts, counts


def scan_boundaries(buffers: BatchBuffers, bos_id: int | None, eos_id: int | None) -> Filled:
    """Document starts found by the BOS (else after each EOS) token in the inputs; with BOS
    each sequence is known to start a document or not (a row can begin mid-document)."""
    inputs = buffers.tokens[:, :-1]
    if bos_id is not None:
        starts = inputs == bos_id
    else:
        starts = np.zeros(inputs.shape, dtype=bool)
        if eos_id is not None:
            np.equal(inputs[:, :-1], eos_id, out=starts[:, 1:])
    starts[:, 0] = True
    positions = np.flatnonzero(starts)
    count = write_boundaries(positions, buffers, inputs.shape[1])
    flags = inputs.reshape(-1)[positions] == bos_id if bos_id is not None else None
    return Filled(count, flags)


def write_boundaries(starts: np.ndarray, buffers: BatchBuffers, seq_len: int) -> int:
    """Fill position_ids and cu_seqlens from sorted flat [B*T] document start indices that
    include every row start; return the number of sequences."""
    total = buffers.position_ids.size
    count = starts.size
    buffers.cu_seqlens[:count] = starts
    buffers.cu_seqlens[count] = total
    lengths = np.diff(buffers.cu_seqlens[:count + 1])
    np.subtract(flat_index(total), np.repeat(starts, lengths),
                out=buffers.position_ids.reshape(-1))
    return count


def write_cu_seqlens(buffers: BatchBuffers, seq_len: int) -> int:
    """cu_seqlens from position_ids already in place (a sequence starts where its position
    id is 0: rows assembled from several sources); return the number of sequences."""
    starts = np.flatnonzero(buffers.position_ids.reshape(-1) == 0)
    buffers.cu_seqlens[:starts.size] = starts
    buffers.cu_seqlens[starts.size] = buffers.position_ids.size
    return int(starts.size)


def write_row_boundaries(buffers: BatchBuffers) -> int:
    """Boundaries at row starts only (windows mode without document boundaries)."""
    batch, seq_len = buffers.position_ids.shape
    buffers.position_ids[...] = flat_index(seq_len)
    buffers.cu_seqlens[:batch + 1] = flat_index(batch + 1) * seq_len
    return batch


_FLAT_INDEX: dict[int, np.ndarray] = {}


def flat_index(size: int) -> np.ndarray:
    """A cached read-only arange(size)."""
    if size not in _FLAT_INDEX:
        index = np.arange(size, dtype=np.int64)
        index.flags.writeable = False
        _FLAT_INDEX[size] = index
    return _FLAT_INDEX[size]
