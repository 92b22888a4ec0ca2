"""The contracts every output format implements, and the registry that names them. A format is
one of two typed kinds: a DocumentFormat (ShardWriter / ShardReader: documents, written per
work unit) or a BatchFormat (BatchWriter / BatchReader: pre-formed batches, packed from the
document shards after the units by one packer for every batch format).

Invariant: a ShardWriter (or BatchWriter) writes only temporary files (hashed as they are
written) until `commit()`, which renames every file of the shard to its final name in the
order its module states (Megatron and NanoGPT: `.bin` first, then the index; a stream
shard: its sidecars first, `.tokens` last) and returns their FileEntry records; `abort()`
leaves nothing behind (a shard is committed only by its unit record, written after). A
ShardReader validates headers and sizes before creating any array, so a corrupt or crafted
file raises FormatError naming the file in O(1) time and memory, and then serves its tokens
as zero-copy slices of a map of the file (small indexes, such as NanoGPT's `.bos.idx` or
Megatron's document offsets, may be read into private arrays; MDS, whose samples interleave
headers with the ids, decodes its tokens into one private array). `Reader.from_manifest`
opens a shard from its manifest entry, so nothing above this package branches on a format's
name: a new format is one module that calls `register`. Byte layouts: docs/formats.md.
Chat data's `.mask` sidecar is checksummed as it is written (`.mask.sums`: one CRC-32 pass
over a byte a token, in the writing worker, ~0.1% of a unit's tokenize time; nothing on the
driver).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from raypipe.errors import ConfigError, FormatError
from raypipe.io.atomic import HashedTempFile, file_sha256
from raypipe.io.checksums import SUMS_SUFFIX, UNIT_BYTES, ChecksumWriter, sums_file_bytes
from raypipe.io.manifest_compat import former_packings, upgrade_batch_section
from raypipe.io.mapping import map_file
from raypipe.io.paths import plain_name, safe_join
from raypipe.io.records import (
    FileEntry,
    FormatSection,
    JsonRecord,
    ShardEntry,
    TokenizerInfo,
)
from raypipe.io.store import Store
from raypipe.knobs import knob, knob_fields_of


@dataclass
class DocumentMetadata:
    """One document's metadata record and its spans, as a writer that keeps metadata gets
    them: (first token, stop token, record), token offsets relative to the document's first
    token (BOS included)."""

    record: dict[str, Any]
    spans: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)


class ShardFiles:
    """The files of one shard being written: hashed temp files `<name><suffix>` in
    `directory`, each committed by suffix, all removed by `abort`."""

    def __init__(self, directory: Path, name: str):
        self.directory = Path(directory)
        self.name = plain_name(name, str(directory), "shard name")  # never a path
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, HashedTempFile] = {}

    def open_file(self, suffix: str) -> HashedTempFile:
        """A hashed temp file for `<name><suffix>`; aborted with the shard."""
        handle = HashedTempFile(self.directory / f"{self.name}{suffix}")
        self._files[suffix] = handle
        return handle

    def commit_file(self, suffix: str) -> FileEntry:
        """Commit one file; its entry's path is relative to the dataset root."""
        handle = self._files.pop(suffix)
        size, sha256, mtime_ns = handle.commit()
        return FileEntry(f"{self.directory.name}/{handle.final.name}", size, sha256, mtime_ns)

    def commit_bytes(self, suffix: str, data: bytes) -> FileEntry:
        """Write a small file of the shard whole (an index known at commit) and commit it."""
        self.open_file(suffix).write(data)
        return self.commit_file(suffix)

    def abort(self) -> None:
        """Remove the temporary files."""
        for handle in self._files.values():
            handle.abort()
        self._files.clear()


MASK_SIDECAR = ".mask"  # a document shard's loss mask (chat data): u8 per token
MASK_SUMS_SIDECAR = MASK_SIDECAR + SUMS_SUFFIX  # its checksums by document (io.checksums)
# raypipe's document lengths of a shard whose format keeps no index of its own (stream,
# MDS): each document's token count, u32 LE, in shard order
LENGTHS_SIDECAR = ".lengths"


class ShardWriter(ShardFiles, ABC):
    """Appends documents (flat uint32 tokens + lengths) to one shard."""

    def __init__(self, directory: Path, name: str, token_dtype: np.dtype, bos_id: int | None):
        super().__init__(directory, name)
        self.token_dtype = np.dtype(token_dtype)
        self.bos_id = bos_id
        self.num_tokens = 0
        self.num_documents = 0
        self.masked_tokens = 0  # tokens whose loss mask is written (chat data: all of them)
        self.mask_sums: ChecksumWriter | None = None  # the `.mask` sidecar's (chat data)

    @property
    def entry_itemsize(self) -> int:
        """The bytes its token file holds a token (the token's; stream: its record's)."""
        return self.token_dtype.itemsize

    @abstractmethod
    def add(self, tokens: np.ndarray, lengths: np.ndarray, metadata: object = None) -> None:
        """Append whole documents; `tokens` is uint32 and sums to `lengths`; `metadata`
        (one DocumentMetadata per document, or None) is kept by formats that store it."""

    # the writer keeps chat data's loss mask in `<name>.mask` (one u8 per token, in token
    # order), a file its ecosystem's readers never open
    keeps_mask_sidecar: bool = False

    def add_loss_mask(self, loss_mask: np.ndarray, lengths: np.ndarray) -> None:
        """The loss mask of the documents the next `add` appends (`lengths`: their token
        counts): one byte per token, 1 where the token is a trained target (chat data).
        Only formats whose `holds_loss_mask` is set store one: in the `.mask` sidecar,
        checksummed by document in `.mask.sums` (so a loader reads it a block at a time),
        where the writer `keeps_mask_sidecar`, else by overriding this."""
        if not self.keeps_mask_sidecar:
            raise FormatError(self.directory / self.name, "this format cannot hold a loss mask")
        mask_file = self._files.get(MASK_SIDECAR) or self.open_file(MASK_SIDECAR)
        data = np.ascontiguousarray(loss_mask, dtype=np.uint8)
        mask_file.write(data.data)
        if self.mask_sums is None:  # units of the token file's tokens: a block of whole
            # token units is one of whole mask units
            self.mask_sums = ChecksumWriter(UNIT_BYTES // self.entry_itemsize)
        self.mask_sums.add(data, np.asarray(lengths, dtype=np.int64))
        self.masked_tokens += int(loss_mask.size)

    def commit_mask_sidecar(self) -> list[FileEntry]:
        """The `.mask` sidecar's and its `.mask.sums`'s entries (none without chat data),
        once it holds a byte per token of the shard."""
        if self.masked_tokens not in (0, self.num_tokens):
            raise FormatError(self.directory / f"{self.name}{MASK_SIDECAR}", "a loss mask "
                              "byte per token", self.num_tokens, self.masked_tokens)
        if MASK_SIDECAR not in self._files or self.mask_sums is None:
            return []
        return [self.commit_file(MASK_SIDECAR),
                self.commit_bytes(MASK_SUMS_SIDECAR, self.mask_sums.encoded())]

    def add_lengths_sidecar(self, lengths: np.ndarray) -> None:
        """Append these documents' token counts to the `.lengths` sidecar (formats that
        keep no index of their own: a loader reads a shard's lengths without its tokens)."""
        lengths_file = self._files.get(LENGTHS_SIDECAR) or self.open_file(LENGTHS_SIDECAR)
        lengths_file.write(np.asarray(lengths).astype("<u4").data)

    def commit_lengths_sidecar(self) -> list[FileEntry]:
        """The `.lengths` sidecar's entry (written empty for a shard of no documents)."""
        if LENGTHS_SIDECAR not in self._files:
            self.open_file(LENGTHS_SIDECAR)
        return [self.commit_file(LENGTHS_SIDECAR)]

    @abstractmethod
    def commit(self) -> list[FileEntry]:
        """Close, fsync and rename every file to its final name; return their entries."""


class ShardReader(ABC):
    """Random access to the documents of one committed shard."""

    tokens: np.ndarray          # 1-D token array (a map of the file; MDS: decoded, private)
    loss_mask: np.ndarray | None = None  # uint8 per token, 1: a trained target (chat data)
    document_starts: np.ndarray  # int64[N + 1] token offsets; document i = starts[i]:starts[i+1]

    @classmethod
    @abstractmethod
    def from_manifest(cls, root: Path, shard: ShardEntry, section: FormatSection,
                      tokenizer: TokenizerInfo) -> ShardReader:
        """Open the shard a manifest entry names (paths checked to stay inside `root`)."""

    @classmethod
    def index_document_lengths(cls, root: Path, shard: ShardEntry,
                               tokenizer: TokenizerInfo) -> np.ndarray:
        """Document lengths from the shard's index files alone (the files of
        `Format.index_suffixes`), for formats that have such an index."""
        raise NotImplementedError(f"{cls.__name__} keeps no document index")

    @property
    def token_entries(self) -> np.ndarray:
        """Its token file's entries, one a token (what a `.sums` covers): `tokens`, or the
        records that hold them (stream)."""
        return self.tokens

    @property
    def num_documents(self) -> int:
        return len(self.document_starts) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def document_lengths(self) -> np.ndarray:
        return np.diff(self.document_starts)

    def locate(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first token, token count) of the documents with these indices in the shard."""
        firsts = self.document_starts[local]
        return firsts, self.document_starts[local + 1] - firsts

    def document(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range [0, {self.num_documents})")
        return self.tokens[self.document_starts[index]:self.document_starts[index + 1]]

    def check_counts(self, shard: ShardEntry, where: Path) -> None:
        """The shard holds what its manifest entry says."""
        for what, expected, actual in (("documents", shard.documents, self.num_documents),
                                       ("tokens", shard.tokens, self.num_tokens)):
            if expected != actual:
                raise FormatError(where, f"{what} differ from the manifest", expected, actual)

    def verify_contents(self) -> None:  # noqa: B027  (optional hook, nothing to check here)
        """Checks beyond headers and sizes that need a pass over the data (verify only)."""


def shard_file(shard: ShardEntry, suffix: str) -> FileEntry | None:
    """The shard's file `<shard name><suffix>` its manifest entry lists (None: not listed,
    a sidecar it may lack); `.sums` is not `.mask.sums`."""
    name = shard.name + suffix
    return next((entry for entry in shard.files if entry.path.rpartition("/")[2] == name),
                None)


def lists_file(shard: ShardEntry, suffix: str) -> bool:
    """The shard's manifest entry lists its file of `suffix` (a sidecar it may lack)."""
    return shard_file(shard, suffix) is not None


def lists_mask_sidecar(shard: ShardEntry) -> bool:
    """The shard's manifest entry lists a `.mask` sidecar (chat data)."""
    return lists_file(shard, MASK_SIDECAR)


def map_mask_sidecar(prefix: Path, tokens: int) -> np.ndarray:
    """The `<prefix>.mask` sidecar as a read-only u8 map, its size checked: a byte a token."""
    path = prefix.with_name(prefix.name + MASK_SIDECAR)
    require_size(path, tokens, require_file(path), "loss mask bytes (one per token)")
    return map_file(path, np.uint8)


def read_lengths_sidecar(path: Path, documents: int | None = None,
                         tokens: int | None = None) -> np.ndarray:
    """A `.lengths` sidecar's document lengths (int64), its size checked against
    `documents` and its sum against `tokens` where given (FormatError naming it)."""
    size = require_file(path)
    if size % 4 or (documents is not None and size != 4 * documents):
        raise FormatError(path, "size of the document lengths (u32 each)",
                          "a multiple of 4" if documents is None else 4 * documents, size)
    lengths = np.fromfile(path, dtype="<u4").astype(np.int64)
    if tokens is not None and int(lengths.sum()) != tokens:
        raise FormatError(path, "tokens the document lengths add up to", tokens,
                          int(lengths.sum()))
    return lengths


def sidecar_document_lengths(root: Path, shard: ShardEntry) -> np.ndarray:
    """The lengths a shard's `.lengths` sidecar lists, checked against its manifest entry
    (what `index_document_lengths` is for a format that keeps one)."""
    return read_lengths_sidecar(lengths_sidecar_path(shard_prefix(root, shard)),
                                shard.documents, shard.tokens)


def lengths_sidecar_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + LENGTHS_SIDECAR)


def check_lengths_sidecar(prefix: Path, lengths: np.ndarray) -> None:
    """The `<prefix>.lengths` sidecar lists the documents an opened shard holds (so plans
    made from it are the reader's documents): FormatError naming it and the first one
    that differs."""
    path = lengths_sidecar_path(prefix)
    listed = read_lengths_sidecar(path)
    if listed.size != lengths.size or not np.array_equal(listed, lengths):
        common = min(listed.size, lengths.size)
        differs = np.flatnonzero(listed[:common] != lengths[:common])
        first = int(differs[0]) if differs.size else common
        raise FormatError(path, f"document lengths differ from the shard's at document "
                          f"{first}", f"{lengths.size} documents as the shard holds them",
                          f"{listed.size} listed")


def shard_prefix(root: Path, shard: ShardEntry) -> Path:
    """`<root>/<format dir>/<shard name>`: the path every file of the shard extends."""
    if not shard.files:
        raise FormatError(root / shard.name, "manifest lists no files for this shard")
    return safe_join(root, shard.files[0].path).with_name(shard.name)


PACKING_BY_DATA = "auto"  # a packing left to the data: see packing_for_data
# how a batch format's records are packed
RECORD_PACKINGS = ("fill", "split", "crop", "concat")
# what a batch format's packing takes (former names too: raypipe.io.manifest_compat)
BATCH_PACKINGS = (*RECORD_PACKINGS, *former_packings(), PACKING_BY_DATA)


def packing_for_data(packing: str, chat: bool) -> str:
    """What packing "auto" stands for, wherever rows are packed (the loader's bestfit mode,
    batch formats' records): "split" for chat data (a conversation that fits a row is never
    cut), "fill" for text (full rows); any other packing as given."""
    if packing != PACKING_BY_DATA:
        return packing
    return "split" if chat else "fill"


@dataclass(frozen=True)
class FormatOptions(JsonRecord):
    """A format's options: a frozen dataclass per format. Fields declared with `knob`
    (default, help, choices) are what a user sets: the tokenize config's
    `formats: {name: {option: value}}`, the CLI's `--<format>-<option>` flags and convert's
    are made from them. Other fields are decided by the data (`for_data`) and recorded in
    the manifest section. Read from a config's or a section's plain dict and type-checked by
    the records' validator; formats without options use this empty one."""

    @classmethod
    def of(cls, given: dict[str, Any] | None, where: str = "format options") -> Any:
        """The options named in `given` (other keys ignored), defaults for the rest."""
        names = {spec.name for spec in fields(cls)}
        return cls.from_json({k: v for k, v in (given or {}).items() if k in names}, where)

    @classmethod
    def settable(cls) -> tuple[Any, ...]:
        """The fields a user sets (declared with `knob`)."""
        return knob_fields_of(cls)

    def for_data(self, chat: bool) -> FormatOptions:
        """The options with what the data decides set (chat data: a loss mask; "auto"
        packing resolved)."""
        return self

    def settings(self) -> dict[str, Any]:
        """The options a user set, by name (what a config records)."""
        return {spec.name: getattr(self, spec.name) for spec in self.settable()}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BatchOptions(FormatOptions):
    """Every batch format's options (one record for all of them): records of `record_len`
    tokens (T + 1, the loader's seq_len + 1), `batch_size` per batch, packed by `packing`
    with `seed`, `batches_per_shard` batches per file."""

    record_len: int = knob(0, "tokens per record, T + 1 (the loader's and pack-report's "
                              "--seq-len is T); required")
    batch_size: int = knob(0, "records per batch; required")
    packing: str = knob(PACKING_BY_DATA, "fill (every token, every record full), split "
                        "(every token, documents whole where they fit, padding marked), "
                        "crop (nanochat: records start with BOS, tails cropped), concat, "
                        "or auto (split for chat data, fill for text)", BATCH_PACKINGS)
    seed: int = knob(0, "record shuffle seed")
    batches_per_shard: int = knob(1024, "batches per file")

    def check(self, where: str) -> None:
        if self.record_len < 2 or self.batch_size < 1:
            raise FormatError(where, "needs record_len (tokens per record, >= 2) and "
                              "batch_size (records per batch, >= 1)")
        if self.packing not in BATCH_PACKINGS:
            raise FormatError(where, f"packing {self.packing!r} not among "
                              f"{list(BATCH_PACKINGS)}")
        if self.batches_per_shard < 1:
            raise FormatError(where, f"batches_per_shard must be >= 1, got "
                              f"{self.batches_per_shard}")

    def for_data(self, chat: bool) -> BatchOptions:
        return replace(self, packing=packing_for_data(self.packing, chat))


@dataclass(frozen=True)
class BatchSection(FormatOptions):
    """What a batch format's manifest section records (every batch format's, one record):
    the record shape (record_len tokens, T + 1; batch_size records), the packing and seed that made
    them, the records before batching and the batches kept, the document format they were
    packed from, the pad token and the packing report's token counts (None where an older
    output does not record them: raypipe.io.manifest_compat)."""

    record_len: int = 0
    batch_size: int = 0
    packing: str = "fill"
    seed: int = 0
    total_records: int = 0
    num_batches: int = 0
    source_format: str | None = None
    pad_id: int | None = None
    used_tokens: int | None = None
    cropped_tokens: int | None = None
    padded_tokens: int = 0
    dropped_tokens: int | None = None
    repeated_tokens: int = 0  # chat data's overlong `split` pieces: tokens placed twice

    @property
    def has_report(self) -> bool:
        return self.used_tokens is not None


def _no_metadata(options: FormatOptions) -> bool:
    return False


# a dataset-level index file of a format: its path in the output, and its bytes from the
# committed section (written when the manifest is, checked by verify)
DatasetIndex = tuple[str, Callable[[Store, FormatSection], bytes]]


@dataclass(frozen=True)
class Format:
    """What every format plugin declares: its file suffixes, token dtype rule, writer and
    reader, its options with their defaults, an optional dataset-level index file and a
    line for the job summary. A format is one of two kinds, each its own typed record:
    `DocumentFormat` (shards of documents, written per work unit) and `BatchFormat`
    (shards of pre-formed batches, packed from the document shards after the units).
    Nothing outside this package branches on a format's name; it asks these."""

    name: str
    suffixes: tuple[str, ...]
    writer: type
    reader: type
    dtype_for_largest_id: Callable[[int], np.dtype]
    options_type: type[FormatOptions] = FormatOptions
    dataset_index: DatasetIndex | None = None
    # a line of the job summary on what the format made of the tokens (its section and the
    # job's total tokens -> the line; None: nothing to add)
    summary_line: Callable[[FormatSection, int], str | None] = lambda section, total: None
    holds_loss_mask: bool = False  # its shards can store a per-token loss mask (chat data)
    # its readers find documents by the separator token alone (no index of their own)
    finds_documents_by_separator: bool = False
    # what its shards hold: "documents" or "batches" (each kind's typed record sets it);
    # the dataset opener (raypipe.dataset) and the loader modes dispatch on it
    kind: ClassVar[str] = ""

    def token_dtype(self, largest_id: int) -> np.dtype:
        return self.dtype_for_largest_id(largest_id)

    def section(self, largest_id: int, shards: Iterable[ShardEntry],
                options: dict[str, Any]) -> FormatSection:
        """The manifest's section for this format (the one place it is built): its token
        dtype for a vocabulary whose largest id is `largest_id`, its shards in order, and its
        options as the manifest records them."""
        return FormatSection(self.token_dtype(largest_id).name, tuple(shards), options)

    def options(self, given: dict[str, Any] | None = None) -> Any:
        """The format's typed options (its `options_type`) from a config's or a manifest
        section's plain dict: defaults for what `given` leaves out."""
        return self.options_type.of(given, f"{self.name} options")

    def options_for(self, given: dict[str, Any] | FormatOptions | None, chat: bool) -> Any:
        """The options a job writes with: `given` (a user's dict, or typed options), the
        data's part decided (`for_data`), checked (FormatError naming the format and the
        option)."""
        if isinstance(given, FormatOptions):
            given = given.settings()
        settable = [spec.name for spec in self.options_type.settable()]
        unknown = sorted(set(given or {}) - set(settable))
        if unknown:
            raise FormatError(f"{self.name} options", f"unknown option(s) {unknown}; "
                              f"{self.name} has {settable or 'none'}")
        resolved = self.options(given).for_data(chat)
        resolved.check(f"{self.name} options")
        return resolved


@dataclass(frozen=True)
class SampleBlocks:
    """How a format whose samples interleave a header with their tokens (MDS) is read a
    block at a time: `offsets_suffix` names the sidecar listing each sample's first byte in
    the shard's token file (u32 LE, one a sample and the file's end), and `decode(data,
    starts, dtype, loss_mask, where)` gives the tokens and (with `loss_mask`) the loss mask
    of a run of whole samples from their bytes (`starts`: each sample's first byte in
    `data`; FormatError naming `where` for bytes that are no such samples)."""

    offsets_suffix: str
    decode: Callable[[np.ndarray, np.ndarray, np.dtype, bool, str],
                     tuple[np.ndarray, np.ndarray | None]]


@dataclass(frozen=True)
class DocumentFormat(Format):
    """A format whose shards hold documents (a ShardWriter / ShardReader pair): which one a
    reader opens when several exist, the files enough for document lengths, whether its
    writer wants each document's metadata record (source, row, columns) and its windows
    carry them, the separator (BOS or EOS) its ecosystem expects by default, its trainer's
    data-path argument, and whether it stores chat data's loss mask."""

    read_order: int = 100  # which document format a reader opens when several exist
    # files enough for document lengths (no tokens): the first lists the lengths (a shard
    # without it is opened whole for them), the others (checksums) are read beside it
    index_suffixes: tuple[str, ...] = ()
    # where its token file (the first suffix's) holds the tokens, back to back in document
    # order from this byte on, so a run of documents is a byte range of it found from the
    # index alone (a loader fetches blocks of it: raypipe.dataset); None: read whole
    tokens_at: int | None = None
    # the entry its token file holds for each token, where wider than the token (stream's
    # {token, metadata_id} records, from the section's options); None: the token itself
    token_entry: Callable[[FormatSection], np.dtype] | None = None
    # where its samples interleave headers with tokens: how a run of them is found (a
    # sidecar of their byte offsets) and decoded, so a loader fetches blocks of them
    samples: SampleBlocks | None = None
    # where its lengths index holds the documents' lengths as one array (the index's
    # suffix, the array's first byte, its dtype), so a loader on a bucket fetches that
    # range alone at the open, not the whole index (Megatron's .idx: 4 of its 20 bytes a
    # document); None: the whole index
    lengths_at: tuple[str, int, str] | None = None
    # its shards are read a block at a time only where they list a `.sums` (outputs written
    # before the format had one are read whole, each checked by its sha256)
    blocks_need_sums: bool = False
    wants_metadata: Callable[[Any], bool] = _no_metadata
    window_metadata: bool = False  # windows of its token stream carry metadata records
    # the document separator its ecosystem writes by default: Megatron's --append-eod and
    # LLM Foundry's eos_text append EOS; nanoGPT/nanochat-style loaders look for BOS
    separator: Literal["bos", "eos"] = "bos"
    # a shard's path prefix as its trainer's data-path argument takes it (Megatron's
    # --data-path: the path without .bin/.idx); None: no such argument
    trainer_prefix: Callable[[ShardEntry], str] | None = None
    # how many metadata records a shard holds, from its manifest entry (formats whose
    # windows carry records; else 0)
    metadata_records: Callable[[ShardEntry], int] = lambda shard: 0
    kind: ClassVar[str] = "documents"

    def entry_dtype(self, section: FormatSection) -> np.dtype:
        """What its token file holds for each token (`token_entry`; else the token)."""
        return (self.token_entry(section) if self.token_entry is not None
                else np.dtype(section.dtype))


@dataclass(frozen=True)
class BatchFormat(Format):
    """A format whose shards hold pre-formed [batch_size, record_len] batches (a BatchWriter
    / BatchReader pair), packed from a job's document shards by one record plan; every
    batch format stores chat data's loss mask, and says which id its padding holds."""

    pad_token: Callable[[TokenizerInfo], int] = lambda tokenizer: 0
    holds_loss_mask: bool = True  # a BatchWriter takes each batch's loss mask
    options_type: type[FormatOptions] = BatchOptions
    kind: ClassVar[str] = "batches"

    def recorded(self, section: FormatSection) -> BatchSection:
        """What the format's manifest section records, typed."""
        return BatchSection.of(upgrade_batch_section(section.options),
                               f"{self.name} section")


@dataclass(frozen=True)
class RecordPieces:
    """Where one packed record's pieces start (`columns`, the first 0) and whether each
    starts and ends its document: what a batch format stores so that a loader finds
    sequences and true targets without a token scan."""

    columns: np.ndarray
    starts_document: np.ndarray
    ends_document: np.ndarray


class BatchWriter(ShardFiles, ABC):
    """Writes `num_batches` pre-formed batches into one shard (told up front)."""

    def __init__(self, directory: Path, name: str, batch_size: int, record_len: int,
                 num_batches: int, seed: int, total_records: int):
        super().__init__(directory, name)

    @abstractmethod
    def add_batch(self, batch: np.ndarray, lengths: np.ndarray, pieces: list[RecordPieces],
                  loss_mask: np.ndarray | None = None) -> None:
        """One [B, T] batch of ids; each record's real tokens (the rest is padding, holding
        the format's pad token), its pieces, and (chat data) its [B, T] per-token loss
        mask (1: the token is a trained target)."""

    @abstractmethod
    def commit(self) -> list[FileEntry]:
        """Close, fsync and rename every file to its final name; return their entries."""


class BatchReader(ABC):
    """Zero-copy access to the batches of one committed batch shard."""

    batch_size: int
    record_len: int  # tokens a record holds: T + 1
    num_batches: int

    @classmethod
    @abstractmethod
    def from_manifest(cls, root: Path, shard: ShardEntry, section: FormatSection,
                      tokenizer: TokenizerInfo) -> BatchReader:
        """Open the shard a manifest entry names (paths checked to stay inside `root`)."""

    def check_counts(self, shard: ShardEntry, where: Path) -> None:
        if shard.batches != self.num_batches:
            raise FormatError(where, "batches differ from the manifest", shard.batches,
                              self.num_batches)

    def verify_contents(self) -> None:  # noqa: B027  (optional hook)
        """Checks beyond headers and sizes that need a pass over the data (verify only)."""

    @abstractmethod
    def batch(self, index: int) -> np.ndarray:
        """Batch `index` as a read-only [B, T] view."""

    @abstractmethod
    def padding(self, index: int, batch: np.ndarray | None = None) -> np.ndarray:
        """[B, T] bool: where batch `index`'s records hold padding."""

    @abstractmethod
    def pieces(self, index: int) -> Any:
        """Batch `index`'s record pieces (None where the file predates them)."""

    @abstractmethod
    def records(self, index: int) -> list[np.ndarray]:
        """Batch `index`'s records without their padding."""

    def loss_mask(self, index: int) -> np.ndarray | None:
        """[B, T] uint8: batch `index`'s per-token loss mask (chat data); None: every
        target is trained."""
        return None


FORMATS: dict[str, Format] = {}


# the keys of a manifest section that are not its format's options (a section records its
# options beside them)
SECTION_KEYS = ("dtype", "shards", "separators")


def register(fmt: Format) -> Format:
    """Add a format to the registry (an option may not take a section key's name)."""
    taken = sorted({spec.name for spec in fields(fmt.options_type)} & set(SECTION_KEYS))
    if taken:
        raise ConfigError(f"format {fmt.name!r}: option(s) {taken} would shadow the manifest "
                          f"section's own keys {list(SECTION_KEYS)}; rename them")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"format {name!r} unknown; known: {list(FORMATS)}") from None


def document_format(name: str) -> DocumentFormat:
    """The document format `name` (ConfigError for a batch format or an unknown name)."""
    fmt = get_format(name)
    if not isinstance(fmt, DocumentFormat):
        raise ConfigError(f"format {name!r} holds pre-formed batches, not documents")
    return fmt


def batch_format(name: str) -> BatchFormat:
    """The batch format `name` (ConfigError for a document format or an unknown name)."""
    fmt = get_format(name)
    if not isinstance(fmt, BatchFormat):
        raise ConfigError(f"format {name!r} holds documents, not pre-formed batches")
    return fmt


def of_kind(names: Iterable[str], kind: str) -> tuple[str, ...]:
    """Those of the formats `names` whose shards hold `kind` ("documents", "batches")."""
    return tuple(name for name in names if get_format(name).kind == kind)


def document_formats() -> tuple[str, ...]:
    """Names of the formats whose shards hold documents, in preference order for reading."""
    chosen = [fmt for fmt in FORMATS.values() if isinstance(fmt, DocumentFormat)]
    return tuple(fmt.name for fmt in sorted(chosen, key=lambda fmt: fmt.read_order))


def batch_formats() -> tuple[str, ...]:
    """Names of the formats whose shards hold pre-formed batches."""
    return tuple(fmt.name for fmt in FORMATS.values() if isinstance(fmt, BatchFormat))


def write_dataset_indexes(store: Store, formats: dict[str, FormatSection]) -> None:
    """Write the dataset-level index file of every format that has one (before the
    manifest: the manifest is what makes an output complete)."""
    for name, section in formats.items():
        index = get_format(name).dataset_index
        if index is not None:
            store.write_bytes(index[0], index[1](store, section))


def dataset_index_problems(store: Store, formats: dict[str, FormatSection]) -> list[str]:
    """What differs between the dataset-level index files and the committed sections."""
    problems = []
    for name, section in formats.items():
        index = get_format(name).dataset_index
        if index is None:
            continue
        path, build = index
        if not store.exists(path):
            problems.append(f"{store.uri_of(path)}: missing")
        elif store.read_bytes(path) != build(store, section):
            problems.append(f"{store.uri_of(path)}: differs from the manifest's shards")
    return problems


def require_file(path: Path) -> int:
    """The size of `path`, or FormatError if it is missing."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise FormatError(path, "file is missing") from None


def require_size(path: Path, expected: int, actual: int, what: str = "file size") -> None:
    if expected != actual:
        raise FormatError(path, f"{what} does not match its header", expected, actual)


def require_sums(prefix: Path, token_file_bytes: int) -> None:
    """The shard's `.sums` (its token file's checksums: raypipe.io.checksums, read by the
    dataset that checks reads) exists and is sized for `token_file_bytes` of tokens."""
    sums_path = prefix.with_name(prefix.name + SUMS_SUFFIX)
    require_size(sums_path, sums_file_bytes(token_file_bytes), require_file(sums_path),
                 "size of the .sums for the token file's tokens")


def starts_from_markers(tokens: np.ndarray, bos_id: int | None,
                        eos_id: int | None) -> np.ndarray:
    """Document starts [N + 1] of a token stream without an index: at every BOS, else after
    every EOS, else the whole stream is one document."""
    count = tokens.size
    if bos_id is not None:
        starts = np.flatnonzero(tokens == bos_id)
    elif eos_id is not None:
        starts = np.flatnonzero(tokens[:-1] == eos_id) + 1
    else:
        starts = np.zeros(0, dtype=np.int64)
    if count and (starts.size == 0 or starts[0] != 0):
        starts = np.concatenate([[0], starts])
    return np.append(starts, count).astype(np.int64)


def check_token_range(tokens: np.ndarray, dtype: np.dtype, where: str) -> None:
    """Refuse ids that do not fit the shard dtype; never truncate."""
    if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
        raise FormatError(where, f"token id {int(tokens.max())} does not fit {dtype}",
                          f"<= {np.iinfo(dtype).max}", int(tokens.max()))


__all__ = ["FORMATS", "BatchFormat", "BatchReader", "BatchWriter", "DocumentFormat",
           "DocumentMetadata", "Format",
           "LENGTHS_SIDECAR", "RecordPieces", "SampleBlocks", "ShardReader", "ShardWriter",
           "batch_format", "batch_formats",
           "dataset_index_problems", "document_format", "document_formats", "file_sha256",
           "get_format", "of_kind", "register", "shard_prefix",
           "write_dataset_indexes"]
