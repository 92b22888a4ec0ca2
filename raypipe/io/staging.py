"""Where a writer's files wait before they are published into an output: the output directory
itself when it is local, else a private local directory on the worker's disk.

Invariant: a format writer always writes a local file (temp name, fsync, rename, hashed as
it is written); `publish` then puts each committed file into the store in the order given
(data before index) and returns its entry with the store's modification time, so the
entry a unit record lists describes the object exactly as the store holds it. A staged
file is deleted once uploaded, so a worker's disk holds at most one shard of a unit. The
staging directory is `$RAYPIPE_STAGING_DIR` (else `<tmp>/raypipe-staging`)/`<pid>-<random>`;
directories whose process died (a killed worker) are swept by the next staging on that
host. Local outputs cost nothing here (publish is the identity); object storage costs one
upload and one HEAD per file.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from raypipe.io.records import FileEntry, UnitShard
from raypipe.io.store import Store


def staging_root() -> Path:
    configured = os.environ.get("RAYPIPE_STAGING_DIR")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "raypipe-staging"


def _sweep_dead(root: Path) -> None:
    """Remove staging directories of processes that no longer exist."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        pid = child.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(child, ignore_errors=True)
        except PermissionError:
            continue


class Staging:
    """A local directory for files bound for `store`, laid out as the store is."""

    def __init__(self, store: Store):
        self.store = store
        if store.local:
            self.directory = store.root
            return
        root = staging_root()
        root.mkdir(parents=True, exist_ok=True)
        _sweep_dead(root)
        self.directory = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self.store.local:
            shutil.rmtree(self.directory, ignore_errors=True)

    def publish(self, entries: tuple[FileEntry, ...] | list[FileEntry]) -> tuple[FileEntry, ...]:
        """Upload committed local files in order; their entries as the store holds them."""
        if self.store.local:
            return tuple(entries)
        published = []
        for entry in entries:
            local = self.directory / entry.path
            mtime_ns = self.store.upload(local, entry.path)
            local.unlink(missing_ok=True)
            published.append(dataclasses.replace(entry, mtime_ns=mtime_ns))
        return tuple(published)

    def publish_shard(self, shard: UnitShard) -> UnitShard:
        files = {name: self.publish(entries) for name, entries in shard.files.items()}
        return dataclasses.replace(shard, files=files)
