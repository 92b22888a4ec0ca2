"""Megatron-LM indexed dataset: `<name>.bin` (tokens) + `<name>.idx` (docs/formats.md), and
raypipe's `<name>.sums` beside them (CRC-32 of the `.bin` in units of whole documents:
raypipe.io.checksums; megatron-core never opens it).

Invariant: byte-exact to megatron-core's `IndexedDataset` (version 1, one sequence per
document, document_indices = [0..N]). dtype uint16 (code 8) when the largest id < 65500,
else int32 (code 4). The reader checks magic, version, dtype code, the idx size implied by
its counts (34 + 12S + 8D, before touching any array), pointer/length consistency and the
.bin size (and the .sums size, where the shard lists one). Cost: the writer keeps 4 bytes
per document (and 4 a checksum unit) in memory until commit; reading
opens two maps (no file descriptor held) and does O(S) vectorized checks (~1 ms per
million documents).
"""

from __future__ import annotations

import struct
from functools import cached_property
from pathlib import Path

import numpy as np

from raypipe import _faults as faults
from raypipe.errors import FormatError
from raypipe.formats.base import (
    MASK_SIDECAR,
    MASK_SUMS_SIDECAR,
    DocumentFormat,
    ShardReader,
    ShardWriter,
    check_token_range,
    lists_file,
    lists_mask_sidecar,
    map_mask_sidecar,
    register,
    require_file,
    require_size,
    require_sums,
    shard_prefix,
)
from raypipe.io.checksums import SUMS_SUFFIX, ChecksumWriter
from raypipe.io.mapping import map_file
from raypipe.io.records import FileEntry, FormatSection, ShardEntry, TokenizerInfo

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def megatron_dtype(largest_id: int) -> np.dtype:
    return np.dtype(np.uint16 if largest_id < 65500 else np.int32)


def encode_index(lengths: np.ndarray, dtype: np.dtype) -> bytes:
    """The .idx bytes for one sequence per document."""
    count = len(lengths)
    pointers = np.zeros(count, dtype=np.int64)
    if count:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    header = HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[dtype], count, count + 1)
    return b"".join((header, lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(),
                     np.arange(count + 1, dtype="<i8").tobytes()))


class MegatronWriter(ShardWriter):
    keeps_mask_sidecar = True  # megatron-core opens .bin/.idx only

    def __init__(self, directory: Path, name: str, token_dtype: np.dtype, bos_id: int | None):
        super().__init__(directory, name, token_dtype, bos_id)
        self.bin_file = self.open_file(".bin")
        self.lengths: list[np.ndarray] = []
        self.sums = ChecksumWriter()

    def add(self, tokens: np.ndarray, lengths: np.ndarray, metadata: object = None) -> None:
        check_token_range(tokens, self.token_dtype, str(self.bin_file.final))
        data = tokens.astype(self.token_dtype, copy=False).data
        self.bin_file.write(data)
        self.sums.add(data, lengths.astype(np.int64) * self.token_dtype.itemsize)
        self.lengths.append(lengths.astype(np.int32))
        self.num_tokens += int(tokens.size)
        self.num_documents += len(lengths)

    def commit(self) -> list[FileEntry]:
        lengths = np.concatenate(self.lengths) if self.lengths else np.empty(0, np.int32)
        index = encode_index(lengths, self.token_dtype)
        idx_file = self.open_file(".idx")
        idx_file.write(index[:len(index) // 2])
        faults.point("megatron.mid_index", self.name)
        idx_file.write(index[len(index) // 2:])
        entries = [self.commit_file(".bin"), *self.commit_mask_sidecar()]
        faults.point("megatron.after_bin", self.name)
        entries.append(self.commit_file(".idx"))
        entries.append(self.commit_bytes(SUMS_SUFFIX, self.sums.encoded()))
        return entries


class MegatronReader(ShardReader):
    """Opens `<prefix>.bin/.idx`; `prefix` is the path without suffix."""

    @classmethod
    def from_manifest(cls, root: Path, shard: ShardEntry, section: FormatSection,
                      tokenizer: TokenizerInfo) -> MegatronReader:
        return cls(shard_prefix(root, shard), loss_mask=lists_mask_sidecar(shard),
                   sums=lists_file(shard, SUMS_SUFFIX))

    @classmethod
    def index_document_lengths(cls, root: Path, shard: ShardEntry,
                               tokenizer: TokenizerInfo) -> np.ndarray:
        prefix = shard_prefix(root, shard)
        index = MegatronIndex(prefix.with_name(prefix.name + ".idx"))
        lengths = index.sequence_lengths
        if lengths.size and lengths.min() < 0:
            raise FormatError(index.idx_path, "negative sequence length", ">= 0", lengths.min())
        index.check_documents(lengths.size)
        if index.one_sequence_per_document:
            return lengths  # a view of the .idx map: no copy
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        return np.diff(offsets[index.document_indices])

    def __init__(self, prefix: str | Path, loss_mask: bool = False, sums: bool = False):
        prefix = Path(prefix)
        self.idx_path = prefix.with_name(prefix.name + ".idx")
        self.bin_path = prefix.with_name(prefix.name + ".bin")
        index = MegatronIndex(self.idx_path)
        bin_size = require_file(self.bin_path)
        self.dtype = index.dtype
        self.index = index
        self.sequence_lengths = index.sequence_lengths
        self.sequence_pointers = index.sequence_pointers
        self.document_indices = index.document_indices
        self._check_consistency(bin_size, index.sequence_lengths.size)
        index.check_documents(index.sequence_lengths.size)
        self.tokens = map_file(self.bin_path, self.dtype, 0, bin_size // self.dtype.itemsize)
        if sums:
            require_sums(prefix, bin_size)
        if loss_mask:
            self.loss_mask = map_mask_sidecar(prefix, self.tokens.size)

    @cached_property
    def document_starts(self) -> np.ndarray:  # type: ignore[override]
        """int64[D + 1] token offsets (8 bytes a document: built only when asked; the
        loader locates documents through the index map instead)."""
        offsets = np.zeros(self.sequence_lengths.size + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=offsets[1:])
        return offsets[self.document_indices]

    @property
    def num_documents(self) -> int:
        return self.document_indices.size - 1

    @property
    def document_lengths(self) -> np.ndarray:
        if self.index.one_sequence_per_document:
            return self.sequence_lengths  # a view of the .idx map
        return np.diff(self.document_starts)

    def locate(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.index.one_sequence_per_document:
            return super().locate(local)
        return (self.sequence_pointers[local] // self.dtype.itemsize,
                self.sequence_lengths[local].astype(np.int64))

    def _check_consistency(self, bin_size: int, count: int) -> np.ndarray:
        lengths = self.sequence_lengths.astype(np.int64)
        if count and lengths.min() < 0:
            raise FormatError(self.idx_path, "negative sequence length", ">= 0", lengths.min())
        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if not np.array_equal(self.sequence_pointers, offsets[:-1] * self.dtype.itemsize):
            bad = int(np.flatnonzero(self.sequence_pointers != offsets[:-1] *
                                     self.dtype.itemsize)[0])
            raise FormatError(self.idx_path, f"sequence_pointers[{bad}] inconsistent with "
                              "lengths", int(offsets[bad] * self.dtype.itemsize),
                              int(self.sequence_pointers[bad]))
        require_size(self.bin_path, int(offsets[-1]) * self.dtype.itemsize, bin_size,
                     "token file size implied by the .idx")
        return offsets


class MegatronIndex:
    """The arrays of a `.idx` file, header and size checked (views of one memmap)."""

    def __init__(self, idx_path: Path):
        self.idx_path = idx_path
        idx_size = require_file(idx_path)
        if idx_size < HEADER.size:
            raise FormatError(idx_path, "truncated header", f">= {HEADER.size} bytes", idx_size)
        with open(idx_path, "rb") as handle:
            magic, version, code, count, doc_count = HEADER.unpack(handle.read(HEADER.size))
        if magic != MAGIC:
            raise FormatError(idx_path, "wrong magic", MAGIC, magic)
        if version != VERSION:
            raise FormatError(idx_path, "unsupported version", VERSION, version)
        if code not in DTYPE_CODES:
            raise FormatError(idx_path, "unknown dtype code", sorted(DTYPE_CODES), code)
        expected = HEADER.size + 12 * count + 8 * doc_count
        if idx_size not in (expected, expected + count):  # + optional int8 sequence_modes
            require_size(idx_path, expected, idx_size, f"index size for S={count}, D={doc_count}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = map_file(idx_path)
        self.sequence_lengths = np.frombuffer(index, "<i4", count, HEADER.size)
        self.sequence_pointers = np.frombuffer(index, "<i8", count, HEADER.size + 4 * count)
        self.document_indices = np.frombuffer(index, "<i8", doc_count, HEADER.size + 12 * count)

    @property
    def one_sequence_per_document(self) -> bool:
        """document_indices = [0 .. S] (raypipe writes no other; checked by
        check_documents to rise from 0 to S, so S + 1 entries means every step is 1)."""
        return self.document_indices.size == self.sequence_lengths.size + 1

    def check_documents(self, count: int) -> None:
        indices = self.document_indices
        if len(indices) == 0 or indices[0] != 0 or indices[-1] != count or (
                np.diff(indices) < 0).any():
            raise FormatError(self.idx_path, "document_indices must rise from 0 to S",
                              f"[0 .. {count}]", indices[:1].tolist() + indices[-1:].tolist())


def data_path_prefix(shard: ShardEntry) -> str:
    """The shard's prefix as Megatron's --data-path takes it: its .bin without the suffix."""
    return shard.files[0].path.removesuffix(".bin")


MEGATRON = register(DocumentFormat("megatron", (".bin", ".idx", MASK_SIDECAR, MASK_SUMS_SIDECAR,
                                                SUMS_SUFFIX),
                                   MegatronWriter, MegatronReader, megatron_dtype,
                                   read_order=0, index_suffixes=(".idx", SUMS_SUFFIX),
                                   tokens_at=0, lengths_at=(".idx", HEADER.size, "<i4"),
                                   separator="eos", trainer_prefix=data_path_prefix,
                                   holds_loss_mask=True))
