"""An output's unit orders, kept, and a view of its units in another order.

Invariant: every manifest a job writes (and the one a rerun replaces) has the order of its
units kept under `_views/<key>.json`, the key a digest of the names in order, written once
and never changed. A loader whose output gained units since its state was saved numbers
documents in the order it had (its units first, in their order; the units added after
them): `view_manifest` is the manifest of the output's units in that order, shards and
totals with them, so every earlier document keeps its number and every file is checked as
the manifest's own; a unit whose files differ from the kept digests is named as rewritten.
Cost, on the driver when a job writes its manifest: one small JSON file (~40 bytes a unit,
and 19 a unit per format for its digest), 8.7 us a unit per format to digest, plus a read
of the manifest a rerun replaces; a view is O(units + shards) in memory, built once per
loader that needs it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

from raypipe.errors import FormatError
from raypipe.io.records import Manifest
from raypipe.io.store import Store

VIEWS_DIR = "_views"


def view_key(unit_names: Sequence[str]) -> str:
    """The key of a unit order: a digest of the names, in order."""
    return hashlib.sha256("\n".join(unit_names).encode()).hexdigest()[:16]


def unit_names(manifest: Manifest) -> list[str]:
    return [unit.name for unit in manifest.units]


def keep_view(store: Store, manifest: Manifest) -> str:
    """Keep `manifest`'s unit order (once), with a digest of each unit's shard files per
    format (what names a unit rewritten since); its key."""
    names = unit_names(manifest)
    key = view_key(names)
    path = f"{VIEWS_DIR}/{key}.json"
    if not store.exists(path):
        store.write_json(path, {"units": names, "digests": {
            format_name: unit_digests(manifest, format_name)
            for format_name in manifest.formats}})
    return key


def unit_digests(manifest: Manifest, format_name: str) -> dict[str, str]:
    """{unit: digest of its shard files of format `format_name`} (names, sizes, sha256)."""
    files: dict[str, list] = {}
    for shard in manifest.formats[format_name].shards:
        files.setdefault(shard.name.rsplit("-", 1)[0], []).extend(
            [entry.path, entry.bytes, entry.sha256] for entry in shard.files)
    return {name: hashlib.sha256(repr(files.get(name, [])).encode()).hexdigest()[:16]
            for name in unit_names(manifest)}


def rewritten_unit(store: Store, key: str, current: Manifest, format_name: str
                   ) -> str | None:
    """The first unit of the kept order `key` whose shard files of `format_name` differ
    from what the order kept (None: none, or the output keeps no digests for it)."""
    path = f"{VIEWS_DIR}/{key}.json"
    if not store.exists(path):
        return None
    kept = (store.read_json(path).get("digests") or {}).get(format_name)
    if not isinstance(kept, dict):
        return None
    now = unit_digests(current, format_name)
    return next((name for name, digest in kept.items()
                 if name in now and now[name] != digest), None)


def read_view(store: Store, key: str, current: Manifest) -> list[str] | None:
    """The unit order kept under `key` (the current manifest's own, if it is that one);
    None where the output does not keep it."""
    names = unit_names(current)
    if view_key(names) == key:
        return names
    path = f"{VIEWS_DIR}/{key}.json"
    if not store.exists(path):
        return None
    kept = store.read_json(path).get("units")
    if not isinstance(kept, list) or view_key(kept) != key:
        raise FormatError(store.uri_of(path), "not the unit order its name says")
    return kept


def view_manifest(manifest: Manifest, names: Sequence[str], format_name: str) -> Manifest:
    """`manifest` with its units, and format `format_name`'s shards, in the order of
    `names` (a unit the manifest lacks is a FormatError naming it); the other formats left
    out (their shards follow the manifest's order)."""
    units = {unit.name: unit for unit in manifest.units}
    missing = [name for name in names if name not in units]
    if missing:
        raise FormatError(f"unit {missing[0]}", "the run's data held this unit; the output "
                          f"no longer does ({len(missing)} missing)")
    section = manifest.formats[format_name]
    by_unit: dict[str, list] = {}
    for shard in section.shards:
        by_unit.setdefault(shard.name.rsplit("-", 1)[0], []).append(shard)
    shards = tuple(shard for name in names for shard in by_unit.get(name, []))
    chosen = [units[name] for name in names]
    totals = dataclasses.replace(
        manifest.totals, rows=sum(unit.rows for unit in chosen),
        documents=sum(unit.documents for unit in chosen),
        tokens=sum(unit.tokens for unit in chosen), shards=len(shards),
        bytes=sum(shard.bytes for shard in shards), trained_tokens=None)
    return dataclasses.replace(manifest, units=tuple(chosen), totals=totals, formats={
        format_name: dataclasses.replace(section, shards=shards)})


__all__ = ["VIEWS_DIR", "keep_view", "read_view", "rewritten_unit", "unit_digests",
           "unit_names", "view_key", "view_manifest"]
