"""Stream with metadata: `<name>.tokens` + `.metadata.index` + `.metadata.bin`, and raypipe's
`.lengths` (each document's token count, u32) and `.sums` (CRC-32 of `.tokens` in 4 KiB
units of whole documents: raypipe.io.checksums) (docs/formats.md).

Invariant: `.tokens` is little-endian records {token: u32, metadata_id: u32} (or plain u32
tokens when written without metadata); `.metadata.index` is u64[M + 1] byte offsets with
index[0] = 0 and index[M] = size of `.metadata.bin`; metadata ids are shard-local and
allocated in token order (a document's record, then its spans' records in span order), so
the ids of any window form one contiguous range: a window's metadata is one index read and
one data read. Readers find documents by the BOS (or EOS) token, as NanoGPT readers do; a
shard that lists `.lengths` (new outputs) must agree with them, and a loader reads every
shard's lengths from it alone (4 bytes a document, not the tokens); with the `.sums` too, a
run of documents is a byte range of `.tokens` (8 bytes a token with metadata, 4 without),
checked as it arrives, so a loader on a bucket fetches blocks of it. Chat data (which
needs --bos or --eos here) adds `.mask`, one u8 per token (1: a trained target), and a span
record per turn: its role and whether it is trained. Cost: the writer keeps one batch in
memory plus 8 bytes per record for the index; reader validation is O(1) (ids are
range-checked per window read) plus one vectorized pass over the tokens for the documents;
the `.lengths` and `.sums` are two more files a shard (4 bytes a document; 4 bytes a 4 KiB
unit), streamed as written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.errors import FormatError
from raypipe.formats.base import (
    LENGTHS_SIDECAR,
    MASK_SIDECAR,
    MASK_SUMS_SIDECAR,
    DocumentFormat,
    DocumentMetadata,
    FormatOptions,
    ShardReader,
    ShardWriter,
    check_lengths_sidecar,
    check_token_range,
    lists_file,
    lists_mask_sidecar,
    map_mask_sidecar,
    register,
    require_file,
    require_size,
    require_sums,
    shard_prefix,
    sidecar_document_lengths,
    starts_from_markers,
)
from raypipe.io.checksums import SUMS_SUFFIX, ChecksumWriter
from raypipe.io.mapping import TOKEN_FIELD, map_file, token_view
from raypipe.io.records import FileEntry, FormatSection, ShardEntry, TokenizerInfo
from raypipe.io.serialize import SERIALIZERS, get_serializer
from raypipe.knobs import knob

RECORD = np.dtype([(TOKEN_FIELD, "<u4"), ("metadata_id", "<u4")])
PLAIN = np.dtype("<u4")


def stream_dtype(largest_id: int) -> np.dtype:
    return np.dtype(np.uint32)


class StreamWriter(ShardWriter):
    keeps_mask_sidecar = True  # chat data: `<name>.mask`, a byte per token of `.tokens`

    def __init__(self, directory: Path, name: str, token_dtype: np.dtype, bos_id: int | None,
                 metadata: bool = True, serializer: str = "json"):
        super().__init__(directory, name, token_dtype, bos_id)
        self.with_metadata = metadata
        self.serializer = get_serializer(serializer)
        self.tokens_file = self.open_file(".tokens")
        self.bin_file = self.open_file(".metadata.bin") if metadata else None
        self.offsets: list[int] = [0]
        self.sums = ChecksumWriter()

    @property
    def entry_itemsize(self) -> int:
        return (RECORD if self.with_metadata else PLAIN).itemsize

    def _add_record(self, record: dict[str, Any]) -> int:
        data = self.serializer.dumps(record)
        self.bin_file.write(data)
        self.offsets.append(self.offsets[-1] + len(data))
        return len(self.offsets) - 2

    def add(self, tokens: np.ndarray, lengths: np.ndarray,
            metadata: list[DocumentMetadata] | None = None) -> None:
        check_token_range(tokens, self.token_dtype, str(self.tokens_file.final))
        if not self.with_metadata:
            self._write_entries(tokens.astype(PLAIN, copy=False), lengths)
        else:
            records = np.empty(tokens.size, dtype=RECORD)
            records["token"] = tokens
            ends = np.cumsum(lengths)
            for index, (start, stop) in enumerate(zip((ends - lengths).tolist(), ends.tolist(),
                                                      strict=True)):
                doc = metadata[index] if metadata else DocumentMetadata({})
                ids = records["metadata_id"][start:stop]
                document_id = self._add_record(doc.record)
                ids[:] = document_id
                for first, last, span in doc.spans:
                    ids[first:last] = self._add_record({**span, "document": document_id})
            self._write_entries(records, lengths)
        self.add_lengths_sidecar(lengths)
        self.num_tokens += int(tokens.size)
        self.num_documents += len(lengths)

    def _write_entries(self, entries: np.ndarray, lengths: np.ndarray) -> None:
        """The documents' entries into `.tokens`, and their checksums into the `.sums`."""
        data = np.ascontiguousarray(entries).view(np.uint8)
        self.tokens_file.write(data.data)
        self.sums.add(data, lengths.astype(np.int64) * entries.dtype.itemsize)

    def commit(self) -> list[FileEntry]:
        entries = (self.commit_mask_sidecar() + self.commit_lengths_sidecar()
                   + [self.commit_bytes(SUMS_SUFFIX, self.sums.encoded())])
        if self.bin_file is not None:
            self.open_file(".metadata.index").write(np.array(self.offsets, dtype="<u8").data)
            bin_entry = self.commit_file(".metadata.bin")
            entries += [self.commit_file(".metadata.index"), bin_entry]
        return [self.commit_file(".tokens"), *entries]


@dataclass(frozen=True)
class StreamOptions(FormatOptions):
    """metadata: tokens carry metadata ids (else plain u32 tokens); serializer: of the
    metadata records (json or msgpack)."""

    metadata: bool = knob(True, "tokens carry the ids of per-document metadata records "
                                "(--no-stream-metadata: plain u32 tokens)")
    serializer: str = knob("json", "the metadata records' serializer",
                           lambda: tuple(sorted(SERIALIZERS)))

    def check(self, where: str) -> None:
        if self.serializer not in SERIALIZERS:
            raise FormatError(where, f"serializer {self.serializer!r} not among "
                              f"{sorted(SERIALIZERS)}")


class StreamReader(ShardReader):
    """Opens one stream shard. `metadata=None` detects it from the sidecar files."""

    @classmethod
    def from_manifest(cls, root: Path, shard: ShardEntry, section: FormatSection,
                      tokenizer: TokenizerInfo) -> StreamReader:
        options = STREAM.options(section.options)
        return cls(shard_prefix(root, shard), tokenizer.bos_id, tokenizer.eos_id,
                   options.metadata, options.serializer, lists_mask_sidecar(shard),
                   lists_file(shard, LENGTHS_SIDECAR), lists_file(shard, SUMS_SUFFIX))

    @classmethod
    def index_document_lengths(cls, root: Path, shard: ShardEntry,
                               tokenizer: TokenizerInfo) -> np.ndarray:
        return sidecar_document_lengths(root, shard)

    def __init__(self, prefix: str | Path, bos_id: int | None = None, eos_id: int | None = None,
                 metadata: bool | None = None, serializer: str = "json",
                 loss_mask: bool = False, lengths: bool = False, sums: bool = False):
        prefix = Path(prefix)
        self.tokens_path = prefix.with_name(prefix.name + ".tokens")
        self.index_path = prefix.with_name(prefix.name + ".metadata.index")
        self.bin_path = prefix.with_name(prefix.name + ".metadata.bin")
        self.serializer = get_serializer(serializer)
        size = require_file(self.tokens_path)
        if metadata is None:
            metadata = self.index_path.exists() or self.bin_path.exists()
        self.with_metadata = metadata
        record = RECORD if metadata else PLAIN
        if size % record.itemsize:
            raise FormatError(self.tokens_path, f"size is not a multiple of the "
                              f"{record.itemsize}-byte record", "a multiple", size)
        count = size // record.itemsize
        raw = map_file(self.tokens_path, record, 0, count)
        self.records = raw
        self.tokens = token_view(raw)
        self.metadata_ids = raw["metadata_id"] if metadata else None
        if metadata:
            self._open_metadata()
        self.document_starts = starts_from_markers(self.tokens, bos_id, eos_id)
        if lengths:
            check_lengths_sidecar(prefix, np.diff(self.document_starts))
        if sums:
            require_sums(prefix, size)
        if loss_mask:
            self.loss_mask = map_mask_sidecar(prefix, self.tokens.size)

    @property
    def token_entries(self) -> np.ndarray:
        return self.records

    def _open_metadata(self) -> None:
        index_size = require_file(self.index_path)
        bin_size = require_file(self.bin_path)
        if index_size % 8 or index_size < 8:
            raise FormatError(self.index_path, "size must be a positive multiple of 8 (u64)",
                              ">= 8, multiple of 8", index_size)
        self.index = map_file(self.index_path, "<u8")
        if int(self.index[0]) != 0:
            raise FormatError(self.index_path, "index[0] must be 0", 0, int(self.index[0]))
        require_size(self.bin_path, int(self.index[-1]), bin_size,
                     "metadata.bin size (index[M])")
        self.bin = map_file(self.bin_path, np.uint8)

    def verify_contents(self) -> None:
        """Every metadata id points inside the index; the index ascends."""
        if self.metadata_ids is None or not self.num_tokens:
            return
        largest = int(np.max(self.metadata_ids))
        if largest >= self.num_records:
            raise FormatError(self.tokens_path, "metadata id outside the index",
                              f"< {self.num_records}", largest)
        if (np.diff(self.index.astype(np.int64)) < 0).any():
            raise FormatError(self.index_path, "offsets are not ascending", "ascending",
                              "a decrease")

    @property
    def num_records(self) -> int:
        return len(self.index) - 1 if self.with_metadata else 0

    def read_records(self, first: int, last: int) -> list[Any]:
        """Records first..last inclusive: one index read, one data read."""
        if not self.with_metadata:
            return []
        if first < 0 or last >= self.num_records:
            raise FormatError(self.tokens_path, "metadata id outside the index",
                              f"< {self.num_records}", last)
        offsets = np.asarray(self.index[first:last + 2], dtype=np.int64)
        if (np.diff(offsets) < 0).any() or offsets[-1] > self.bin.size:
            raise FormatError(self.index_path, f"offsets of records {first}..{last} are not "
                              "ascending inside metadata.bin", f"<= {self.bin.size}",
                              int(offsets[-1]))
        data = self.bin[offsets[0]:offsets[-1]].tobytes()
        try:
            return self.serializer.loads_many(data, (offsets - offsets[0]).tolist())
        except ValueError as exc:
            raise FormatError(self.bin_path, f"records {first}..{last} do not decode as "
                              f"{self.serializer.name}: {exc}") from exc


def token_entry(section: FormatSection) -> np.dtype:
    """What `.tokens` holds a token: a {token, metadata_id} record, or (no metadata) it."""
    return RECORD if STREAM.options(section.options).metadata else PLAIN


def metadata_records(shard: ShardEntry) -> int:
    """The metadata records of a shard, from its `.metadata.index` size in the manifest."""
    return sum(max(0, entry.bytes // 8 - 1) for entry in shard.files
               if entry.path.endswith(".metadata.index"))


STREAM = register(DocumentFormat("stream", (".tokens", ".metadata.index", ".metadata.bin",
                                            MASK_SIDECAR, MASK_SUMS_SIDECAR, LENGTHS_SIDECAR,
                                            SUMS_SUFFIX),
                                 StreamWriter, StreamReader, stream_dtype,
                                 options_type=StreamOptions, read_order=2,
                                 index_suffixes=(LENGTHS_SIDECAR, SUMS_SUFFIX),
                                 tokens_at=0, token_entry=token_entry, blocks_need_sums=True,
                                 wants_metadata=lambda options: options.metadata,
                                 window_metadata=True, holds_loss_mask=True,
                                 finds_documents_by_separator=True,
                                 metadata_records=metadata_records))
