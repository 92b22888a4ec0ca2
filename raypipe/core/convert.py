"""`raypipe convert SRC DST --format F`: any format into any other without re-tokenizing.

Invariant: document formats convert shard by shard under the same shard names, document by
document, so megatron <-> nanogpt <-> stream (tokens and document boundaries) round-trip
losslessly. Metadata does not survive a trip through megatron or nanogpt (they cannot hold
it); a stream target from another format is written without metadata. LLMBATCH as a source
yields its records (packed rows), not the original documents; as a target it packs the
source documents (raypipe.core.llmbatch_writer). The destination gets its own manifest
naming its source. Cost: one sequential read and write of every token.
"""

from __future__ import annotations

import hashlib
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.core.atomic import remove_stale_temps
from raypipe.core.dataset import LLMBatchDataset, TokenDataset
from raypipe.core.llmbatch_writer import write_llmbatch
from raypipe.core.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    library_versions,
    read_manifest,
    write_manifest,
)
from raypipe.core.unit import ShardRoller, UnitSettings
from raypipe.errors import ConfigError, FormatError
from raypipe.formats import get_format

DOCUMENTS_PER_ADD = 4096


def _source_documents(src: Path, manifest: dict[str, Any]):
    """(shard name, iterator of token arrays) per source shard."""
    document_formats = [f for f in manifest["formats"] if f != "llmbatch"]
    if document_formats:
        dataset = TokenDataset(src, manifest=manifest)
        for index in range(dataset.num_shards):
            reader = dataset.reader(index)
            yield dataset.shards[index]["name"], (reader.document(d)
                                                  for d in range(reader.num_documents))
    else:
        dataset = LLMBatchDataset(src, manifest)
        for index, shard in enumerate(dataset.shards):
            reader = dataset.reader(index)
            yield shard["name"], (row for b in range(reader.num_batches)
                                  for row in reader.batch(b))


def _write_documents(settings: UnitSettings, name: str, documents) -> list[dict[str, Any]]:
    roller = ShardRoller(settings, name, number_parts=False)
    pending: list[np.ndarray] = []
    try:
        for document in documents:
            pending.append(np.asarray(document, dtype=np.uint32))
            if len(pending) == DOCUMENTS_PER_ADD:
                _flush(roller, pending)
        _flush(roller, pending)
        return roller.finish()
    except BaseException:
        roller.abort()
        raise


def _flush(roller: ShardRoller, pending: list[np.ndarray]) -> None:
    if pending:
        roller.add(np.concatenate(pending), np.array([d.size for d in pending], np.int64))
        pending.clear()


def convert_dataset(src: str | Path, dst: str | Path, format_name: str,
                    seq_len: int | None = None, batch_size: int | None = None,
                    packing: str = "bestfit", seed: int = 0, batches_per_shard: int = 1024,
                    overwrite: bool = False) -> dict[str, Any]:
    src, dst = Path(src), Path(dst)
    manifest = read_manifest(src)
    if (dst / MANIFEST_NAME).exists() and not overwrite:
        raise ConfigError(f"{dst}: already holds a dataset; pass --overwrite to replace it")
    if dst.resolve() == src.resolve():
        raise ConfigError(f"{dst}: convert needs a destination other than the source")
    shutil.rmtree(dst / format_name, ignore_errors=True)
    remove_stale_temps(dst)
    info = manifest["tokenizer"]
    fingerprint = hashlib.sha256(f"{manifest['fingerprint']}->{format_name}".encode()
                                 ).hexdigest()[:16]
    if format_name == "llmbatch":
        if not seq_len or not batch_size:
            raise ConfigError("convert to llmbatch needs --seq-len and --batch-size")
        if "llmbatch" in manifest["formats"] and len(manifest["formats"]) == 1:
            raise FormatError(src / MANIFEST_NAME, "llmbatch -> llmbatch is not a conversion")
        section = write_llmbatch(TokenDataset(src, manifest=manifest), dst / "llmbatch",
                                 seq_len, batch_size, packing, seed, batches_per_shard)
    else:
        fmt = get_format(format_name)
        from raypipe.core.tokenizer import TokenizerInfo

        settings = UnitSettings(str(dst.resolve()), (format_name,), "text", 2**31 - 1, 1, None,
                                TokenizerInfo(**info), fingerprint,
                                format_options={"stream": {"metadata": False}})
        table = []
        for name, documents in _source_documents(src, manifest):
            for shard in _write_documents(settings, name, documents):
                table.append({"name": shard["name"], "documents": shard["documents"],
                              "tokens": shard["tokens"], "files": shard["files"][format_name]})
        section = {"dtype": fmt.token_dtype(info["largest_id"]).name, "shards": table}
        if format_name == "stream":
            section["metadata"] = False
    out = {"manifest_version": MANIFEST_VERSION, "kind": "raypipe-tokens",
           "fingerprint": fingerprint, "tokenizer": info,
           "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "converted_from": {"path": str(src), "fingerprint": manifest["fingerprint"]},
           "config": manifest.get("config", {}), "totals": manifest.get("totals", {}),
           "formats": {format_name: section}, "versions": library_versions()}
    write_manifest(dst, out)
    return out

