"""Unit commit records and the dataset manifest.

Invariant: the commit order is shard files -> unit record (`_units/<unit>.json`) ->
`manifest.json`, each written atomically. A unit counts as committed only if its record
exists, carries the job's fingerprint and every file it lists exists with the recorded
size; the manifest is written last and is the record that the whole dataset is complete.
No path read from a record or manifest may leave the dataset directory. Cost: one small
JSON file per unit; checking 1,000 committed units is ~1,000 stats (tens of ms).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from raypipe.core.atomic import atomic_writer, write_json_atomic
from raypipe.errors import FormatError

MANIFEST_NAME = "manifest.json"
UNITS_DIR = "_units"
JOB_RECORD = "_job.json"
MANIFEST_VERSION = 1


def safe_join(root: Path, relative: str) -> Path:
    """`root / relative`, refusing absolute paths and `..` escapes."""
    candidate = (root / relative).resolve()
    if os.path.isabs(relative) or not candidate.is_relative_to(root.resolve()):
        raise FormatError(root / relative, "path escapes the dataset directory", str(root),
                          relative)
    return root / relative


def unit_record_path(output: Path, unit_name: str) -> Path:
    return output / UNITS_DIR / f"{unit_name}.json"


def write_unit_record(output: Path, record: dict[str, Any]) -> None:
    write_json_atomic(unit_record_path(output, record["unit"]["name"]), record)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise FormatError(path, f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise FormatError(path, "top level is not a JSON object")
    return data


def record_files_present(output: Path, record: dict[str, Any]) -> bool:
    for shard in record["shards"]:
        for files in shard["files"].values():
            for entry in files:
                try:
                    if os.stat(safe_join(output, entry["path"])).st_size != entry["bytes"]:
                        return False
                except FileNotFoundError:
                    return False
    return True


def committed_unit_record(output: Path, unit_name: str, fingerprint: str) -> dict | None:
    """The unit's record if the unit is fully committed for this fingerprint, else None."""
    path = unit_record_path(output, unit_name)
    if not path.exists():
        return None
    record = read_json(path)
    if record.get("fingerprint") != fingerprint or not record_files_present(output, record):
        return None
    return record


def read_manifest(output: str | Path) -> dict[str, Any]:
    path = Path(output) / MANIFEST_NAME
    if not path.exists():
        raise FormatError(path, "no manifest: the dataset is incomplete or not a raypipe output")
    manifest = read_json(path)
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise FormatError(path, "unsupported manifest version", MANIFEST_VERSION,
                          manifest.get("manifest_version"))
    return manifest


def library_versions() -> dict[str, str]:
    import numpy
    import pyarrow
    import tokenizers

    from raypipe import __version__

    return {"raypipe": __version__, "python": platform.python_version(),
            "numpy": numpy.__version__, "pyarrow": pyarrow.__version__,
            "tokenizers": tokenizers.__version__}


def shard_table(records: list[dict[str, Any]], format_name: str) -> list[dict[str, Any]]:
    """The shards of one format, in unit order, as the manifest lists them."""
    table = []
    for record in records:
        for shard in record["shards"]:
            table.append({"name": shard["name"], "documents": shard["documents"],
                          "tokens": shard["tokens"], "files": shard["files"][format_name]})
    return table


def write_manifest(output: Path, manifest: dict[str, Any]) -> None:
    from raypipe.core import faults

    final = output / MANIFEST_NAME
    with atomic_writer(final) as handle:
        handle.write((json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        handle.flush()
        faults.point("manifest.before_rename", path=final)
    faults.point("manifest.after_rename", path=final)
