"""Data that changes under a run: a mixture source dropped and one added on resume,
documents excluded on resume, at other world sizes, every surviving token still trained
once, counted token by token.

    python bench/changing_data.py [DATA] [--exclude 1000] [--stops 0.3,0.65]
        [--seq-len 512] [--rows 24] [--tokens 4000000] [--source-tokens 2000000]

Two runs, each stopped on 2 ranks, resumed on 3 with the change, stopped again and
finished on 1 (`--stops`: the fractions of the run's steps where it stops):

1. One dataset (DATA, default: a synthetic one of --tokens tokens, built once in
   --workdir), one bestfit epoch of --rows global rows a step. At the first stop,
   `raypipe.trace` of the steps before it names --exclude documents (its JSON records,
   written to a file, as a user would keep them); the second run resumes with
   `exclude=<that file>`, the third from the second's state alone.
2. A mixture of numbered synthetic sources (a token's id says which token of which
   document of which source it is; --source-tokens each): web and code at 0.5 / 0.5; at
   the first stop, code is dropped, books added (web and books at 0.5 / 0.5), and --exclude
   documents that trace named in the steps before the stop are excluded (those of code:
   nothing left to exclude, counted in the log). The run goes on until web and books have
   each finished their epoch 0.

Checks, each printed, exit status 1 when one fails:
- each step's rows equal those of a run that made the same changes at the same step
  without stopping again, at the first run's world size;
- the state records each change (its step, the documents excluded, the sources added and
  dropped);
- no excluded document's token, and no dropped source's, is trained from the change on;
- every token of every surviving document of an epoch is trained exactly once in it (one
  dataset: but the drop-last tail, which the loader reports; a mixture drops nothing);
  nothing twice;
- `raypipe trace` rebuilds every step's rows (one dataset: from the final state's
  history; the mixture: from each run's first state), so a rerun of the history gives the
  same steps.
The tokens are held in memory (a check for datasets up to ~10^8 tokens).

Not exercised here: units added to a dataset on resume (served from the next epoch;
tests/test_changing_data.py), and training while the tokenize job runs (refused: docs/
loader.md, "When the data changes").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import synthetic_token_dataset, write_synthetic_dataset
from every_token_once import Rows, run, traced_steps

from raypipe.dataset import TokenDataset
from raypipe.loader import MixtureLoader, TokenLoader
from raypipe.tools.trace import trace


def names_from_trace(path: str, history: dict, stop: int, wanted: int, out: Path) -> list[int]:
    """Trace the steps before `stop`, last first, until `wanted` documents are named; write
    their records (one a line) to `out` and return the documents, in the order named."""
    documents: dict[int, str] = {}
    step = stop - 1
    while len(documents) < wanted and step >= 0:
        for record in trace(path, step, history=history):
            if record.document not in documents and len(documents) < wanted:
                documents[record.document] = record.line()
        step -= 1
    out.write_text("\n".join(documents.values()) + "\n")
    return list(documents)


def first_batch_seconds(path: str, world: int, state: dict, options: dict) -> float:
    """Seconds from a loader's construction to its first batch, resumed from `state`."""
    began = time.perf_counter()
    loader = TokenLoader(path, rank=0, world_size=world, device="cpu", **options)
    loader.load_state_dict(state)
    iterator = iter(loader)
    next(iterator)
    seconds = time.perf_counter() - began
    iterator.close()
    return seconds


def resume_cost(path: str, world: int, state: dict, options: dict, names: Path) -> None:
    """The first batch of a resume that excludes the documents (the names resolved, the
    rest of the epoch planned again) against a plain resume's, best of 3 each, alternated."""
    plain, excluding = [], []
    for _ in range(3):
        plain.append(first_batch_seconds(path, world, state, options))
        excluding.append(first_batch_seconds(path, world, state,
                                             {**options, "exclude": str(names)}))
    print(f"first batch after the resume: {min(excluding):.3f} s excluding the documents, "
          f"{min(plain):.3f} s without (ratio {min(excluding) / min(plain):.2f})")


def one_dataset(args: argparse.Namespace, worlds: list[int], stops: list[float]) -> bool:
    """Scenario 1: one dataset, documents excluded on resume; True where every check held."""
    dataset = TokenDataset(args.data)
    tokens = np.concatenate(list(dataset.iter_documents())).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(dataset.document_lengths())[:-1]])
    owner = np.repeat(np.arange(starts.size), dataset.document_lengths())
    shape = {"seed": args.seed, "seq_len": args.seq_len,
             "batch_schedule": [(0, args.rows)]}
    plain, _, _ = run(args.data, worlds[0], None, None, shape)
    stop_steps = [int(fraction * len(plain)) for fraction in stops]
    change = stop_steps[0]
    print(f"1. {args.data}: {starts.size:,} documents, {tokens.size:,} tokens; one epoch of "
          f"{len(plain)} steps of {args.rows} rows at seq_len {args.seq_len}")

    served: Rows = {}
    state = None
    names_file = args.workdir / "excluded.jsonl"
    excluded: list[int] = []
    for index, world in enumerate(worlds):
        stop = stop_steps[index] if index < len(stop_steps) else None
        options = dict(shape)
        if index == 1:
            excluded = names_from_trace(args.data, state, change, args.exclude, names_file)
            options["exclude"] = str(names_file)
        rows, state, loader = run(args.data, world, state, stop, options)
        served.update(rows)
        print(f"run {index + 1}: {world} ranks, steps {min(rows)}-{max(rows)}"
              + (f", resumed excluding the {len(excluded):,} documents trace named in "
                 f"{names_file}" if index == 1 else ""))

    # the reference: the first run's world size, the same exclusion at the same step
    first, first_state, _ = run(args.data, worlds[0], None, change, shape)
    rest, _, _ = run(args.data, worlds[0], first_state, None,
                     {**shape, "exclude": str(names_file)})
    reference = {**first, **rest}
    same = sorted(served) == sorted(reference) and all(served[s] == reference[s]
                                                       for s in reference)
    print(f"every step's rows equal the run that excluded them at step {change} without "
          f"stopping again: {same}")
    record = (state.get("exclusions") or [{}])[0]
    recorded = (record.get("step") == change and record.get("named") == len(excluded)
                and record.get("documents") == sorted(excluded))
    print(f"the state records the exclusion: step {record.get('step')}, "
          f"{len(record.get('documents', [])):,} documents, {record.get('not_found')} not "
          f"found: {recorded}")
    traced, counts = traced_steps(args.data, sorted(served), state, tokens, starts)
    held = all(traced[s] == served[s] for s in served)
    print(f"trace of every step (from the final state's history) rebuilds its rows: {held}")
    _, before = traced_steps(args.data, list(range(change)), state, tokens, starts)
    is_excluded = np.isin(owner, excluded)
    late = int((counts - before)[is_excluded].sum())
    epoch, tail_rows, tail_tokens = loader.dropped_tail
    twice = int((counts > 1).sum())
    never_kept = int(((counts == 0) & ~is_excluded).sum())
    print(f"excluded documents' tokens trained from step {change} on: {late:,} (before it: "
          f"{int(before[is_excluded].sum()):,} of their {int(is_excluded.sum()):,})")
    print(f"other documents' tokens trained more than once {twice:,}, never {never_kept:,}; "
          f"the loader's drop-last tail of epoch {epoch}: {tail_rows} rows, {tail_tokens:,} "
          "tokens")
    resume_cost(args.data, worlds[1], first_state, shape, names_file)
    return same and recorded and held and late == 0 and twice == 0 and \
        never_kept == tail_tokens


FIRST_TOKEN = {"web": 1, "code": 10_000_000, "books": 20_000_000}  # each source's numbering


def numbered_source(directory: Path, name: str, tokens: int, seed: int) -> str:
    """A megatron dataset of about `tokens` tokens numbered from FIRST_TOKEN[name] on, in
    storage order (a token's id says which token of which document of which source)."""
    output = directory / f"numbered-{name}-{tokens}-seed{seed}"
    if not (output / "manifest.json").exists():
        rng = np.random.default_rng(seed)
        lengths = np.clip(rng.lognormal(5.5, 1.0, tokens // 150).astype(np.int64) + 2, 2,
                          20_000)
        lengths = lengths[np.cumsum(lengths) <= tokens]
        first = FIRST_TOKEN[name]
        ids = np.arange(first, first + int(lengths.sum()), dtype=np.uint32)
        write_synthetic_dataset(output, "megatron", [(ids, lengths, None)],
                                f"numbered-{name}-{seed}", shard_tokens=1 << 22,
                                largest_id=1 << 26)
    return str(output)


def serve_mixture(paths: dict[str, str], world: int, state: dict | None, options: dict,
                  until: Any) -> tuple[dict[int, np.ndarray], dict, dict]:
    """A mixture's steps on `world` ranks from `state` while `until(rank 0's positions,
    steps)` is False: {step: rows of every rank, each T + 1 tokens}, the state after, and
    the state it started from (the resume's changes in it)."""
    loaders = [MixtureLoader(paths, rank=rank, world_size=world, device="cpu", **options)
               for rank in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    started = loaders[0].state_dict()
    iterators = [iter(loader) for loader in loaders]
    taken = {}
    while not until(loaders[0].run.positions, loaders[0].steps):
        batches = [next(iterator) for iterator in iterators]
        taken[batches[0].step] = np.concatenate(
            [torch.cat([batch.inputs, batch.targets[:, -1:]], 1).numpy() for batch in batches])
    for iterator in iterators:
        iterator.close()
    return taken, json.loads(json.dumps(loaders[0].state_dict())), started


def traced_mixture(paths: dict[str, str], state: dict | None, world: int, steps: list[int],
                   options: dict) -> tuple[dict[int, np.ndarray], list[Any]]:
    """The rows `raypipe.trace` rebuilds for `steps` (consecutive, from where `state`
    stands, or from step 0), and its records."""
    records = list(trace(paths, None if state else steps[0], steps=len(steps), state=state,
                         world_size=world, batch_size=options["rows"] // world,
                         seq_len=options["seq_len"], seed=options["seed"],
                         weights=None if state else options["weights"]))
    per_rank = options["rows"] // world
    rows = {step: np.zeros((options["rows"], options["seq_len"] + 1), dtype=np.int64)
            for step in steps}
    for record in records:
        first = FIRST_TOKEN[record.source] + options["starts"][record.source][record.document]
        rows[record.step][record.rank * per_rank + record.row,
                          record.col_start:record.col_end] = np.arange(
            first + record.token_start, first + record.token_end)
    return rows, records


def mixture(args: argparse.Namespace, worlds: list[int], stops: list[float]) -> bool:
    """Scenario 2: a mixture whose sources change on resume, documents excluded too; True
    where every check held."""
    paths = {name: numbered_source(args.workdir, name, args.source_tokens, seed)
             for seed, name in enumerate(FIRST_TOKEN)}
    before = {name: paths[name] for name in ("web", "code")}
    after = {name: paths[name] for name in ("web", "books")}
    starts = {name: np.concatenate([[0], np.cumsum(TokenDataset(path).document_lengths())])
              for name, path in paths.items()}
    shape = {"seed": args.seed, "seq_len": args.seq_len, "batch_size": None,
             "batch_schedule": [(0, args.rows)]}
    weights_before, weights_after = {"web": 0.5, "code": 0.5}, {"web": 0.5, "books": 0.5}

    def finished(positions: dict, steps: int) -> bool:  # web and books past epoch 0
        return all(positions[name].epoch >= 1 for name in after if name in positions)

    epoch_steps = int(starts["web"][-1]) // (args.seq_len + 1) * 2 // args.rows
    change, second_stop = (int(fraction * epoch_steps) for fraction in stops)
    names_file = args.workdir / "excluded-mixture.jsonl"
    print(f"2. a mixture of numbered sources: web {int(starts['web'][-1]):,} and code "
          f"{int(starts['code'][-1]):,} tokens at 0.5 / 0.5; at step {change} code dropped, "
          f"books ({int(starts['books'][-1]):,} tokens) added at 0.5 / 0.5")
    first, state, _ = serve_mixture(before, worlds[0], None,
                                    {**shape, "weights": weights_before},
                                    lambda _, steps: steps >= change)
    records = [record for step in range(change - 1, -1, -1)
               for record in trace(before, step, world_size=worlds[0],
                                   batch_size=args.rows // worlds[0], seq_len=args.seq_len,
                                   seed=args.seed, weights=weights_before)]
    named: dict[tuple[str, int], str] = {}
    for record in records:
        if len(named) < args.exclude:
            named.setdefault((record.source, record.document), record.line())
    names_file.write_text("\n".join(named.values()) + "\n")
    excluded = {name: sorted(document for source, document in named if source == name)
                for name in paths}
    new = {**shape, "weights": weights_after, "exclude": str(names_file)}
    second, middle, resumed = serve_mixture(after, worlds[1], state, new,
                                            lambda _, steps: steps >= second_stop)
    third, final, third_start = serve_mixture(after, worlds[2], middle,
                                              {**shape, "weights": weights_after}, finished)
    served = {**first, **second, **third}
    print(f"run 1: {worlds[0]} ranks, steps 0-{change - 1}; run 2: {worlds[1]} ranks, steps "
          f"{change}-{second_stop - 1}, code dropped, books added, excluding the "
          f"{len(named):,} documents trace named ({len(excluded['web']):,} of web, "
          f"{len(excluded['code']):,} of code) in {names_file}; run 3: {worlds[2]} ranks, "
          f"steps {second_stop}-{max(served)}, until web and books finished epoch 0")
    reference, _, _ = serve_mixture(after, worlds[0], state, new,
                                    lambda _, steps: steps > max(served))
    same = all(sorted(map(tuple, served[step])) == sorted(map(tuple, reference[step]))
               for step in range(change, max(served) + 1))
    print(f"every step's rows equal the run that made the changes at step {change} without "
          f"stopping again: {same}")
    change_record = (final.get("changes") or [{}])[0]
    recorded = (change_record.get("step") == change and change_record.get("added") == ["books"]
                and change_record.get("dropped") == ["code"]
                and [entry["documents"] for entry in final["exclusions"]["web"]]
                == [excluded["web"]])
    print(f"the state records the change (step {change_record.get('step')}, added "
          f"{change_record.get('added')}, dropped {change_record.get('dropped')}) and web's "
          f"exclusion of {len(final['exclusions']['web'][0]['documents']):,} documents: "
          f"{recorded}")
    options = {**shape, "weights": weights_before, "starts": starts, "rows": args.rows}
    held, epoch_zero = True, []
    for segment, world, start in ((first, worlds[0], None), (second, worlds[1], resumed),
                                  (third, worlds[2], third_start)):
        rows, records = traced_mixture(before if start is None else after, start, world,
                                       sorted(segment), options)
        held = held and all(np.array_equal(rows[step], segment[step]) for step in segment)
        epoch_zero += [record for record in records if record.epoch == 0]
    print(f"trace rebuilds every step's rows, from each run's first state: {held}")
    exact = True
    excluded_sets = {name: set(documents) for name, documents in excluded.items()}
    for name in paths:
        size = int(starts[name][-1])
        counts = np.zeros(size, dtype=np.int64)
        late = 0
        for record in epoch_zero:
            if record.source != name:
                continue
            first_token = int(starts[name][record.document])
            counts[first_token + record.token_start:first_token + record.token_end] += 1
            late += (record.step >= change and (name == "code" or record.document
                                                in excluded_sets[name]))
        owner = np.repeat(np.arange(starts[name].size - 1), np.diff(starts[name]))
        kept = ~np.isin(owner, excluded[name])
        whole = name != "code"  # its epoch 0 was cut short by the drop
        ok = counts.max(initial=0) <= 1 and late == 0 and (
            not whole or bool((counts[kept] == 1).all()))
        exact = exact and ok
        print(f"{name}: epoch 0's tokens trained once {int((counts == 1).sum()):,} of {size:,}"
              f", twice or more {int((counts > 1).sum()):,}, pieces after its change {late}"
              + (f"; every token of every document not excluded once: "
                 f"{bool((counts[kept] == 1).all())}" if whole else
                 " (dropped at the change: nothing after it)"))
    return same and recorded and held and exact


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="?", default=None)
    parser.add_argument("--exclude", type=int, default=1000, help="documents to exclude")
    parser.add_argument("--worlds", default="2,3,1")
    parser.add_argument("--stops", default="0.3,0.65")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=24, help="global rows a step")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4_000_000)
    parser.add_argument("--source-tokens", type=int, default=2_000_000,
                        help="tokens of each numbered source of the mixture")
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    worlds = [int(value) for value in args.worlds.split(",")]
    stops = [float(value) for value in args.stops.split(",")]
    if len(worlds) != 3 or len(stops) != 2:
        parser.error("--worlds: three runs; --stops: where the first two stop")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.data is None:
        args.data = str(synthetic_token_dataset(args.workdir, args.tokens))
    began = time.perf_counter()
    passed = one_dataset(args, worlds, stops)
    passed = mixture(args, worlds, stops) and passed
    print(f"CHANGING DATA: {'PASS' if passed else 'FAIL'} ({time.perf_counter() - began:.1f} s)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
