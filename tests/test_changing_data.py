"""Data that changes under a run. Documents excluded on resume
(raypipe.sampling.exclusions): from the step of the change no excluded document is served,
every other token is still served once in the epoch (the drop-last tail counted), the
change is in the state, a resume at any world size and `raypipe trace --history` replay the
same steps, and a mode that cannot re-plan refuses it naming the mode. The dataset's tokens
are their own identity (numbered 1..N), so the tests count tokens in the batches, not in
the plans. Mixture sources added and dropped on resume: the kept ones continue where they
stood, an added one from its first row, a dropped one serves nothing more, each recorded."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.dataset import TokenDataset
from raypipe.errors import ConfigError, StateError
from raypipe.io.states import LoaderState
from raypipe.loader import MixtureLoader, TokenLoader
from tests import test_state_harness as harness
from tests.conftest import write_parquet
from tests.helpers import (
    corpus_with_gaps,
    document_starts,
    lockstep,
    numbered_dataset,
    tokenize,
)

TOKENS = 60_000
SEQ_LEN, ROWS = 32, 6  # rows per step of the whole run: 6 divides among 1, 2 and 3 ranks
CHANGE = 9  # the step the exclusion begins at


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    return numbered_dataset(tmp_path_factory.mktemp("numbered"), TOKENS)


def serve(path, world, state, steps, **options):
    """({step: [rows of every rank, each its T + 1 tokens]}, the state after, rank 0's
    loader) for at most `steps` steps from `state`."""
    if options.get("mode", "bestfit") == "bestfit":
        options = {"block_documents": 64, **options}
    loaders = [TokenLoader(str(path), SEQ_LEN, ROWS // world, rank=rank, world_size=world,
                           seed=3, **options) for rank in range(world)]
    taken, state = lockstep(loaders, state, steps)
    return {step: rows for step, (_, rows) in taken.items()}, state, loaders[0]


def documents_of(taken, starts) -> np.ndarray:
    """The documents whose tokens the steps hold."""
    tokens = np.concatenate([rows.ravel() for rows in taken.values()]) if taken else []
    tokens = np.asarray(tokens)
    return np.unique(np.searchsorted(starts, tokens[tokens > 0], side="right") - 1)


MODES = [pytest.param({"packing": "fill"}, id="fill"),
         pytest.param({"packing": "split"}, id="split"),
         pytest.param({"shuffle": "shard_local", "group_shards": 1}, id="shard_local"),
         pytest.param({"mode": "documents"}, id="documents")]


@pytest.mark.parametrize("knobs", MODES)
def test_documents_excluded_on_resume_are_not_served_after_and_every_other_token_once(
        numbered, knobs):
    path, total = numbered
    starts = document_starts(path)
    lengths = np.diff(np.append(starts, total + 1))
    before, state, _ = serve(path, 2, None, CHANGE, **knobs)
    served = documents_of(before, starts)
    unserved = np.setdiff1d(np.arange(starts.size), served)
    # named three ways: trace records of served documents, numbers of unserved ones, and
    # names that match none, or that repeat
    names = ([{"document": int(document)} for document in served[:20]]
             + [int(document) for document in unserved[::7][:200]]
             + [str(int(unserved[0])), 10**9, {"document": starts.size}])
    excluded = np.union1d(served[:20], unserved[::7][:200])
    after, state, loader = serve(path, 3, state, 10**6, exclude=names, **knobs)
    record = state["exclusions"][0]
    assert record["step"] == CHANGE and record["documents"] == excluded.tolist()
    assert (record["named"], record["not_found"], record["repeated"]) == (len(names), 2, 1)
    assert not np.isin(documents_of(after, starts), excluded).any()
    counts = np.bincount(np.concatenate([rows.ravel() for rows in
                                         [*before.values(), *after.values()]]),
                         minlength=total + 1)[1:]
    if knobs.get("mode") == "documents":  # one document a row, cropped to it
        per_document = np.minimum(lengths, SEQ_LEN + 1)
        kept = np.setdiff1d(np.arange(starts.size), excluded)
        assert counts.max() == 1
        trained = np.add.reduceat(counts, starts - 1)
        missing = per_document[kept] - trained[kept]
        assert (missing >= 0).all() and missing.sum() == loader.dropped_tail[2]
        return
    assert counts.max() == 1, "a token trained twice"
    never = counts == 0
    owner = np.searchsorted(starts, np.arange(1, total + 1), side="right") - 1
    # every token never trained is the drop-last tail's, or an excluded document's
    # that the steps before the change had not served
    assert int((never & ~np.isin(owner, excluded)).sum()) == loader.dropped_tail[2]
    unserved_excluded = np.isin(owner, excluded) & np.isin(
        np.arange(1, total + 1), np.concatenate([rows.ravel() for rows in before.values()]),
        invert=True)
    assert (never[np.isin(owner, excluded)] == unserved_excluded[np.isin(owner, excluded)]
            ).all()


def test_a_resume_after_an_exclusion_at_any_world_size_serves_the_same_steps(numbered):
    path, _ = numbered
    before, state, _ = serve(path, 2, None, CHANGE)
    excluded = list(range(0, 600, 5))
    whole, _, _ = serve(path, 2, state, 10**6, exclude=excluded)
    first, middle, _ = serve(path, 3, state, 7, exclude=excluded)
    rest, final, _ = serve(path, 1, middle, 10**6)  # the state carries the exclusion
    resumed = {**first, **rest}
    assert sorted(resumed) == sorted(whole)
    for step, rows in whole.items():
        assert sorted(map(tuple, resumed[step])) == sorted(map(tuple, rows)), step
    assert [entry["documents"] for entry in final["exclusions"]] == [excluded]
    # the same names again on a later resume exclude nothing more
    _, again, _ = serve(path, 2, middle, 1, exclude=excluded)
    assert len(again["exclusions"]) == 1


def test_trace_history_replays_the_steps_across_an_exclusion(numbered):
    from raypipe import trace

    path, _ = numbered
    starts = document_starts(path)
    _, state, _ = serve(path, 2, None, CHANGE)
    after, state, _ = serve(path, 3, state, 4, exclude=list(range(0, 900, 4)))
    for step in (CHANGE, CHANGE + 3):
        pieces = [record for record in trace(str(path), step, history=state,
                                             world_size=3)]
        rows = after[step]
        for piece in pieces:
            first = int(starts[piece.document])
            row = rows[piece.rank * (ROWS // 3) + piece.row]
            assert row[piece.col_start:piece.col_end].tolist() == list(
                range(first + piece.token_start, first + piece.token_end))
        assert {(piece.rank, piece.row) for piece in pieces} == {
            (rank, row) for rank in range(3) for row in range(ROWS // 3)}
        assert not {piece.document for piece in pieces} & set(range(0, 900, 4))


def test_a_document_named_by_input_and_row_is_the_one_trace_names(tmp_path, corpus_texts,
                                                                  tokenizer_path):
    from raypipe import trace

    corpus = corpus_with_gaps(tmp_path / "corpus", corpus_texts[:400])
    output = tokenize(corpus, tmp_path / "tokens", tokenizer_path)
    loader = TokenLoader(str(output), 64, 2, seed=1)
    iterator = iter(loader)
    next(iterator)
    iterator.close()
    state = loader.state_dict()
    records = list(trace(str(output), 0, world_size=1, seq_len=64, batch_size=2, seed=1))
    named = [f"{record.input}:{record.input_row}" for record in records]
    names_file = tmp_path / "bad.txt"  # as trace prints them, and as "input:row"
    names_file.write_text("\n".join([json.dumps(records[0].to_json()), *named[1:],
                                     f"{records[0].input}:99999", ""]))
    # the same names in a list, in the same forms (trace's JSON line taken as it prints)
    as_list = names_file.read_text().splitlines()
    for exclude in (str(names_file), as_list):
        resumed = TokenLoader(str(output), 64, 2, seed=1, exclude=exclude)
        resumed.load_state_dict(state)
        record = resumed.state_dict()["exclusions"][0]
        assert record["documents"] == sorted({record.document for record in records})
        assert record["not_found"] == 1 and record["named"] == len(records) + 1


def test_a_state_lists_its_exclusions_and_inspect_shows_every_change(numbered, tmp_path,
                                                                     capsys):
    from raypipe.cli import main

    path, _ = numbered
    _, state, _ = serve(path, 2, None, 3)
    _, state, _ = serve(path, 2, state, 2, exclude=[1, 2, 3])
    _, state, _ = serve(path, 3, state, 2, exclude=[1, 2, 3, 4, 99999999])
    assert [(entry["step"], entry["documents"], entry["not_found"], entry["repeated"])
            for entry in state["exclusions"]] == [(3, [1, 2, 3], 0, 0), (5, [4], 1, 3)]
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    assert main(["inspect", str(saved)]) == 0
    shown = capsys.readouterr().out
    assert "from step 3: 3 document(s) excluded (3 named, 0 not found" in shown
    assert "from step 5: 1 document(s) excluded (5 named, 1 not found, 3 excluded" in shown
    assert "from step 0: global batch 6, seq_len 32" in shown


def test_a_state_whose_phase_counts_more_exclusions_than_it_records_is_refused(numbered):
    path, _ = numbered
    _, state, _ = serve(path, 2, None, 3, exclude=[5])
    state["phases"] = [[SEQ_LEN, 0, 2]]
    with pytest.raises(StateError, match="phase 0 excludes 2 exclusions' documents"):
        LoaderState.from_dict(state)
    state["phases"], state["exclusions"][0]["documents"] = None, [7, 5]
    with pytest.raises(StateError, match="'documents' is not a list of increasing"):
        LoaderState.from_dict(state)


def test_windows_mode_refuses_an_exclusion_naming_the_mode_and_a_mixture_the_source(
        numbered, caplog):
    path, _ = numbered
    with pytest.raises(ConfigError, match="mode 'windows' cannot plan an epoch without"):
        TokenLoader(str(path), SEQ_LEN, 2, mode="windows", exclude=[1])
    with pytest.raises(ConfigError, match="exclude: 1 names no source; a mixture's"):
        MixtureLoader({"a": str(path), "b": str(path)}, SEQ_LEN, 2, exclude=[1])
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        loader = MixtureLoader({"a": str(path), "b": str(path)}, SEQ_LEN, 2,
                               exclude=[{"source": "c", "document": 1}])
        assert loader.state_dict()["exclusions"] is None
    assert "1 name(s) of sources this mixture does not have (c: 1)" in caplog.text
    # a trace record's JSON line in a list names its source, as in a file
    mixture = MixtureLoader({"a": str(path), "b": str(path)}, SEQ_LEN, 2,
                            exclude=['{"source": "a", "document": 1}'])
    next(iter(mixture))
    assert mixture.state_dict()["exclusions"]["a"][0]["documents"] == [1]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=2, max_size=200),
       cuts=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3),
       picks=st.lists(st.integers(0, 199), min_size=1, max_size=3 * 20),
       packing=st.sampled_from(["fill", "split", "crop"]), seed=st.integers(0, 5),
       lanes=st.sampled_from([0, 1, 2, 3]), seq_lens=st.lists(st.sampled_from([16, 9, 24]),
                                                             min_size=3, max_size=3))
def test_any_chain_of_exclusions_serves_each_other_token_at_most_once_and_fill_split_all(
        lengths, cuts, picks, packing, seed, lanes, seq_lens):
    """Serve a plan to a position, exclude some documents and continue (at a seq_len that
    may change too), again: no excluded document's token after its exclusion, every other
    token once (fill, split: exactly); under a global shuffle (lanes 0) and a windowed one
    of 1, 2 or 3 lanes (shards of 5 documents, windows of 2 shards), each lane serving a
    prefix of its rows."""
    from raypipe.sampling.blocks import whole_shards
    from raypipe.sampling.lengths import DocumentLengths
    from raypipe.sampling.modes.base import PlanInputs, PlanSpec
    from raypipe.sampling.modes.bestfit import BESTFIT
    from raypipe.sampling.plans import ShardWindows

    lengths = np.array(lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    counts = np.zeros(int(lengths.sum()), dtype=np.int64)

    class Dataset:
        bos_id, eos_id = 1, None

    shards = np.diff(np.append(np.arange(0, lengths.size, 5), lengths.size))
    groups = ShardWindows(whole_shards(shards), 2, lanes) if lanes else None

    def inputs(excluded):
        return PlanInputs(Dataset(), lambda: DocumentLengths.of(lengths), groups=groups,
                          excluded=np.array(sorted(excluded), dtype=np.int64))

    def spec_at(seq_len):
        return PlanSpec.of(seq_len=seq_len, seed=seed, packing=packing, block_documents=8,
                           **({"shuffle": "windowed"} if lanes else {}))

    excluded: set[int] = set()
    plan = BESTFIT.plan(spec_at(16), inputs(excluded), 0)
    chunks = [picks[index::len(cuts)] for index in range(len(cuts))]
    for cut, chunk, seq_len in zip(cuts, chunks, seq_lens, strict=False):
        position = int(cut * plan.size)
        for _, row in plan.rows(np.arange(position, dtype=np.int64)) if position else []:
            for document, start, take in zip(row.documents, row.starts, row.take,
                                             strict=True):
                counts[offsets[document] + start:offsets[document] + start + take] += 1
        excluded |= {pick % lengths.size for pick in chunk}
        plan = BESTFIT.continue_plan(spec_at(seq_len), inputs(excluded), 0, plan, position)
    for _, row in plan.rows(np.arange(plan.size, dtype=np.int64)) if plan.size else []:
        for document, start, take in zip(row.documents, row.starts, row.take, strict=True):
            assert int(document) not in excluded
            counts[offsets[document] + start:offsets[document] + start + take] += 1
    owner = np.repeat(np.arange(lengths.size), lengths)
    kept = ~np.isin(owner, list(excluded))
    assert counts.max() <= 1
    if packing != "crop":
        assert (counts[kept] == 1).all()


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=2, max_size=200),
       present=st.floats(0.05, 1.0), cuts=st.lists(st.floats(0.0, 1.0), min_size=1,
                                                    max_size=3),
       picks=st.lists(st.integers(0, 199), max_size=3 * 10),
       mode=st.sampled_from(["fill", "split", "crop", "documents"]), seed=st.integers(0, 5),
       windowed=st.booleans(), lanes=st.sampled_from([1, 2, 3]))
def test_any_chain_of_joins_and_exclusions_serves_every_token_of_the_epoch_once(
        lengths, present, cuts, picks, mode, seed, windowed, lanes):
    """A plan of the first documents, served to a position, continued with more documents
    joined (and some excluded), again: every token of every document that joined and was
    not excluded is served once (crop: at most once; documents: its first row's worth);
    under a windowed shuffle (shards of 5 documents, windows of 2 shards) too, of 1, 2 or
    3 lanes (each lane's rest planned again, the joined windows shared out between them)."""
    lanes = lanes if windowed else 1
    from raypipe.sampling.blocks import whole_shards
    from raypipe.sampling.lengths import DocumentLengths
    from raypipe.sampling.modes import get_mode
    from raypipe.sampling.modes.base import PlanInputs, PlanSpec
    from raypipe.sampling.plans import ShardWindows

    lengths = np.array(lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    counts = np.zeros(int(lengths.sum()), dtype=np.int64)
    capacity = 17

    class Dataset:
        bos_id, eos_id = 1, None

    def inputs(count, excluded):
        shards = np.diff(np.append(np.arange(0, count, 5), count))  # of 5 documents
        return PlanInputs(Dataset(), lambda: DocumentLengths.of(lengths[:count]),
                          groups=(ShardWindows(whole_shards(shards), 2, lanes) if windowed
                                  else None),
                          excluded=np.array(sorted(excluded), dtype=np.int64))

    def serve(plan, positions):
        if mode == "documents":
            for document in plan.documents(positions).tolist():
                take = min(int(lengths[document]), capacity)
                counts[offsets[document]:offsets[document] + take] += 1
            return set(plan.documents(positions).tolist())
        served = set()
        for _, row in plan.rows(positions) if positions.size else []:
            for document, start, take in zip(row.documents, row.starts, row.take,
                                             strict=True):
                counts[offsets[document] + start:offsets[document] + start + take] += 1
                served.add(int(document))
        return served

    knobs = ({"mode": "documents"} if mode == "documents"
             else {"packing": mode, "block_documents": 8})
    spec = PlanSpec.of(seq_len=capacity - 1, seed=seed, **knobs,
                       **({"shuffle": "windowed"} if windowed else {}))
    planner = get_mode(spec.mode)
    count = min(lengths.size, max(5, int(present * lengths.size) // 5 * 5))  # whole shards
    excluded: set[int] = set()
    plan = planner.plan(spec, inputs(count, excluded), 0)
    for index, cut in enumerate(cuts):
        position = int(cut * plan.size)
        serve(plan, np.arange(position, dtype=np.int64))
        count = min(lengths.size, (count + 5 + (lengths.size - count) // 2) // 5 * 5)
        excluded |= {pick % count for pick in picks[index::len(cuts)]}
        plan = planner.continue_plan(spec, inputs(count, excluded), 0, plan, position)
    assert not serve(plan, np.arange(plan.size, dtype=np.int64)) & excluded
    owner = np.repeat(np.arange(lengths.size), lengths)
    within = offsets[owner] + capacity > np.arange(owner.size)  # a document's first row
    kept = ~np.isin(owner, list(excluded)) & (owner < count)
    kept &= within if mode == "documents" else True
    assert counts.max() <= 1 and not counts[owner >= count].any()
    if mode != "crop":
        assert (counts[kept] == 1).all()


@pytest.fixture(scope="module")
def extra_source(tmp_path_factory, corpus_texts, tokenizer_path):
    """A third dataset of other documents, the same tokenizer as the session's."""
    root = tmp_path_factory.mktemp("extra")
    write_parquet(root / "corpus" / "part-0.parquet", corpus_texts[600:900], row_group_rows=50)
    return tokenize(root / "corpus", root / "tokens", tokenizer_path)


def by_name(consumed, names):
    """(source name, position) -> tokens of each row served (the loader's source ids index
    the sorted names of the mixture that served it)."""
    return [((sorted(names)[source], position), tokens)
            for (source, position), tokens in consumed]


def test_a_source_added_and_one_dropped_on_resume_continue_the_kept_from_where_they_stood(
        token_dataset, rich_dataset, extra_source, tmp_path, capsys):
    from raypipe.cli import main

    before = {"web": str(token_dataset), "code": str(rich_dataset)}
    after = {"web": str(token_dataset), "extra": str(extra_source)}
    old = {"mode": "documents", "weights": {"web": 0.6, "code": 0.4}}
    new = {"mode": "documents", "weights": {"web": 0.5, "extra": 0.5}}
    first, state = harness.run_segment(before, old, 2, None, steps=10)
    served_web = state["sources"]["web"]["consumed"]
    second, middle = harness.run_segment(after, new, 3, state, steps=6)
    third, final = harness.run_segment(after, new, 1, middle, steps=6)
    whole, _ = harness.run_segment(after, new, 2, state, steps=12)  # no stop after the change
    rows = by_name(second + third, after)
    assert rows == by_name(whole, after), "a resume after the change served other steps"
    web = [position for (name, position), _ in by_name(first, before) if name == "web"]
    web += [position for (name, position), _ in rows if name == "web"]
    assert sorted(web) == list(range(len(web))), "web repeated or skipped a row"
    extra = sorted(position for (name, position), _ in rows if name == "extra")
    assert extra == list(range(len(extra))), "the added source did not begin at its first row"
    assert abs(len(extra) - 0.5 * len(rows)) <= 1, "the new weights' shares"
    assert served_web < final["sources"]["web"]["consumed"] and "code" not in final["sources"]
    change = final["changes"][0]
    assert (change["step"], change["added"], change["dropped"]) == (10, ["extra"], ["code"])
    assert change["weights"] == {"extra": 0.5, "web": 0.5}
    saved = tmp_path / "mixture-state.json"
    saved.write_text(json.dumps(final))
    assert main(["inspect", str(saved)]) == 0
    assert "from step 10: sources added ['extra'], dropped ['code']" in capsys.readouterr().out


def test_trace_after_a_source_change_names_the_rows_the_resumed_mixture_served(
        token_dataset, rich_dataset, extra_source):
    from raypipe import trace

    before = {"web": str(token_dataset), "code": str(rich_dataset)}
    after = {"web": str(token_dataset), "extra": str(extra_source)}
    _, state = harness.run_segment(before, {"mode": "documents"}, 2, None, steps=4)
    loaders = [MixtureLoader(after, harness.T, harness.B, rank=rank, world_size=2,
                             seed=harness.SEED, mode="documents") for rank in range(2)]
    for loader in loaders:
        loader.load_state_dict(state)
    resumed = loaders[0].state_dict()
    batches = [next(iter(loader)) for loader in loaders]
    pieces = list(trace(after, state=resumed, world_size=2, batch_size=harness.B,
                        seed=harness.SEED,
                        mode="documents"))
    assert {piece.step for piece in pieces} == {4}
    assert {piece.source for piece in pieces} <= {"web", "extra"} and any(
        piece.source == "extra" for piece in pieces)
    datasets = {name: TokenDataset(path) for name, path in after.items()}
    for piece in pieces:
        batch = batches[piece.rank]
        row = torch.cat([batch.inputs[piece.row], batch.targets[piece.row, -1:]]).tolist()
        assert batch.source_ids[piece.row] == sorted(after).index(piece.source)
        dataset = datasets[piece.source]
        shard = int(np.searchsorted(dataset.document_offsets, piece.document, side="right")) - 1
        tokens = dataset.reader(shard).document(
            piece.document - int(dataset.document_offsets[shard]))
        assert row[piece.col_start:piece.col_end] == tokens[
            piece.token_start:piece.token_end].tolist()


def serve_mixture(paths, world, state, steps, **options):
    """({step: rows of every rank}, the state after) of a mixture, as `serve`."""
    loaders = [MixtureLoader(paths, SEQ_LEN, ROWS // world, rank=rank, world_size=world,
                             seed=3, block_documents=64, **options) for rank in range(world)]
    taken, state = lockstep(loaders, state, steps)
    return {step: rows for step, (_, rows) in taken.items()}, state


def test_a_mixture_excludes_each_source_s_documents_named_by_trace_records(tmp_path):
    from raypipe import trace

    a, _ = numbered_dataset(tmp_path / "a", 30_000)
    b, _ = numbered_dataset(tmp_path / "b", 30_000, first=1_000_000, seed=8)
    paths = {"a": str(a), "b": str(b)}
    starts = {"a": document_starts(a), "b": document_starts(b) - 1 + 1_000_000}
    before, state = serve_mixture(paths, 2, None, CHANGE)
    records = [record.to_json() for record in trace(
        paths, CHANGE - 1, steps=1, state=None, world_size=2, batch_size=ROWS // 2, seed=3,
        block_documents=64, seq_len=SEQ_LEN)]
    named = records + [{"source": "b", "document": 5}, {"source": "a", "document": 10**7}]
    after, final = serve_mixture(paths, 3, state, 12, exclude=named)
    excluded = {name: sorted({r["document"] for r in named
                              if r["source"] == name and r["document"] < starts[name].size})
                for name in paths}
    assert {name: entries[0]["documents"] for name, entries in
            final["exclusions"].items()} == excluded
    assert final["exclusions"]["a"][0]["not_found"] == 1
    served_after = np.concatenate([rows.ravel() for rows in after.values()])
    for name in paths:
        owners = np.searchsorted(starts[name], served_after[served_after >= starts[name][0]],
                                 side="right") - 1
        owners = owners[owners < starts[name].size]
        assert not np.isin(owners, excluded[name]).any(), name
    every = np.concatenate([rows.ravel() for rows in [*before.values(), *after.values()]])
    every = every[every > 0]
    assert np.bincount(every).max() == 1, "a token trained twice"
    # the same steps from a resume at another world size after the change
    first, middle = serve_mixture(paths, 1, state, 5, exclude=named)
    rest, _ = serve_mixture(paths, 2, middle, 7)
    for step, rows in after.items():
        again = {**first, **rest}[step]
        assert sorted(map(tuple, again)) == sorted(map(tuple, rows)), step


def test_jobs_train_sends_the_documents_of_its_exclude_file_to_the_train_loader(numbered,
                                                                               tmp_path):
    import runpy
    from pathlib import Path

    from raypipe.examples.gpt_train import open_loaders

    path, _ = numbered
    job = runpy.run_path(str(Path(__file__).resolve().parents[1] / "jobs" / "train.py"))
    names = tmp_path / "bad.jsonl"
    names.write_text('{"document": 3}\n7\n\n')
    args = job["build_parser"]().parse_args(["--data", str(path), "--exclude", str(names),
                                             "--seq-len", "32"])
    config = job["run_config"](args)
    assert config["options"]["exclude"] == [{"document": 3}, "7"]
    train, validation = open_loaders(
        config, lambda *given, name, **options: TokenLoader(*given, **options))
    assert validation is None
    record = train.state_dict()["exclusions"][0]
    assert (record["step"], record["documents"], record["named"]) == (0, [3, 7], 2)


@pytest.fixture
def growing(tmp_path, corpus_texts, tokenizer_path):
    """A tokenized output of two parquet files, and a function that adds a third and
    reruns the job (its units added to the output)."""
    corpus = tmp_path / "corpus"
    for index in range(2):
        write_parquet(corpus / f"part-{index}.parquet", corpus_texts[index:600:3],
                      row_group_rows=50)
    output = tokenize(corpus, tmp_path / "tokens", tokenizer_path)

    def add_a_file() -> None:
        write_parquet(corpus / "part-2.parquet", corpus_texts[2:600:3], row_group_rows=50)
        tokenize(corpus, output, tokenizer_path)

    return output, add_a_file


def serve_epochs(path, world, state, steps, **options):
    loaders = [TokenLoader(str(path), SEQ_LEN, ROWS // world, rank=rank, world_size=world,
                           seed=3, **options) for rank in range(world)]
    taken, state = lockstep(loaders, state, steps)
    return {step: rows for step, (_, rows) in taken.items()}, state, loaders[0]


def pieces_by_document(path, state, steps):
    """{document: [(token_start, token_end), ...]} of the pieces trace names in `steps`
    steps from where `state` stands."""
    from raypipe import trace

    found: dict[int, list] = {}
    for record in trace(str(path), state=state, steps=steps):
        found.setdefault(record.document, []).append((record.token_start, record.token_end))
    return found


def test_units_added_on_resume_are_served_from_the_next_epoch_and_every_token_once(growing,
                                                                                   tmp_path):
    from raypipe.tools.inspect import inspect_state

    path, add_a_file = growing
    whole, _, _ = serve_epochs(path, 2, None, 10**6)
    first, state, _ = serve_epochs(path, 2, None, 20)
    assert state["view"] and state["units_added"] is None
    add_a_file()
    rest, at_epoch_end, loader = serve_epochs(path, 3, state, 10**6, units_join="next_epoch")
    # the epoch in progress is the one the run would have served without the new units
    assert sorted({**first, **rest}) == sorted(whole)
    for step, rows in rest.items():
        assert sorted(map(tuple, rows)) == sorted(map(tuple, whole[step])), step
    record = at_epoch_end["units_added"][0]
    assert (record["step"], record["epoch"]) == (20, 1)
    before = TokenDataset(path).num_documents - 200  # the third file's 200 documents
    assert record["documents"] == before + 200 and loader.dataset.num_documents == before + 200
    # epoch 1 serves every document of the grown data, each token once (but the tail)
    steps = len(loader)
    pieces = pieces_by_document(path, at_epoch_end, steps)
    lengths = loader.dataset.document_lengths()
    assert set(pieces) <= set(range(before + 200)) and max(pieces) >= before
    tail = loader.run.planned.left_at(1, loader.run.phases, steps * ROWS)[1]
    covered = 0
    for document, ranges in pieces.items():
        ranges.sort()
        assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:],
                                                                   strict=False)), document
        covered += sum(end - start for start, end in ranges)
    assert covered + tail == int(lengths.sum())
    # a resume in epoch 1, at another world size, continues it (the data as the state had it)
    middle, mid_state, _ = serve_epochs(path, 1, at_epoch_end, 5)
    after, _, _ = serve_epochs(path, 2, mid_state, 3)
    replayed = pieces_by_document(path, mid_state, 3)
    assert sum(len(ranges) for ranges in replayed.values()) > 0
    assert mid_state["units_added"] == at_epoch_end["units_added"]
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(mid_state))
    assert "from step 20: the output's units added: 12 units" in inspect_state(saved)


@pytest.mark.parametrize("mode", ["bestfit", "documents", "windowed"])
def test_units_added_on_resume_join_the_rest_of_the_epoch_and_every_token_once(growing, mode):
    path, add_a_file = growing
    knobs = {"mode": "documents"} if mode == "documents" else {"block_documents": 1}
    if mode == "windowed":  # the added units' shards: windows after the epoch's own
        knobs.update(shuffle="windowed", window_blocks=2, lanes=1)
    whole, _, _ = serve_epochs(path, 2, None, 10**6, **knobs)  # (blocks of ~170 documents)
    first, state, _ = serve_epochs(path, 2, None, 20, **knobs)
    before = TokenDataset(path).num_documents
    add_a_file()
    rest, at_epoch_end, loader = serve_epochs(path, 3, state, 10**6, **knobs)
    record = at_epoch_end["units_added"][0]
    assert (record["step"], record["epoch"], record["joins"]) == (20, 1, True)
    assert at_epoch_end["epoch"] == 1
    # the steps before the join are the run's as it was; those after hold the added
    # documents shuffled in among the rest (not appended after it)
    assert all(np.array_equal(first[step], whole[step]) for step in first)
    epoch_0 = {**first, **rest}
    traced = {step: list(trace_step(path, step, at_epoch_end)) for step in epoch_0}
    joined = [step for step, records in traced.items()
              if any(record.document >= before for record in records)]
    old = [step for step, records in traced.items()
           if any(record.document < before for record in records)]
    assert min(joined) >= 20
    if mode == "windowed":
        assert max(old) <= min(joined) + 1
    else:
        assert max(old) > min(joined) + len(rest) // 4
    # trace of the history names the rows served, token for token
    starts = np.concatenate([[0], np.cumsum(loader.dataset.document_lengths())])
    tokens = np.concatenate(list(loader.dataset.iter_documents()))
    for step in (19, 20, 21, max(epoch_0)):
        rows = epoch_0[step]
        world = 2 if step < 20 else 3  # trace names the ranks of the world that took it
        for piece in traced[step]:
            first_token = int(starts[piece.document])
            assert piece.rank < world
            row = rows[piece.rank * (ROWS // world) + piece.row]
            assert row[piece.col_start:piece.col_end].tolist() == tokens[
                first_token + piece.token_start:first_token + piece.token_end].tolist(), step
    # every token of every document, old and added, is trained once in epoch 0 (documents
    # mode: a row holds a document's first T + 1 tokens), but the drop-last tail
    lengths = loader.dataset.document_lengths()
    covered = np.zeros(lengths.size, dtype=np.int64)
    for records in traced.values():
        for record in records:
            covered[record.document] += record.token_end - record.token_start
    capacity = lengths if mode != "documents" else np.minimum(lengths, SEQ_LEN + 1)
    assert (covered <= capacity).all()
    tail_tokens = loader.dropped_tail[2]
    assert int(capacity.sum() - covered.sum()) == tail_tokens
    assert (covered[before:] > 0).sum() > 0.8 * (lengths.size - before)


def test_a_mixture_source_s_added_units_join_its_epoch_and_every_token_once(growing,
                                                                           token_dataset):
    """A mixture source whose output gained units on resume takes them into the rest of its
    epoch (the other source unchanged); by the end of that epoch, every token of every
    document of the grown source was served once, as trace of the resumed state names."""
    from raypipe import trace

    path, add_a_file = growing
    paths = {"grow": str(path), "web": str(token_dataset)}
    before = TokenDataset(path).num_documents
    first, state = serve_mixture(paths, 2, None, 10)
    served_before = list(trace(paths, steps=10, world_size=2, seq_len=SEQ_LEN,
                               batch_size=ROWS // 2, seed=3, block_documents=64))
    add_a_file()
    loaders = [MixtureLoader(paths, SEQ_LEN, ROWS // 3, rank=rank, world_size=3, seed=3,
                             block_documents=64) for rank in range(3)]
    for loader in loaders:
        loader.load_state_dict(state)
    resumed = loaders[0].state_dict()
    record = resumed["units_added"]["grow"][0]
    assert (record["step"], record["joins"], record["documents"]) == (10, True, before + 200)
    assert "web" not in resumed["units_added"]
    taken, steps = {}, 0
    iterators = [iter(loader) for loader in loaders]
    while True:
        batches = [next(iterator) for iterator in iterators]
        taken[batches[0].step] = np.concatenate([torch.cat(
            [batch.inputs, batch.targets[:, -1:]], 1).numpy() for batch in batches])
        steps += 1
        if batches[0].mixture_state["grow"].epoch >= 1:
            break
    grown = loaders[0].sources[loaders[0].names.index("grow")].dataset
    lengths = grown.document_lengths()
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate(list(grown.iter_documents()))
    covered = np.zeros(lengths.size, dtype=np.int64)
    pieces = [*served_before,
              *trace(paths, state=resumed, steps=steps, world_size=3, batch_size=ROWS // 3,
                     seed=3, block_documents=64)]
    for piece in pieces:
        if piece.source != "grow" or piece.epoch != 0:
            continue
        covered[piece.document] += piece.token_end - piece.token_start
        if piece.step >= 10:  # the resumed steps' rows, token for token
            row = taken[piece.step][piece.rank * (ROWS // 3) + piece.row]
            first_token = int(starts[piece.document])
            assert row[piece.col_start:piece.col_end].tolist() == tokens[
                first_token + piece.token_start:first_token + piece.token_end].tolist()
    assert np.array_equal(covered, lengths)  # a mixture drops no tail
    assert (covered[before:] > 0).all()


def test_units_joining_a_mixture_source_that_served_no_row_since_a_join_join_its_epoch(
        tmp_path, corpus_texts, tokenizer_path, token_dataset):
    """Units that join a mixture source standing at the start of the phase an earlier join
    began (a light source can take no row in a step) join the rest of its epoch too: its
    epoch is under way, so they are not served from its start again; every token of its
    first epoch is served once, as trace of each resumed state names the rows served."""
    from raypipe import trace

    corpus, output = tmp_path / "corpus", tmp_path / "tokens"
    write_parquet(corpus / "part-0.parquet", corpus_texts[0:600:3], row_group_rows=50)
    tokenize(corpus, output, tokenizer_path)
    paths = {"grow": str(output), "web": str(token_dataset)}
    weights = {"grow": 0.1, "web": 0.9}
    options = {"weights": weights, "seed": 3, "block_documents": 64}  # serve_mixture's
    light = next(batch.step for batch in MixtureLoader(paths, SEQ_LEN, ROWS, **options)
                 if batch.step >= 5 and not (batch.source_ids == 0).any())  # grow: none
    taken, state = serve_mixture(paths, 1, None, light, weights=weights)
    resumed = [(0, None)]  # (first step, the state trace replays it from)
    for index in (1, 2):  # two files added, each joining on a resume
        write_parquet(corpus / f"part-{index}.parquet", corpus_texts[index:600:3],
                      row_group_rows=50)
        tokenize(corpus, output, tokenizer_path)
        loader = MixtureLoader(paths, SEQ_LEN, ROWS, **options)
        loader.load_state_dict(state)
        resumed.append((loader.run.steps, loader.state_dict()))
        for batch in loader:
            taken[batch.step] = torch.cat([batch.inputs, batch.targets[:, -1:]], 1).numpy()
            where = batch.mixture_state["grow"]
            if index == 1 and where.position == 0 and len(where.phases or ()) > 1:
                break  # at the start of the join's phase, no row served since
            if where.epoch >= 1:
                break
        else:
            raise AssertionError("unreachable: a loader serves without end")
        state = loader.state_dict()
    joins = state["units_added"]["grow"]
    assert [record["joins"] for record in joins] == [True, True]
    assert joins[1]["step"] == resumed[2][0] and joins[1]["epoch"] == 1
    grown = loader.sources[loader.names.index("grow")].dataset
    lengths = grown.document_lengths()
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate(list(grown.iter_documents()))
    covered = np.zeros(lengths.size, dtype=np.int64)
    for piece in trace(paths, 0, steps=max(taken) + 1, history=state):
        if piece.source != "grow" or piece.epoch != 0:
            continue
        row = taken[piece.step][piece.row]
        at = int(starts[piece.document])
        assert row[piece.col_start:piece.col_end].tolist() == tokens[
            at + piece.token_start:at + piece.token_end].tolist(), piece.step
        covered[piece.document] += piece.token_end - piece.token_start
    assert np.array_equal(covered, lengths)  # every token once (a mixture drops no tail)


def trace_step(path, step, history):
    from raypipe import trace

    return trace(str(path), step, history=history)


def test_trace_history_replays_a_run_across_units_added(growing):
    from raypipe import trace

    path, add_a_file = growing
    _, state, _ = serve_epochs(path, 2, None, 20)
    add_a_file()
    epoch_0, end, loader = serve_epochs(path, 2, state, 10**6)
    epoch_1, final, _ = serve_epochs(path, 2, end, 4)
    starts = np.concatenate([[0], np.cumsum(loader.dataset.document_lengths())])
    tokens = np.concatenate(list(loader.dataset.iter_documents()))
    for step in (21, max(epoch_0), min(epoch_1), min(epoch_1) + 3):
        rows = {**epoch_0, **epoch_1}[step]
        for piece in trace(str(path), step, history=final):
            first = int(starts[piece.document])
            row = rows[piece.rank * (ROWS // 2) + piece.row]
            assert row[piece.col_start:piece.col_end].tolist() == tokens[
                first + piece.token_start:first + piece.token_end].tolist(), step


def test_a_unit_the_run_held_that_the_output_lost_is_refused_naming_it(growing, tmp_path):
    from raypipe.io.manifest import read_manifest, write_manifest

    path, add_a_file = growing
    _, state, _ = serve_epochs(path, 2, None, 3)
    add_a_file()
    manifest = read_manifest(path)
    gone = manifest.units[0].name
    lost = dataclasses.replace(manifest, units=manifest.units[1:])
    write_manifest(path, lost)
    with pytest.raises(StateError, match=f"unit {gone}: the run's data held this unit"):
        serve_epochs(path, 2, state, 1)


def test_a_mode_or_a_split_that_cannot_serve_units_added_refuses_them(growing):
    path, add_a_file = growing
    _, windows, _ = serve_epochs(path, 1, None, 2, mode="windows")
    _, split, _ = serve_epochs(path, 1, None, 2, split="train", validation_fraction=0.2)
    add_a_file()
    with pytest.raises(StateError, match="gained units since the checkpoint, and mode "
                       "'windows' cannot serve them"):
        serve_epochs(path, 1, windows, 1, mode="windows")
    with pytest.raises(StateError, match="split 'train' draws its documents by the data's"):
        serve_epochs(path, 1, split, 1, split="train", validation_fraction=0.2)


def test_a_unit_rewritten_since_the_checkpoint_is_refused_naming_it(tmp_path, corpus_texts,
                                                                    tokenizer_path):
    corpus = tmp_path / "corpus"
    for index in range(2):
        write_parquet(corpus / f"part-{index}.parquet", corpus_texts[index:400:2],
                      row_group_rows=400)
    path = tokenize(corpus, tmp_path / "tokens", tokenizer_path)
    _, state, _ = serve_epochs(path, 2, None, 3)
    write_parquet(corpus / "part-1.parquet", [text.upper() for text in corpus_texts[1:400:2]],
                  row_group_rows=400)  # the same rows, other text: its unit is rewritten
    tokenize(corpus, path, tokenizer_path)
    rewritten = next(unit.name for unit in TokenDataset(path).manifest.units
                     if unit.name.startswith("part-1"))
    with pytest.raises(StateError, match=f"unit {rewritten} of the run's data was rewritten "
                       "since the checkpoint"):
        serve_epochs(path, 2, state, 1)


def test_trace_history_replays_a_mixture_across_sources_weights_worlds_and_exclusions(
        tmp_path, capsys):
    """A mixture run on 2 ranks (sources a, b), resumed on 3 with b dropped, c added, new
    weights and documents of a excluded, then on 1 with other weights and documents of the
    added c excluded: `trace --history`
    of the final state alone names, for every step of all three legs and every rank, the
    tokens each row held (the datasets' tokens are numbered, so a piece's tokens are its
    ids), and no other; the CLI prints the same pieces, and inspect lists the legs."""
    from raypipe import trace
    from raypipe.cli import main

    firsts = {"a": 1, "b": 1_000_000, "c": 2_000_000}
    paths = {name: str(numbered_dataset(tmp_path / name, 20_000, first=first,
                                        seed=first % 97)[0])
             for name, first in firsts.items()}
    starts = {name: document_starts(paths[name]) - 1 + first
              for name, first in firsts.items()}
    legs = [({"a": paths["a"], "b": paths["b"]}, 2, {"a": 0.5, "b": 0.5}, {}),
            ({"a": paths["a"], "c": paths["c"]}, 3, {"a": 0.3, "c": 0.7},
             {"exclude": [{"source": "a", "document": d} for d in range(0, 400, 3)]}),
            ({"a": paths["a"], "c": paths["c"]}, 1, {"a": 0.6, "c": 0.4},
             {"exclude": [{"source": "c", "document": d} for d in range(0, 300, 2)]})]
    served, state = {}, None
    for sources, world, weights, options in legs:
        taken, state = serve_mixture(sources, world, state, 7, weights=weights, **options)
        served.update({step: (world, rows) for step, rows in taken.items()})
    assert [leg["step"] for leg in state["history"]] == [0, 7, 14]
    assert "b" in state["views"], "the dropped source's data record was not kept"
    pieces = list(trace(legs[-1][0], 0, steps=len(served), history=state))
    held: dict[tuple[int, int, int], list[int]] = {}
    for piece in pieces:
        first = int(starts[piece.source][piece.document])
        expected = list(range(first + piece.token_start, first + piece.token_end))
        world, rows = served[piece.step]
        row = rows[piece.rank * (ROWS // world) + piece.row]
        assert row[piece.col_start:piece.col_end].tolist() == expected, piece
        held.setdefault((piece.step, piece.rank, piece.row), []).extend(expected)
    for step, (world, rows) in served.items():
        for index, row in enumerate(rows):
            where = (step, index // (ROWS // world), index % (ROWS // world))
            assert sorted(held.get(where, [])) == sorted(row[row > 0].tolist()), where
    assert {piece.source for piece in pieces if piece.step < 7} == {"a", "b"}
    assert {piece.source for piece in pieces if piece.step >= 7} == {"a", "c"}
    with pytest.raises(ConfigError, match="last leg mixes sources"):
        list(trace({"a": paths["a"], "b": paths["b"]}, 0, history=state))
    saved, mixture = tmp_path / "state.json", tmp_path / "mixture.yaml"
    saved.write_text(json.dumps(state))
    mixture.write_text(json.dumps({"sources": {name: {"path": path}
                                               for name, path in legs[-1][0].items()}}))
    assert main(["trace", str(mixture), "--history", str(saved), "--step", "8"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [piece.to_json() for piece in pieces if piece.step == 8]
    assert main(["inspect", str(saved)]) == 0
    report = capsys.readouterr().out
    assert "from step 7: a leg on 3 rank(s): sources ['a', 'c']" in report
    assert "from step 14: a leg on 1 rank(s)" in report


def test_trace_history_refuses_a_mixture_source_dropped_and_added_again_naming_it(tmp_path):
    """A source dropped and later added again begins afresh, and the state keeps the data
    records of its last stretch only: trace --history refuses, naming the source and the
    steps, instead of replaying its first stretch with the second's data."""
    from raypipe import trace

    a = str(numbered_dataset(tmp_path / "a", 20_000)[0])
    b = str(numbered_dataset(tmp_path / "b", 20_000, first=1_000_000, seed=8)[0])
    _, state = serve_mixture({"a": a, "b": b}, 2, None, 3)
    _, state = serve_mixture({"a": a}, 2, state, 3)
    _, state = serve_mixture({"a": a, "b": b}, 2, state, 3)
    with pytest.raises(ConfigError, match="source 'b' was dropped at step 3 and added again "
                                          "at step 6"):
        list(trace({"a": a, "b": b}, 0, history=state))


def test_a_state_of_another_dataset_is_refused_as_such_naming_both(
        numbered, token_dataset):
    """A state made on one output, loaded on another: one line that says it is another
    dataset's state and names both fingerprints (not "does not keep the unit order")."""
    path, _ = numbered
    other = TokenLoader(str(token_dataset), 32, 4, seed=1)
    next(iter(other))
    state = other.state_dict()
    loader = TokenLoader(str(path), 32, 4, seed=1)
    with pytest.raises(StateError) as refused:
        loader.load_state_dict(state)
    message = str(refused.value)
    assert "the state is another dataset's" in message and "\n" not in message
    assert state["dataset"] in message and loader.dataset.fingerprint in message
