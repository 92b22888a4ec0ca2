"""Work units: (input file, row-group or byte range) with a name derived from the fragment,
and the record batches of one unit.

Invariant: the unit list and every unit's name are a pure function of the input files and
`unit_bytes`, never of parallelism, so the shards written for a unit (named after it) are
the same at any worker count or batch size. Inputs are a glob, a directory (every parquet
file below it; its JSON-lines files when it has no parquet file, else they are passed over,
logged and named in the summary) or a list of those, on any filesystem pyarrow understands
(local, s3://, gs://, ...). Parquet files are cut at row groups, JSON-lines files as
`raypipe.preprocess.jsonl` says. Planning reads only parquet footers and the first line of
each JSON-lines file: the text column is checked in every file before any task starts.
Cost: one footer read per parquet file (~1 ms locally), two to three small reads per JSON-lines
file plus one per cut.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raypipe.errors import InputError
from raypipe.io.filesystem import filesystem_and_path, uri_of
from raypipe.io.records import WorkUnit
from raypipe.preprocess.jsonl import (
    JSONL_SUFFIXES,
    byte_ranges,
    file_identity,
    first_record_fields,
    is_jsonl,
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
class InputFiles:
    """The files a job's input specs name, and the input-looking files passed over: the
    JSON-lines files of a directory that holds parquet files (a `dataset_info.json` or a
    stats file beside the data)."""

    files: list[str]
    passed_over: list[str]


def expand_input(spec: str) -> list[str]:
    """One input spec -> sorted file URIs (local files by their resolved path)."""
    return find_input(spec).files


def of_directory(found: list[str]) -> tuple[list[str], list[str]]:
    """A directory's inputs: its parquet files if it has any, else its JSON-lines files;
    and the JSON-lines files passed over."""
    parquet = [path for path in found if path.endswith(".parquet")]
    jsonl = [path for path in found if path.endswith(JSONL_SUFFIXES)]
    return (parquet, jsonl) if parquet else (jsonl, [])


def find_input(spec: str) -> InputFiles:
    """One input spec -> its sorted file URIs (local files by their resolved path), and
    what a directory's listing passed over."""
    filesystem, path = filesystem_and_path(spec)
    passed_over: list[str] = []
    if GLOB_CHARS.search(path):
        base = path[:GLOB_CHARS.search(path).start()].rsplit("/", 1)[0] or "/"
        pattern = glob_regex(path)
        matches = [p for p in _list_files(filesystem, base, spec) if pattern.fullmatch(p)]
    else:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise InputError(f"{spec}: no such file or directory")
        if info.type == pafs.FileType.Directory:
            matches, passed_over = of_directory(_list_files(filesystem, path, spec))
        elif info.type == pafs.FileType.File:
            matches = [path]
        else:  # a FIFO, socket or device would block or mislead the readers
            raise InputError(f"{spec}: not a regular file ({info.type.name})")
    if isinstance(filesystem, pafs.LocalFileSystem):  # one identity per file
        matches = [os.path.realpath(m) for m in matches]
        passed_over = [os.path.realpath(m) for m in passed_over]
    return InputFiles(sorted({uri_of(m, spec) for m in matches}),
                      sorted({uri_of(m, spec) for m in passed_over}))


def _list_files(filesystem: pafs.FileSystem, base: str, spec: str) -> list[str]:
    """Every file below `base`. Locally a walk that follows directory links but enters each
    directory (by device and inode) once, so a link loop ends instead of multiplying."""
    try:
        if isinstance(filesystem, pafs.LocalFileSystem):
            return _walk_local(base)
        infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=True))
        return [info.path for info in infos if info.is_file]
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{spec}: cannot list {base}: {exc}") from exc


def _walk_local(base: str) -> list[str]:
    seen: set[tuple[int, int]] = set()
    files = []
    for root, directories, names in os.walk(base, followlinks=True):
        status = os.stat(root)
        if (status.st_dev, status.st_ino) in seen:
            directories[:] = []
            continue
        seen.add((status.st_dev, status.st_ino))
        directories.sort()
        files.extend(os.path.join(root, name) for name in sorted(names)
                     if os.path.isfile(os.path.join(root, name)))
    return files


def expand_inputs(specs: tuple[str, ...] | list[str]) -> list[str]:
    return find_inputs(specs).files


def find_inputs(specs: tuple[str, ...] | list[str]) -> InputFiles:
    """Every spec's files, each once (a file some spec names is not passed over); a spec
    list that names no file is an error. Passed-over files are logged."""
    found = [find_input(spec) for spec in specs]
    unique = sorted({path for each in found for path in each.files})
    if not unique:
        raise InputError(f"inputs {list(specs)}: no parquet or JSON-lines file "
                         f"({', '.join(INPUT_SUFFIXES)}) matches")
    passed_over = sorted({path for each in found for path in each.passed_over} - set(unique))
    if passed_over:
        logger.warning("%d JSON-lines file(s) passed over in a directory of parquet files "
                       "(name them to read them): %s", len(passed_over),
                       ", ".join(passed_over[:5]) + (" ..." if len(passed_over) > 5 else ""))
    return InputFiles(unique, passed_over)


def open_parquet(uri: str) -> pq.ParquetFile:
    return _open_with_identity(uri)[0]


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


def unit_name(uri: str, start: int | None = None, stop: int | None = None,
              part: str = "rg") -> str:
    """`<file stem>-<hash of the URI>-<part><start>-<stop>`: row groups (`rg`) or, for
    JSON lines, byte offsets (`b`); `-whole` for a file read whole (no range)."""
    name = PurePosixPath(uri).name
    for suffix in INPUT_SUFFIXES:
        name = name.removesuffix(suffix)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    digest = hashlib.sha1(uri.encode()).hexdigest()[:8]
    if start is None or stop is None:
        return f"{stem[:48]}-{digest}-whole"
    width = 5 if part == "rg" else 12
    return f"{stem[:48]}-{digest}-{part}{start:0{width}d}-{stop:0{width}d}"


def _check_columns(uri: str, columns: list[str], available: list[str], noun: str) -> None:
    for role, column in zip([f"text {noun}"] + [noun] * len(columns), columns, strict=False):
        if column not in available:
            raise InputError(f"{uri}: {role} {column!r} not found; "
                             f"available {noun}s: {available}")


def units_of_file(uri: str, columns: list[str], unit_bytes: int,
                  text_first: bool = True) -> list[WorkUnit]:
    """Split one file into consecutive row-group ranges of about `unit_bytes` each; every
    name in `columns` (text column first, of a type that holds text) must exist."""
    parquet, identity = _open_with_identity(uri)
    schema = parquet.schema_arrow
    _check_columns(uri, columns, schema.names, "column")
    text_type = schema.field(columns[0]).type
    if text_first and not can_hold_text(text_type):
        raise InputError(f"{uri}: text column {columns[0]!r} has type {text_type}, which "
                         "cannot hold text (expected string, binary or a dictionary of them)")
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
    _check_columns(uri, columns, first_record_fields(uri), "field")
    identity, size = file_identity(uri)
    ranges = byte_ranges(uri, size, unit_bytes)
    whole = len(ranges) == 1
    return [WorkUnit(uri, 0, 1, -1, unit_name(uri) if whole else unit_name(uri, start, stop, "b"),
                     0 if start == 0 else -1,
                     identity, kind="jsonl", byte_start=start, byte_stop=-1 if whole else stop,
                     size_bytes=stop - start)
            for start, stop in ranges]


def plan_units(inputs: tuple[str, ...] | list[str], text_column: str, unit_bytes: int,
               extra_columns: tuple[str, ...] = ()) -> list[WorkUnit]:
    return plan_files(expand_inputs(inputs), text_column, unit_bytes, extra_columns)


def plan_files(files: list[str], text_column: str, unit_bytes: int,
               extra_columns: tuple[str, ...] = (), text_first: bool = True
               ) -> list[WorkUnit]:
    """The work units of `files`, in order; checks every file's columns (and that the
    first holds text, unless `text_first` is off: chat rows)."""
    units: list[WorkUnit] = []
    columns = [text_column, *extra_columns]
    for uri in files:
        plan = units_of_jsonl if is_jsonl(uri) else units_of_file
        units.extend(plan(uri, columns, unit_bytes, text_first))
    return units


def unit_batches(unit: WorkUnit, columns: list[str], batch_rows: int,
                 text_first: bool = True) -> Iterator[pa.RecordBatch]:
    """The rows of a file unit as record batches of `columns` (text first; chat rows:
    `text_first=False`), in file order; a decode error is an InputError naming the unit's
    file and range."""
    if unit.kind == "jsonl":
        yield from jsonl_batches(unit, columns, batch_rows, text_first)
        return
    parquet = open_parquet(unit.uri)
    batches = parquet.iter_batches(batch_size=batch_rows, columns=list(dict.fromkeys(columns)),
                                   row_groups=range(unit.row_group_start, unit.row_group_stop),
                                   use_threads=False)
    try:
        yield from batches
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{unit.location} cannot be read: {exc}") from exc
