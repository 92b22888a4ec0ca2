"""LLMBATCH (ZeroBatch v2, docs/formats.md): pre-formed [batch_size, seq_len] uint32 batches,
each in a 4096-byte-aligned slot, so serving batch i is one slice of an mmap.

Invariant: a 4096-byte header (magic `LLMBATCH`, version 1, batch_size, seq_len,
num_batches as u64 at offset 20, dtype 0 = uint32, seed, total_records; the rest zero),
then slot i at 4096 + i * padded where padded = ceil(B*T*4 / 4096) * 4096, zero-filled past
the batch's bytes; file size = 4096 + num_batches * padded. A record position that holds
no token (the padding of `split` or `fill` packing) holds PAD_ID = 0xFFFFFFFF, which no tokenizer
id reaches, so it can never be mistaken for a token. The reader checks every header
field and the size before mapping anything; `batch(i)` is a zero-copy [B, T] view.
The writer is told the number of batches up front (the header is written first, so the
file is hashed as it is written). Cost: writing is one sequential pass; reading a batch is
one memmap slice.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from raypipe.errors import FormatError
from raypipe.formats.base import Format, ShardWriter, register, require_file, require_size
from raypipe.io.manifest import FileEntry, FormatSection, ShardEntry, TokenizerInfo, safe_join
from raypipe.io.mapping import map_file

MAGIC = b"LLMBATCH"
VERSION = 1
PAGE = 4096
HEADER = struct.Struct("<8sIIIQIII")  # 40 bytes, then zeros up to PAGE
MAX_U32 = 2**32 - 1
PAD_ID = MAX_U32  # a padding slot of a record (split, fill); never a token id


def slot_bytes(batch_size: int, seq_len: int) -> int:
    raw = batch_size * seq_len * 4
    return -(-raw // PAGE) * PAGE


def encode_header(batch_size: int, seq_len: int, num_batches: int, seed: int,
                  total_records: int) -> bytes:
    packed = HEADER.pack(MAGIC, VERSION, batch_size, seq_len, num_batches, 0,
                         seed & MAX_U32, min(total_records, MAX_U32))
    return packed + bytes(PAGE - len(packed))


class LLMBatchWriter(ShardWriter):
    """Writes `num_batches` whole batches ([B, T] arrays of token ids) into one `.batch`
    file named `<name>.batch` in `directory`."""

    def __init__(self, directory: Path, name: str, batch_size: int, seq_len: int,
                 num_batches: int, seed: int, total_records: int):
        super().__init__(directory, name, np.dtype("<u4"), None)
        self.batch_size, self.seq_len, self.num_batches = batch_size, seq_len, num_batches
        self.padded = slot_bytes(batch_size, seq_len)
        self.padding = bytes(self.padded - batch_size * seq_len * 4)
        self.file = self.open_file(".batch")
        self.file.write(encode_header(batch_size, seq_len, num_batches, seed, total_records))
        self.written = 0

    def add_batch(self, batch: np.ndarray) -> None:
        if batch.shape != (self.batch_size, self.seq_len):
            raise FormatError(self.file.final, "batch shape", (self.batch_size, self.seq_len),
                              batch.shape)
        if batch.size and (batch.min() < 0 or batch.max() > MAX_U32):
            raise FormatError(self.file.final, "token id outside uint32", f"0..{MAX_U32}",
                              (int(batch.min()), int(batch.max())))
        self.file.write(np.ascontiguousarray(batch, dtype="<u4").data)
        self.file.write(self.padding)
        self.written += 1

    def add(self, tokens: np.ndarray, lengths: np.ndarray, metadata: object = None) -> None:
        raise FormatError(self.file.final, "LLMBATCH holds pre-formed batches, not documents")

    def commit(self) -> list[FileEntry]:
        if self.written != self.num_batches:
            raise FormatError(self.file.final, "batches written differ from the header",
                              self.num_batches, self.written)
        return [self.commit_file(".batch")]


class LLMBatchReader:
    @classmethod
    def from_manifest(cls, root: Path, shard: ShardEntry, section: FormatSection,
                      tokenizer: TokenizerInfo) -> LLMBatchReader:
        if len(shard.files) != 1:
            raise FormatError(root / shard.name, "an LLMBATCH shard is one file", 1,
                              len(shard.files))
        return cls(safe_join(root, shard.files[0].path))

    def check_counts(self, shard: ShardEntry, where: Path) -> None:
        if shard.batches != self.num_batches:
            raise FormatError(where, "batches differ from the manifest", shard.batches,
                              self.num_batches)

    def verify_contents(self) -> None:
        """Nothing beyond the header and size checks done on open."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = require_file(self.path)
        if size < PAGE:
            raise FormatError(self.path, "truncated header", f">= {PAGE} bytes", size)
        with open(self.path, "rb") as handle:
            header = handle.read(PAGE)
        (magic, version, batch_size, seq_len, num_batches, dtype, seed,
         total_records) = HEADER.unpack_from(header)
        if magic != MAGIC:
            raise FormatError(self.path, "wrong magic", MAGIC, magic)
        if version != VERSION:
            raise FormatError(self.path, "unsupported version", VERSION, version)
        if dtype != 0:
            raise FormatError(self.path, "unsupported dtype code", 0, dtype)
        if batch_size < 1 or seq_len < 1:
            raise FormatError(self.path, "batch_size and seq_len must be >= 1", ">= 1",
                              (batch_size, seq_len))
        if any(header[HEADER.size:]):
            raise FormatError(self.path, "reserved header bytes are not zero", 0, "non-zero")
        self.padded = slot_bytes(batch_size, seq_len)
        require_size(self.path, PAGE + num_batches * self.padded, size)
        self.batch_size, self.seq_len, self.num_batches = batch_size, seq_len, num_batches
        self.seed, self.total_records = seed, total_records
        self.data = map_file(self.path, np.uint8, PAGE)

    def __len__(self) -> int:
        return self.num_batches

    def batch(self, index: int) -> np.ndarray:
        """Batch `index` as a read-only [B, T] uint32 view (no copy)."""
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range [0, {self.num_batches})")
        start = index * self.padded
        raw = self.data[start:start + self.batch_size * self.seq_len * 4]
        return raw.view("<u4").reshape(self.batch_size, self.seq_len)


def llmbatch_dtype(largest_id: int) -> np.dtype:
    return np.dtype(np.uint32)


LLMBATCH = register(Format("llmbatch", (".batch",), LLMBatchWriter, LLMBatchReader,
                           llmbatch_dtype, holds="batches"))
