"""Pack a tokenized dataset into LLMBATCH shards: records shuffled across the whole dataset.

Invariant: records are the rows of an epoch-0 plan over ALL documents of the dataset
(`bestfit`: BOS-aligned best-fit rows of seq_len tokens; `concat`: windows of seq_len
tokens of the concatenated stream, consecutive windows sharing one token), taken in that
plan's Feistel order with `seed` (a global shuffle, not per shard), grouped B at a time;
the last total_records mod B records are dropped. Shards hold `batches_per_shard` batches
each, named `batches-NNNNN.batch`, listed in order in the manifest. Each shard file is
committed atomically. Cost: one memmap read and one sequential write per token kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from raypipe.core.batches import BatchBuffers, BatchBuilder, TokenSource
from raypipe.core.dataset import TokenDataset
from raypipe.core.epoch import make_plan
from raypipe.formats.base import file_sha256
from raypipe.formats.llmbatch import LLMBatchWriter

DESCRIBE_BATCHES = 64


def write_llmbatch(dataset: TokenDataset, directory: Path, seq_len: int, batch_size: int,
                   packing: str, seed: int, batches_per_shard: int) -> dict[str, Any]:
    """Write the shards; return the manifest's `llmbatch` section."""
    mode = "bestfit" if packing == "bestfit" else "windows"
    plan = make_plan(mode, dataset.num_tokens, dataset.document_lengths, seq_len - 1, seed, 0)
    builder = BatchBuilder(TokenSource(dataset), plan, seq_len - 1, boundaries=False)
    host = np.empty(BatchBuffers.size(batch_size, seq_len - 1), dtype=np.int64)
    buffers = BatchBuffers.over(host, batch_size, seq_len - 1)
    builder.prepare(buffers)
    num_batches = plan.size // batch_size
    shards = []
    for first in range(0, num_batches, batches_per_shard):
        stop = min(first + batches_per_shard, num_batches)
        name = f"batches-{len(shards):05d}"
        path = Path(directory) / f"{name}.batch"
        writer = LLMBatchWriter(path, batch_size, seq_len, seed, plan.size)
        try:
            for chunk in range(first, stop, DESCRIBE_BATCHES):
                steps = np.arange(chunk, min(chunk + DESCRIBE_BATCHES, stop), dtype=np.int64)
                positions = steps[:, None] * batch_size + np.arange(batch_size)
                for batch_plan in builder.describe(positions):
                    builder.fill(batch_plan, buffers)
                    writer.add(buffers.tokens)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        shards.append({"name": name, "first_batch": first, "batches": stop - first,
                       "files": [{"path": f"llmbatch/{path.name}", "bytes": path.stat().st_size,
                                  "sha256": file_sha256(path)}]})
    return {"dtype": "uint32", "seq_len": seq_len, "batch_size": batch_size,
            "packing": packing, "seed": seed, "total_records": plan.size,
            "num_batches": num_batches, "source_format": dataset.format_name,
            "shards": shards}


def write_llmbatch_from_manifest(output: Path, manifest: dict[str, Any], seq_len: int,
                                 batch_size: int, packing: str, seed: int,
                                 batches_per_shard: int) -> dict[str, Any]:
    dataset = TokenDataset(output, manifest=manifest)
    return write_llmbatch(dataset, Path(output) / "llmbatch", seq_len, batch_size, packing, seed,
                          batches_per_shard)
