"""JSON-lines inputs: `*.jsonl`, `*.json` (one object per line), gzip- or zstd-compressed.

Invariant: a JSONL file is planned into work units as a parquet file is, as a pure function
of the file and `unit_bytes`: a compressed file (`.gz`, `.zst`: not seekable) is one unit; an
uncompressed one is cut into byte ranges of about `unit_bytes`, each ending just after a
newline (found at plan time with one small read per cut), so a line belongs to the unit its
first byte is in and no line is read twice or lost. Rows come out as Arrow record batches of
the chosen fields, so cleaning, tokenizing and writing are the parquet path's. A line that
is not a JSON object is an InputError naming the file and its line number (counted from the
file's start, also inside a byte range); blank lines are not rows. A read error (a truncated
or corrupt .gz) comes after every complete line before it: a gzip file pyarrow's decoder
fails on is decoded again by zlib up to the damage (a .zst keeps what pyarrow's decoder
gave, often nothing: a frame decodes whole). A field that is missing
or JSON null counts as `null`, a non-string text as `non_string`, a text that is not valid
Unicode (a lone surrogate escape, or bytes that are not UTF-8) as `invalid_utf8`.
The input's identity (part of every commit record) is sha256 of the size and the first and
last MiB: for gzip and zstd the tail holds the checksum of the whole content; an
uncompressed file edited in its middle without a change of size keeps its identity.
Cost: one `json.loads` per line (~3% of tokenizing it), the decompression, and at plan time
two small reads per file plus one per cut.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from raypipe.errors import InputError
from raypipe.io.filesystem import filesystem_and_path
from raypipe.io.lines import lines_before
from raypipe.io.records import WorkUnit

COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd"}
JSONL_SUFFIXES = tuple(f"{stem}{zip_suffix}" for stem in (".jsonl", ".json")
                       for zip_suffix in ("", *COMPRESSED_SUFFIXES))
IDENTITY_BYTES = 1 << 20
READ_BYTES = 8 << 20
FIRST_RECORD_BYTES = 64 << 10
TEXT_SKIPS = "text_skips"  # schema metadata key: rows the reader already classified
TEXT_SKIP_ROWS = "text_skip_rows"  # schema metadata key: the first of them, by row
SKIP_ROWS_NAMED = 100  # rows of a batch the reader names with their reason
JSON_FIELDS = "json_fields"  # schema metadata key: the fields are JSON text (chat rows)


def is_jsonl(uri: str) -> bool:
    return uri.endswith(JSONL_SUFFIXES)


def compression_of(uri: str) -> str | None:
    return next((codec for suffix, codec in COMPRESSED_SUFFIXES.items()
                 if uri.endswith(suffix)), None)


def _open_random_access(uri: str) -> Any:
    filesystem, path = filesystem_and_path(uri)
    try:
        return filesystem.open_input_file(path)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{uri}: cannot open: {exc}") from exc


class GzipStream:
    """A gzip file's content, decompressed by zlib as it is read, at most `size` bytes a
    read: the bytes before damage (a truncated file, a corrupt block) all come out before
    the read that raises. Reads concatenated members (`cat a.gz b.gz`) as one content, as
    gzip does. Used only to salvage a file pyarrow's decoder failed on (that decoder loses
    the read that fails; every whole file is read by it)."""

    COMPRESSED_READ = 1 << 20

    def __init__(self, raw: Any):
        self.raw = raw
        self.decoder = zlib.decompressobj(wbits=31)
        self.input = b""
        self.in_member = False  # the decoder has taken bytes of a member it has not ended
        self.failure: str | None = None

    def __enter__(self) -> GzipStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.raw.close()

    def read(self, size: int) -> bytes:
        parts: list[bytes] = []
        wanted = size
        while wanted > 0 and self.failure is None:
            if not self.input:
                self.input = self.raw.read(self.COMPRESSED_READ)
                if not self.input:
                    if self.in_member:
                        self.failure = "truncated gzip stream: the file ends inside it"
                    break
            try:
                out = self.decoder.decompress(self.input, wanted)
            except zlib.error as exc:
                self.failure = f"corrupt gzip data: {exc}"
                break
            self.in_member = True
            self.input = self.decoder.unconsumed_tail
            if self.decoder.eof:  # a member ends: the next one, if any, starts a decoder
                self.input = self.decoder.unused_data  # (the tail is in it too)
                self.decoder = zlib.decompressobj(wbits=31)
                self.in_member = False
            parts.append(out)
            wanted -= len(out)
        if not parts and self.failure is not None:
            raise OSError(self.failure)
        return b"".join(parts)


def _open_stream(uri: str, start: int = 0, data: bytes | None = None) -> Any:
    """The file's bytes from `start` (decompressed for .gz/.zst, which start at 0); from
    `data`, the file's bytes already read, where given."""
    codec = compression_of(uri)
    if data is not None:
        buffer = pa.BufferReader(data)
        if codec is not None:
            return pa.CompressedInputStream(buffer, codec)
        buffer.seek(start)
        return buffer
    filesystem, path = filesystem_and_path(uri)
    try:
        if codec is not None:
            return filesystem.open_input_stream(path, compression=codec)
        handle = filesystem.open_input_file(path)
        handle.seek(start)
        return handle
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{uri}: cannot open: {exc}") from exc


def file_identity(uri: str) -> tuple[str, int]:
    """(identity, size in bytes): sha256 of the size and the first and last MiB."""
    with _open_random_access(uri) as handle:
        size = handle.size()
        digest = hashlib.sha256(f"{size}:".encode())
        digest.update(handle.read(min(size, IDENTITY_BYTES)))
        if size > IDENTITY_BYTES:
            handle.seek(max(IDENTITY_BYTES, size - IDENTITY_BYTES))
            digest.update(handle.read())
    return digest.hexdigest()[:16], size


def _next_line_start(handle: Any, position: int, size: int) -> int:
    """The offset just after the first newline at or after `position` (or `size`)."""
    handle.seek(position)
    while position < size:
        chunk = handle.read(min(1 << 16, size - position))
        newline = chunk.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(chunk)
    return size


def byte_ranges(uri: str, size: int, unit_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of about `unit_bytes`, each ending after a newline."""
    if compression_of(uri) is not None or size <= unit_bytes:
        return [(0, size)]
    cuts = [0]
    with _open_random_access(uri) as handle:
        while cuts[-1] + unit_bytes < size:
            cut = _next_line_start(handle, cuts[-1] + unit_bytes, size)
            if cut >= size:
                break
            cuts.append(cut)
    return list(zip(cuts, [*cuts[1:], size], strict=True))


def _lines(uri: str, start: int, stop: int | None, chunk_bytes: int = READ_BYTES,
           data: bytes | None = None) -> Iterator[bytes]:
    """The lines of the file in [start, stop) (the whole file if stop is None), without
    their newline, read `chunk_bytes` at a time (from `data` where given); memory is
    bounded by that plus the longest line. A read error comes after every complete line
    before it (the partial line it cuts is not a row)."""
    tail = b""
    for chunk in _chunks(uri, start, stop, chunk_bytes, data):
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        yield from lines
    if tail:
        yield tail


def _chunks(uri: str, start: int, stop: int | None, chunk_bytes: int,
            data: bytes | None) -> Iterator[bytes]:
    """The file's bytes in [start, stop), `chunk_bytes` at a time. A gzip file pyarrow's
    decoder fails on is decoded again by zlib (GzipStream) from the byte it reached, so
    the bytes up to the damage still come out before the error."""
    with _open_stream(uri, start, data) as stream:
        remaining = None if stop is None else stop - start
        read = start
        while remaining is None or remaining > 0:
            try:
                chunk = _read(stream, chunk_bytes if remaining is None
                              else min(chunk_bytes, remaining), uri, read)
            except InputError:
                if compression_of(uri) != "gzip":
                    raise
                yield from _salvage_gzip(uri, data, read, chunk_bytes)
                return  # zlib read it to its end (a 0-byte file: empty, not damaged)
            read += len(chunk)
            if not chunk:
                break
            if remaining is not None:
                remaining -= len(chunk)
            yield chunk


def _salvage_gzip(uri: str, data: bytes | None, offset: int, chunk_bytes: int
                  ) -> Iterator[bytes]:
    """A damaged gzip file's content from decompressed byte `offset` up to the damage,
    decoded by zlib, then an InputError naming where it stops (none where zlib reads it
    whole)."""
    if data is not None:
        raw: Any = pa.BufferReader(data)
    else:
        filesystem, path = filesystem_and_path(uri)
        try:
            raw = filesystem.open_input_stream(path, compression=None)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"{uri}: cannot open: {exc}") from exc
    read = 0
    with GzipStream(raw) as stream:
        while read < offset:  # what pyarrow gave already: decoded again, not yielded
            skipped = _read(stream, min(chunk_bytes, offset - read), uri, read)
            if not skipped:
                return
            read += len(skipped)
        while True:
            chunk = _read(stream, chunk_bytes, uri, read)
            if not chunk:
                return
            read += len(chunk)
            yield chunk


def _read(stream: Any, size: int, uri: str, offset: int) -> bytes:
    """`size` bytes of the stream; a read or decompression error (a truncated .gz, a
    corrupt .zst frame) is an InputError naming the file and the (decompressed) offset."""
    try:
        return stream.read(size)
    except (OSError, EOFError, pa.ArrowException) as exc:
        at = "decompressed byte" if compression_of(uri) else "byte"
        raise InputError(f"{uri}: cannot be read past {at} {offset}: {exc}") from None


def _parse(line: bytes, where: Any, number: int) -> dict[str, Any] | None:
    """The line's JSON object; None for bytes that are not UTF-8 (skipped as
    invalid_utf8); InputError for anything else that is not one JSON object."""
    try:
        value = json.loads(line)
    except UnicodeDecodeError:
        return None
    except json.JSONDecodeError as exc:  # a msg may end in "at" ("... starting at")
        at = "" if exc.msg.endswith(" at") else " at"
        raise InputError(f"{where(number)}: not valid JSON ({exc.msg}{at} column "
                         f"{exc.colno})") from None
    if not isinstance(value, dict):
        raise InputError(f"{where(number)}: not a JSON object (a JSON-lines corpus holds one "
                         f"object per line), got {type(value).__name__}")
    return value


def first_record_fields(uri: str, data: bytes | None = None) -> list[str] | None:
    """The field names of the file's first JSON object; None for a file without one (empty,
    or blank lines only: no row, which is not an error). Reads (and decompresses) 64 KiB at
    a time, so planning costs a small read per file."""
    for number, line in enumerate(_lines(uri, 0, None, FIRST_RECORD_BYTES, data), 1):
        if line.strip():
            record = _parse(line, lambda n: f"{uri}: line {n}", number)
            if record is None:
                raise InputError(f"{uri}: line {number}: not UTF-8")
            return list(record)
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, from a \ud800-style escape
        return False
    return True


class ReaderSkips:
    """The rows of one batch the reader turned into nulls: counted by reason, and the first
    SKIP_ROWS_NAMED of them named by row (for the unit's rejects)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.rows: dict[int, str] = {}

    def add(self, row: int, reason: str) -> None:
        self.counts[reason] += 1
        if len(self.rows) < SKIP_ROWS_NAMED:
            self.rows[row] = reason

    def metadata(self) -> dict[str, str]:
        return {TEXT_SKIPS: json.dumps(dict(self.counts)),
                TEXT_SKIP_ROWS: json.dumps(self.rows)}


def _text_array(values: list[Any], skipped: ReaderSkips) -> pa.Array:
    """The text field as a large_string array; a non-string or a string that is not valid
    Unicode becomes a null counted under its reason."""
    texts = []
    for row, value in enumerate(values):
        if value is not None and not isinstance(value, str):
            skipped.add(row, "non_string")
            value = None
        texts.append(value)
    try:
        return pa.array(texts, type=pa.large_string())
    except (UnicodeEncodeError, pa.ArrowException):
        for index, text in enumerate(texts):
            if text is not None and not _is_unicode(text):
                skipped.add(index, "invalid_utf8")
                texts[index] = None
        return pa.array(texts, type=pa.large_string())


def _field_array(values: list[Any], where: Any, field: str) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError) as exc:
        raise InputError(f"{where()}: field {field!r} holds values of mixed types that no "
                         f"column can hold: {exc}") from None


def _json_batch(rows: list[dict[str, Any] | None], columns: list[str], skipped: ReaderSkips
                ) -> pa.RecordBatch:
    """Rows whose fields are kept as JSON text (chat conversations: nested values of any
    shape; `JSON_FIELDS` in the schema metadata says so)."""
    present = [row or {} for row in rows]
    arrays = [pa.array([None if row.get(name) is None else json.dumps(row[name])
                        for row in present], pa.large_string()) for name in columns]
    schema = pa.schema([pa.field(name, pa.large_string()) for name in columns],
                       metadata={**skipped.metadata(), JSON_FIELDS: "1"})
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def fields_as_json(batch: pa.RecordBatch) -> bool:
    """The batch's fields are JSON text (`jsonl_batches(..., text_first=False)`)."""
    return JSON_FIELDS.encode() in (batch.schema.metadata or {})


def _batch(rows: list[dict[str, Any] | None], columns: list[str], skipped: ReaderSkips,
           where: Any) -> pa.RecordBatch:
    """Rows (None: a skipped line, already counted in `skipped`) as a record batch; rows
    the reader turned into nulls are named in the schema metadata (`reader_skips`) so they
    are counted under their reason, not as `null`."""
    present = [row or {} for row in rows]
    arrays = [_text_array([row.get(columns[0]) for row in present], skipped)]
    arrays += [_field_array([row.get(name) for row in present], where, name)
               for name in columns[1:]]
    schema = pa.schema([pa.field(columns[0], pa.large_string()),
                        *[pa.field(name, array.type)
                          for name, array in zip(columns[1:], arrays[1:], strict=True)]],
                       metadata=skipped.metadata())
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def reader_skips(batch: pa.RecordBatch) -> Counter:
    """Rows of `batch` the JSONL reader already counted (as nulls), by reason."""
    raw = (batch.schema.metadata or {}).get(TEXT_SKIPS.encode())
    return Counter(json.loads(raw)) if raw else Counter()


def reader_skip_rows(batch: pa.RecordBatch) -> dict[int, str]:
    """The first rows of `batch` the JSONL reader turned into nulls, with their reason."""
    raw = (batch.schema.metadata or {}).get(TEXT_SKIP_ROWS.encode())
    return {int(row): reason for row, reason in json.loads(raw).items()} if raw else {}


class LineLocator:
    """File line numbers for messages about a byte-range unit: the lines before the range
    are counted only when a message needs them (one read of the file's prefix)."""

    def __init__(self, unit: WorkUnit):
        self.unit = unit
        self.before: int | None = None if unit.byte_start else 0

    def __call__(self, line_in_unit: int) -> str:
        if self.before is None:
            self.before = lines_before(self.unit.uri, self.unit.byte_start)
        return f"{self.unit.uri}: line {self.before + line_in_unit}"

    def first_row(self) -> int:
        """The file row (0-based line) the unit starts at."""
        if self.before is None:
            self.before = lines_before(self.unit.uri, self.unit.byte_start)
        return self.before


def jsonl_batches(unit: WorkUnit, columns: list[str], batch_rows: int,
                  text_first: bool = True, data: bytes | None = None,
                  skip_bad_lines: bool = False) -> Iterator[pa.RecordBatch]:
    """The unit's lines as record batches of `columns` (text first; `text_first=False`:
    every field as JSON text), `batch_rows` lines each: one row per line, so a row's index
    is its line's. A line that is not a JSON object fails the unit naming it, unless
    `skip_bad_lines`: then it is a null row counted as `invalid_json` and the lines after it
    are read. A read error (a truncated .gz) comes after the batch of the complete lines
    before it, and names the line it falls in."""
    make = _batch if text_first else (lambda rows, columns, skipped, where:
                                      _json_batch(rows, columns, skipped))
    where = LineLocator(unit)

    def lines_from(first: int) -> Any:
        return lambda: f"{where(first)} and the lines after it"

    stop = None if unit.byte_stop < 0 else unit.byte_stop
    rows: list[dict[str, Any] | None] = []
    skipped = ReaderSkips()
    number = 0
    lines = _lines(unit.uri, unit.byte_start, stop, data=data)
    while True:
        try:
            line = next(lines, None)
        except InputError as exc:  # the damage: the complete lines before it first
            if rows:
                yield make(rows, columns, skipped, lines_from(number - len(rows) + 1))
            raise InputError(f"{where(number + 1)}: "
                             f"{str(exc).removeprefix(unit.uri + ': ')}") from None
        if line is None:
            break
        number += 1
        rows.append(_record(line, where, number, skipped, len(rows), skip_bad_lines))
        if len(rows) == batch_rows:
            yield make(rows, columns, skipped, lines_from(number - len(rows) + 1))
            rows, skipped = [], ReaderSkips()
    if rows:
        yield make(rows, columns, skipped, lines_from(number - len(rows) + 1))


def _record(line: bytes, where: Any, number: int, skipped: ReaderSkips, row: int,
            skip_bad_lines: bool) -> dict[str, Any] | None:
    """The line's JSON object, or None counted in `skipped` under its reason."""
    if not line.strip():
        skipped.add(row, "blank_line")
        return None
    try:
        record = _parse(line, where, number)
    except InputError:
        if not skip_bad_lines:
            raise
        skipped.add(row, "invalid_json")
        return None
    if record is None:
        skipped.add(row, "invalid_utf8")
    return record
