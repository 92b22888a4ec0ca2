"""Plan a job's input files into work units sized by bytes, whatever the files.

Invariant: the unit list is a pure function of the sorted input files, their sizes (from
the listing) and `unit_bytes`, never of parallelism or timing. A config that leaves
`unit_bytes` to raypipe gets the output's earlier value (a rerun plans the same units), else
`auto_unit_bytes` of the listing's total: so a corpus of a few files is cut into units
enough for every worker, and the output is the same bytes at any parallelism (deciding it
costs one sum over the listing and one read of the output's job record, once a job, not
per unit). A file of at least `unit_bytes` is cut as `raypipe.preprocess.inputs` cuts it
(row groups, byte ranges); the smaller ones are grouped, in sorted order, into `group`
units that close once they hold `unit_bytes` (so a group holds less than `unit_bytes` plus
one file) or GROUP_FILES files.
The units are ordered by their first file. So 10^4 files of 10 KB make a few units and a
few shards, and a job has at most (small files' bytes / unit_bytes + 1) group units. A
group's identity is its members' listing (URI, size, modification time): a file rewritten
in place re-runs its group (a copy that does not keep times re-runs it too). A group of
one file is planned as that file alone (its identity from its contents, as before).

Metadata reads run side by side (raypipe.io.parallel): a large file's footer or cuts, and the first
member of each group (its columns are checked before the output is touched; every other
member is checked by the worker that reads it). So planning costs one listing, and one
small read per large file and per group, 32 at a time: 2,000 files on object
storage at 20 ms a request plan in well under a second of requests.

A file that cannot be planned (a corrupt parquet footer, a JSON-lines file whose first line
is not JSON) fails the job before the output is touched, in one message naming every such
file planning read (up to BAD_FILES_NAMED), unless `skip_bad_files`: then each is named
as a BadFile (and later in the summary and the manifest).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from raypipe.errors import InputError, bad_input
from raypipe.io.parallel import map_threads
from raypipe.io.records import BadFile, WorkUnit
from raypipe.preprocess.inputs import (
    FileStat,
    InputFiles,
    check_jsonl_fields,
    file_stem,
    find_inputs,
    name_digest,
    stat_files,
    unit_name,
    units_of_file,
    units_of_jsonl,
)
from raypipe.preprocess.jsonl import is_jsonl

GROUP_FILES = 16_384  # files in one group at most (bounds a unit record's size)
# unit_bytes left to raypipe: the input's bytes / AUTO_UNITS, within [MIN, MAX]: a 200 MB
# corpus makes enough units for every worker of a small cluster from the first second,
# a large one 64 MiB units; units stay >= 1 MiB, as a unit's own cost (its shard files,
# their fsyncs and its record: milliseconds) is felt only below a few MiB; from the
# listing alone, so never from the cluster
AUTO_UNITS = 64
MIN_AUTO_UNIT_BYTES = 1 << 20
MAX_AUTO_UNIT_BYTES = 64 << 20


@dataclass(frozen=True)
class InputUnits:
    """A job's units in order, and the files planning skipped under `skip_bad_files`."""

    units: list[WorkUnit]
    bad_files: tuple[BadFile, ...] = ()


def auto_unit_bytes(input_bytes: int) -> int:
    """The unit size of an input of `input_bytes` (the listing's sizes) when the config
    leaves it to raypipe."""
    return min(MAX_AUTO_UNIT_BYTES, max(MIN_AUTO_UNIT_BYTES, -(-input_bytes // AUTO_UNITS)))


def file_groups(files: list[str], stats: dict[str, FileStat], unit_bytes: int
                ) -> list[list[str]]:
    """The files in order, each large file alone, small ones grouped: a group closes once it
    holds `unit_bytes` or GROUP_FILES files. A group lists its first file's position among
    `files`, so the units keep the files' order."""
    alone: list[tuple[int, list[str]]] = []
    groups: list[tuple[int, list[str]]] = []
    current: list[str] = []
    held = 0
    for position, uri in enumerate(files):
        size = stats[uri].size
        if size >= unit_bytes:
            alone.append((position, [uri]))
            continue
        if not current:
            groups.append((position, current))
        current.append(uri)
        held += size
        if held >= unit_bytes or len(current) >= GROUP_FILES:
            current, held = [], 0
    return [members for _, members in sorted(alone + groups)]


def member_unit(uri: str, stat: FileStat) -> WorkUnit:
    """A small file read whole inside a group: row_group_stop -1 means every row group,
    with the file's columns checked as it is read."""
    return WorkUnit(uri, 0, -1, -1, unit_name(uri), 0,
                    f"{stat.size}:{stat.mtime_ns}", kind="jsonl" if is_jsonl(uri)
                    else "parquet", size_bytes=stat.size)


def group_unit(uris: list[str], stats: dict[str, FileStat]) -> WorkUnit:
    """`<first file's stem>-<hash of the member URIs>-files<count>`, its identity the hash
    of the members' listing."""
    members = tuple(member_unit(uri, stats[uri]) for uri in uris)
    listing = "\n".join(f"{m.uri}\t{m.source}" for m in members).encode()
    name = f"{file_stem(uris[0])[:40]}-{name_digest(chr(10).join(uris))}-files{len(uris):05d}"
    return WorkUnit(uris[0], 0, 1, -1, name, 0, hashlib.sha256(listing).hexdigest()[:16],
                    kind="group", size_bytes=sum(m.size_bytes for m in members),
                    members=members)


def plan_inputs(found: InputFiles, columns: list[str], unit_bytes: int,
                text_first: bool = True, skip_bad_files: bool = False) -> InputUnits:
    """The work units of `found`'s files (columns checked: the text column first, of a type
    that holds text, unless `text_first` is off: chat rows)."""
    stats = found.stats if len(found.stats) == len(found.files) else stat_files(found.files)
    groups = file_groups(found.files, stats, unit_bytes)

    def plan_one(uris: list[str]) -> list[WorkUnit] | BadFile | InputError:
        try:
            if len(uris) > 1:
                _check_first_member(uris[0], columns, text_first)
                return [group_unit(uris, stats)]
            plan = units_of_jsonl if is_jsonl(uris[0]) else units_of_file
            return plan(uris[0], columns, unit_bytes, text_first)
        except InputError as exc:
            if skip_bad_files and len(uris) == 1:
                return BadFile.of_error(uris[0], exc, stats[uris[0]].size)
            if skip_bad_files:  # the worker reading the group names and skips it
                return [group_unit(uris, stats)]
            return exc

    planned = map_threads(plan_one, groups)
    errors = [each for each in planned if isinstance(each, InputError)]
    if errors:
        raise bad_input(errors)
    units = [unit for each in planned if isinstance(each, list) for unit in each]
    return InputUnits(units, tuple(each for each in planned if isinstance(each, BadFile)))


def _check_first_member(uri: str, columns: list[str], text_first: bool) -> None:
    """A group's first file holds the columns (its footer or first line): a wrong column
    name fails the job before the output is touched, not in a worker."""
    if is_jsonl(uri):
        check_jsonl_fields(uri, columns)
    else:
        units_of_file(uri, columns, 1 << 62, text_first)


def plan_units(inputs: tuple[str, ...] | list[str], text_column: str, unit_bytes: int,
               extra_columns: tuple[str, ...] = ()) -> list[WorkUnit]:
    """The units of the files `inputs` name (text column first, then `extra_columns`)."""
    return plan_inputs(find_inputs(inputs), [text_column, *extra_columns], unit_bytes).units
