"""`raypipe inspect`: what an output holds, for a person.

Invariant: reads only the manifest, shard indexes and a few sample documents (never whole
shards); every figure printed comes from the files. Cost: O(documents) for the length
percentiles (index reads), O(samples) token reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import BatchDataset, TokenDataset, open_format
from raypipe.errors import FormatError
from raypipe.formats import document_format
from raypipe.io.manifest import as_store, read_manifest, unit_record_name
from raypipe.io.parallel import map_threads
from raypipe.io.records import Manifest, UnitRecord
from raypipe.io.states import Exclusion, LoaderState, MixtureState, UnitsAdded
from raypipe.io.store import Store
from raypipe.preprocess.summary import packing_line
from raypipe.sampling.mixture import is_mixture_spec, mixture_weights, read_mixture, spec_weights
from raypipe.sampling.replay import read_state_file


def _decoder(manifest: Manifest, tokenizer: str | None) -> Any:
    spec = tokenizer or manifest.tokenizer.spec
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(spec) if spec and Path(spec).exists() else None
    except Exception:  # a sample shown as ids is still useful
        return None


def _show(tokens: np.ndarray, decoder: Any, chars: int = 200) -> str:
    if decoder is None:
        return f"ids {tokens[:24].tolist()}..."
    return repr(decoder.decode(tokens.tolist(), skip_special_tokens=False)[:chars])


TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"  # around the trained spans of a conversation


def _show_trained(tokens: np.ndarray, trained: np.ndarray, decoder: Any,
                  chars: int = 600) -> str:
    """A conversation decoded, its trained spans (loss mask 1) between [[ and ]]."""
    if decoder is None:
        return f"trained ids {tokens[trained.astype(bool)][:24].tolist()}..."
    edges = np.flatnonzero(np.diff(np.concatenate([[0], trained.astype(np.int8), [0]])))
    cuts = [0, *edges.tolist(), tokens.size]
    parts = []
    for start, stop in zip(cuts[:-1], cuts[1:], strict=True):
        if stop <= start:
            continue
        text = decoder.decode(tokens[start:stop].tolist(), skip_special_tokens=False)
        inside = bool(trained[start])
        parts.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if inside else text)
    return repr("".join(parts)[:chars])


def inspect_dataset(root: str | Path | Store, samples: int = 3, tokenizer: str | None = None,
                    plot: str | Path | None = None) -> str:
    if is_mixture_spec(root):
        return inspect_mixture(str(root), samples, tokenizer)
    if isinstance(root, str | Path) and str(root).endswith(".json") and Path(root).is_file():
        return inspect_state(root)
    return inspect_output(root, samples, tokenizer, plot)


def inspect_state(path: str | Path) -> str:
    """A loader state (its JSON file): where the run stands, its knobs, and every change
    it records (shapes by step, documents excluded by step)."""
    state = read_state_file(path)
    if isinstance(state, MixtureState):
        lines = [f"{path}: a mixture's loader state, after {state.steps:,} steps",
                 f"  weights: {state.weights}", f"  knobs: {state.knobs}"]
        lines += [f"  source {name}: epoch {where.epoch}, position {where.position:,}, "
                  f"{where.consumed:,} rows served (dataset {where.dataset})"
                  for name, where in sorted(state.sources.items())]
        changes = [(change.step, f"sources added {change.added}, dropped {change.dropped}, "
                    f"weights {change.weights}") for change in state.changes or ()]
        changes += [(leg.step, f"a leg on {leg.world_size} rank(s): sources "
                     f"{sorted(leg.datasets)}, global batch and seq_len "
                     + ", ".join(f"{row[1]}x{row[2]} from step {row[0]}" for row in leg.batches)
                     + f", {len(leg.stage_starts)} weight stage(s)")
                    for leg in state.history or ()]
        changes += [(record.step, f"source {name}: " + excluded(record))
                    for name, records in (state.exclusions or {}).items()
                    for record in records]
        changes += [(record.step, f"source {name}: " + units_added(record))
                    for name, records in (state.units_added or {}).items()
                    for record in records]
        return "\n".join(lines + history_lines(changes))
    assert isinstance(state, LoaderState)
    saved = state.saved_with
    lines = [f"{path}: a loader state of dataset {state.dataset} ({state.format})",
             f"  stands at: epoch {state.epoch}, position {state.position:,}, after "
             f"{state.steps if state.steps is not None else '?'} steps (saved at world size "
             f"{saved.get('world_size')}, batch size {saved.get('batch_size')})",
             f"  knobs: {state.knobs}"]
    if state.phases:
        lines.append("  this epoch's phases (seq_len, from position, exclusions in force, "
                     "joins of units in force): "
                     + ", ".join(str(tuple(row)) for row in state.phases))
    changes = [(entry[0], f"global batch {entry[1]}, seq_len {entry[2]}")
               for entry in state.history or []]
    changes += [(record.step, excluded(record)) for record in state.exclusions or ()]
    changes += [(record.step, units_added(record)) for record in state.units_added or ()]
    return "\n".join(lines + history_lines(changes))


def units_added(record: UnitsAdded) -> str:
    return (f"the output's units added: {record.units:,} units, {record.documents:,} "
            "documents in all, " + (f"joining epoch {record.epoch - 1} here, then every "
                                    "epoch" if record.joins else
                                    f"served from epoch {record.epoch}"))


def excluded(record: Exclusion) -> str:
    return (f"{len(record.documents):,} document(s) excluded ({record.named:,} named, "
            f"{record.not_found:,} not found, {record.repeated:,} excluded already)")


def history_lines(changes: list[tuple[int, str]]) -> list[str]:
    """A state's changes, by step."""
    return ([f"  history ({len(changes)} change(s)):" if changes else "  history: none"]
            + [f"    from step {step:,}: {what}"
               for step, what in sorted(changes, key=lambda change: change[0])])


def list_rejects(root: str | Path | Store) -> str:
    """What the job did not turn into documents, by name: the input files it skipped as
    bad (the manifest's `bad_files`), the files of input directories it passed over, then
    every unit's named rejects (file, row, reason)
    and how many more of its skipped rows were only counted. Reads the manifest and the
    unit records (32 at a time)."""
    store = as_store(root)
    manifest = read_manifest(store)
    lines = [f"bad file\t{bad.uri}\t{bad.rows_read} rows read before\t{bad.reason}"
             for bad in manifest.bad_files]
    lines += [f"passed over\t{each.uri}\t{each.bytes} bytes\t{each.reason}"
              for each in manifest.passed_over]
    records = map_threads(lambda name: UnitRecord.from_json(
        store.read_json(unit_record_name(name)), store.uri_of(unit_record_name(name))),
        [unit.name for unit in manifest.units])
    for record in records:
        lines += [f"reject\t{reject.uri}\trow {reject.row}\t{reject.reason}"
                  for reject in record.rejects]
        unnamed = record.rows - record.documents - len(record.rejects)
        if unnamed > 0:
            lines.append(f"counted\t{record.unit.location}\t{unnamed} more skipped row(s)\t"
                         + ", ".join(f"{k}={v}" for k, v in record.skipped.items()))
    return "\n".join(lines) if lines else f"{store.uri}: every input row made a document"


def trainer_data_path(root: str | Path | Store, format_name: str) -> str:
    """The data-path argument of `format_name`'s trainer (Megatron's --data-path) naming
    every shard prefix of a dataset (each document once: Megatron builds every prefix whole
    when no weights are given), or of a mixture spec (a blend: each source's weight split
    over its prefixes by their tokens)."""
    prefix_of = document_format(format_name).trainer_prefix
    if prefix_of is None:
        raise FormatError(format_name, "this format has no trainer data-path argument")
    if not is_mixture_spec(root):
        return " ".join(prefix for prefix, _ in shard_prefixes(root, format_name, prefix_of))
    spec = read_mixture(str(root))
    names = sorted(spec)
    prefixes = {name: shard_prefixes(spec[name].path, format_name, prefix_of)
                for name in names}
    totals = {name: sum(tokens for _, tokens in prefixes[name]) for name in names}
    weights = mixture_weights(names, spec_weights(spec), totals)
    return " ".join(f"{weight * tokens / max(totals[name], 1):.8g} {prefix}"
                    for name, weight in zip(names, weights.tolist(), strict=True)
                    for prefix, tokens in prefixes[name])


def shard_prefixes(root: str | Path | Store, format_name: str,
                   prefix_of: Any) -> list[tuple[str, int]]:
    """(the trainer's prefix URI, tokens) of every shard of `format_name`, in order."""
    store = as_store(root)
    section = read_manifest(store).formats.get(format_name)
    if section is None:
        raise FormatError(store.uri_of("manifest.json"), f"no {format_name} output in this "
                          "dataset (tokenize with --format including it)")
    return [(store.uri_of(prefix_of(shard)), shard.tokens or 0) for shard in section.shards]


def inspect_mixture(spec_path: str, samples: int, tokenizer: str | None) -> str:
    """Per source: tokens and weight (given, or by tokens), then each source's inspection."""
    spec = read_mixture(spec_path)
    names = sorted(spec)
    totals = {name: read_manifest(spec[name].path).totals.tokens for name in names}
    weights = mixture_weights(names, spec_weights(spec), totals)
    lines = [f"mixture {spec_path}", f"  {'source':<16}{'tokens':>16}{'weight':>10}"
             f"{'token share':>13}"]
    for name, weight in zip(names, weights.tolist(), strict=True):
        lines.append(f"  {name:<16}{totals[name]:>16,}{weight:>10.4f}"
                     f"{totals[name] / max(sum(totals.values()), 1):>13.4f}")
    for name in names:
        lines += ["", f"== source {name}", inspect_output(spec[name].path, samples, tokenizer,
                                                          None)]
    return "\n".join(lines)


def inspect_output(root: str | Path | Store, samples: int = 3, tokenizer: str | None = None,
                   plot: str | Path | None = None) -> str:
    root = as_store(root)
    manifest = read_manifest(root)
    totals, info = manifest.totals, manifest.tokenizer
    lines = [f"dataset {root}",
             f"  tokenizer   {info.spec} (largest id {info.largest_id}, "
             f"bos {info.bos_id}, eos {info.eos_id})",
             f"  documents   {totals.documents:,}   tokens {totals.tokens:,}"
             f"   skipped {totals.skipped or 'none'}", *input_lines(manifest)]
    decoder = _decoder(manifest, tokenizer)
    for name, section in manifest.formats.items():
        own = "" if section.separators is None else (
            f", its own separators: bos {section.separators['bos_id']}, "
            f"eos {section.separators['eos_id']}")
        lines.append(f"format {name}: dtype {section.dtype}, {len(section.shards)} shards{own}")
        dataset = open_format(root, name, manifest)
        view, plotted = VIEWS[dataset.kind](dataset, samples, decoder, plot)
        lines += view
        plot = None if plotted else plot  # one histogram: the first format that draws one
    return "\n".join(lines)


def input_lines(manifest: Manifest) -> list[str]:
    """What the job did not read: bad files skipped, and files of input directories passed
    over (each counted, the first few named; `--rejects` lists them all)."""
    lines = []
    if manifest.bad_files:
        lines.append(f"  bad files   {len(manifest.bad_files)} skipped "
                     f"({sum(bad.rows_read for bad in manifest.bad_files):,} rows read before "
                     f"their errors), such as {manifest.bad_files[0].uri} "
                     f"({manifest.bad_files[0].reason}); --rejects lists them")
    if manifest.passed_over:
        shown = "; ".join(f"{m.uri} ({m.reason})" for m in manifest.passed_over[:3])
        more = len(manifest.passed_over) - 3
        lines.append(f"  passed over {len(manifest.passed_over)} file(s) of the input "
                     f"directories, not read: {shown}" + (f" and {more} more" if more > 0
                                                         else ""))
    return lines


def _inspect_documents(dataset: TokenDataset, samples: int, decoder: Any,
                       plot: str | Path | None) -> tuple[list[str], bool]:
    """The shards, the document lengths (drawn into `plot`, if given) and samples."""
    lines = ["  shard                                            documents       tokens"
             "        bytes"]
    for shard in dataset.shards[:20]:
        lines.append(f"  {shard.name:<46} {shard.documents:>10,} {shard.tokens:>12,} "
                     f"{shard.bytes:>12,}")
    if dataset.num_shards > 20:
        lines.append(f"  ... {dataset.num_shards - 20} more shards")
    lengths = dataset.document_lengths()
    if lengths.size:
        pct = np.percentile(lengths, [0, 10, 50, 90, 99, 100]).astype(int).tolist()
        lines.append("  document length (tokens) min/p10/p50/p90/p99/max: "
                     + " / ".join(f"{p:,}" for p in pct))
    plotted = plot is not None and bool(lengths.size)
    if plotted:
        from raypipe.tools.plot import histogram_chart

        drawn = histogram_chart(lengths, Path(plot), f"Document lengths: {dataset.root} "
                                f"({dataset.format_name}, {lengths.size:,} documents)")
        lines.append(f"  histogram of document lengths -> {plot} (60 log-spaced bins, "
                     f"{int(lengths.min()):,} to {int(lengths.max()):,} tokens; {drawn})")
    for index, tokens in enumerate(dataset.iter_documents()):
        if index >= samples:
            break
        trained = dataset.document_loss_mask(index)
        if trained is not None:  # chat data: the conversation, its trained spans marked
            lines.append(f"  conversation {index} ({tokens.size} tokens, {int(trained.sum())} "
                         f"trained, between {TRAINED_OPEN} {TRAINED_CLOSE}): "
                         f"{_show_trained(tokens, trained, decoder)}")
            continue
        lines.append(f"  sample {index} ({tokens.size} tokens): {_show(tokens, decoder)}")
        if dataset.format.window_metadata and dataset.format_options.metadata:
            start = int(dataset.document_starts_global(index))
            window = dataset.window(start, int(tokens.size))
            records = [window.records[i] for i in sorted(set(window.metadata_ids.tolist()))]
            lines.append(f"    metadata: {records[:4]}{' ...' if len(records) > 4 else ''}")
    return lines, plotted


def _inspect_batches(dataset: BatchDataset, samples: int, decoder: Any,
                     plot: str | Path | None) -> tuple[list[str], bool]:
    """The batch shape, the packing report and sample records (nothing drawn)."""
    options, section = dataset.options, dataset.section
    lines = [f"  {dataset.num_batches:,} batches of [{dataset.batch_size}, {dataset.record_len}] "
             f"({options.packing} packing, seed {options.seed}, "
             f"{options.total_records:,} records before batching)",
             "  records, not documents: each row is a packed sequence"]
    if options.has_report:
        lines.append(f"  {packing_line(section.options)}")
    shown = 0
    for batch in range(dataset.num_batches):
        trained = dataset.loss_mask(batch)
        for row, record in enumerate(dataset.records(batch)):
            if shown >= samples:
                return lines, False
            if trained is not None:  # chat data: the record, its trained tokens marked
                mask = trained[row, :record.size]
                lines.append(f"  record {shown} ({int(mask.sum())} trained, between "
                             f"{TRAINED_OPEN} {TRAINED_CLOSE}): "
                             f"{_show_trained(record, mask, decoder)}")
            else:
                lines.append(f"  record {shown}: {_show(record, decoder)}")
            shown += 1
    return lines, False


# each kind of format's view (raypipe.dataset opens it as its kind's dataset)
VIEWS: dict[str, Callable[[Any, int, Any, str | Path | None], tuple[list[str], bool]]] = {
    "documents": _inspect_documents, "batches": _inspect_batches}
