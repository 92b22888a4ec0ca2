"""Data that changes under a run: training while the tokenize job runs, a mixture source
dropped and one added on resume, documents excluded on resume, at other world sizes, every
surviving token still trained once, counted token by token.

    python bench/changing_data.py [DATA] [--exclude 1000] [--stops 0.3,0.65]
        [--seq-len 512] [--rows 24] [--tokens 4000000] [--source-tokens 1000000]
        [--unit-seconds 0.2]

Two runs, each stopped on 2 ranks, resumed on 3 with the change, stopped again and
finished on 1 (`--stops`: the fractions of the run's steps where it stops):

1. One dataset (DATA, default: a synthetic one of --tokens tokens, built once in
   --workdir), one bestfit epoch of --rows global rows a step. At the first stop,
   `raypipe.trace` of the steps before it names --exclude documents (its JSON records,
   written to a file, as a user would keep them); the second run resumes with
   `exclude=<that file>`, the third from the second's state alone.
2. The issue's one run: a mixture of numbered sources (documents whose texts are their
   tokens' numbers, tokenized by raypipe's job with a word-level tokenizer that maps "t<i>"
   to id i, so a token's id says which token of which document of which source it is;
   --source-tokens each). web is written by a tokenize job of 20 units that runs while
   the mixture trains (each unit slowed to --unit-seconds with raypipe's test-only fault
   hook, as a long job's pace); code was tokenized before. The first run is 2 processes of
   one torch.distributed (gloo) group that start once 10% of web's units have committed
   and follow the job (`follow=True`), its units joining web's epoch as they commit; at
   the first stop code is dropped, books added (web and books at 0.5 / 0.5); at the
   second, --exclude documents that `raypipe trace --history` of that stop's state named
   in the steps before it are excluded. The run goes on until web and
   books have each finished their epoch 0.

Checks, each printed, exit status 1 when one fails:
- each step's rows equal those of a run that made the same changes at the same steps
  at the first run's world size (one dataset: without stopping again; the mixture: from
  the first stop, where it no longer follows a job);
- the state records each change (web's units joining, their steps; the documents
  excluded, the sources added and dropped);
- no excluded document's token, and no dropped source's, is trained from the change on;
- every token of every surviving document of an epoch is trained exactly once in it (one
  dataset: but the drop-last tail, which the loader reports; a mixture drops nothing);
  nothing twice;
- `raypipe trace --history` of the final state alone rebuilds every step's rows (the
  mixture's: across its legs, each join of units and each exclusion), so a rerun of the
  history gives the same steps.
The tokens are held in memory (a check for datasets up to ~10^8 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from common import free_port, synthetic_token_dataset
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


def numbered_lengths(tokens: int, seed: int) -> np.ndarray:
    """Document lengths of about `tokens` tokens in all (lognormal, median ~250)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.5, 1.0, tokens // 150).astype(np.int64) + 2, 2, 20_000)
    return lengths[np.cumsum(lengths) <= tokens]


def numbered_tokenizer(directory: Path, tokens: int) -> Path:
    """A word-level tokenizer mapping "t<i>" to id i for every token a numbered corpus of
    each source holds (EOS "<|endoftext|>" is id 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = directory / f"numbered-tokenizer-{tokens}.json"
    if path.exists():
        return path
    vocab = {"<|endoftext|>": 0, "<unk>": FIRST_TOKEN["code"] - 1}  # (ids past the largest
    # make tokenizers' serialization slow: it walks every id up to it)
    for seed, first in enumerate(FIRST_TOKEN.values()):
        count = int(numbered_lengths(tokens, seed).sum())
        vocab.update({f"t{i}": i for i in range(first, first + count)})
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.save(str(path))
    return path


def numbered_corpus(directory: Path, name: str, tokens: int, seed: int, files: int = 4,
                    units_per_file: int = 5) -> Path:
    """Parquet files of documents whose texts are their tokens' numbers ("t17 t18 ..."),
    numbered from FIRST_TOKEN[name] on in file order, cut into `files` x `units_per_file`
    row groups (a job's units): tokenized with `numbered_tokenizer`, an output whose
    token ids say which token of which document of which source they are."""
    corpus = directory / f"numbered-corpus-{name}-{tokens}-seed{seed}"
    if corpus.exists():
        return corpus
    lengths = numbered_lengths(tokens, seed)
    starts = FIRST_TOKEN[name] + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    texts = [" ".join(f"t{i}" for i in range(start, start + length))
             for start, length in zip(starts.tolist(), lengths.tolist(), strict=True)]
    temporary = corpus.with_name(corpus.name + ".partial")
    temporary.mkdir(parents=True, exist_ok=True)
    for index, part in enumerate(np.array_split(np.arange(len(texts)), files)):
        table = pa.table({"text": [texts[i] for i in part.tolist()]})
        pq.write_table(table, temporary / f"part-{index}.parquet",
                       row_group_size=max(1, -(-len(part) // units_per_file)))
    temporary.rename(corpus)
    return corpus


def tokenize_job(corpus: Path, tokenizer: Path, output: Path) -> Any:
    """The tokenize job over `corpus` into `output` (EOS after each document)."""
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    return run_job(load_config(None, inputs=[str(corpus / "part-*.parquet")],
                               output=str(output), tokenizer=str(tokenizer), bos=False,
                               eos=True, unit_bytes=1, shard_tokens=1 << 20, overwrite=True),
                   progress_every=3600)


def start_job(corpus: Path, tokenizer: Path, output: Path, unit_seconds: float
              ) -> tuple[threading.Thread, list[BaseException]]:
    """`tokenize_job` on a thread, each unit's commit slowed by `unit_seconds` (raypipe's
    test-only fault hook, as a long job's pace), so training overlaps it; (the thread, the
    errors it raised)."""
    os.environ["RAYPIPE_TEST_FAULT"] = json.dumps(
        {"point": "unit.before_record", "action": "delay", "seconds": unit_seconds,
         "always": True, "marker": str(output.parent / f"{output.name}.slow-units")})
    errors: list[BaseException] = []

    def job() -> None:
        try:
            tokenize_job(corpus, tokenizer, output)
        except BaseException as exc:  # noqa: BLE001  (reported by the caller)
            errors.append(exc)

    thread = threading.Thread(target=job, name="tokenize-job", daemon=True)
    thread.start()
    return thread, errors


def committed_share(output: Path) -> float:
    """The share of the running job's units committed (its live status)."""
    from raypipe.io.live import LiveOutput
    from raypipe.io.store import Store

    status = LiveOutput(Store(output)).status() if output.exists() else None
    return status.units_committed / max(status.units_planned, 1) if status else 0.0


RANK_WORKER = "--rank-worker"


def rank_worker(argv: list[str]) -> int:
    """One rank of the first run (a process of a gloo group): follow the mixture for the
    given steps, then write its rows, and (rank 0) the state before every step."""
    import torch.distributed as dist

    spec = json.loads(argv[0])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                            rank=spec["rank"], world_size=spec["world"])
    if spec["rank"] == 0:
        Path(spec["out"]).with_suffix(".ready").touch()  # the job starts now
    while spec["rank"] == 0 and committed_share(Path(spec["paths"]["web"])) < 0.1:
        time.sleep(0.02)  # training starts once 10% of the job's units are committed
    dist.barrier()
    loader = MixtureLoader(spec["paths"], follow=True, follow_steps=spec["follow_steps"],
                           device="cpu", **spec["options"])
    states, rows = [loader.state_dict()], {}
    for batch in loader:
        rows[batch.step] = torch.cat([batch.inputs, batch.targets[:, -1:]], 1).tolist()
        states.append(loader.state_dict())
        dist.barrier()  # a training step's all-reduce, a while as the job still runs
        following = loader.followers["web"].active  # (every rank the same: rank 0's)
        if following:
            time.sleep(spec["step_seconds"])
        if batch.step + 1 >= spec["stop"] and not following:
            break  # at the stop, once the job finished and its last units joined
    Path(spec["out"]).write_text(json.dumps({"rows": rows, "states": states}))
    dist.destroy_process_group()
    return 0


def follow_run(paths: dict[str, str], world: int, stop: int, options: dict,
               workdir: Path) -> Future:
    """The first run, started: `world` rank processes that wait for 10% of the job's units,
    then follow it to step `stop` (later, until the job finished), each step taking
    options["step_seconds"] while the job runs; its result ({step: rows of every rank},
    the state before each step), once they are done."""
    return ThreadPoolExecutor(1).submit(follow_ranks, paths, world, stop, options, workdir)


def follow_ranks(paths: dict[str, str], world: int, stop: int, options: dict,
                 workdir: Path) -> tuple[dict[int, np.ndarray], list[dict]]:
    port = free_port()
    outs = [workdir / f"follow-rank-{rank}.json" for rank in range(world)]
    ranks = [subprocess.Popen([sys.executable, __file__, RANK_WORKER, json.dumps(
        {"port": port, "rank": rank, "world": world, "paths": paths, "stop": stop,
         "options": {"seed": options["seed"], "seq_len": options["seq_len"],
                     "weights": options["weights"], "batch_size": options["rows"] // world},
         "follow_steps": 2, "step_seconds": options["step_seconds"],
         "out": str(outs[rank])})])
        for rank in range(world)]
    if any(rank.wait() for rank in ranks):
        raise RuntimeError("a rank of the following run failed")
    served = [json.loads(out.read_text()) for out in outs]
    steps = sorted(int(step) for step in served[0]["rows"])
    rows = {step: np.concatenate([np.array(rank["rows"][str(step)]) for rank in served])
            for step in steps}
    return rows, served[0]["states"]


def traced_mixture(paths: dict[str, str], final: dict, steps: int, world_of: Any,
                   options: dict, data: dict[str, tuple[np.ndarray, np.ndarray]]
                   ) -> tuple[dict[int, np.ndarray], list[Any]]:
    """The rows `raypipe.trace --history` rebuilds from the `final` state alone for the
    run's first `steps` steps (`world_of(step)`: the ranks that took it) from each
    source's tokens (`data`: {source: (its tokens, each document's first)} in the run's
    numbering), and its records."""
    records = list(trace(paths, 0, steps=steps, history=final))
    rows = {step: np.zeros((options["rows"], options["seq_len"] + 1), dtype=np.int64)
            for step in range(steps)}
    for record in records:
        tokens, starts = data[record.source]
        first = int(starts[record.document])
        per_rank = options["rows"] // world_of(record.step)
        rows[record.step][record.rank * per_rank + record.row,
                          record.col_start:record.col_end] = tokens[
            first + record.token_start:first + record.token_end]
    return rows, records


def read_view(output: Path, key: str) -> list[str]:
    """The units of an output's kept unit order `key`."""
    from raypipe.io.manifest import read_manifest
    from raypipe.io.store import Store
    from raypipe.io.views import read_view as kept

    return kept(Store(output), key, read_manifest(output)) or []


def run_data(loader: MixtureLoader) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each source's tokens and each document's first, as the run numbers them."""
    data = {}
    for name, source in zip(loader.names, loader.sources, strict=True):
        lengths = source.dataset.document_lengths()
        data[name] = (np.concatenate(list(source.dataset.iter_documents())).astype(np.int64),
                      np.concatenate([[0], np.cumsum(lengths)]))
    return data


def mixture(args: argparse.Namespace, worlds: list[int], stops: list[float]) -> bool:
    """Scenario 2, one run: web is written by a tokenize job that runs while the mixture
    trains; a source dropped and one added on resume, documents excluded; True where
    every check held."""
    tokenizer = numbered_tokenizer(args.workdir, args.source_tokens)
    corpora = {name: numbered_corpus(args.workdir, name, args.source_tokens, seed)
               for seed, name in enumerate(FIRST_TOKEN)}
    web = args.workdir / "live-web"
    shutil.rmtree(web, ignore_errors=True)  # written anew each run, while the run trains
    paths = {name: str(args.workdir / f"numbered-{name}") for name in FIRST_TOKEN}
    paths["web"] = str(web)
    for name in ("code", "books"):  # tokenized before: only web is written as it trains
        tokenize_job(corpora[name], tokenizer, Path(paths[name]))
    before = {name: paths[name] for name in ("web", "code")}
    after = {name: paths[name] for name in ("web", "books")}
    shape = {"seed": args.seed, "seq_len": args.seq_len, "batch_size": None,
             "batch_schedule": [(0, args.rows)]}
    weights_before, weights_after = {"web": 0.5, "code": 0.5}, {"web": 0.5, "books": 0.5}
    epoch_steps = args.source_tokens // (args.seq_len + 1) * 2 // args.rows
    stop_at, second_run = (int(fraction * epoch_steps) for fraction in stops)
    options = {"seed": args.seed, "seq_len": args.seq_len, "rows": args.rows,
               "weights": weights_before,  # a step's pace: the job ends before the stop
               "step_seconds": 0.8 * args.unit_seconds * 20 / max(stop_at, 1)}
    ranks = follow_run(before, worlds[0], stop_at, options, args.workdir)  # waiting for 10%
    ready = (args.workdir / "follow-rank-0.json").with_suffix(".ready")
    ready.unlink(missing_ok=True)
    while not ready.exists() and ranks.running():
        time.sleep(0.05)
    job, errors = start_job(corpora["web"], tokenizer, web, args.unit_seconds)
    first, states = ranks.result()
    change = len(first)  # the first stop (after the job finished, and the stop asked)
    second_stop = change + max(1, second_run - stop_at)
    job.join()
    share = states[0]["views"] and len(read_view(web, states[0]["views"]["web"])) / 20
    os.environ.pop("RAYPIPE_TEST_FAULT", None)
    if errors:
        raise errors[0]
    state = states[-1]
    joins = (state.get("units_added") or {}).get("web", [])  # (none: the job ended first)
    print(f"2. a mixture of numbered sources, one written while it trains: web (a tokenize "
          f"job over {args.source_tokens:,} numbered tokens in 20 units, "
          f"{args.unit_seconds} s a unit) and code at 0.5 / 0.5; training began with "
          f"{share:.0%} of web's units committed, {len(joins)} joins of its units as they "
          f"committed (steps {[record['step'] for record in joins]}); at step {change} code "
          "dropped, books added at 0.5 / 0.5")
    kept = {**shape, "weights": weights_after}
    second, middle, _ = serve_mixture(after, worlds[1], state, kept,
                                      lambda _, steps: steps >= second_stop)
    # the documents that trace --history of the second stop's state names in the steps
    # before it, the latest first (of the sources kept: a dropped one serves nothing more)
    records = [record for record in trace(after, 0, steps=second_stop, history=middle)
               if record.source in after]
    records.sort(key=lambda record: -record.step)
    names_file = args.workdir / "excluded-mixture.jsonl"
    named: dict[tuple[str, int], str] = {}
    for record in records:
        if len(named) < args.exclude:
            named.setdefault((record.source, record.document), record.line())
    names_file.write_text("\n".join(named.values()) + "\n")
    excluded = {name: sorted(document for source, document in named if source == name)
                for name in paths}
    new = {**kept, "exclude": str(names_file)}

    def finished(positions: dict, steps: int) -> bool:  # web and books past epoch 0
        return all(positions[name].epoch >= 1 for name in after if name in positions)

    third, final, _ = serve_mixture(after, worlds[2], middle, new, finished)
    served = {**first, **second, **third}
    print(f"run 1: {worlds[0]} ranks (processes of one gloo group, following the job), steps "
          f"0-{change - 1}; run 2: {worlds[1]} ranks, steps {change}-{second_stop - 1}, code "
          f"dropped, books added; run 3: {worlds[2]} ranks, steps {second_stop}-"
          f"{max(served)}, until web and books finished epoch 0, excluding the "
          f"{len(named):,} documents trace --history named in steps 0-{second_stop - 1} "
          f"({len(excluded['web']):,} of web, {len(excluded['books']):,} of books; "
          f"{names_file})")
    reference, halfway, _ = serve_mixture(after, worlds[0], state, kept,
                                          lambda _, steps: steps >= second_stop)
    rest, _, _ = serve_mixture(after, worlds[0], halfway, new,
                               lambda _, steps: steps > max(served))
    reference.update(rest)
    same = all(sorted(map(tuple, served[step])) == sorted(map(tuple, reference[step]))
               for step in range(change, max(served) + 1))
    print(f"every step's rows after the first stop equal a run on {worlds[0]} ranks that made "
          f"the same changes at steps {change} and {second_stop}: {same}")
    change_record = (final.get("changes") or [{}])[0]
    recorded = (change_record.get("step") == change and change_record.get("added") == ["books"]
                and change_record.get("dropped") == ["code"]
                and all([entry["documents"] for entry in final["exclusions"][name]]
                        == [excluded[name]] and final["exclusions"][name][0]["step"]
                        == second_stop for name in after if excluded[name])
                # (web's units all joined while the first run followed the job)
                and (final.get("units_added") or {}).get("web", []) == joins
                and any(record["joins"] for record in joins))
    print(f"the state records web's units joining ({len(joins)}), the change (step "
          f"{change_record.get('step')}, added {change_record.get('added')}, dropped "
          f"{change_record.get('dropped')}) and the exclusions at step {second_stop} "
          f"({', '.join(f'{name}: {len(excluded[name]):,}' for name in after)}): {recorded}")
    data = {**run_data(MixtureLoader(before, device="cpu", **shape)),  # (code's)
            **run_data_of_state(after, final, shape)}  # web as the run numbered it, books

    def world_of(step: int) -> int:
        return worlds[0] if step < change else worlds[1] if step < second_stop else worlds[2]

    rows, records = traced_mixture(after, final, max(served) + 1, world_of, options, data)
    held = all(np.array_equal(rows[step], served[step]) for step in served)
    epoch_zero = [record for record in records if record.epoch == 0]
    print(f"trace --history of the final state alone rebuilds every step's rows (its "
          f"{len(final['history'])} legs: {[leg['step'] for leg in final['history']]}; "
          f"web's joins, code dropped, books added, the exclusions): {held}")
    exact = True
    excluded_sets = {name: set(documents) for name, documents in excluded.items()}
    for name, (tokens, starts) in data.items():
        counts = np.zeros(tokens.size, dtype=np.int64)
        late = 0
        for record in epoch_zero:
            if record.source != name:
                continue
            first_token = int(starts[record.document])
            counts[first_token + record.token_start:first_token + record.token_end] += 1
            late += (record.step >= change if name == "code" else
                     record.step >= second_stop and record.document in excluded_sets[name])
        owner = np.repeat(np.arange(starts.size - 1), np.diff(starts))
        surviving = ~np.isin(owner, excluded[name])
        whole = name != "code"  # its epoch 0 was cut short by the drop
        numbered = tokens > 0  # (web's EOS tokens are id 0)
        ids = np.bincount(tokens[numbered], weights=counts[numbered]) \
            if numbered.any() else np.zeros(0)
        ok = counts.max(initial=0) <= 1 and late == 0 and (
            not whole or bool((counts[surviving] == 1).all())) and ids.max(initial=0) <= 1
        exact = exact and ok
        print(f"{name}: epoch 0's tokens trained once {int((counts == 1).sum()):,} of "
              f"{tokens.size:,}, twice or more {int((counts > 1).sum()):,}, pieces after its "
              f"change {late}" + (f"; every token of every document not excluded once: "
                                  f"{bool((counts[surviving] == 1).all())}" if whole else
                                  " (dropped at the change: nothing after it)"))
    enough = len(named) == args.exclude
    if not enough:
        print(f"trace named {len(named):,} documents before the second stop, not "
              f"{args.exclude:,}: a later stop names more")
    return same and recorded and held and exact and enough


def run_data_of_state(paths: dict[str, str], state: dict, shape: dict
                      ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The sources' data as the run that saved `state` numbers it (its units in its
    order, those it gained after)."""
    loader = MixtureLoader(paths, device="cpu", **{**shape, "weights": state["weights"]})
    loader.load_state_dict(state)
    return run_data(loader)


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
    parser.add_argument("--source-tokens", type=int, default=1_000_000,
                        help="tokens of each numbered source of the mixture")
    parser.add_argument("--unit-seconds", type=float, default=0.2,
                        help="how long each unit of the job training follows takes, at least")
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    if len(sys.argv) > 2 and sys.argv[1] == RANK_WORKER:
        return rank_worker(sys.argv[2:])
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
