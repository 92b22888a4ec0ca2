"""LLMBATCH (ZeroBatch v2, docs/formats.md): pre-formed [batch_size, record_len] uint32 batches,
each in a 4096-byte-aligned slot, so serving batch i is one slice of an mmap.

Invariant: a 4096-byte header (magic `LLMBATCH`, version 1, batch_size, record_len
(the spec's `seq_len`), num_batches as u64 at offset 20, dtype 0 = uint32, seed,
total_records; the rest zero), then slot i at 4096 + i * padded where padded =
ceil(B*T*4 / 4096) * 4096, zero-filled past the batch's bytes; file size = 4096 +
num_batches * padded. Every stored id is a real token of the vocabulary, so any reader of
the format can feed a batch to an embedding: a record position that holds no token (the
tail of a record under `split` or `fill` packing) holds the tokenizer's pad token
(`pad_token`: its pad id, else EOS, else BOS, else 0; the section's `pad_id` option).
Which positions are padding is in a sidecar `<name>.lengths`: uint32 little-endian, one
per record in file order, its real tokens (padding is always a record's tail), 4 bytes per
record of T x 4 (0.05% at T = 2049); an older file without it is read through
raypipe.io.manifest_compat, which names what older files lack. Where each
record's pieces start is in a second sidecar `<name>.pieces`: (records + 1) uint64 offsets
into a table of uint32 piece words, then the words; a word is the piece's first column in
its record (bits 0-29), bit 30 set when the piece starts its document and bit 31 when it
ends it. A record's pieces are contiguous slices of single documents, so the loader takes
sequences (cu_seqlens, position_ids) and masks (the target into a piece is true only where
the piece before ends its document and this one starts its own) from the file, never from
a token scan (a file without it: from a BOS/EOS scan). About 4 bytes per piece, 8 per
record. The reader checks every header field and the sizes before mapping anything;
`batch(i)` is a zero-copy [B, T] view. The writer is told the number of batches up front
(the header is written first, so the file is hashed as it is written).
Cost: writing is one sequential pass; reading a batch is one memmap slice (+ B lengths).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raypipe.errors import FormatError
from raypipe.formats.base import (
    BatchFormat,
    BatchReader,
    BatchWriter,
    RecordPieces,
    register,
    require_file,
    require_size,
)
from raypipe.io.manifest_compat import SentinelLengths
from raypipe.io.mapping import map_file
from raypipe.io.paths import safe_join
from raypipe.io.records import FileEntry, FormatSection, ShardEntry, TokenizerInfo

MAGIC = b"LLMBATCH"
VERSION = 1
PAGE = 4096
HEADER = struct.Struct("<8sIIIQIII")  # 40 bytes, then zeros up to PAGE
MAX_U32 = 2**32 - 1
LENGTHS = ".lengths"  # the sidecar: real tokens per record
PIECES = ".pieces"  # the sidecar: where each record's pieces start, and their kind
MASK = ".mask"  # the sidecar of chat data: u8 per record position, 1: a trained target
STARTS_DOCUMENT = np.uint32(1 << 30)
ENDS_DOCUMENT = np.uint32(1 << 31)
COLUMN_BITS = np.uint32((1 << 30) - 1)


def piece_words(columns: np.ndarray, starts_document: np.ndarray,
                ends_document: np.ndarray) -> np.ndarray:
    """One record's pieces as `.pieces` words."""
    columns = np.asarray(columns, dtype=np.int64)
    if columns.size and (columns[0] != 0 or columns.max() > int(COLUMN_BITS)):
        raise ValueError(f"piece columns {columns.tolist()[:8]} must start at 0 and fit 30 bits")
    return (columns.astype(np.uint32)
            | np.where(starts_document, STARTS_DOCUMENT, np.uint32(0))
            | np.where(ends_document, ENDS_DOCUMENT, np.uint32(0))).astype(np.uint32)


@dataclass(frozen=True)
class BatchPieces:
    """The pieces of one batch's records: record r's words are words[offsets[r]:
    offsets[r + 1]] (see piece_words)."""

    offsets: np.ndarray
    words: np.ndarray

    @property
    def records(self) -> np.ndarray:
        """The record of each piece."""
        return np.repeat(np.arange(self.offsets.size - 1), np.diff(self.offsets))

    @property
    def columns(self) -> np.ndarray:
        return (self.words & COLUMN_BITS).astype(np.int64)

    @property
    def starts_document(self) -> np.ndarray:
        return (self.words & STARTS_DOCUMENT) != 0

    @property
    def ends_document(self) -> np.ndarray:
        return (self.words & ENDS_DOCUMENT) != 0

    @property
    def false_joins(self) -> np.ndarray:
        """Pieces whose crossing target is not true: not first in their record, and not (the
        piece before ends its document and this one starts its own)."""
        first = np.zeros(self.words.size, dtype=bool)
        first[self.offsets[:-1][np.diff(self.offsets) > 0]] = True
        true = np.zeros(self.words.size, dtype=bool)
        true[1:] = self.ends_document[:-1] & self.starts_document[1:]
        return ~first & ~true


def pad_token(tokenizer: TokenizerInfo) -> int:
    """The id padding positions hold: the tokenizer's pad token, else EOS, else BOS, else 0
    (a real token either way; the sidecar says where padding is)."""
    for token_id in (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id):
        if token_id is not None:
            return token_id
    return 0


def slot_bytes(batch_size: int, record_len: int) -> int:
    raw = batch_size * record_len * 4
    return -(-raw // PAGE) * PAGE


def encode_header(batch_size: int, record_len: int, num_batches: int, seed: int,
                  total_records: int) -> bytes:
    packed = HEADER.pack(MAGIC, VERSION, batch_size, record_len, num_batches, 0,
                         seed & MAX_U32, min(total_records, MAX_U32))
    return packed + bytes(PAGE - len(packed))


class LLMBatchWriter(BatchWriter):
    """Writes `num_batches` whole batches ([B, T] arrays of token ids) into `<name>.batch`
    in `directory`, each record's real tokens into `<name>.lengths`, its pieces into
    `<name>.pieces` (kept in memory until commit: ~4 bytes a piece) and, for chat data,
    its per-token loss mask into `<name>.mask`."""

    def __init__(self, directory: Path, name: str, batch_size: int, record_len: int,
                 num_batches: int, seed: int, total_records: int):
        super().__init__(directory, name, batch_size, record_len, num_batches, seed,
                         total_records)
        self.batch_size, self.record_len, self.num_batches = batch_size, record_len, num_batches
        self.padded = slot_bytes(batch_size, record_len)
        self.padding = bytes(self.padded - batch_size * record_len * 4)
        self.file = self.open_file(".batch")
        self.file.write(encode_header(batch_size, record_len, num_batches, seed, total_records))
        self.lengths = self.open_file(LENGTHS)
        self.piece_words: list[np.ndarray] = []
        self.written = 0

    def add_batch(self, batch: np.ndarray, lengths: np.ndarray, pieces: list[RecordPieces],
                  loss_mask: np.ndarray | None = None) -> None:
        """One batch, its records' real tokens (the rest of each record is padding, already
        holding the pad token), each record's pieces and (chat data) its loss mask: every
        batch of a shard has one, or none does."""
        words = [piece_words(record.columns, record.starts_document, record.ends_document)
                 for record in pieces]
        if batch.shape != (self.batch_size, self.record_len):
            raise FormatError(self.file.final, "batch shape", (self.batch_size, self.record_len),
                              batch.shape)
        if batch.size and (batch.min() < 0 or batch.max() > MAX_U32):
            raise FormatError(self.file.final, "token id outside uint32", f"0..{MAX_U32}",
                              (int(batch.min()), int(batch.max())))
        if lengths.shape != (self.batch_size,) or lengths.min() < 0 or (
                lengths.max() > self.record_len):
            raise FormatError(self.lengths.final, "record lengths", f"{self.batch_size} in "
                              f"[0, {self.record_len}]", lengths.tolist())
        if len(words) != self.batch_size or any(
                record.size and int((record & COLUMN_BITS).max()) >= max(int(length), 1)
                for record, length in zip(words, lengths.tolist(), strict=True)):
            raise FormatError(self.file.final, "record pieces", "a piece list per record, "
                              "each column inside the record's real tokens",
                              [record.size for record in words])
        self._add_loss_mask(loss_mask)
        self.file.write(np.ascontiguousarray(batch, dtype="<u4").data)
        self.file.write(self.padding)
        self.lengths.write(np.ascontiguousarray(lengths, dtype="<u4").data)
        self.piece_words.extend(words)
        self.written += 1

    def _add_loss_mask(self, loss_mask: np.ndarray | None) -> None:
        masked = MASK in self._files
        if loss_mask is None and not masked:
            return
        if loss_mask is None or (self.written and not masked):
            raise FormatError(self.directory / f"{self.name}{MASK}", "a loss mask for every "
                              "batch of a shard, or for none", "all or none", "some")
        if loss_mask.shape != (self.batch_size, self.record_len):
            raise FormatError(self.directory / f"{self.name}{MASK}", "loss mask shape",
                              (self.batch_size, self.record_len), loss_mask.shape)
        mask_file = self._files.get(MASK) or self.open_file(MASK)
        mask_file.write(np.ascontiguousarray(loss_mask, dtype=np.uint8).data)

    def commit(self) -> list[FileEntry]:
        if self.written != self.num_batches:
            raise FormatError(self.file.final, "batches written differ from the header",
                              self.num_batches, self.written)
        counts = np.array([words.size for words in self.piece_words], dtype=np.int64)
        pieces = self.open_file(PIECES)
        pieces.write(np.concatenate([[0], np.cumsum(counts)]).astype("<u8").data)
        if self.piece_words:
            pieces.write(np.concatenate(self.piece_words).astype("<u4").data)
        masks = [self.commit_file(MASK)] if MASK in self._files else []
        return [self.commit_file(".batch"), self.commit_file(LENGTHS), self.commit_file(PIECES),
                *masks]


class LLMBatchReader(BatchReader):
    @classmethod
    def from_manifest(cls, root: Path, shard: ShardEntry, section: FormatSection,
                      tokenizer: TokenizerInfo) -> LLMBatchReader:
        paths = [safe_join(root, entry.path) for entry in shard.files]
        by_suffix = {suffix: [path for path in paths if path.name.endswith(suffix)]
                     for suffix in (".batch", LENGTHS, PIECES, MASK)}
        batches, lengths, pieces, masks = by_suffix.values()
        if (len(batches) != 1 or len(lengths) > 1 or len(pieces) > len(lengths)
                or len(masks) > len(pieces)
                or len(paths) != sum(map(len, by_suffix.values()))):
            raise FormatError(root / shard.name, "an LLMBATCH shard is a .batch file and "
                              "its .lengths and .pieces sidecars, and .mask for chat data "
                              "(older files: without .pieces, or the .batch file alone)",
                              [".batch", LENGTHS, PIECES, MASK],
                              [entry.path for entry in shard.files])
        return cls(batches[0], lengths[0] if lengths else None, pieces[0] if pieces else None,
                   masks[0] if masks else None)

    def verify_contents(self) -> None:
        """Every record length within [0, record_len]; every record's pieces start at column 0
        and rise inside its real tokens (the header and sizes are checked on open)."""
        if self.lengths.size and int(np.max(self.lengths)) > self.record_len:
            raise FormatError(self.lengths_path, "record length past record_len",
                              f"<= {self.record_len}", int(np.max(self.lengths)))
        if self.piece_offsets is None or self.piece_words is None:
            return
        pieces = BatchPieces(self.piece_offsets.astype(np.int64), self.piece_words)
        records, columns = pieces.records, pieces.columns
        first = np.zeros(columns.size, dtype=bool)
        first[pieces.offsets[:-1][np.diff(pieces.offsets) > 0]] = True
        lengths = np.asarray(self.lengths[records], dtype=np.int64)
        rising = np.ones(columns.size, dtype=bool)
        rising[1:] = columns[1:] > columns[:-1]
        bad = np.flatnonzero((first & (columns != 0)) | (~first & ~rising)
                             | (columns >= np.maximum(lengths, 1)))
        if bad.size:
            at = int(bad[0])
            raise FormatError(self.pieces_path, f"record {int(records[at])}: piece column",
                              "0 first, then rising inside the record's tokens",
                              int(columns[at]))

    def __init__(self, path: str | Path, lengths_path: str | Path | None = None,
                 pieces_path: str | Path | None = None, mask_path: str | Path | None = None):
        """`lengths_path`: the `.lengths` sidecar (None: an older file, whose lengths are
        read from its padding: raypipe.io.manifest_compat.SentinelLengths); `pieces_path`:
        the `.pieces` sidecar (None: an older file);
        `mask_path`: the `.mask` sidecar (chat data; None: every target is trained)."""
        self.path = Path(path)
        size = require_file(self.path)
        if size < PAGE:
            raise FormatError(self.path, "truncated header", f">= {PAGE} bytes", size)
        with open(self.path, "rb") as handle:
            header = handle.read(PAGE)
        (magic, version, batch_size, record_len, num_batches, dtype, seed,
         total_records) = HEADER.unpack_from(header)
        if magic != MAGIC:
            raise FormatError(self.path, "wrong magic", MAGIC, magic)
        if version != VERSION:
            raise FormatError(self.path, "unsupported version", VERSION, version)
        if dtype != 0:
            raise FormatError(self.path, "unsupported dtype code", 0, dtype)
        if batch_size < 1 or record_len < 1:
            raise FormatError(self.path, "batch_size and record_len must be >= 1", ">= 1",
                              (batch_size, record_len))
        if any(header[HEADER.size:]):
            raise FormatError(self.path, "reserved header bytes are not zero", 0, "non-zero")
        self.padded = slot_bytes(batch_size, record_len)
        require_size(self.path, PAGE + num_batches * self.padded, size)
        self.batch_size, self.record_len, self.num_batches = batch_size, record_len, num_batches
        self.seed, self.total_records = seed, total_records
        self.data = map_file(self.path, np.uint8, PAGE)
        self.lengths_path = None if lengths_path is None else Path(lengths_path)
        # each record's real tokens (a 0.3 file without the sidecar: read as one)
        self.lengths: np.ndarray | SentinelLengths = SentinelLengths(
            self.batch, batch_size, num_batches * batch_size)
        if self.lengths_path is not None:
            require_size(self.lengths_path, 4 * num_batches * batch_size,
                         require_file(self.lengths_path))
            self.lengths = map_file(self.lengths_path, "<u4")
        self.pieces_path = None if pieces_path is None else Path(pieces_path)
        self.piece_offsets: np.ndarray | None = None
        self.piece_words: np.ndarray | None = None
        if self.pieces_path is not None:
            self._map_pieces(self.pieces_path, num_batches * batch_size)
        self.mask: np.ndarray | None = None
        if mask_path is not None:
            require_size(Path(mask_path), num_batches * batch_size * record_len,
                         require_file(Path(mask_path)), "loss mask bytes (one per position)")
            self.mask = map_file(Path(mask_path), np.uint8)

    def _map_pieces(self, path: Path, records: int) -> None:
        size = require_file(path)
        table = 8 * (records + 1)
        if size < table or (size - table) % 4:
            raise FormatError(path, "pieces sidecar size", f"{table} + 4 x pieces bytes", size)
        offsets = map_file(path, "<u8", 0, records + 1)
        pieces = (size - table) // 4
        if offsets[0] != 0 or int(offsets[-1]) != pieces or (np.diff(offsets.astype(
                np.int64)) < 0).any():
            raise FormatError(path, "piece offsets", f"rising from 0 to {pieces}",
                              [int(offsets[0]), int(offsets[-1])])
        self.piece_offsets = offsets
        self.piece_words = map_file(path, "<u4", table) if pieces else np.zeros(0, "<u4")

    def __len__(self) -> int:
        return self.num_batches

    def batch(self, index: int) -> np.ndarray:
        """Batch `index` as a read-only [B, T] uint32 view (no copy)."""
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range [0, {self.num_batches})")
        start = index * self.padded
        raw = self.data[start:start + self.batch_size * self.record_len * 4]
        return raw.view("<u4").reshape(self.batch_size, self.record_len)

    def padding(self, index: int, batch: np.ndarray | None = None) -> np.ndarray:
        """[B, T] bool: True where batch `index`'s records hold padding (`batch`: the
        batch's ids, where the caller has them already)."""
        lengths = self.lengths[index * self.batch_size:(index + 1) * self.batch_size]
        return np.arange(self.record_len)[None, :] >= lengths[:, None]

    def pieces(self, index: int) -> BatchPieces | None:
        """Batch `index`'s record pieces (None: an older file, without them)."""
        if self.piece_offsets is None or self.piece_words is None:
            return None
        offsets = self.piece_offsets[index * self.batch_size:(index + 1) * self.batch_size + 1]
        offsets = offsets.astype(np.int64)
        return BatchPieces(offsets - offsets[0], self.piece_words[offsets[0]:offsets[-1]])

    def loss_mask(self, index: int) -> np.ndarray | None:
        """[B, T] uint8 view: batch `index`'s loss mask (None: no `.mask` sidecar)."""
        if self.mask is None:
            return None
        size = self.batch_size * self.record_len
        return self.mask[index * size:(index + 1) * size].reshape(self.batch_size,
                                                                  self.record_len)

    def records(self, index: int) -> list[np.ndarray]:
        """Batch `index`'s records without their padding (views)."""
        batch = self.batch(index)
        lengths = self.lengths[index * self.batch_size:(index + 1) * self.batch_size]
        return [record[:length] for record, length in zip(batch, lengths.tolist(),
                                                          strict=True)]


def llmbatch_dtype(largest_id: int) -> np.dtype:
    return np.dtype(np.uint32)


LLMBATCH = register(BatchFormat("llmbatch", (".batch", LENGTHS, PIECES, MASK), LLMBatchWriter,
                                LLMBatchReader, llmbatch_dtype,
                                pad_token=pad_token))
