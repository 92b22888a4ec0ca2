"""The Writer/Reader interface every output format implements, and shared helpers.

Invariant: a ShardWriter writes only temporary files until `commit()`, which renames every
file of the shard to its final name (data files first, index last) and returns the final
file names; `abort()` leaves nothing behind. A ShardReader validates headers and sizes
before creating any array, so a corrupt or crafted file raises FormatError naming the file
in O(1) time and memory, and then serves documents as zero-copy slices of a memmap.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raypipe.errors import FormatError


class ShardWriter(ABC):
    """Appends documents (flat uint32 tokens + lengths) to one shard."""

    def __init__(self, directory: Path, name: str, token_dtype: np.dtype, bos_id: int | None):
        self.directory = Path(directory)
        self.name = name
        self.token_dtype = np.dtype(token_dtype)
        self.bos_id = bos_id
        self.num_tokens = 0
        self.num_documents = 0

    @abstractmethod
    def add(self, tokens: np.ndarray, lengths: np.ndarray, metadata: object = None) -> None:
        """Append whole documents; `tokens` is uint32 and sums to `lengths`; `metadata`
        (one DocumentMetadata per document, or None) is kept by formats that store it."""

    @abstractmethod
    def commit(self) -> list[str]:
        """Close, fsync and rename every file to its final name; return the file names."""

    @abstractmethod
    def abort(self) -> None:
        """Remove the temporary files."""


class ShardReader(ABC):
    """Random access to the documents of one committed shard."""

    tokens: np.ndarray          # 1-D token array (a memmap view; never a copy of the shard)
    document_starts: np.ndarray  # int64[N + 1] token offsets; document i = starts[i]:starts[i+1]

    @property
    def num_documents(self) -> int:
        return len(self.document_starts) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def document_lengths(self) -> np.ndarray:
        return np.diff(self.document_starts)

    def document(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range [0, {self.num_documents})")
        return self.tokens[self.document_starts[index]:self.document_starts[index + 1]]


@dataclass(frozen=True)
class Format:
    """A format: its file suffixes, token dtype rule, writer and reader."""

    name: str
    suffixes: tuple[str, ...]
    writer: type[ShardWriter]
    reader: type[ShardReader]
    dtype_for_largest_id: object  # Callable[[int], np.dtype]

    def token_dtype(self, largest_id: int) -> np.dtype:
        return self.dtype_for_largest_id(largest_id)  # type: ignore[operator]


def require_file(path: Path) -> int:
    """The size of `path`, or FormatError if it is missing."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise FormatError(path, "file is missing") from None


def require_size(path: Path, expected: int, actual: int, what: str = "file size") -> None:
    if expected != actual:
        raise FormatError(path, f"{what} does not match its header", expected, actual)


def memmap_tokens(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


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


def file_sha256(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_token_range(tokens: np.ndarray, dtype: np.dtype, where: str) -> None:
    """Refuse ids that do not fit the shard dtype; never truncate."""
    if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
        raise FormatError(where, f"token id {int(tokens.max())} does not fit {dtype}",
                          f"<= {np.iinfo(dtype).max}", int(tokens.max()))
