"""A local path or URI -> (pyarrow filesystem, path on it).

Invariant: a plain path is made absolute before it is resolved, so the same file always
resolves to the same (filesystem, path); `uri_of` turns a listed path back into a URI of the
spec's scheme. Endpoints and credentials come from pyarrow's standard environment
(`AWS_ENDPOINT_URL`, `AWS_*`, `GOOGLE_APPLICATION_CREDENTIALS`). Cost: one `from_uri` call.
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath

import pyarrow as pa
import pyarrow.fs as pafs

from raypipe.errors import InputError


def filesystem_and_path(uri: str) -> tuple[pafs.FileSystem, str]:
    """Resolve a local path or URI to a pyarrow filesystem and a path on it."""
    if "://" not in uri:
        uri = str(PurePosixPath(uri)) if uri.startswith("/") else os.path.abspath(uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{uri}: cannot open: {exc}") from exc


def uri_of(path: str, spec: str) -> str:
    """`path` (as a filesystem listed it) as a URI of the same scheme as `spec`."""
    if "://" in spec:
        return f"{spec.split('://', 1)[0]}://{path}"
    return path
