"""`raypipe pack-report`: what a loader mode keeps of a dataset per epoch.

Invariant: the report is computed from the same epoch plan the loader runs (document lengths
only, no token reads), so used + cropped + dropped = the dataset's tokens, and padding is
counted apart. Cost: one epoch plan (~1 us per document for bestfit).
"""

from __future__ import annotations

from pathlib import Path

from raypipe.dataset import TokenDataset
from raypipe.sampling.plans import ShardGroups, make_plan


def pack_report(dataset_path: str | Path, seq_len: int, mode: str = "bestfit", seed: int = 0,
                epoch: int = 0, epochs: int = 1, block_documents: int = 4096,
                format_name: str | None = None, packing: str = "split",
                shuffle: str = "global", group_shards: int = 4) -> str:
    """The report for `epochs` epochs from `epoch`, as printed text (a dataset on object
    storage: only its index files are fetched)."""
    dataset = TokenDataset(dataset_path, format_name)
    groups = None if shuffle == "global" else ShardGroups.of(
        dataset.shard_token_counts, dataset.shard_document_counts, group_shards)
    shape = f"{mode} ({packing})" if mode == "bestfit" else mode
    lines = [f"packing report: {dataset_path}",
             f"{shape} rows of {seq_len} + 1 tokens, {shuffle} shuffle, seed {seed}, "
             f"epoch {epoch} ({dataset.num_documents:,} documents, format "
             f"{dataset.format_name})"]
    for current in range(epoch, epoch + epochs):
        plan = make_plan(mode, dataset.num_tokens, dataset.document_lengths, seq_len, seed,
                         current, block_documents, packing, groups)
        if epochs > 1:
            lines.append(f"-- epoch {current}")
        lines.append(plan.report().render())
    return "\n".join(lines)
