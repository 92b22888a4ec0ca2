"""`raypipe verify`: re-check every shard of an output against its manifest.

Invariant: a dataset passes only if every file the manifest lists exists inside the dataset
directory with the recorded size and sha256, every shard opens in its format's reader
(headers, index consistency) with the manifest's document/token/batch counts, and every
stream metadata id is inside its shard's index. The first failure raises FormatError naming
the file and the expected versus actual value. Cost: one full read of every file (sha256
at ~1 GB/s) plus O(tokens) id checks for stream shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from raypipe.dataset import LLMBatchDataset, ShardSet, TokenDataset
from raypipe.errors import FormatError
from raypipe.formats import FORMATS
from raypipe.formats.base import require_file, require_size
from raypipe.io.atomic import file_sha256
from raypipe.io.manifest import FileEntry, Manifest, read_manifest, safe_join


@dataclass(frozen=True)
class VerifyCounts:
    formats: int
    shards: int
    files: int


def check_file(root: Path, entry: FileEntry) -> None:
    path = safe_join(root, entry.path)
    require_size(path, entry.bytes, require_file(path))
    digest = file_sha256(path)
    if digest != entry.sha256:
        raise FormatError(path, "sha256 differs from the manifest", entry.sha256, digest)


def shard_set(root: Path, name: str, manifest: Manifest) -> ShardSet:
    """The shards of format `name`, opened the way the loader opens them."""
    if FORMATS[name].holds == "batches":
        return LLMBatchDataset(root, manifest)
    return TokenDataset(root, name, manifest)


def open_every_shard(root: Path, name: str, manifest: Manifest) -> None:
    """Open each shard of format `name` in its reader (headers, indexes, counts; no
    checksums) and run the format's own content checks."""
    shards = shard_set(root, name, manifest)
    for index in range(shards.num_shards):
        shards.reader(index).verify_contents()


def verify_dataset(root: str | Path) -> VerifyCounts:
    """Check everything; return counts of what was checked."""
    root = Path(root)
    manifest = read_manifest(root)
    files = shards = 0
    for name, section in manifest.formats.items():
        if name not in FORMATS:
            raise FormatError(root / "manifest.json", f"format {name!r} unknown",
                              list(FORMATS), name)
        for shard in section.shards:
            for entry in shard.files:
                check_file(root, entry)
                files += 1
        open_every_shard(root, name, manifest)
        shards += len(section.shards)
    return VerifyCounts(len(manifest.formats), shards, files)
