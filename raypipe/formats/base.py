"""The contracts every output format implements, and the registry that names them.

Invariant: a ShardWriter writes only temporary files (hashed as they are written) until
`commit()`, which renames every file of the shard to its final name in the order its
module states (Megatron and NanoGPT: `.bin` first, then the index; a stream shard: its
sidecars first, `.tokens` last) and returns their FileEntry records; `abort()` leaves
nothing behind (a shard is committed only by its unit record, written after). A
ShardReader validates headers and sizes before creating any array, so a corrupt or crafted
file raises FormatError naming the file in O(1) time and memory, and then serves its
tokens as zero-copy slices of a map of the file (small indexes, such as NanoGPT's
`.bos.idx` or Megatron's document offsets, may be read into private arrays; MDS, whose
samples interleave headers with the ids, decodes its tokens into one private array).
`Reader.from_manifest` opens a shard from its manifest entry, so nothing above this package
branches on a format's name: a new format is one module that calls `register`. Byte
layouts: docs/formats.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np

from raypipe.errors import ConfigError, FormatError
from raypipe.io.atomic import HashedTempFile, file_sha256
from raypipe.io.paths import plain_name, safe_join
from raypipe.io.records import FileEntry, FormatSection, JsonRecord, ShardEntry, TokenizerInfo
from raypipe.io.store import Store


class ShardWriter(ABC):
    """Appends documents (flat uint32 tokens + lengths) to one shard."""

    def __init__(self, directory: Path, name: str, token_dtype: np.dtype, bos_id: int | None):
        self.directory = Path(directory)
        self.name = plain_name(name, str(directory), "shard name")  # never a path
        self.token_dtype = np.dtype(token_dtype)
        self.bos_id = bos_id
        self.num_tokens = 0
        self.num_documents = 0
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

    @abstractmethod
    def add(self, tokens: np.ndarray, lengths: np.ndarray, metadata: object = None) -> None:
        """Append whole documents; `tokens` is uint32 and sums to `lengths`; `metadata`
        (one DocumentMetadata per document, or None) is kept by formats that store it."""

    def add_loss_mask(self, loss_mask: np.ndarray) -> None:
        """Append the loss mask of the documents the last `add` appended: one byte per
        token, 1 where the token is a trained target (chat data). Only formats whose
        `holds_loss_mask` is set store one."""
        raise FormatError(self.directory / self.name, "this format cannot hold a loss mask")

    @abstractmethod
    def commit(self) -> list[FileEntry]:
        """Close, fsync and rename every file to its final name; return their entries."""

    def abort(self) -> None:
        """Remove the temporary files."""
        for handle in self._files.values():
            handle.abort()
        self._files.clear()


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


def shard_prefix(root: Path, shard: ShardEntry) -> Path:
    """`<root>/<format dir>/<shard name>`: the path every file of the shard extends."""
    if not shard.files:
        raise FormatError(root / shard.name, "manifest lists no files for this shard")
    return safe_join(root, shard.files[0].path).with_name(shard.name)


@dataclass(frozen=True)
class FormatOptions(JsonRecord):
    """A format's options: a frozen dataclass per format (fields with their defaults), read
    once from a config's or a manifest section's plain dict and type-checked by the records'
    validator; formats without options use this empty one."""

    @classmethod
    def of(cls, given: dict[str, Any] | None, where: str = "format options") -> Any:
        """The options named in `given` (other keys ignored), defaults for the rest."""
        names = {spec.name for spec in fields(cls)}
        return cls.from_json({k: v for k, v in (given or {}).items() if k in names}, where)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _no_metadata(options: FormatOptions) -> bool:
    return False


# a dataset-level index file of a format: its path in the output, and its bytes from the
# committed section (written when the manifest is, checked by verify)
DatasetIndex = tuple[str, Callable[[Store, FormatSection], bytes]]


@dataclass(frozen=True)
class Format:
    """A format plugin: its file suffixes, token dtype rule, writer, reader, what a shard
    holds (documents, or pre-formed batches packed from documents after the units), its
    options with their defaults, whether its writer wants each document's metadata record
    (source, row, columns), an optional dataset-level index file, and the separator (BOS
    or EOS) its ecosystem expects by default. Nothing outside
    this package branches on a format's name; it asks these."""

    name: str
    suffixes: tuple[str, ...]
    writer: type
    reader: type
    dtype_for_largest_id: Callable[[int], np.dtype]
    holds: Literal["documents", "batches"] = "documents"
    options_type: type[FormatOptions] = FormatOptions
    read_order: int = 100  # which document format a reader opens when several exist
    index_suffixes: tuple[str, ...] = ()  # files enough for document lengths (no tokens)
    wants_metadata: Callable[[Any], bool] = _no_metadata
    dataset_index: DatasetIndex | None = None
    window_metadata: bool = False  # windows of its token stream carry metadata records
    # the document separator its ecosystem writes by default: Megatron's --append-eod and
    # LLM Foundry's eos_text append EOS; nanoGPT/nanochat-style loaders look for BOS
    separator: Literal["bos", "eos"] = "bos"
    # a shard's path prefix as its trainer's data-path argument takes it (Megatron's
    # --data-path: the path without .bin/.idx); None: no such argument
    trainer_prefix: Callable[[ShardEntry], str] | None = None
    holds_loss_mask: bool = False  # its shards can store a per-token loss mask (chat data)
    # a line of the job summary on what the format made of the tokens (its section and the
    # job's total tokens -> the line; None: nothing to add)
    summary_line: Callable[[FormatSection, int], str | None] = lambda section, total: None

    def token_dtype(self, largest_id: int) -> np.dtype:
        return self.dtype_for_largest_id(largest_id)

    def section(self, largest_id: int, shards: Iterable[ShardEntry],
                options: dict[str, Any]) -> FormatSection:
        """The manifest's section for this format (the one place it is built): its token
        dtype for a vocabulary whose largest id is `largest_id`, its shards in order, and its
        options as the manifest records them."""
        return FormatSection(self.token_dtype(largest_id).name, tuple(shards), options)

    @property
    def holds_batches(self) -> bool:
        """Its shards hold pre-formed batches (packed after the units), not documents."""
        return self.holds == "batches"

    def options(self, given: dict[str, Any] | None = None) -> Any:
        """The format's typed options (its `options_type`) from a config's or a manifest
        section's plain dict: defaults for what `given` leaves out."""
        return self.options_type.of(given, f"{self.name} options")


FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"format {name!r} unknown; known: {list(FORMATS)}") from None


def document_formats() -> tuple[str, ...]:
    """Names of the formats whose shards hold documents, in preference order for reading."""
    chosen = [fmt for fmt in FORMATS.values() if not fmt.holds_batches]
    return tuple(fmt.name for fmt in sorted(chosen, key=lambda fmt: fmt.read_order))


def batch_formats() -> tuple[str, ...]:
    """Names of the formats whose shards hold pre-formed batches."""
    return tuple(fmt.name for fmt in FORMATS.values() if fmt.holds_batches)


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


__all__ = ["FORMATS", "Format", "ShardReader", "ShardWriter", "batch_formats",
           "dataset_index_problems", "document_formats", "file_sha256", "get_format",
           "register", "shard_prefix", "write_dataset_indexes"]
