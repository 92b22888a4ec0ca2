"""Work units: (input file, row-group or byte range) with a name derived from the fragment,
and the record batches of one unit.

Invariant: the unit list and every unit's name are a pure function of the input files and
`unit_bytes`, never of parallelism, so the shards written for a unit (named after it) are
the same at any worker count or batch size. Inputs are a glob, a directory (every parquet
and JSON-lines file below it, each kind with its own reader; any other file is passed over,
and so are names data tools leave beside data: `.`/`_`-prefixed ones as pyarrow's dataset
discovery skips them, and Hugging Face's `dataset_info.json`, `state.json`,
`dataset_dict.json`, and a listed `.json` whose first line is no JSON object holding the
text field, a notes or stats file; each passed-over file is named in the summary and the
manifest, and a warning past PASSED_OVER_WARN_SHARE of the bytes) or a list of those, on
any filesystem
pyarrow understands
(local, s3://, gs://, ...). Parquet files are cut at row groups, JSON-lines files as
`raypipe.preprocess.jsonl` says. Planning reads only parquet footers and the first line of
each JSON-lines file: the text column is checked in every file before any task starts.
Cost: one footer read per parquet file (~1 ms locally), two to three small reads per JSON-lines
file plus one per cut (a listed `.json` one more, its first line: 32 in flight).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import stat as stat_module
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raypipe.errors import InputError
from raypipe.io.filesystem import filesystem_and_path, uri_of
from raypipe.io.parallel import THREADS, map_threads
from raypipe.io.records import PassedOver, WorkUnit
from raypipe.preprocess.jsonl import (
    JSONL_SUFFIXES,
    byte_ranges,
    file_identity,
    first_record_fields,
    jsonl_batches,
)
from raypipe.preprocess.texts import can_hold_text

INPUT_SUFFIXES = (".parquet", *JSONL_SUFFIXES)
logger = logging.getLogger("raypipe")

GLOB_CHARS = re.compile(r"[*?\[]")


def glob_regex(pattern: str) -> re.Pattern[str]:
    """Shell glob semantics: `*` and `?` stay inside one path segment, `**` crosses them."""
    out, index = [], 0
    while index < len(pattern):
        char = pattern[index]
        if pattern.startswith("**/", index):
            out.append("(?:.*/)?")
            index += 3
            continue
        if pattern.startswith("**", index):
            out.append(".*")
            index += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            close = pattern.find("]", index + 1)
            if close < 0:
                out.append(re.escape(char))
            else:
                out.append("[" + pattern[index + 1:close].replace("!", "^", 1) + "]")
                index = close
        else:
            out.append(re.escape(char))
        index += 1
    return re.compile("".join(out))


@dataclass(frozen=True)
class FileStat:
    """A file's size and modification time, as its listing gives them (no read)."""

    size: int
    mtime_ns: int


@dataclass(frozen=True)
class InputFiles:
    """The files a job's input specs name (with their listing's size and time), and the
    files of input directories passed over (not read), each with why."""

    files: list[str]
    passed_over: list[PassedOver]
    stats: dict[str, FileStat] = field(default_factory=dict)
    # the files a directory's or a glob's listing found (not named as they are)
    listed: frozenset[str] = frozenset()

    @property
    def passed_over_share(self) -> float:
        """The passed-over files' share of the bytes listed (read and passed over)."""
        passed = sum(each.bytes for each in self.passed_over)
        return passed / max(passed + sum(stat.size for stat in self.stats.values()), 1)


PASSED_OVER_WARN_SHARE = 0.01  # of the listed bytes: past it, passed-over files are a warning
# names data tools write beside data, never read from a directory (naming one reads it)
METADATA_NAMES = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})
HIDDEN_PREFIXES = (".", "_")  # pyarrow.dataset's ignore_prefixes: _SUCCESS, .DS_Store, ...
# a suffix JSON lines share with one JSON document: a listed one is read only as JSON lines
JSON_DOCUMENT_SUFFIXES = tuple(f".json{zipped}" for zipped in ("", ".gz", ".zst"))


def expand_input(spec: str) -> list[str]:
    """One input spec -> sorted file URIs (local files by their resolved path)."""
    return find_input(spec).files


def why_passed_over(path: str) -> str | None:
    """Why a directory's file is not read (None: it is read)."""
    name = path.rsplit("/", 1)[-1]
    if name.startswith(HIDDEN_PREFIXES):
        return f"a name starting with {name[0]!r} (hidden or a marker)"
    if name in METADATA_NAMES:
        return "dataset metadata, not rows"
    if not name.endswith(INPUT_SUFFIXES):
        return f"not parquet or JSON lines ({', '.join(INPUT_SUFFIXES)})"
    return None


OUTPUT_MARKER = "/_units/_job.json"  # a raypipe output's job record, below its root


def of_directory(found: dict[str, FileStat]) -> tuple[list[str], list[PassedOver]]:
    """A directory's inputs: every parquet and JSON-lines file below it; and the others,
    passed over with why (by the path as listed), a raypipe output below it whole (its
    manifest.json is not JSON lines)."""
    outputs = tuple(path[:-len(OUTPUT_MARKER)] + "/" for path in found
                    if path.endswith(OUTPUT_MARKER))
    read, passed = [], []
    for path, stat in found.items():
        reason = ("inside a raypipe output" if outputs and path.startswith(outputs)
                  else why_passed_over(path))
        if reason is None:
            read.append(path)
        else:
            passed.append(PassedOver(path, reason, stat.size))
    return read, passed


def find_input(spec: str) -> InputFiles:
    """One input spec -> its sorted file URIs (local files by their resolved path), and
    what a directory's listing passed over."""
    filesystem, path = filesystem_and_path(spec)
    passed_over: list[PassedOver] = []
    if GLOB_CHARS.search(path):
        base = path[:GLOB_CHARS.search(path).start()].rsplit("/", 1)[0] or "/"
        pattern = glob_regex(path)
        listed = {p: stat for p, stat in _list_files(filesystem, base, spec).items()
                  if pattern.fullmatch(p)}
    else:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise InputError(f"{spec}: no such file or directory")
        if info.type == pafs.FileType.Directory:
            every = _list_files(filesystem, path, spec)
            matches, passed_over = of_directory(every)
            listed = {p: every[p] for p in matches}
        elif info.type == pafs.FileType.File:
            listed = {path: _stat_of(info)}
        else:  # a FIFO, socket or device would block or mislead the readers
            raise InputError(f"{spec}: not a regular file ({info.type.name})")
    if isinstance(filesystem, pafs.LocalFileSystem):  # one identity per file
        listed = {os.path.realpath(p): stat for p, stat in listed.items()}
    stats = {uri_of(p, spec): stat for p, stat in listed.items()}
    passed = {uri_of(os.path.realpath(m.uri) if isinstance(filesystem, pafs.LocalFileSystem)
                     else m.uri, spec): m for m in passed_over}
    named = info.type == pafs.FileType.File if not GLOB_CHARS.search(path) else False
    return InputFiles(sorted(stats), [PassedOver(uri, m.reason, m.bytes)
                                      for uri, m in sorted(passed.items())], stats,
                      frozenset() if named else frozenset(stats))


def _stat_of(info: pafs.FileInfo) -> FileStat:
    return FileStat(int(info.size or 0), int(info.mtime_ns or 0))


def _list_files(filesystem: pafs.FileSystem, base: str, spec: str) -> dict[str, FileStat]:
    """Every file below `base`, with its size and time (one listing: a LIST request per
    1,000 objects on object storage). Locally a walk that follows directory links but
    enters each directory (by device and inode) once, so a link loop ends instead of
    multiplying."""
    try:
        if isinstance(filesystem, pafs.LocalFileSystem):
            return _walk_local(base)
        infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=True))
        return {info.path: _stat_of(info) for info in infos if info.is_file}
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{spec}: cannot list {base}: {exc}") from exc


def _walk_local(base: str) -> dict[str, FileStat]:
    seen: set[tuple[int, int]] = set()
    files = {}
    for root, directories, names in os.walk(base, followlinks=True):
        status = os.stat(root)
        if (status.st_dev, status.st_ino) in seen:
            directories[:] = []
            continue
        seen.add((status.st_dev, status.st_ino))
        directories.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            try:
                found = os.stat(path)
            except OSError:  # a dangling link
                continue
            if stat_module.S_ISREG(found.st_mode):
                files[path] = FileStat(found.st_size, found.st_mtime_ns)
    return files


def expand_inputs(specs: tuple[str, ...] | list[str]) -> list[str]:
    return find_inputs(specs).files


def find_inputs(specs: tuple[str, ...] | list[str]) -> InputFiles:
    """Every spec's files, each once (a file some spec names is not passed over); a spec
    list that names no file is an error. Passed-over files are logged: a warning past
    PASSED_OVER_WARN_SHARE of the bytes listed."""
    found = [find_input(spec) for spec in specs]
    stats = {path: stat for each in found for path, stat in each.stats.items()}
    unique = sorted(stats)
    passed = {each.uri: each for one in found for each in one.passed_over
              if each.uri not in stats}
    if not unique:
        raise InputError(f"inputs {list(specs)}: no parquet or JSON-lines file "
                         f"({', '.join(INPUT_SUFFIXES)}) matches"
                         + (f" ({len(passed)} other file(s) passed over, such as "
                            f"{next(iter(passed))})" if passed else ""))
    named = {path for each in found for path in each.files if path not in each.listed}
    listed = frozenset(path for each in found for path in each.listed) - named
    inputs = InputFiles(unique, [passed[uri] for uri in sorted(passed)], stats, listed)
    if inputs.passed_over:
        level = (logging.WARNING if inputs.passed_over_share > PASSED_OVER_WARN_SHARE
                 else logging.INFO)
        logger.log(level, "%d file(s) of the input directories passed over (%.1f%% of the "
                   "bytes listed; name a file to read it): %s", len(inputs.passed_over),
                   100 * inputs.passed_over_share,
                   "; ".join(f"{m.uri} ({m.reason})" for m in inputs.passed_over[:5])
                   + (" ..." if len(inputs.passed_over) > 5 else ""))
    return inputs


def pass_over_json_documents(found: InputFiles, columns: list[str]) -> InputFiles:
    """The inputs less the `.json` files a listing found whose first line is no JSON object
    holding `columns` (a notes or stats file beside the data: one JSON document, or
    records of something else), each passed over and named, as a README is; a `.json`
    named on its own is read (a bad one fails, naming it). One small read per listed
    `.json`, 32 at a time."""
    candidates = [uri for uri in found.files
                  if uri in found.listed and uri.endswith(JSON_DOCUMENT_SUFFIXES)]

    def why(uri: str) -> str | None:
        try:
            check_jsonl_fields(uri, columns)
        except InputError as exc:
            return (f"a .json that is not JSON lines holding {columns[0]!r}: "
                    f"{str(exc).removeprefix(uri + ': ')}")
        return None

    reasons = {uri: reason for uri, reason in zip(candidates, map_threads(why, candidates),
                                                  strict=True) if reason is not None}
    if not reasons:
        return found
    passed = [PassedOver(uri, reason, found.stats[uri].size) for uri, reason in
              reasons.items()]
    logger.warning("%d .json file(s) of the input directories passed over (name a file to "
                   "read it): %s", len(passed), "; ".join(f"{m.uri} ({m.reason})"
                                                          for m in passed[:5])
                   + (" ..." if len(passed) > 5 else ""))
    files = [uri for uri in found.files if uri not in reasons]
    if not files:
        raise InputError(f"inputs: no JSON-lines or parquet file left: {len(passed)} .json "
                         f"file(s) hold no JSON object with {columns[0]!r} in their first "
                         f"line, such as {passed[0].uri} ({passed[0].reason})")
    return InputFiles(files, sorted([*found.passed_over, *passed], key=lambda m: m.uri),
                      {uri: found.stats[uri] for uri in files}, found.listed)


def open_parquet(uri: str, data: bytes | None = None) -> pq.ParquetFile:
    """The parquet file to read (from `data`, its bytes already read, where given)."""
    try:
        if data is not None:
            return pq.ParquetFile(pa.BufferReader(data))
        filesystem, path = filesystem_and_path(uri)
        return pq.ParquetFile(filesystem.open_input_file(path))
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{uri}: not a readable parquet file: {exc}") from exc


def read_whole(uri: str) -> bytes:
    """A small file's bytes as stored (compressed, if it is), in one stream: on object
    storage a HEAD and a GET, no footer or range reads."""
    filesystem, path = filesystem_and_path(uri)
    try:
        with filesystem.open_input_stream(path, compression=None) as stream:
            return stream.read()
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{uri}: cannot be read: {exc}") from exc


def member_table(unit: WorkUnit, columns: list[str], data: bytes | None
                 ) -> tuple[pa.Table, InputError | None]:
    """A group's parquet file whole, as a table of `columns` (checked) without schema
    metadata, so consecutive files' tables concatenate; from `data`, its bytes, where
    given. A damaged row group: the whole row groups before it, and the error naming it."""
    parquet = open_parquet(unit.uri, data)
    check_columns(unit.uri, columns, parquet.schema_arrow.names, "column")
    wanted = list(dict.fromkeys(columns))
    try:
        return parquet.read(columns=wanted, use_threads=False).replace_schema_metadata(None), \
            None
    except (OSError, pa.ArrowException):
        pass  # read again one row group at a time, to keep those before the damage
    groups: list[pa.Table] = []
    for group in range(parquet.num_row_groups):
        try:
            groups.append(parquet.read_row_group(group, columns=wanted, use_threads=False))
        except (OSError, pa.ArrowException) as exc:
            error = InputError(f"{unit.uri}: row group {group} cannot be read (the row groups "
                               f"before it are kept): {one_line(exc)}")
            break
    else:  # every group read alone: the whole read failed for another reason
        error = InputError(f"{unit.uri} cannot be read as one table")
    table = pa.concat_tables(groups) if groups else \
        parquet.schema_arrow.empty_table().select(wanted)
    return table.replace_schema_metadata(None), error


PREFETCH_FILES = 32  # a group's files read ahead at most, ...
PREFETCH_BYTES = 64 << 20  # ... and bytes


def prefetched(units: tuple[WorkUnit, ...]
               ) -> Iterator[tuple[WorkUnit, bytes | InputError, float]]:
    """Each of a group's (small) files with its bytes, in order, read up to PREFETCH_FILES
    and PREFETCH_BYTES ahead on threads: on object storage a file costs two requests, and
    their latency overlaps the tokenizing (a group of 6,400 files at 20 ms a request would
    otherwise wait 2 minutes). A file that cannot be read comes as its InputError; with
    each file, the CPU seconds its reading thread spent (the unit's record counts them)."""
    def read(uri: str) -> tuple[bytes | InputError, float]:
        started = time.thread_time()
        try:
            data: bytes | InputError = read_whole(uri)
        except InputError as exc:
            data = exc
        return data, time.thread_time() - started

    pending: collections.deque = collections.deque()
    upcoming = iter(units)
    with ThreadPoolExecutor(PREFETCH_FILES, thread_name_prefix="raypipe-prefetch") as pool:
        while True:
            held = sum(unit.size_bytes for unit, _ in pending)
            while len(pending) < PREFETCH_FILES and (held < PREFETCH_BYTES or not pending):
                unit = next(upcoming, None)
                if unit is None:
                    break
                pending.append((unit, pool.submit(read, unit.uri)))
                held += unit.size_bytes
            if not pending:
                return
            unit, future = pending.popleft()
            yield unit, *future.result()


def _open_with_identity(uri: str) -> tuple[pq.ParquetFile, str]:
    """The parquet file, and its identity: sha256 of its size and footer (the footer holds
    every row group's offsets, sizes and statistics, so a rewrite changes it). Two small
    reads; no timestamps, so a copy of an unchanged file keeps its identity."""
    filesystem, path = filesystem_and_path(uri)
    try:
        handle = filesystem.open_input_file(path)
        size = handle.size()
        handle.seek(max(size - 8, 0))
        tail = handle.read(8)
        footer_length = int.from_bytes(tail[:4], "little") if len(tail) == 8 else 0
        handle.seek(max(size - 8 - footer_length, 0))
        footer = handle.read(min(footer_length, size))
        identity = hashlib.sha256(f"{size}:".encode() + footer).hexdigest()[:16]
        handle.seek(0)
        return pq.ParquetFile(handle), identity
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{uri}: not a readable parquet file: {exc}") from exc


def file_stem(uri: str) -> str:
    """A file's name without its input suffix, in characters a unit name may hold."""
    name = PurePosixPath(uri).name
    for suffix in INPUT_SUFFIXES:
        name = name.removesuffix(suffix)
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def name_digest(text: str) -> str:
    """The short hash a unit name carries (of its file's URI, or a group's URIs)."""
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def unit_name(uri: str, start: int | None = None, stop: int | None = None,
              part: str = "rg") -> str:
    """`<file stem>-<hash of the URI>-<part><start>-<stop>`: row groups (`rg`) or, for
    JSON lines, byte offsets (`b`); `-whole` for a file read whole (no range)."""
    stem, digest = file_stem(uri), name_digest(uri)
    if start is None or stop is None:
        return f"{stem[:48]}-{digest}-whole"
    width = 5 if part == "rg" else 12
    return f"{stem[:48]}-{digest}-{part}{start:0{width}d}-{stop:0{width}d}"


def check_columns(uri: str, columns: list[str], available: list[str], noun: str) -> None:
    for role, column in zip([f"text {noun}"] + [noun] * len(columns), columns, strict=False):
        if column not in available:
            raise InputError(f"{uri}: {role} {column!r} not found; "
                             f"available {noun}s: {available}")


def check_jsonl_fields(uri: str, columns: list[str], data: bytes | None = None) -> None:
    """The file's first JSON object holds every field in `columns` (text first); a file
    without a JSON line has no row to check (it is read as empty)."""
    fields = first_record_fields(uri, data)
    if fields is not None:
        check_columns(uri, columns, fields, "field")


def unreadable_members(unit: WorkUnit, columns: list[str], text_first: bool = True
                       ) -> list[InputError]:
    """The members of a group whose header cannot be read or lacks `columns`: a parquet
    footer, a JSON-lines file's first line; each file closed after. Run before a group's
    work, so a garbage file fails the unit before its good files are tokenized (and a rerun
    reads nothing twice), naming every such member at once. A damaged page behind a sound
    footer is found only when read. Cost: locally ~50 us a small parquet file, one after
    another (32 threads cost more in hand-offs); on object storage a footer read a file,
    32 in flight."""
    def problem(member: WorkUnit) -> InputError | None:
        try:
            if member.kind == "jsonl":
                check_jsonl_fields(member.uri, columns)
                return None
            filesystem, path = filesystem_and_path(member.uri)
            with filesystem.open_input_file(path) as handle:
                schema = pq.ParquetFile(handle).schema_arrow
            check_columns(member.uri, columns, schema.names, "column")
            check_text_type(member.uri, schema, columns[0], text_first)
        except InputError as exc:
            return exc
        except (OSError, pa.ArrowException) as exc:
            return InputError(f"{member.uri}: not a readable parquet file: {one_line(exc)}")
        return None

    local = isinstance(filesystem_and_path(unit.uri)[0], pafs.LocalFileSystem)
    return [error for error in map_threads(problem, unit.members, 1 if local else THREADS)
            if error is not None]


def one_line(error: BaseException) -> str:
    """A library's message on one line (Arrow's span several)."""
    return " ".join(str(error).split())


def check_text_type(uri: str, schema: pa.Schema, column: str, text_first: bool) -> None:
    text_type = schema.field(column).type
    if text_first and not can_hold_text(text_type):
        raise InputError(f"{uri}: text column {column!r} has type {text_type}, which "
                         "cannot hold text (expected string, binary or a dictionary of them)")


def units_of_file(uri: str, columns: list[str], unit_bytes: int,
                  text_first: bool = True) -> list[WorkUnit]:
    """Split one file into consecutive row-group ranges of about `unit_bytes` each; every
    name in `columns` (text column first, of a type that holds text) must exist."""
    parquet, identity = _open_with_identity(uri)
    schema = parquet.schema_arrow
    check_columns(uri, columns, schema.names, "column")
    check_text_type(uri, schema, columns[0], text_first)
    meta = parquet.metadata
    units: list[WorkUnit] = []
    start, rows, size, first_row = 0, 0, 0, 0
    for index in range(meta.num_row_groups):
        group = meta.row_group(index)
        rows += group.num_rows
        size += group.total_byte_size
        if size >= unit_bytes or index == meta.num_row_groups - 1:
            units.append(WorkUnit(uri, start, index + 1, rows, unit_name(uri, start, index + 1),
                                  first_row, identity, size_bytes=size))
            first_row += rows
            start, rows, size = index + 1, 0, 0
    return units


def units_of_jsonl(uri: str, columns: list[str], unit_bytes: int,
                   text_first: bool = True) -> list[WorkUnit]:
    """Byte ranges of about `unit_bytes` (a compressed file whole); the first record must
    hold every field in `columns` (text field first)."""
    check_jsonl_fields(uri, columns)
    identity, size = file_identity(uri)
    ranges = byte_ranges(uri, size, unit_bytes)
    whole = len(ranges) == 1
    return [WorkUnit(uri, 0, 1, -1, unit_name(uri) if whole else unit_name(uri, start, stop, "b"),
                     0 if start == 0 else -1,
                     identity, kind="jsonl", byte_start=start, byte_stop=-1 if whole else stop,
                     size_bytes=stop - start)
            for start, stop in ranges]


def stat_files(files: list[str]) -> dict[str, FileStat]:
    """Each file's listing size and time (one stat or HEAD each)."""
    stats = {}
    for uri in files:
        filesystem, path = filesystem_and_path(uri)
        stats[uri] = _stat_of(filesystem.get_file_info(path))
    return stats


def unit_batches(unit: WorkUnit, columns: list[str], batch_rows: int,
                 text_first: bool = True, data: bytes | None = None,
                 skip_bad_lines: bool = False) -> Iterator[pa.RecordBatch]:
    """The rows of a file unit as record batches of `columns` (text first; chat rows:
    `text_first=False`), in file order; a decode error is an InputError naming the unit's
    file and range (or line), raised after every complete row before it: the lines of a
    JSON-lines file, the whole row groups of a parquet file (batches span row groups; after
    an error the row groups not yet given are read again one at a time, so a batch that
    held a good group's rows beside a damaged one's loses none of them).
    `skip_bad_lines`: a line that is not JSON is a row counted as `invalid_json`
    (raypipe.preprocess.jsonl)."""
    if unit.kind == "jsonl":
        if unit.row_group_stop < 0:  # a group's member: its columns are checked here
            check_jsonl_fields(unit.uri, columns, data)
        yield from jsonl_batches(unit, columns, batch_rows, text_first, data, skip_bad_lines)
        return
    parquet = open_parquet(unit.uri, data)
    if unit.row_group_stop < 0:  # a group's member: every row group, columns checked here
        check_columns(unit.uri, columns, parquet.schema_arrow.names, "column")
    stop = unit.row_group_stop if unit.row_group_stop >= 0 else parquet.num_row_groups
    groups = range(unit.row_group_start, stop)
    wanted = list(dict.fromkeys(columns))
    given = 0
    try:
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=wanted,
                                          row_groups=groups, use_threads=False):
            yield batch
            given += batch.num_rows
        return
    except (OSError, pa.ArrowException) as exc:
        failure = exc
    yield from _row_groups_after(unit, parquet, groups, wanted, batch_rows, given)
    raise InputError(f"{unit.location} cannot be read: {one_line(failure)}") from failure


def _row_groups_after(unit: WorkUnit, parquet: pq.ParquetFile, groups: range,
                      columns: list[str], batch_rows: int, given: int
                      ) -> Iterator[pa.RecordBatch]:
    """After a failed read of `groups`: the rows past the first `given`, one row group at a
    time, up to the damaged group, which raises an InputError naming it."""
    first = 0
    for group in groups:
        rows = parquet.metadata.row_group(group).num_rows
        if first + rows > given:
            try:
                table = parquet.read_row_group(group, columns=columns, use_threads=False)
            except (OSError, pa.ArrowException) as exc:
                raise InputError(f"{unit.location}: row group {group} cannot be read (the "
                                 f"row groups before it are kept): {one_line(exc)}") from exc
            yield from table.slice(max(0, given - first)).to_batches(max_chunksize=batch_rows)
        first += rows
