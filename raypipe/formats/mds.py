"""MosaicML Streaming MDS (docs/formats.md): one sample per document, written directly to
MDS's published layout, so `streaming.StreamingDataset` and LLM Foundry's text dataloader
open the output unchanged (no mosaicml-streaming dependency). Beside each shard raypipe
writes `<name>.lengths` (each sample's token count, u32), so a loader reads every shard's
lengths without fetching the shards, and beside a raw shard `<name>.offsets` (the header's
sample offsets, u32) and `<name>.sums` (CRC-32 of the samples in units cut by their token
bytes: raypipe.io.checksums), so a loader fetches, checks and decodes a block of samples
alone (`SampleBlocks`); MDS never opens them, and an opened shard must agree with all three.

Invariant: a shard `<name>.mds` is [u32 samples n][u32 offsets[n + 1], absolute in the
file][the shard's config JSON][samples]; a sample is [u32 size of each variable-size
column][its columns in name order]: `id` (int64: the document's row in its input; a
converted dataset's: its index in the source shard), for chat data `loss_mask`
(`ndarray:uint8`, one per token, 1: a trained target), `source` (str: the input file, or
the source shard) and `tokens` (`ndarray:uint16` or `ndarray:uint32`, the tokenizer's
width: one byte (1 << 2 | shape width), the length, then the ids; `loss_mask` is encoded
alike). With `compression: zstd` the whole shard is one zstd frame in `<name>.mds.zstd`.
`mds/index.json` lists every shard in manifest order (`index_bytes`, written when the
manifest is committed), so the bytes are the same at any parallelism. Cost: writing keeps 4
B per document of the open shard (zstd: the raw shard in memory at commit), and one CRC
pass over its samples; raypipe's reader decodes a shard (a block, from a bucket) into one
private token array when it opens it (O(shard tokens), a vectorized pass and a copy a
sample), since MDS interleaves sample headers with tokens and no zero-copy view exists.
"""

from __future__ import annotations

import json
import logging
import tempfile
from array import array
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from raypipe.errors import FormatError
from raypipe.formats.base import (
    LENGTHS_SIDECAR,
    DocumentFormat,
    FormatOptions,
    SampleBlocks,
    ShardReader,
    ShardWriter,
    check_lengths_sidecar,
    check_token_range,
    lists_file,
    register,
    require_file,
    shard_prefix,
    sidecar_document_lengths,
)
from raypipe.io.checksums import SUMS_SUFFIX, ChecksumWriter, StreamChecksums
from raypipe.io.mapping import map_file
from raypipe.io.paths import safe_join
from raypipe.io.records import FileEntry, FormatSection, ShardEntry, TokenizerInfo
from raypipe.io.store import Store
from raypipe.knobs import knob

NAME = "mds"
RAW, ZSTD = ".mds", ".mds.zstd"
OFFSETS_SIDECAR = ".offsets"  # each sample's first byte in the `.mds`, and its size (u32)
SIDECARS = (LENGTHS_SIDECAR, OFFSETS_SIDECAR, SUMS_SUFFIX)
INDEX = "index.json"
COMPRESSIONS = (None, "zstd")
COLUMNS = ("id", "source", "tokens")  # MDS orders columns by name
SHAPE_WIDTHS = {0: 1, 1: 2, 2: 4, 3: 8}  # MDS ndarray shape dtype code -> bytes
COPY_CHUNK = 8 << 20
CONCAT_DROP_WARNING = 0.01  # share of the tokens dropped as shard tails that is warned about
logger = logging.getLogger("raypipe")


def token_encoding(dtype: np.dtype) -> str:
    return f"ndarray:{np.dtype(dtype).name}"


def column_encodings(dtype: np.dtype, loss_mask: bool) -> dict[str, str]:
    """Each column's MDS encoding, in name order."""
    masked = {"loss_mask": "ndarray:uint8"} if loss_mask else {}
    return {"id": "int64", **masked, "source": "str", "tokens": token_encoding(dtype)}


def shard_config(dtype: np.dtype, compression: str | None,
                 loss_mask: bool = False) -> dict[str, Any]:
    """The writer config MDS embeds in every shard and repeats in index.json."""
    encodings = column_encodings(dtype, loss_mask)
    return {"column_encodings": list(encodings.values()),
            "column_names": list(encodings),
            "column_sizes": [8 if name == "id" else None for name in encodings],
            "compression": compression, "format": "mds", "hashes": [], "size_limit": None,
            "version": 2}


def encode_ndarray(values: np.ndarray) -> bytes:
    """MDS's encoding of a 1-D array of a fixed dtype: (1 << 2 | shape width), the length,
    then the values."""
    count = values.size
    code = next(code for code, width in SHAPE_WIDTHS.items() if count < 1 << (8 * width))
    return bytes([1 << 2 | code]) + count.to_bytes(SHAPE_WIDTHS[code], "little") + \
        values.tobytes()


def encode_sample(row: int, source: bytes, tokens: np.ndarray,
                  loss_mask: np.ndarray | None = None) -> bytes:
    """One sample: the sizes of its variable columns, then id and those columns in name
    order (loss_mask, source, tokens)."""
    columns = [source, encode_ndarray(tokens)]
    if loss_mask is not None:
        columns.insert(0, encode_ndarray(np.ascontiguousarray(loss_mask, dtype=np.uint8)))
    return b"".join([np.array([len(column) for column in columns], "<u4").tobytes(),
                     np.int64(row).astype("<i8").tobytes(), *columns])


class Concatenation:
    """LLM Foundry's `--concat_tokens N`: documents back to back, cut into samples of
    exactly N tokens; a sample's id and source are those of the document its first token
    belongs to. The shard's tail under N tokens is dropped (`pending` at commit: counted
    in the manifest, as the shard's tokens fall short of its documents')."""

    def __init__(self, size: int, dtype: np.dtype):
        self.size = size
        self.pending = np.empty(0, dtype)
        self.pending_owner: tuple[int, str] | None = None

    def samples(self, tokens: np.ndarray, lengths: np.ndarray,
                owners: list[tuple[int, str]]) -> list[tuple[tuple[int, str], np.ndarray]]:
        stream = np.concatenate([self.pending, tokens])
        lead = [self.pending_owner] if self.pending_owner is not None else []
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else []
        starts = [0] * len(lead) + [self.pending.size + int(at) for at in offsets]
        who = lead + owners
        count = stream.size // self.size
        out = []
        for index in range(count):
            first = index * self.size
            owner = who[int(np.searchsorted(starts, first, side="right")) - 1]
            out.append((owner, stream[first:first + self.size]))
        cut = count * self.size
        self.pending = stream[cut:].copy()
        self.pending_owner = (who[int(np.searchsorted(starts, cut, side="right")) - 1]
                              if self.pending.size else None)
        return out


class MDSWriter(ShardWriter):
    """Appends documents as MDS samples; the header (sample offsets) is written at commit,
    so samples go to a spool file first."""

    def __init__(self, directory: Path, name: str, token_dtype: np.dtype, bos_id: int | None,
                 compression: str | None = None, concat_tokens: int | None = None,
                 loss_mask: bool = False):
        super().__init__(directory, name, np.dtype(token_dtype).newbyteorder("<"), bos_id)
        self.concat = Concatenation(concat_tokens, self.token_dtype) if concat_tokens else None
        if compression not in COMPRESSIONS:
            raise FormatError(self.directory / name, "mds compression", COMPRESSIONS,
                              compression)
        self.compression = compression
        self.with_loss_mask = loss_mask
        self.pending_mask: np.ndarray | None = None  # add_loss_mask's, for the next add
        self.config = json.dumps(shard_config(self.token_dtype, compression, loss_mask),
                                 sort_keys=True).encode()
        self.spool = tempfile.TemporaryFile(dir=self.directory, prefix=f".{name}.samples.")
        self.sizes: list[int] = []
        self.encoded: list[bytes] = []  # samples of the running `add`, spooled at its end
        # the samples' checksums, so a loader reads a run of them alone (raw shards only:
        # a zstd frame is read whole)
        self.sums = ChecksumWriter() if compression is None else None
        self.sample_tokens = array("I")  # each sample's token count: the `.lengths`
        self.documents_seen = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, metadata: object = None) -> None:
        check_token_range(tokens, self.token_dtype, str(self.directory / self.name))
        tokens = np.ascontiguousarray(tokens, dtype=self.token_dtype)
        records = metadata if isinstance(metadata, list) else None
        owners = [(int(records[index].record["row"]), str(records[index].record["source"]))
                  if records is not None else (self.documents_seen + index, self.name)
                  for index in range(len(lengths))]  # without metadata: index in the shard
        self.documents_seen += len(lengths)
        loss_mask, self.pending_mask = self.pending_mask, None
        if self.with_loss_mask != (loss_mask is not None) or (
                loss_mask is not None and loss_mask.size != tokens.size):
            raise FormatError(self.directory / self.name, "a loss mask byte per token of "
                              "every document of a shard with a loss_mask column, else none",
                              tokens.size if self.with_loss_mask else 0,
                              0 if loss_mask is None else loss_mask.size)
        if self.concat is not None:
            for (row, source), sample in self.concat.samples(tokens, lengths, owners):
                self._write(row, source, sample)
            self._spool()
            return
        ends = np.cumsum(lengths)
        for (row, source), stop, length in zip(owners, ends.tolist(), lengths.tolist(),
                                               strict=True):
            if length < 1:
                raise FormatError(self.directory / self.name, "an MDS sample needs >= 1 "
                                  "token (an empty document)", ">= 1", length)
            self._write(row, source, tokens[stop - length:stop],
                        None if loss_mask is None else loss_mask[stop - length:stop])
        self._spool()

    def add_loss_mask(self, loss_mask: np.ndarray, lengths: np.ndarray) -> None:
        """The `loss_mask` column of the documents the next `add` appends (chat data: each
        sample checked by the shard's sha256, so no sums)."""
        self.pending_mask = loss_mask

    def _write(self, row: int, source: str, sample_tokens: np.ndarray,
               loss_mask: np.ndarray | None = None) -> None:
        sample = encode_sample(row, source.encode(), sample_tokens, loss_mask)
        self.encoded.append(sample)
        self.sizes.append(len(sample))
        self.sample_tokens.append(sample_tokens.size)
        self.num_documents += 1
        self.num_tokens += int(sample_tokens.size)

    def _spool(self) -> None:
        """Write the samples of an `add` (and their checksums: units cut by the samples'
        token bytes, as a loader cuts blocks) in one call."""
        if not self.encoded:
            return
        data = b"".join(self.encoded)
        self.spool.write(data)
        if self.sums is not None:
            tokens = np.frombuffer(self.sample_tokens, np.uint32)[-len(self.encoded):]
            self.sums.add(data, np.array([len(sample) for sample in self.encoded], np.int64),
                          tokens.astype(np.int64) * self.token_dtype.itemsize)
        self.encoded.clear()

    def _offsets(self) -> np.ndarray:
        """u32 LE [n + 1]: each sample's first byte in the raw shard, and its size."""
        count = len(self.sizes)
        start = 4 + 4 * (count + 1) + len(self.config)
        offsets = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]) + start
        if offsets[-1] >= 1 << 32:
            raise FormatError(self.directory / self.name, "an MDS shard's offsets are u32: "
                              "shard under 4 GiB (lower --shard-tokens)", "< 4 GiB",
                              int(offsets[-1]))
        return offsets.astype("<u4")

    def commit(self) -> list[FileEntry]:
        offsets = self._offsets()
        header = np.uint32(len(self.sizes)).astype("<u4").tobytes() + offsets.tobytes() + \
            self.config
        self.spool.seek(0)
        suffix = ZSTD if self.compression else RAW
        out = self.open_file(suffix)
        try:
            if self.compression:
                raw = header + self.spool.read()
                out.write(pa.compress(raw, codec="zstd", asbytes=True))
            else:
                out.write(header)
                while block := self.spool.read(COPY_CHUNK):
                    out.write(block)
        finally:
            self.spool.close()
        entries = [self.commit_file(suffix)]
        if self.sums is not None:
            entries += [self.commit_bytes(OFFSETS_SIDECAR, offsets.tobytes()),
                        self.commit_bytes(SUMS_SUFFIX, self.sums.encoded())]
        self.add_lengths_sidecar(np.frombuffer(self.sample_tokens, np.uint32))
        return [*entries, *self.commit_lengths_sidecar()]

    def abort(self) -> None:
        self.spool.close()
        super().abort()


def shard_file(where: object, shard: ShardEntry) -> FileEntry:
    """The shard's one MDS file (`.mds` or `.mds.zstd`; its sidecars aside)."""
    data = [entry for entry in shard.files if not entry.path.endswith(SIDECARS)]
    if len(data) != 1:
        raise FormatError(f"{where}/{shard.name}", "an MDS shard is one file (and its "
                          f"sidecars {list(SIDECARS)})", 1, len(data))
    return data[0]


def zstd_content_size(head: bytes, where: object) -> int:
    """The decompressed size a zstd frame header declares (RFC 8878, 3.1.1.1)."""
    if len(head) < 6 or head[:4] != b"\x28\xb5\x2f\xfd":
        raise FormatError(where, "not a zstd frame", "magic 28 b5 2f fd", head[:4].hex())
    descriptor = head[4]
    single_segment = bool(descriptor & 0x20)
    size_flag = descriptor >> 6
    at = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 0x3]
    width = (1 if single_segment else 0, 2, 4, 8)[size_flag]
    if width == 0 or len(head) < at + width:
        raise FormatError(where, "zstd frame without its content size", "a size", None)
    value = int.from_bytes(head[at:at + width], "little")
    return value + 256 if width == 2 else value


def read_raw(path: Path) -> np.ndarray:
    """A shard's raw bytes: a map of `.mds`, or `.mds.zstd` decompressed into memory."""
    if path.name.endswith(ZSTD):
        with pa.input_stream(str(path), compression="zstd") as stream:
            return np.frombuffer(stream.read(), np.uint8)
    return map_file(path, np.uint8)


class MDSReader(ShardReader):
    """An MDS shard's documents: headers checked, tokens decoded into one array."""

    @classmethod
    def from_manifest(cls, root: Path, shard: ShardEntry, section: FormatSection,
                      tokenizer: TokenizerInfo) -> MDSReader:
        reader = cls(safe_join(root, shard_file(root, shard).path), np.dtype(section.dtype))
        prefix = shard_prefix(root, shard)
        if lists_file(shard, LENGTHS_SIDECAR):
            check_lengths_sidecar(prefix, reader.document_lengths)
        if lists_file(shard, OFFSETS_SIDECAR) and lists_file(shard, SUMS_SUFFIX):
            reader.check_block_sidecars(prefix)
        return reader

    @classmethod
    def index_document_lengths(cls, root: Path, shard: ShardEntry,
                               tokenizer: TokenizerInfo) -> np.ndarray:
        return sidecar_document_lengths(root, shard)

    def __init__(self, path: str | Path, token_dtype: np.dtype | None = None):
        self.path = Path(path)
        require_file(self.path)
        raw = read_raw(self.path)
        if raw.size < 8:
            raise FormatError(self.path, "truncated MDS header", ">= 8 bytes", raw.size)
        count = int(raw[:4].view("<u4")[0])
        if raw.size < 4 * (count + 2):
            raise FormatError(self.path, "MDS offsets past the end of the file",
                              f">= {4 * (count + 2)} bytes", raw.size)
        offsets = raw[4:4 * (count + 2)].view("<u4").astype(np.int64)
        self.config = self._config(raw[4 * (count + 2):offsets[0]].tobytes())
        if np.any(np.diff(offsets) < 17) or offsets[-1] != raw.size:
            raise FormatError(self.path, "MDS sample offsets", f"increasing, ending at "
                              f"{raw.size}", f"ending at {int(offsets[-1])}")
        layout = dict(zip(self.config["column_names"], self.config["column_encodings"],
                          strict=True))
        self.dtype = np.dtype(layout["tokens"].split(":")[1]).newbyteorder("<")
        if token_dtype is not None and self.dtype != np.dtype(token_dtype):
            raise FormatError(self.path, "MDS token dtype differs from the manifest",
                              np.dtype(token_dtype).name, self.dtype.name)
        self.raw, self.offsets = raw, offsets
        self._decode(raw, offsets[:-1])

    def check_block_sidecars(self, prefix: Path) -> None:
        """The `.offsets` and `.sums` a loader reads blocks of samples by (on a bucket)
        place and check this shard's samples (one CRC pass over them), so a shard that opens
        whole here serves the same samples a block at a time: FormatError naming the
        sidecar that does not."""
        offsets_path, sums_path = (prefix.with_name(prefix.name + suffix)
                                   for suffix in (OFFSETS_SIDECAR, SUMS_SUFFIX))
        require_file(offsets_path)
        require_file(sums_path)
        listed = np.fromfile(offsets_path, dtype="<u4").astype(np.int64)
        if not np.array_equal(listed, self.offsets):
            raise FormatError(offsets_path, "sample offsets of the MDS shard's header",
                              f"{self.offsets.size} equal", f"{listed.size}, others")
        first = int(self.offsets[0])
        sums = StreamChecksums(sums_path, self.offsets - first, str(self.path),
                               self.document_starts * self.dtype.itemsize)
        problem = sums.problem(self.raw[first:], 0)
        if problem is not None:
            raise FormatError(self.path, problem)

    def _config(self, data: bytes) -> dict[str, Any]:
        try:
            config = json.loads(data)
        except ValueError as exc:
            raise FormatError(self.path, f"MDS shard config is not JSON ({exc})") from None
        encodings = config.get("column_encodings") if isinstance(config, dict) else None
        names = config.get("column_names") if isinstance(config, dict) else None
        layout = (dict(zip(names, encodings, strict=True))
                  if isinstance(names, list) and isinstance(encodings, list)
                  and len(names) == len(encodings) else None)
        if (config.get("format") != "mds" or layout is None
                or layout.get("tokens") not in ("ndarray:uint16", "ndarray:uint32")
                or layout != column_encodings(np.dtype(layout["tokens"].split(":")[1]),
                                              "loss_mask" in layout)):
            raise FormatError(self.path, "MDS columns", f"{list(COLUMNS)} as int64, str, "
                              "ndarray:uint16|uint32 (chat data: and loss_mask as "
                              "ndarray:uint8)", names)
        return config

    def _decode(self, raw: np.ndarray, starts: np.ndarray) -> None:
        samples = decode_samples(raw, starts, self.dtype,
                                 "loss_mask" in self.config["column_names"], str(self.path))
        self.ids, self.tokens = samples.ids, samples.tokens
        self.source_starts, self.source_sizes = samples.source_starts, samples.source_sizes
        self.document_starts = samples.document_starts
        if samples.loss_mask is not None:
            self.loss_mask = samples.loss_mask


@dataclass
class Samples:
    """A run of samples decoded: each one's id, where its source string lies in the bytes
    decoded, its first token, and the tokens (and loss mask) back to back."""

    ids: np.ndarray
    source_starts: np.ndarray
    source_sizes: np.ndarray
    document_starts: np.ndarray
    tokens: np.ndarray
    loss_mask: np.ndarray | None


def decode_samples(raw: np.ndarray, starts: np.ndarray, dtype: np.dtype, masked: bool,
                   where: str) -> Samples:
    """The samples beginning at `starts` of `raw` (each ending where the next begins, the
    last at the end of `raw`): every sample's columns located (vectorized), each checked to
    end where the sample does, then the tokens (and the loss mask) gathered."""
    variable = 3 if masked else 2  # (loss_mask), source, tokens: a u32 size each
    head = 4 * variable + 8
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.append(starts[1:], raw.size)
    if np.any(ends - starts <= head):
        raise FormatError(where, "MDS samples", f"each over {head} bytes", "a shorter one")
    heads = raw[starts[:, None] + np.arange(head)]  # the sizes, then the int64 id
    sizes = heads[:, :4 * variable].copy().view("<u4").astype(np.int64)
    ids = heads[:, 4 * variable:].copy().view("<i8")[:, 0].astype(np.int64)
    column_starts = starts[:, None] + head + np.concatenate(
        [np.zeros((sizes.shape[0], 1), np.int64), np.cumsum(sizes, axis=1)[:, :-1]], axis=1)
    if np.any(column_starts[:, -1] + sizes[:, -1] != ends):
        raise FormatError(where, "MDS sample columns", "sizes adding up to the sample's",
                          "others")
    firsts, counts = ndarray_column(raw, column_starts[:, -1], sizes[:, -1], dtype, where,
                                    "tokens")
    document_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    loss_mask = None
    if masked:
        mask_firsts, mask_counts = ndarray_column(raw, column_starts[:, 0], sizes[:, 0],
                                                  np.dtype(np.uint8), where, "loss_mask")
        if not np.array_equal(mask_counts, counts):
            raise FormatError(where, "MDS loss_mask column", "a byte per token",
                              "another length")
        loss_mask = gather(raw, mask_firsts, mask_counts, document_starts, np.dtype(np.uint8))
    return Samples(ids, column_starts[:, -2], sizes[:, -2], document_starts,
                   gather(raw, firsts, counts, document_starts, dtype), loss_mask)


def decode_block(data: np.ndarray, starts: np.ndarray, dtype: np.dtype, loss_mask: bool,
                 where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """A block's tokens and loss mask from its samples' bytes (`SampleBlocks.decode`)."""
    samples = decode_samples(data, starts, np.dtype(dtype).newbyteorder("<"), loss_mask, where)
    return samples.tokens, samples.loss_mask


def ndarray_column(raw: np.ndarray, at: np.ndarray, size: np.ndarray, dtype: np.dtype,
                   where: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(first value byte, value count) of every sample's 1-D ndarray column `name`."""
    codes = raw[np.minimum(at, raw.size - 1)].astype(np.int64)
    if np.any(codes >> 2 != 1):
        raise FormatError(where, f"MDS {name} are not 1-D arrays", "ndim 1", "other")
    widths = np.array([SHAPE_WIDTHS[code] for code in range(4)])[codes & 3]
    item = dtype.itemsize
    counts = (size - 1 - widths) // item
    if np.any(counts < 1) or np.any(1 + widths + counts * item != size):
        raise FormatError(where, f"MDS {name} column sizes", "whole values", "a partial one")
    return at + 1 + widths, counts


def gather(raw: np.ndarray, firsts: np.ndarray, counts: np.ndarray, starts: np.ndarray,
           dtype: np.dtype) -> np.ndarray:
    """The samples' values (`counts[i]` of `dtype` at byte `firsts[i]`) as one array."""
    out = np.empty(int(starts[-1]), dtype)
    item = dtype.itemsize
    for index, (at, count) in enumerate(zip(firsts.tolist(), counts.tolist(), strict=True)):
        first = int(starts[index])
        out[first:first + count] = raw[at:at + count * item].view(dtype)
    return out


def index_bytes(store: Store, section: FormatSection) -> bytes:
    """MDS's `index.json` for the committed shards of `section`, in manifest order (the
    compressed shards' raw sizes from their frame headers: one 18-byte read each)."""
    dtype = np.dtype(section.dtype)
    options = MDS.options(section.options)
    compression = options.compression
    shards = []
    for shard in section.shards:
        entry = shard_file(store.uri, shard)
        basename = entry.path.split("/", 1)[1]
        raw = {"basename": basename, "bytes": entry.bytes, "hashes": {}}
        zipped = None
        if compression:
            head = store.read_head(entry.path, 18)
            zipped = raw
            raw = {"basename": basename[:-len(".zstd")], "hashes": {},
                   "bytes": zstd_content_size(head, store.uri_of(entry.path))}
        shards.append({**shard_config(dtype, compression, options.loss_mask), "raw_data": raw,
                       "samples": shard.documents, "zip_data": zipped})
    return json.dumps({"shards": shards, "version": 2}, sort_keys=True).encode()


def mds_dtype(largest_id: int) -> np.dtype:
    return np.dtype("<u2") if largest_id < 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class MDSOptions(FormatOptions):
    """compression: None (shards map without a copy) or "zstd" (each shard one frame);
    concat_tokens: None (a sample per document) or N (LLM Foundry's --concat_tokens:
    samples of exactly N tokens, documents back to back); loss_mask: samples carry a
    `loss_mask` column (chat data)."""

    compression: str | None = knob(None, "zstd compresses each shard whole (default: none, "
                                         "so shards map without a copy)", COMPRESSIONS)
    concat_tokens: int | None = knob(None, "samples of exactly N tokens, documents back to "
                                           "back (LLM Foundry's --concat_tokens; each shard's "
                                           "tail under N is dropped and counted); default: a "
                                           "sample per document")
    loss_mask: bool = False  # decided by the data: chat data's samples carry it

    def for_data(self, chat: bool) -> MDSOptions:
        return replace(self, loss_mask=chat)

    def check(self, where: str) -> None:
        if self.loss_mask and self.concat_tokens is not None:
            raise FormatError(where, "mds concat_tokens cuts documents into fixed-length "
                              "samples, for pretraining text: chat data keeps a sample per "
                              "conversation")
        if self.compression not in COMPRESSIONS:
            raise FormatError(where, f"mds compression {self.compression!r} not among "
                              f"{list(COMPRESSIONS)}")
        if self.concat_tokens is not None and self.concat_tokens < 1:
            raise FormatError(where, f"mds concat_tokens {self.concat_tokens} must be >= 1")


def concat_summary(section: FormatSection, total_tokens: int) -> str | None:
    """The summary line of a concatenated MDS output: samples, and the shards' tails under
    N tokens that were dropped."""
    size = section.options.get("concat_tokens")
    if not size:
        return None
    samples = sum(shard.documents or 0 for shard in section.shards)
    kept = sum(shard.tokens or 0 for shard in section.shards)
    dropped = total_tokens - kept
    if dropped > CONCAT_DROP_WARNING * total_tokens:
        logger.warning("mds: %d tokens (%.1f%%) dropped as shard tails under %d tokens; raise "
                       "--shard-tokens or --unit-bytes (fewer, larger shards drop less)",
                       dropped, 100 * dropped / max(total_tokens, 1), size)
    return (f"{samples:,} samples of {size} tokens (documents back to back); dropped "
            f"{dropped:,} tokens ({dropped / max(total_tokens, 1):.3%}): each shard's tail "
            f"under {size}")


MDS = register(DocumentFormat(NAME, (RAW, ZSTD, *SIDECARS), MDSWriter, MDSReader,
                              mds_dtype, options_type=MDSOptions, read_order=400,
                              index_suffixes=SIDECARS, blocks_need_sums=True,
                              samples=SampleBlocks(OFFSETS_SIDECAR, decode_block),
                              wants_metadata=lambda options: True, holds_loss_mask=True,
                              dataset_index=(f"{NAME}/{INDEX}", index_bytes), separator="eos",
                              summary_line=concat_summary))
