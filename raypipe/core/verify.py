"""`raypipe verify`: re-check every shard of an output against its manifest.

Invariant: a dataset passes only if every file the manifest lists exists inside the dataset
directory with the recorded size and sha256, every shard opens in its format's reader
(headers, index consistency) with the manifest's document/token/batch counts, and every
stream metadata id is inside its shard's index. The first failure raises FormatError naming
the file and the expected versus actual value. Cost: one full read of every file (sha256
at ~1 GB/s) plus O(tokens) id checks for stream shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from raypipe.core.dataset import LLMBatchDataset, TokenDataset
from raypipe.core.manifest import read_manifest, safe_join
from raypipe.errors import FormatError
from raypipe.formats.base import file_sha256, require_file, require_size


def check_file(root: Path, entry: dict[str, Any]) -> None:
    path = safe_join(root, entry["path"])
    require_size(path, entry["bytes"], require_file(path))
    digest = file_sha256(path)
    if digest != entry["sha256"]:
        raise FormatError(path, "sha256 differs from the manifest", entry["sha256"], digest)


def check_stream_ids(dataset: TokenDataset, index: int) -> None:
    reader = dataset.reader(index)
    if getattr(reader, "metadata_ids", None) is None or not reader.num_tokens:
        return
    largest = int(np.max(reader.metadata_ids))
    if largest >= reader.num_records:
        raise FormatError(reader.tokens_path, "metadata id outside the index",
                          f"< {reader.num_records}", largest)
    offsets = np.asarray(reader.index)
    if (np.diff(offsets.astype(np.int64)) < 0).any():
        raise FormatError(reader.index_path, "offsets are not ascending", "ascending",
                          "a decrease")


def open_every_shard(root: Path, name: str, manifest: dict[str, Any]) -> None:
    """Open each shard of format `name` in its reader (headers, indexes, counts; no
    checksums); stream shards also get their metadata ids range-checked."""
    if name == "llmbatch":
        batches = LLMBatchDataset(root, manifest)
        for index in range(len(batches.shards)):
            batches.reader(index)
        return
    documents = TokenDataset(root, name, manifest)
    for index in range(documents.num_shards):
        documents.reader(index)
        if name == "stream":
            check_stream_ids(documents, index)


def verify_dataset(root: str | Path) -> dict[str, int]:
    """Check everything; return counts of what was checked."""
    root = Path(root)
    manifest = read_manifest(root)
    files = shards = 0
    for name, section in manifest["formats"].items():
        for shard in section["shards"]:
            for entry in shard["files"]:
                check_file(root, entry)
                files += 1
        open_every_shard(root, name, manifest)
        shards += len(section["shards"])
    return {"formats": len(manifest["formats"]), "shards": shards, "files": files}
