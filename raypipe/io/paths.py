"""Path safety for names and paths read from records and manifests.

Invariant: a shard name read from a manifest is a plain file name (no directory part, not .
or .., no NUL, at most 255 bytes); a path read from one is relative with no `..` part, and
`safe_join` checks it again against the real directory before any use, so nothing a crafted
manifest says can reach outside the dataset directory. Inside a job that `ray job submit`
started, a location the job writes for later (a tokenize output, a training run's
checkpoints) is refused in one line when it is relative or inside the working directory:
that is Ray's throw-away copy of `--working-dir`, and a resubmitted job gets a new one.
Cost: a string check; one resolve() per join.
"""

from __future__ import annotations

import os
from pathlib import Path

from raypipe.errors import ConfigError, FormatError


def plain_name(name: str, where: str, field_name: str = "name") -> str:
    """`name` if it is a plain file name (no directory part, not . or .., no NUL), else a
    FormatError: names read from a manifest become file names on the reader's disk."""
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name
            or len(name.encode()) > 255):
        raise FormatError(where, f"{field_name} {name!r} is not a plain file name")
    return name


def relative_path(path: str, where: str) -> str:
    """`path` if it is relative and has no `..` part (checked again against the real
    directory by `safe_join` before any use)."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if not path or path.startswith("/") or "\x00" in path or ".." in parts or not parts:
        raise FormatError(where, f"path {path!r} must be relative to the dataset, without ..")
    return path


def safe_join(root: Path, relative: str) -> Path:
    """`root / relative`, refusing absolute paths and `..` escapes."""
    candidate = (root / relative).resolve()
    if os.path.isabs(relative) or not candidate.is_relative_to(root.resolve()):
        raise FormatError(root / relative, "path escapes the dataset directory", str(root),
                          relative)
    return root / relative


SUBMITTED_JOB_VARIABLE = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor


def check_lasting_location(location: str, what: str) -> None:
    """In a submitted Ray job, a ConfigError if `location` (a path or URI) would land in
    Ray's temporary copy of the working directory; elsewhere nothing."""
    if SUBMITTED_JOB_VARIABLE not in os.environ or "://" in location:
        return
    copy = os.path.realpath(os.getcwd())
    where = os.path.realpath(os.path.abspath(location))
    if os.path.isabs(location) and not (where + os.sep).startswith(copy + os.sep):
        return
    relation = "inside" if os.path.isabs(location) else "relative to"
    raise ConfigError(f"{what} {location!r} is {relation} Ray's temporary copy of the "
                      f"working directory ({copy}): a resubmitted job gets a new copy, so "
                      "it would be lost (or start over); give an absolute path every node "
                      "sees, or a URI (s3://...)")
