"""The commit protocol of an output: unit commit records, then the manifest.

Invariant: the commit order is shard files -> unit record (`_units/<unit>.json`) ->
`manifest.json`, each written atomically. A unit counts as committed only if its record
parses (raypipe.io.records), carries the job's fingerprint and every file it lists exists
with the recorded size (and, where its modification time moved, sha256); the manifest is
written last and is the record that the whole dataset is complete. Cost: one small JSON
file per unit; checking the committed units of a job is one listing of the output plus one
record read per committed unit, 32 in flight (`committed_unit_records`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from raypipe import _faults as faults
from raypipe.errors import FormatError
from raypipe.io.atomic import atomic_writer
from raypipe.io.parallel import map_threads
from raypipe.io.records import FileEntry, Manifest, ShardEntry, UnitRecord, WorkUnit, to_json
from raypipe.io.store import Store
from raypipe.io.views import keep_view

logger = logging.getLogger("raypipe")


MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "config.yaml"  # the job's config, beside the manifest


UNITS_DIR = "_units"


JOB_RECORD = "_job.json"


def as_store(location: Store | str | Path) -> Store:
    return location if isinstance(location, Store) else Store(location)


def unit_record_name(unit_name: str) -> str:
    return f"{UNITS_DIR}/{unit_name}.json"


def unit_record_paths(output: Store) -> list[str]:
    """The paths of every unit record the output holds (one listing, no record read)."""
    job = f"{UNITS_DIR}/{JOB_RECORD}"
    return [path for path in output.list_files(UNITS_DIR)
            if path.endswith(".json") and path != job]


def write_unit_record(output: Store, record: UnitRecord) -> None:
    output.write_json(unit_record_name(record.unit.name), to_json(record))


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise FormatError(path, f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise FormatError(path, "top level is not a JSON object")
    return data


Listing = dict[str, tuple[int, int | None]]  # Store.list_infos: path -> (size, mtime)


def file_problem(root: Store | str | Path, entry: FileEntry,
                 listing: Listing | None = None) -> str | None:
    """Why the file an entry names is not the file that was committed, or None. A stat
    (a HEAD on object storage), or the output's `listing` where given, decides when size
    and modification time match the record; a changed modification time (an edit in place,
    a copy that did not keep times) is settled by the file's sha256."""
    store = as_store(root)
    found = store.info(entry.path) if listing is None else listing.get(entry.path)
    if found is None:
        return "file listed in the manifest is missing"
    size, mtime_ns = found
    if size != entry.bytes:
        return f"size differs from the manifest (expected {entry.bytes}, found {size})"
    moved = entry.mtime_ns is not None and mtime_ns != entry.mtime_ns
    if moved and store.sha256(entry.path) != entry.sha256:
        return "contents changed since the commit (sha256 differs from the manifest)"
    return None


def record_problem(output: Store, record: UnitRecord,
                   listing: Listing | None = None) -> str | None:
    """The first file of a unit's record that is not intact, described, or None."""
    for shard in record.shards:
        for entries in shard.files.values():
            for entry in entries:
                problem = file_problem(output, entry, listing)
                if problem is not None:
                    return f"{output.uri_of(entry.path)}: {problem}"
    return None


def committed_unit_records(output: Store, units: Sequence[WorkUnit],
                           fingerprints: Collection[str]) -> dict[str, UnitRecord]:
    """The records of the `units` that are committed (`committed_unit_record`), by unit
    name. One listing of the output finds which units have a record and the size and time
    of every file; only those records are read, side by side: a rerun of a finished output
    of 2,000 units costs a listing and 2,000 small GETs 32 at a time, no HEAD per file."""
    listing = output.list_infos()
    present = [unit for unit in units if unit_record_name(unit.name) in listing]
    found = map_threads(lambda unit: committed_unit_record(output, unit, fingerprints,
                                                           listing), present)
    return {unit.name: record for unit, record in zip(present, found, strict=True)
            if record is not None}


def committed_unit_record(output: Store, unit: WorkUnit, fingerprints: Collection[str],
                          listing: Listing | None = None) -> UnitRecord | None:
    """The unit's record if the unit is fully committed for one of these fingerprints (the
    job's, and the one an older release computed for the same config) from the same input
    (a record from before input identities were kept is taken as is), else None. Files
    are checked against `listing` where given (Store.list_infos of the output)."""
    name = unit_record_name(unit.name)
    if (name not in listing) if listing is not None else not output.exists(name):
        return None
    record = UnitRecord.from_json(output.read_json(name), output.uri_of(name))
    if record.fingerprint not in fingerprints:
        return None
    if record.unit.source and unit.source and record.unit.source != unit.source:
        logger.warning("re-running unit %s: %s changed since it was tokenized", unit.name,
                       unit.uri)
        return None
    problem = record_problem(output, record, listing)
    if problem is not None:
        logger.warning("re-running unit %s: %s", unit.name, problem)
        return None
    return record


def read_manifest(output: Store | str | Path) -> Manifest:
    store = as_store(output)
    if not store.exists(MANIFEST_NAME):
        bucket = store.missing_bucket()
        raise FormatError(store.uri_of(MANIFEST_NAME), f"no manifest: bucket {bucket!r} "
                          "does not exist" if bucket else "no manifest: the dataset is "
                          "incomplete or not a raypipe output")
    # (a rerun of the job replaces it while loaders may read it: a cut-short read is made
    # again on object storage, raypipe.io.store)
    return Manifest.from_json(store.read_json(MANIFEST_NAME, replaced_in_place=True),
                              store.uri_of(MANIFEST_NAME))


def shard_table(records: list[UnitRecord], format_name: str) -> tuple[ShardEntry, ...]:
    """The shards of one format, in unit order, as the manifest lists them."""
    return tuple(shard.entry(format_name) for record in records for shard in record.shards)


def write_manifest(output: Store | str | Path, manifest: Manifest) -> None:
    """Write the manifest: the record that the whole dataset is complete (written last);
    the unit order of the one it replaces, and its own, kept (raypipe.io.views)."""
    store = as_store(output)
    if store.exists(MANIFEST_NAME):
        keep_view(store, read_manifest(store))
    keep_view(store, manifest)
    # compact: json's C encoder (an indent takes its Python one, ~10x slower at 10^4 units)
    data = (json.dumps(manifest.to_json(), separators=(",", ":"), sort_keys=True)
            + "\n").encode()
    if store.local:
        final = store.root / MANIFEST_NAME
        with atomic_writer(final) as handle:
            handle.write(data)
            handle.flush()
            faults.point("manifest.before_rename", path=final)
    else:
        faults.point("manifest.before_rename", path=store.uri_of(MANIFEST_NAME))
        store.write_bytes(MANIFEST_NAME, data)
    faults.point("manifest.after_rename", path=store.uri_of(MANIFEST_NAME))

