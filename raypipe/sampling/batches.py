"""Materialize one rank's rows of a batch into caller-provided numpy buffers.

Invariant: for global positions g (this rank's share of a global step), row i of the output
holds observation g_i of the epoch plan: T + 1 tokens read straight from the shard memmaps
(no shard is ever loaded whole), inputs = row[:-1], targets = row[1:]; `position_ids`
restart at 0 at every document start and `cu_seqlens` lists the document starts over the
flattened [B, T] inputs (flash-attention varlen style), so attention can stay inside
documents. Observations are described (permuted, located) for many batches per numpy call;
filling a row is then one slice copy per touched shard (windows) or per packed document
(bestfit). Measured on 2 cores, B=8, T=2048: ~35 us per batch for windows, ~70 us for
bestfit (see bench/loader_bench.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from raypipe.dataset import LLMBatchDataset, StreamWindow, TokenDataset
from raypipe.sampling.plans import BestFitPlan, DocumentPlan, PreformedPlan, WindowPlan


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
class BatchPlan:
    """What one batch holds, computed ahead: positions, observation ids, and per row either
    a global token offset (windows), a document id (documents) or packed segments."""

    positions: np.ndarray
    observation_ids: np.ndarray
    rows: list[Any]


def shard_array(dataset: TokenDataset, shard: int, attribute: str) -> np.ndarray:
    """One array of a shard's reader as a plain ndarray view (slicing a np.memmap subclass
    costs ~1 us more per slice)."""
    return np.asarray(getattr(dataset.reader(shard), attribute)).view(np.ndarray)


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

    def shards_of_documents(self, doc_ids: np.ndarray) -> np.ndarray:
        ids = self.global_documents(doc_ids)
        ids = ids[ids >= 0]
        return np.unique(np.searchsorted(self.document_offsets, ids, side="right") - 1)

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
        goes the long way). ~3 us a row (2049 tokens widened to int64, and the loop): ~23 us
        for a batch of 8, where a copy per row with its own shard lookup took ~30 us."""
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

    def span_pieces(self, start: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The documents a stream span [start, start + width) holds (global tokens, no
        split): (column where each piece starts, it starts its document, it ends its
        document), from the shards' document starts (a binary search per shard touched)."""
        columns, starts, ends = [], [], []
        at = start
        shard = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
        while at < start + width and shard < len(self.token_offsets) - 1:
            base = int(self.token_offsets[shard])
            bounds = self.dataset.reader(shard).document_starts
            stop = min(start + width, int(self.token_offsets[shard + 1])) - base
            local = at - base
            first = int(np.searchsorted(bounds, local, side="right")) - 1
            last = int(np.searchsorted(bounds, stop, side="left"))
            firsts = np.maximum(bounds[first:last], local)
            columns.append(firsts + base - start)
            starts.append(firsts == bounds[first:last])
            ends.append(bounds[first + 1:last + 1] <= stop)
            at, shard = stop + base, shard + 1
        return (np.concatenate(columns).astype(np.int64), np.concatenate(starts),
                np.concatenate(ends))

    def locate_documents(self, doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first token, token count) of each document of a plan (an empty
        observation, id -1, is 0 tokens)."""
        doc_ids = self.global_documents(doc_ids)
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


class BatchBuilder:
    """Describes batches ahead (vectorized) and fills BatchBuffers from a description."""

    def __init__(self, source: TokenSource, plan: WindowPlan | BestFitPlan | DocumentPlan,
                 seq_len: int, pad_id: int = 0, boundaries: bool = True):
        self.source = source
        self.plan = plan
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.boundaries = boundaries
        self.bos_id = source.dataset.bos_id
        self.eos_id = source.dataset.eos_id

    def describe(self, positions: np.ndarray) -> list[BatchPlan]:
        """`positions` [steps, B] -> one BatchPlan per step, with one numpy pass per kind."""
        steps, batch = positions.shape
        flat = positions.reshape(-1)
        if isinstance(self.plan, WindowPlan):
            ids, offsets = self.plan.window_starts(flat)
            rows = offsets.reshape(steps, batch).tolist()
        elif isinstance(self.plan, DocumentPlan):
            local_ids = self.plan.documents(flat)
            shards, firsts, counts = self.source.locate_documents(local_ids)
            ids = self.source.global_documents(local_ids)
            rows = np.stack([shards, firsts, counts], axis=1).reshape(steps, batch, 3).tolist()
        else:
            ids, rows = self._describe_bestfit(flat, steps, batch)
        ids = ids.reshape(steps, batch)
        return [BatchPlan(positions[i], ids[i], rows[i]) for i in range(steps)]

    def shards(self, positions: np.ndarray) -> np.ndarray:
        """The shards the observations at `positions` read (for fetching them ahead)."""
        flat = positions.reshape(-1)
        if isinstance(self.plan, WindowPlan):
            return self.source.shards_of_tokens(self.plan.window_starts(flat)[1],
                                                self.seq_len + 1)
        if isinstance(self.plan, DocumentPlan):
            return self.source.shards_of_documents(self.plan.documents(flat))
        blocks, local = self.plan.row_ids(flat)
        doc_ids = [self.plan.pack(block).row(row).doc_ids
                   for block, row in zip(blocks.tolist(), local.tolist(), strict=True)]
        return self.source.shards_of_documents(np.concatenate(doc_ids) if doc_ids
                                               else np.empty(0, np.int64))

    def _describe_bestfit(self, flat: np.ndarray, steps: int, batch: int):
        """Per row: (shard, first token in the shard, count, starts its document, ends its
        document) segments, located for all rows of all steps in one vectorized pass."""
        rows_of = self.plan.rows(flat)
        pieces = [row for _, row in rows_of]
        shards, firsts, _ = self.source.locate_documents(
            np.concatenate([row.doc_ids for row in pieces]))
        starts = np.concatenate([row.starts for row in pieces])
        ends = np.concatenate([row.ends_document for row in pieces])
        described = list(zip(shards.tolist(), (firsts + starts).tolist(),
                             np.concatenate([row.take for row in pieces]).tolist(),
                             (starts == 0).tolist(), ends.tolist(), strict=True))
        rows, at = [], 0
        for row in pieces:
            rows.append(described[at:at + len(row.take)])
            at += len(row.take)
        nested = [rows[i * batch:(i + 1) * batch] for i in range(steps)]
        return np.array([row_id for row_id, _ in rows_of], dtype=np.int64), nested

    def prepare(self, buffers: BatchBuffers) -> None:
        """Once per buffer: the parts that do not change from batch to batch."""
        buffers.mask[...] = 1
        if not self.boundaries:
            write_row_boundaries(buffers)

    def fill(self, plan: BatchPlan, buffers: BatchBuffers) -> Filled:
        """Write the batch into a `prepare`d buffer."""
        if isinstance(self.plan, WindowPlan):
            return self._fill_windows(plan, buffers)
        if isinstance(self.plan, BestFitPlan):
            return self._fill_bestfit(plan, buffers)
        return self._fill_documents(plan, buffers)

    def row_lengths(self, plan: BatchPlan) -> np.ndarray:
        """Real tokens of each row `fill` writes (the rest of a row is padding, its tail)."""
        width = self.seq_len + 1
        if isinstance(self.plan, WindowPlan):
            return np.full(len(plan.rows), width, dtype=np.int64)
        if isinstance(self.plan, BestFitPlan):
            counts = [sum(segment[2] for segment in row) for row in plan.rows]
        else:
            counts = [row[2] for row in plan.rows]
        return np.minimum(np.array(counts, dtype=np.int64), width)

    def row_pieces(self, plan: BatchPlan) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per row `fill` writes: (column where each piece starts, it starts its document,
        it ends its document); padding is no piece."""
        if isinstance(self.plan, WindowPlan):
            return [self.source.span_pieces(offset, self.seq_len + 1) for offset in plan.rows]
        if isinstance(self.plan, BestFitPlan):
            pieces = []
            for row in plan.rows:
                counts = np.array([segment[2] for segment in row], dtype=np.int64)
                pieces.append((np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64),
                               np.array([segment[3] for segment in row], dtype=bool),
                               np.array([segment[4] for segment in row], dtype=bool)))
            return pieces
        return [(np.zeros(int(count > 0), np.int64), np.ones(int(count > 0), bool),
                 np.full(int(count > 0), count <= self.seq_len + 1))
                for _, _, count in plan.rows]

    def _fill_windows(self, plan: BatchPlan, buffers: BatchBuffers) -> Filled:
        self.source.copy_windows(plan.rows, buffers.tokens)
        if not self.boundaries:
            return Filled(len(plan.rows))
        return scan_boundaries(buffers, self.bos_id, self.eos_id)

    def metadata(self, plan: BatchPlan) -> list[StreamWindow]:
        """Windows mode over a stream dataset: each row's tokens with their metadata."""
        return [self.source.dataset.window(offset, self.seq_len + 1) for offset in plan.rows]

    def _fill_bestfit(self, plan: BatchPlan, buffers: BatchBuffers) -> Filled:
        """Pieces back to back, each a sequence of its own; the target that crosses into a
        piece is masked unless the piece before ends its document and this one starts its
        own (raypipe.sampling.pack); a row's unfilled tail is padding: pad_id tokens, masked
        targets, a sequence of its own (attention never crosses a piece)."""
        tokens, starts, flags = self.source.tokens, [], []
        width = self.seq_len + 1
        for row, segments in enumerate(plan.rows):
            out, mask, at, ended = buffers.tokens[row], buffers.mask[row], 0, True
            mask[:] = 1
            for shard, first, count, starts_document, ends_document in segments:
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

    def _fill_documents(self, plan: BatchPlan, buffers: BatchBuffers) -> Filled:
        tokens, width = self.source.tokens, self.seq_len + 1
        for row, (shard, first, count) in enumerate(plan.rows):
            kept = min(count, width)
            buffers.tokens[row, :kept] = tokens[shard][first:first + kept]
            buffers.tokens[row, kept:] = self.pad_id
            buffers.mask[row, :max(kept - 1, 0)] = 1
            buffers.mask[row, max(kept - 1, 0):] = 0
        rows = np.arange(len(plan.rows), dtype=np.int64) * self.seq_len
        count = write_boundaries(rows, buffers, self.seq_len)
        real = np.array([row[2] > 0 for row in plan.rows], dtype=bool)  # empty: padding only
        return Filled(count, real)


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


class PreformedBatchBuilder:
    """LLMBATCH: a batch is one pre-formed [B, T] block, copied out of its mmap slice."""

    def __init__(self, dataset: LLMBatchDataset, plan: PreformedPlan, boundaries: bool = True,
                 pad_id: int = 0):
        self.dataset, self.plan, self.boundaries = dataset, plan, boundaries
        self.pad_id = pad_id
        self.padded = dataset.padded_tokens > 0

    def shards(self, positions: np.ndarray) -> np.ndarray:
        ids = self.plan.batches(positions.reshape(-1))
        return np.unique(np.searchsorted(self.dataset.batch_offsets, ids, side="right") - 1)

    def describe(self, positions: np.ndarray) -> list[BatchPlan]:
        ids = self.plan.batches(positions.reshape(-1)).reshape(positions.shape)
        return [BatchPlan(positions[i], ids[i], ids[i].tolist()) for i in range(len(ids))]

    def prepare(self, buffers: BatchBuffers) -> None:
        buffers.mask[...] = 1
        if not self.boundaries:
            write_row_boundaries(buffers)

    def fill(self, plan: BatchPlan, buffers: BatchBuffers) -> Filled:
        index = plan.rows[0]
        buffers.tokens[...] = self.dataset.batch(index)
        padding = None
        if self.padded:  # the format says where padding is: masked, then pad_id
            padding = self.dataset.padding(index, buffers.tokens)
            np.logical_not(padding[:, 1:], out=buffers.mask)
            buffers.tokens[padding] = self.pad_id
        pieces = self.dataset.pieces(index)
        if pieces is not None:  # the file says where its pieces are
            return self._fill_pieces(pieces, padding, buffers)
        if not self.boundaries:
            return Filled(buffers.tokens.shape[0])
        return scan_boundaries(buffers, self.dataset.bos_id, self.dataset.eos_id)

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
