"""Crash-safe file commits: write to a temporary name, fsync, rename.

Invariant: a file under its final name is always complete. A writer works on
`.<final>.<pid>.raypipe.tmp` in the same directory (so the rename is atomic on POSIX), fsyncs the
file, `os.replace`s it onto the final name and fsyncs the directory. A crash at any point
leaves either nothing or a hidden temp file under the final name's directory, which
`remove_stale_temps` sweeps on the next run (only names of that pattern: a user's own
`.x.tmp` is never touched). `HashedTempFile` computes a file's size and sha256 while it is
written, so committing a shard never reads it back. Cost: one fsync per file and per
directory (a few ms each on local disk), negligible against shard sizes of MBs to GBs;
sha256 on the write path runs at ~1 GB/s, far above any tokenizer's rate.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

TEMP_SUFFIX = ".raypipe.tmp"


def temp_path_for(final: Path) -> Path:
    """The temporary name a writer of `final` uses (hidden, per process)."""
    return final.parent / f".{final.name}.{os.getpid()}{TEMP_SUFFIX}"


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_file(temp: Path, final: Path) -> None:
    """fsync `temp`, rename it onto `final`, fsync the directory."""
    with open(temp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(temp, final)
    fsync_directory(final.parent)


@contextmanager
def atomic_writer(final: Path) -> Iterator[IO[bytes]]:
    """Open a binary temp file; on clean exit commit it to `final`, on error remove it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path_for(final)
    try:
        with open(temp, "wb") as handle:
            yield handle
        commit_file(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(final: Path, data: bytes) -> None:
    with atomic_writer(final) as handle:
        handle.write(data)


def write_json_atomic(final: Path, obj: object) -> None:
    write_bytes_atomic(final, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


class HashedTempFile:
    """A binary temp file for `final` that hashes what is written to it."""

    def __init__(self, final: Path):
        self.final = Path(final)
        self.temp = temp_path_for(self.final)
        self.handle: IO[bytes] = open(self.temp, "wb")
        self.digest = hashlib.sha256()
        self.size = 0
        self.patched = False

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        self.handle.write(view)
        self.digest.update(view)
        self.size += view.nbytes

    def patch_start(self, data: bytes) -> None:
        """Overwrite the first bytes (a header known only at the end); the checksum is then
        taken by one read of the file at commit."""
        self.handle.seek(0)
        self.handle.write(data)
        self.handle.seek(0, os.SEEK_END)
        self.patched = True

    def commit(self) -> tuple[int, str, int]:
        """Close, fsync, rename onto the final name; return (size, sha256, mtime_ns)."""
        self.handle.close()
        digest = file_sha256(self.temp) if self.patched else self.digest.hexdigest()
        commit_file(self.temp, self.final)
        return self.size, digest, os.stat(self.final).st_mtime_ns

    def abort(self) -> None:
        """Remove the temp file. Closing may fail (a full disk fails the final flush): the
        file is discarded anyway, and the error that made us abort is the one to report."""
        with suppress(OSError):
            self.handle.close()
        self.temp.unlink(missing_ok=True)


def file_sha256(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def remove_stale_temps(directory: Path) -> int:
    """Delete temp files a crashed writer left anywhere under `directory`; return the count."""
    removed = 0
    if not directory.exists():
        return 0
    for path in directory.rglob(f".*.*{TEMP_SUFFIX}"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed
