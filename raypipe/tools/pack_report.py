"""`raypipe pack-report`: what a loader mode keeps of a dataset per epoch.

Invariant: the report is computed from the epoch plan the loader runs, built by the same
code (raypipe.sampling.epochs: document lengths only, no token reads), so used + cropped +
dropped = the dataset's tokens, and padding is counted apart. Cost: one epoch plan per epoch
reported (a vectorized pass over the lengths for bestfit fill: docs/scale.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raypipe.dataset import BatchDataset, TokenDataset, open_kind
from raypipe.sampling.epochs import EpochPlans, PlanSpec
from raypipe.sampling.lengths import dataset_lengths
from raypipe.sampling.mixture import (
    is_mixture_spec,
    mixture_weights,
    read_mixture,
    realized_shares,
    spec_weights,
)
from raypipe.sampling.plans import PackingReport

MIXTURE_STEPS = 1000
MIXTURE_ROWS_PER_STEP = 8


def pack_report(dataset_path: str | Path, seq_len: int, mode: str = PlanSpec.mode, *,
                epoch: int = 0, epochs: int = 1, format_name: str | None = None,
                **knobs: Any) -> str:
    """The report for `epochs` epochs from `epoch`, as printed text (a dataset on object
    storage: only its index files are fetched; a mixture YAML: each source's report, and the
    mixture's shares). `knobs`: the loader's (seed, shuffle, split, ... and the mode's own,
    e.g. bestfit's packing), as the loader takes them."""
    spec = PlanSpec.of(mode, seq_len, **knobs)
    epoch_range = range(epoch, epoch + epochs)
    if is_mixture_spec(dataset_path):
        return mixture_report(str(dataset_path), spec, epoch_range)
    dataset = open_kind(str(dataset_path), spec.loader_mode.serves, format_name)
    return REPORTS[dataset.kind](str(dataset_path), dataset, spec, epoch_range)


def documents_report(where: str, dataset: TokenDataset, spec: PlanSpec, epochs: range) -> str:
    """What the mode's epoch plans keep of the documents."""
    spec = spec.for_data(dataset.has_loss_mask)
    return render(where, dataset, spec, epoch_plans(dataset, spec, epochs))


def batches_report(where: str, dataset: BatchDataset, spec: PlanSpec, epochs: range) -> str:
    """What a batch format's records, written at tokenize (or convert) time, hold: the
    report their manifest section recorded (records are fixed; seq_len and seed are
    theirs)."""
    report = PackingReport.from_options(dataset.section.options)
    return "\n".join([
        f"packing report: {where}",
        f"{dataset.format_name} records of {dataset.record_len} tokens ({dataset.options.packing} "
        f"packing, seed {dataset.options.seed}), {dataset.num_batches:,} batches of "
        f"{dataset.batch_size}",
        report.render(),
    ])


def epoch_plans(dataset: TokenDataset, spec: PlanSpec, epochs: range
                ) -> list[tuple[int, Any]]:
    """The loader's plan of each epoch the report covers."""
    plans = EpochPlans(spec, dataset, lambda: dataset_lengths(dataset, node_cache=False))
    return [(epoch, plans.build(epoch)) for epoch in epochs]


def render(where: str, dataset: TokenDataset, spec: PlanSpec,
           plans: list[tuple[int, Any]]) -> str:
    lines = [f"packing report: {where}",
             f"{spec.describe()}, {spec.shuffle} shuffle, seed {spec.seed}, epoch "
             f"{plans[0][0]} ({dataset.num_documents:,} documents, format "
             f"{dataset.format_name})"]
    for epoch, plan in plans:
        if len(plans) > 1:
            lines.append(f"-- epoch {epoch}")
        report = plan.report().with_loss_mask(  # chat data: its loss mask
            dataset.manifest.totals.trained_tokens, [dataset.document_lengths()],
            spec.packing, spec.seq_len, spec.resolved_overlong)
        lines.append(report.render())
    return "\n".join(lines)


def mixture_report(spec_path: str, spec: PlanSpec, epochs: range) -> str:
    """Each source's report, then the mixture's shares: weights, the rows each source serves
    over 1,000 steps of 8 rows, and how many of its epochs those rows are."""
    mixture = read_mixture(spec_path)
    names = sorted(mixture)
    datasets = {name: TokenDataset(mixture[name].path) for name in names}
    tokens = {name: datasets[name].num_tokens for name in names}
    weights = mixture_weights(names, spec_weights(mixture), tokens)
    shares = realized_shares(weights, MIXTURE_ROWS_PER_STEP, MIXTURE_STEPS)
    rows = MIXTURE_STEPS * MIXTURE_ROWS_PER_STEP
    lines = [f"mixture {spec_path}: {len(names)} sources",
             f"{'source':<16}{'tokens':>16}{'weight':>10}{'rows share':>12}{'epochs':>10}"
             f"   (over {MIXTURE_STEPS:,} steps of {MIXTURE_ROWS_PER_STEP} rows)"]
    sections = []
    for index, name in enumerate(names):
        source_spec = spec.for_data(datasets[name].has_loss_mask)
        plans = epoch_plans(datasets[name], source_spec, epochs)
        observations = plans[0][1].size
        served = shares[index] * rows / observations if observations else float("nan")
        lines.append(f"{name:<16}{tokens[name]:>16,}{weights[index]:>10.4f}"
                     f"{shares[index]:>12.4f}{served:>10.2f}")
        sections.append(f"== source {name} (weight {weights[index]:.4f})\n"
                        + render(mixture[name].path, datasets[name], source_spec, plans))
    return "\n".join(lines + [""] + sections)


# each kind of format's report (the mode says which kind it serves)
REPORTS = {"documents": documents_report, "batches": batches_report}
