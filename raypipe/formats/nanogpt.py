"""NanoGPT token shards: `<name>.bin` (1024-byte header + tokens) + `<name>.bos.idx`, and
raypipe's `<name>.sums` beside them (CRC-32 of the tokens in units of whole documents:
raypipe.io.checksums; llm.c and modded-nanogpt open only the `.bin`) (docs/formats.md).

Invariant: uint16 shards carry the original header (magic 20240520, version 1, T, 0) that
llm.c, modded-nanogpt and NeMo Automodel all read; uint32 shards (largest id > 65535) carry
Automodel's header (magic 278895051, version 1, T, itemsize 4). `.bos.idx` is int32 TOKEN
indices of every BOS (raypipe rule), written only when BOS is prepended; the reader
spot-checks that they point at BOS tokens. With both, a run of documents is a byte range of
the `.bin` found without reading it, each range checked by the `.sums` (a loader on a
bucket fetches blocks of it). Cost: the writer streams tokens and BOS
positions straight to disk (memory bounded by one batch) and rewrites the 1 KB header at
commit; the `.sums` is one more file a shard (4 bytes a 4 KiB unit, CRC-32 at 2-3 GB/s as
the tokens are written).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from raypipe.errors import FormatError
from raypipe.formats.base import (
    DocumentFormat,
    ShardReader,
    ShardWriter,
    check_token_range,
    lists_file,
    register,
    require_file,
    require_size,
    require_sums,
    shard_prefix,
    starts_from_markers,
)
from raypipe.io.checksums import SUMS_SUFFIX, ChecksumWriter
from raypipe.io.mapping import map_file
from raypipe.io.records import FileEntry, FormatSection, ShardEntry, TokenizerInfo

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAGIC_ORIGINAL = 20240520
MAGIC_AUTOMODEL = 278895051
VERSION = 1
MAX_TOKENS = 2**31 - 1
BOS_SPOT_CHECKS = 64


def nanogpt_dtype(largest_id: int) -> np.dtype:
    return np.dtype(np.uint16 if largest_id <= 0xFFFF else np.uint32)


def encode_header(num_tokens: int, dtype: np.dtype) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    original = dtype.itemsize == 2
    header[0] = MAGIC_ORIGINAL if original else MAGIC_AUTOMODEL
    header[1] = VERSION
    header[2] = num_tokens
    header[3] = 0 if original else dtype.itemsize
    return header.tobytes()


class NanoGPTWriter(ShardWriter):
    def __init__(self, directory: Path, name: str, token_dtype: np.dtype, bos_id: int | None):
        super().__init__(directory, name, token_dtype, bos_id)
        self.bin_file = self.open_file(".bin")
        self.bin_file.write(bytes(HEADER_BYTES))
        self.bos_file = self.open_file(".bos.idx") if bos_id is not None else None
        self.sums = ChecksumWriter()

    def add(self, tokens: np.ndarray, lengths: np.ndarray, metadata: object = None) -> None:
        check_token_range(tokens, self.token_dtype, str(self.bin_file.final))
        if self.num_tokens + tokens.size > MAX_TOKENS:
            raise FormatError(self.bin_file.final, "shard exceeds the int32 token count of "
                              "the header", f"<= {MAX_TOKENS}", self.num_tokens + tokens.size)
        if self.bos_file is not None:
            starts = np.cumsum(lengths) - lengths + self.num_tokens
            self.bos_file.write(starts.astype("<i4").tobytes())
        data = tokens.astype(self.token_dtype, copy=False).data
        self.bin_file.write(data)
        self.sums.add(data, lengths.astype(np.int64) * self.token_dtype.itemsize)
        self.num_tokens += int(tokens.size)
        self.num_documents += len(lengths)

    def commit(self) -> list[FileEntry]:
        # the header's token count is known only now: the .bin is checksummed by one read
        # at commit (the one file that is not hashed as it is written)
        self.bin_file.patch_start(encode_header(self.num_tokens, self.token_dtype))
        entries = [self.commit_file(".bin")]
        if self.bos_file is not None:
            entries.append(self.commit_file(".bos.idx"))
        entries.append(self.commit_bytes(SUMS_SUFFIX, self.sums.encoded()))
        return entries


class NanoGPTReader(ShardReader):
    """Opens `<prefix>.bin` and, when present, `<prefix>.bos.idx`.

    Documents come from `.bos.idx`; without it, from a scan for `bos_id` (else for the
    token after each `eos_id`), else the whole shard is one document.
    """

    @classmethod
    def from_manifest(cls, root: Path, shard: ShardEntry, section: FormatSection,
                      tokenizer: TokenizerInfo) -> NanoGPTReader:
        return cls(shard_prefix(root, shard), bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                   require_bos_index=tokenizer.bos_id is not None,
                   sums=lists_file(shard, SUMS_SUFFIX))

    @classmethod
    def index_document_lengths(cls, root: Path, shard: ShardEntry,
                               tokenizer: TokenizerInfo) -> np.ndarray:
        """Lengths from `.bos.idx` and the manifest's token count (the BOS spot checks run
        when the shard opens for reading, with its tokens)."""
        prefix = shard_prefix(root, shard)
        bos_path = prefix.with_name(prefix.name + ".bos.idx")
        assert shard.tokens is not None  # the caller reads the tokens without a count
        starts = bos_starts(read_bos_positions(bos_path, shard.tokens), shard.tokens)
        if shard.documents is not None and starts.size - 1 != shard.documents:
            raise FormatError(bos_path, "documents the BOS positions mark",
                              f"{shard.documents} (the manifest's)", starts.size - 1)
        return np.diff(starts)

    def __init__(self, prefix: str | Path, bos_id: int | None = None,
                 require_bos_index: bool = False, eos_id: int | None = None,
                 sums: bool = False):
        prefix = Path(prefix)
        self.bin_path = prefix.with_name(prefix.name + ".bin")
        self.bos_path = prefix.with_name(prefix.name + ".bos.idx")
        size = require_file(self.bin_path)
        if size < HEADER_BYTES:
            raise FormatError(self.bin_path, "truncated header", f">= {HEADER_BYTES} bytes", size)
        header = np.fromfile(self.bin_path, dtype="<i4", count=HEADER_INTS)
        magic, version, count = int(header[0]), int(header[1]), int(header[2])
        if magic not in (MAGIC_ORIGINAL, MAGIC_AUTOMODEL):
            raise FormatError(self.bin_path, "wrong magic", f"{MAGIC_ORIGINAL} or "
                              f"{MAGIC_AUTOMODEL}", magic)
        if version != VERSION:
            raise FormatError(self.bin_path, "unsupported version", VERSION, version)
        itemsize = 2 if magic == MAGIC_ORIGINAL else int(header[3])
        if itemsize not in (2, 4):
            raise FormatError(self.bin_path, "unsupported itemsize", "2 or 4", itemsize)
        if count < 0:
            raise FormatError(self.bin_path, "negative token count", ">= 0", count)
        require_size(self.bin_path, HEADER_BYTES + count * itemsize, size)
        self.dtype = np.dtype(np.uint16 if itemsize == 2 else np.uint32)
        self.tokens = map_file(self.bin_path, self.dtype, HEADER_BYTES, count)
        if sums:
            require_sums(prefix, count * itemsize)
        self.document_starts = self._document_starts(bos_id, eos_id, require_bos_index)

    def _document_starts(self, bos_id: int | None, eos_id: int | None,
                         require_bos_index: bool) -> np.ndarray:
        if not self.bos_path.exists():
            if require_bos_index:
                raise FormatError(self.bos_path, "file is missing")
            return starts_from_markers(self.tokens, bos_id, eos_id)
        positions = self._read_bos_index(bos_id)
        return bos_starts(positions, int(self.tokens.size))

    def _read_bos_index(self, bos_id: int | None) -> np.ndarray:
        positions = read_bos_positions(self.bos_path, int(self.tokens.size))
        if bos_id is not None and positions.size:
            picks = positions[np.linspace(0, positions.size - 1,
                                          min(BOS_SPOT_CHECKS, positions.size)).astype(int)]
            found = self.tokens[picks]
            if (found != bos_id).any():
                bad = int(picks[np.flatnonzero(found != bos_id)[0]])
                raise FormatError(self.bos_path, f"token at position {bad} is not BOS", bos_id,
                                  int(self.tokens[bad]))
        return positions


def read_bos_positions(bos_path: Path, tokens: int) -> np.ndarray:
    """The token positions a `.bos.idx` lists, checked to ascend inside `tokens` tokens."""
    size = require_file(bos_path)
    if size % 4:
        raise FormatError(bos_path, "size is not a multiple of 4 (int32 positions)",
                          "a multiple of 4", size)
    positions = np.fromfile(bos_path, dtype="<i4").astype(np.int64)
    if positions.size and (positions[-1] >= tokens or positions[0] < 0
                           or (np.diff(positions) <= 0).any()):
        raise FormatError(bos_path, "positions must ascend inside the token array",
                          f"0 <= p < {tokens}", f"first {positions[0]}, last {positions[-1]}")
    return positions


def bos_starts(positions: np.ndarray, tokens: int) -> np.ndarray:
    """Document starts (and the end) from a shard's BOS positions: a shard whose first
    token is no BOS starts a document there too."""
    if tokens and (positions.size == 0 or positions[0] != 0):
        positions = np.concatenate([[0], positions])
    return np.append(positions, tokens).astype(np.int64)


NANOGPT = register(DocumentFormat("nanogpt", (".bin", ".bos.idx", SUMS_SUFFIX), NanoGPTWriter,
                                  NanoGPTReader, nanogpt_dtype, read_order=1,
                                  index_suffixes=(".bos.idx", SUMS_SUFFIX),
                                  tokens_at=HEADER_BYTES))
