"""Checksums of a token file in units of whole documents, so any run of documents a reader
takes (a block a loader fetches, a document it serves) is checked against what the job
wrote, without reading the rest of the file.

Invariant: unit k of a token stream holds the documents whose first byte lies in
[k x unit_bytes, (k + 1) x unit_bytes) of the stream (none: an empty unit, crc 0), so units
never cut a document and a loader's block of a multiple of `unit_bytes`
(raypipe.sampling.blocks) is exactly a run of whole units. A stream whose documents carry
more than their tokens (MDS samples) is cut by its documents' token bytes instead (`cuts`:
where each would begin in a file of tokens alone), so its units hold the documents a
loader's blocks do, and each unit's CRC covers those documents' own bytes. A
`<shard>.sums` file records the CRC-32 of every unit: 8 magic bytes, the unit size (u64
LE), then one u32 LE per unit, ceil(stream bytes (or cut bytes) / unit_bytes) of them
(docs/formats.md). Cost: one u32 each 4 KiB (0.1% of the tokens), CRC-32 at ~2-3 GB/s
on one core.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.errors import FormatError
from raypipe.io.mapping import token_view

SUMS_SUFFIX = ".sums"
UNIT_BYTES = 4096  # what new outputs write; a reader takes the size its file records
MAGIC = b"RPSUMS\x00\x01"
HEADER = np.dtype([("magic", "S8"), ("unit_bytes", "<u8")])


def unit_count(stream_bytes: int, unit_bytes: int) -> int:
    return -(-int(stream_bytes) // unit_bytes)


def sums_file_bytes(stream_bytes: int, unit_bytes: int = UNIT_BYTES) -> int:
    """The size of the `.sums` of a stream of `stream_bytes` (written with `unit_bytes`)."""
    return HEADER.itemsize + 4 * unit_count(stream_bytes, unit_bytes)


def unit_bounds(document_bytes: np.ndarray, unit_bytes: int,
                cuts: np.ndarray | None = None) -> np.ndarray:
    """int64[U + 1]: where each unit of the stream starts, and the stream's end, from the
    streams's document starts (`document_bytes`: int64[D + 1] byte offsets, the last the
    stream's size); `cuts` (int64[D + 1], default `document_bytes`): the positions units
    are cut by."""
    starts = np.asarray(document_bytes, dtype=np.int64)
    cut = starts if cuts is None else np.asarray(cuts, dtype=np.int64)
    grid = np.arange(unit_count(int(cut[-1]), unit_bytes), dtype=np.int64) * unit_bytes
    first = np.searchsorted(cut[:-1], grid, side="left")
    return np.append(starts[first], int(starts[-1]))


def encode_sums(crcs: list[int] | np.ndarray, unit_bytes: int) -> bytes:
    header = np.array([(MAGIC, unit_bytes)], dtype=HEADER)
    return header.tobytes() + np.asarray(crcs, dtype="<u4").tobytes()


class ChecksumWriter:
    """CRC-32 of each unit of a token stream written in pieces of whole documents (the
    writer's `add`); `encoded()` is the `.sums` file's bytes. One CRC call a unit."""

    def __init__(self, unit_bytes: int = UNIT_BYTES):
        self.unit_bytes = unit_bytes
        self.crcs: list[int] = []
        self.position = 0  # bytes of the stream so far
        self.cut_position = 0  # ... as units are cut (their tokens' bytes: `add`'s cuts)
        self._crc = 0  # the open unit's CRC so far (unit len(self.crcs))

    def add(self, data: Any, document_bytes: np.ndarray,
            document_cuts: np.ndarray | None = None) -> None:
        """Append whole documents: `data` their bytes, `document_bytes` each one's size,
        `document_cuts` each one's size as units are cut (default: its bytes)."""
        view = memoryview(data).cast("B")
        sizes = np.asarray(document_bytes, dtype=np.int64)
        if int(sizes.sum()) != len(view):
            raise ValueError("document sizes do not add up to the bytes given")
        before = np.cumsum(sizes) - sizes  # each document's first byte in `data`
        cut_sizes = sizes if document_cuts is None else np.asarray(document_cuts, np.int64)
        units = (self.cut_position + np.cumsum(cut_sizes) - cut_sizes) // self.unit_bytes
        self.cut_position += int(cut_sizes.sum())
        opens = np.flatnonzero(units > np.concatenate([[len(self.crcs)], units[:-1]]))
        at = 0
        for index in opens.tolist():
            cut = int(before[index])
            self._crc = zlib.crc32(view[at:cut], self._crc)
            self._open_unit(int(units[index]))
            at = cut
        self._crc = zlib.crc32(view[at:], self._crc)
        self.position += len(view)

    def _open_unit(self, unit: int) -> None:
        """Close the open unit and the empty ones up to `unit`, which opens."""
        self.crcs.append(self._crc)
        self.crcs.extend([0] * (unit - len(self.crcs)))
        self._crc = 0

    def encoded(self) -> bytes:
        count = unit_count(self.cut_position, self.unit_bytes)
        crcs = list(self.crcs)
        if count:
            crcs.append(self._crc)
            crcs.extend([0] * (count - len(crcs)))
        return encode_sums(crcs, self.unit_bytes)


def read_sums(path: Path | str) -> tuple[int, np.ndarray]:
    """(unit_bytes, u32 CRC of each unit) of a `.sums` file."""
    data = Path(path).read_bytes()
    if len(data) < HEADER.itemsize or data[:8] != MAGIC:
        raise FormatError(path, "not a raypipe .sums file", MAGIC, data[:8])
    header = np.frombuffer(data, dtype=HEADER, count=1)[0]
    unit_bytes = int(header["unit_bytes"])
    if unit_bytes < 1 or (len(data) - HEADER.itemsize) % 4:
        raise FormatError(path, "truncated or damaged .sums file")
    return unit_bytes, np.frombuffer(data, dtype="<u4", offset=HEADER.itemsize)


class StreamChecksums:
    """A token stream's unit CRCs and bounds: checks the bytes of a run of units, and
    (`check_span`) each unit a read touches once, remembering which are checked."""

    def __init__(self, sums_path: Path | str, document_bytes: np.ndarray, label: str,
                 cuts: np.ndarray | None = None):
        self.label = label  # the token file's name, for the refusal
        self.unit_bytes, self.crcs = read_sums(sums_path)
        self.bounds = unit_bounds(document_bytes, self.unit_bytes, cuts)
        if len(self.bounds) - 1 != len(self.crcs):
            raise FormatError(sums_path, "checksum units for the token file's size",
                              len(self.bounds) - 1, len(self.crcs))
        empty = self.bounds[1:] == self.bounds[:-1]  # no document starts in them
        if self.crcs[empty].any():
            raise FormatError(sums_path, "an empty checksum unit's CRC-32 is 0", 0,
                              int(self.crcs[empty][self.crcs[empty] != 0][0]))
        self.checked = empty.copy()
        self.unchecked = int((~empty).sum())  # units not checked yet (0: reads go straight)

    def units_of(self, first: int, stop: int) -> range:
        """The units whose bytes overlap [first, stop) of the stream."""
        low = int(np.searchsorted(self.bounds, first, side="right")) - 1
        high = int(np.searchsorted(self.bounds, stop, side="left"))
        return range(max(low, 0), min(high, len(self.crcs)))

    def problem(self, data: Any, first: int) -> str | None:
        """Why `data` (bytes [first, first + len) of the stream, a run of whole units) is
        not what the job wrote, or None."""
        view = memoryview(data).cast("B")
        stop = first + len(view)
        for unit in self.units_of(first, stop):
            low, high = int(self.bounds[unit]), int(self.bounds[unit + 1])
            if low < first or high > stop:
                return f"bytes [{first}, {stop}) are not a run of whole checksum units"
            if zlib.crc32(view[low - first:high - first]) != int(self.crcs[unit]):
                return self._differs(unit)
        return None

    def _differs(self, unit: int) -> str:
        return (f"bytes [{int(self.bounds[unit])}, {int(self.bounds[unit + 1])}) differ "
                f"from what the job wrote (CRC-32 of checksum unit {unit} differs from the "
                ".sums file)")

    def check_span(self, stream: np.ndarray, first: int, stop: int) -> None:
        """Check each unit overlapping bytes [first, stop) not checked yet, reading it from
        `stream` (the stream's bytes, a uint8 map); refuse the first that differs, naming
        the file."""
        self.check_units(stream, self.units_of(first, stop))

    def check_units(self, stream: np.ndarray, units: Any) -> None:
        """Check these units not checked yet (`check_span`)."""
        for unit in units:
            if self.checked[unit]:
                continue
            low, high = int(self.bounds[unit]), int(self.bounds[unit + 1])
            if zlib.crc32(stream[low:high]) != int(self.crcs[unit]):
                raise FormatError(self.label, self._differs(unit))
            self.checked[unit] = True
            self.unchecked -= 1


class CheckedTokens:
    """A shard's 1-D tokens whose reads are checked: each checksum unit a slice or an index
    touches is checked on its first read (raypipe.io.checksums.StreamChecksums), so no
    altered token is served. Reads as the tokens of the entries it wraps (tokens, or
    records holding one: raypipe.io.mapping.token_view): slices of step 1 and indices."""

    def __init__(self, entries: np.ndarray, sums: StreamChecksums):
        self.tokens = token_view(entries)
        self.sums = sums
        self.dtype = self.tokens.dtype
        self.itemsize = entries.dtype.itemsize  # bytes an entry: what the sums count
        self.size = int(entries.size)
        self.shape = (self.size,)
        self.ndim = 1
        self._bytes = entries.view(np.uint8) if entries.size else np.empty(0, np.uint8)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: Any) -> Any:
        if not self.sums.unchecked:
            return self.tokens[key]
        itemsize = self.itemsize
        if isinstance(key, int | np.integer):
            at = (int(key) % max(self.size, 1)) * itemsize
            self.sums.check_span(self._bytes, at, at + itemsize)
            return self.tokens[key]
        if isinstance(key, slice):
            start, stop, _ = key.indices(self.size)
            if stop > start:
                self.sums.check_span(self._bytes, start * itemsize, stop * itemsize)
            return self.tokens[key]
        found = self.tokens[key]  # raises IndexError before any check where out of range
        positions = np.asarray(key, dtype=np.int64).reshape(-1) % max(self.size, 1)
        units = np.searchsorted(self.sums.bounds, positions * itemsize, side="right") - 1
        self.sums.check_units(self._bytes, np.unique(units).tolist())
        return found
