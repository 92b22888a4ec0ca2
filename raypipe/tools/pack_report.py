"""`raypipe pack-report`: what a loader mode keeps of a dataset per epoch.

Invariant: the report is computed from the same epoch plan the loader runs (document lengths
only, no token reads), so used + cropped + dropped = the dataset's tokens, and padding is
counted apart. Cost: one epoch plan (~1 us per document for bestfit).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from raypipe.config import is_mixture_spec, read_mixture
from raypipe.dataset import TokenDataset
from raypipe.sampling.mixture import realized_shares
from raypipe.sampling.plans import ShardGroups, make_plan

MIXTURE_STEPS = 1000
MIXTURE_ROWS_PER_STEP = 8


def pack_report(dataset_path: str | Path, seq_len: int, mode: str = "bestfit", seed: int = 0,
                epoch: int = 0, epochs: int = 1, block_documents: int = 4096,
                format_name: str | None = None, packing: str = "split",
                shuffle: str = "global", group_shards: int = 4) -> str:
    """The report for `epochs` epochs from `epoch`, as printed text (a dataset on object
    storage: only its index files are fetched; a mixture YAML: each source's report, and the
    mixture's shares)."""
    if is_mixture_spec(dataset_path):
        return mixture_report(str(dataset_path), seq_len, mode=mode, seed=seed, epoch=epoch,
                              epochs=epochs, block_documents=block_documents,
                              packing=packing, shuffle=shuffle, group_shards=group_shards)
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


def mixture_report(spec_path: str, seq_len: int, **options: object) -> str:
    """Each source's report, then the mixture's shares: weights, the rows each source serves
    over 1,000 steps of 8 rows, and how many of its epochs those rows are."""
    spec = read_mixture(spec_path)
    names = sorted(spec)
    datasets = {name: TokenDataset(spec[name].path) for name in names}
    tokens = np.array([datasets[name].num_tokens for name in names], dtype=np.float64)
    given = [spec[name].weight for name in names]
    weights = np.array(given, dtype=np.float64) if given[0] is not None else tokens
    weights = weights / weights.sum()
    shares = realized_shares(weights, MIXTURE_ROWS_PER_STEP, MIXTURE_STEPS)
    rows = MIXTURE_STEPS * MIXTURE_ROWS_PER_STEP
    lines = [f"mixture {spec_path}: {len(names)} sources",
             f"{'source':<16}{'tokens':>16}{'weight':>10}{'rows share':>12}{'epochs':>10}"
             f"   (over {MIXTURE_STEPS:,} steps of {MIXTURE_ROWS_PER_STEP} rows)"]
    sections = []
    for index, name in enumerate(names):
        report = pack_report(spec[name].path, seq_len, format_name=None, **options)
        first = report.splitlines()
        observations = _rows_per_epoch(first)
        epochs = shares[index] * rows / observations if observations else float("nan")
        lines.append(f"{name:<16}{int(tokens[index]):>16,}{weights[index]:>10.4f}"
                     f"{shares[index]:>12.4f}{epochs:>10.2f}")
        sections.append(f"== source {name} (weight {weights[index]:.4f})\n{report}")
    return "\n".join(lines + [""] + sections)


def _rows_per_epoch(report_lines: list[str]) -> int:
    for line in report_lines:
        if line.startswith("rows "):
            return int(line.split()[1].replace(",", ""))
    return 0
