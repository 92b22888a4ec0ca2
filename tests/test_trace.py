"""`raypipe trace`: every piece it names, tokenized again from its input file and row, is what
the loader's batch holds at its columns; and, through trace, every target the loader trains
(mask 1) is true in every mode. No Ray."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

from raypipe.loader import MixtureLoader, TokenLoader
from raypipe.tools.trace import trace
from tests.helpers import corpus_with_gaps, tokenize

T, B = 96, 3


@pytest.fixture(scope="module")
def gapped(tmp_path_factory, corpus_texts, tokenizer_path):
    root = tmp_path_factory.mktemp("trace")
    corpus = corpus_with_gaps(root / "corpus", corpus_texts[:500])
    return tokenize(corpus, root / "tokens", tokenizer_path)


@pytest.fixture(scope="module")
def second(tmp_path_factory, corpus_texts, tokenizer_path):
    root = tmp_path_factory.mktemp("trace2")
    corpus = corpus_with_gaps(root / "corpus", corpus_texts[500:800])
    return tokenize(corpus, root / "tokens", tokenizer_path)


def source_tokens(record, tokenizer: Tokenizer) -> list[int]:
    """The record's document tokenized again from its input file and row."""
    text = pq.read_table(record.input, columns=["text"]).column(0)[record.input_row].as_py()
    bos = tokenizer.token_to_id("<|bos|>")
    return [bos, *tokenizer.encode(text, add_special_tokens=False).ids]


def row_tokens(batch, row: int) -> list[int]:
    return torch.cat([batch.inputs[row], batch.targets[row, -1:]]).tolist()


def assert_records_hold_the_batch(records, batch, tokenizer):
    assert records
    for record in records:
        document = source_tokens(record, tokenizer)
        expected = document[record.token_start:record.token_end]
        held = row_tokens(batch, record.row)[record.col_start:record.col_end]
        assert held == expected, record


def test_trace_of_a_bestfit_step_on_two_ranks_names_the_source_rows_of_every_piece(
        gapped, tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    step, rank = 5, 1
    loader = TokenLoader(gapped, T, B, mode="bestfit", seed=3, rank=rank, world_size=2)
    batch = next(b for index, b in enumerate(loader) if index == step)
    records = list(trace(gapped, step, rank=rank, world_size=2, seq_len=T, batch_size=B,
                         mode="bestfit", seed=3))
    assert {r.step for r in records} == {step} and {r.rank for r in records} == {rank}
    assert sorted({r.row for r in records}) == list(range(B))
    assert any(r.input_row != r.document for r in records)  # skipped rows shift inputs
    assert any(r.token_start > 0 for r in records)  # and some pieces are cut documents
    assert_records_hold_the_batch(records, batch, tokenizer)


@pytest.mark.parametrize("mode, knobs", [("windows", {}), ("documents", {}),
                                         ("bestfit", {"packing": "split"}),
                                         ("bestfit", {"packing": "crop"}),
                                         ("bestfit", {"shuffle": "windowed", "lanes": 2,
                                                      "window_blocks": 1}),
                                         ("documents", {"shuffle": "windowed", "lanes": 3})])
def test_trace_names_the_source_rows_of_every_mode(gapped, tokenizer_path, mode, knobs):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    loader = TokenLoader(gapped, T, B, mode=mode, seed=1, **knobs)
    for step, batch in enumerate(loader):
        if step in (0, 7):
            records = list(trace(gapped, step, seq_len=T, batch_size=B, mode=mode, seed=1,
                                 **knobs))
            assert_records_hold_the_batch(records, batch, tokenizer)
        if step == 7:
            break


def kept(loader, steps: int) -> list[SimpleNamespace]:
    """The first `steps` batches' inputs and targets, copied out of the loader's ring."""
    return [SimpleNamespace(inputs=batch.inputs.clone(), targets=batch.targets.clone())
            for batch in itertools.islice(loader, steps)]


def test_trace_names_the_rank_a_balanced_row_went_to(gapped, tokenizer_path):
    """Under balance="attention" a row goes to the rank its cost picks, not the plan
    order's; trace, from the knobs alone, names that rank and row."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    world, knobs = 3, {"mode": "bestfit", "seed": 2, "balance": "attention",
                       "balance_hidden": 1}
    served = [kept(TokenLoader(gapped, T, B, rank=rank, world_size=world, **knobs), 6)
              for rank in range(world)]
    plain = [kept(TokenLoader(gapped, T, B, rank=rank, world_size=world, mode="bestfit",
                              seed=2), 6) for rank in range(world)]
    moved = [(step, rank) for step in range(6) for rank in range(world)
             if not torch.equal(served[rank][step].inputs, plain[rank][step].inputs)]
    assert moved, "balance moved no row in 6 steps: the test would not tell"
    for step, rank in moved[:3]:
        records = list(trace(gapped, step, rank=rank, world_size=world, seq_len=T,
                             batch_size=B, **knobs))
        assert {r.rank for r in records} == {rank}
        assert_records_hold_the_batch(records, served[rank][step], tokenizer)


@pytest.mark.parametrize("knobs", [{}, {"shuffle": "windowed", "window_blocks": 1}],
                         ids=["global", "windowed"])
def test_trace_from_a_saved_state_covers_the_steps_after_it(gapped, tokenizer_path,
                                                            tmp_path, knobs):
    """The state holds the shuffle (a windowed one: its lanes, 2 here, those of the world
    size it started at), so trace needs no knob."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    loader = TokenLoader(gapped, T, B, seed=4, rank=0, world_size=2, **knobs)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(loader.state_dict()))
    following = [next(batches) for _ in range(2)]
    records = list(trace(gapped, state=state, steps=2, rank=0))
    assert sorted({r.step for r in records}) == [3, 4]
    for number, batch in zip((3, 4), following, strict=True):
        assert_records_hold_the_batch([r for r in records if r.step == number], batch,
                                      tokenizer)
    # a step with the state: that many steps after it (the state's position plus steps)
    later = list(trace(gapped, 1, state=state, rank=0))
    assert {r.step for r in later} == {4}
    assert_records_hold_the_batch(later, following[1], tokenizer)


def test_trace_refuses_a_state_from_a_release_that_cut_rows_otherwise(gapped):
    from raypipe.errors import StateError

    loader = TokenLoader(gapped, T, B, seed=4)
    next(iter(loader))
    state = loader.state_dict()
    del state["knobs"]["pieces"]  # as 0.4 saved it: its rows were cut by another rule
    with pytest.raises(StateError, match="another release"):
        list(trace(gapped, state=state))


def test_trace_reads_a_state_from_before_a_knob_existed_at_that_knobs_old_value(
        gapped, tokenizer_path):
    """A crop state as 0.1 saved it (no `packing`, `pieces`, `shuffle` knobs) traces the
    rows the crop loader serves next."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    loader = TokenLoader(gapped, T, B, seed=4, packing="crop")
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    assert {"packing", "pieces", "shuffle"}.isdisjoint(state["knobs"])  # left out at crop
    served = next(batches)
    batches.close()
    assert_records_hold_the_batch(list(trace(gapped, state=state)), served, tokenizer)


def test_trace_of_a_mixture_from_its_saved_state(gapped, second, tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    paths = {"a": str(gapped), "b": str(second)}
    loader = MixtureLoader(paths, T, B, weights={"a": 0.4, "b": 0.6}, seed=2, rank=0,
                           world_size=2)
    batches = iter(loader)
    for _ in range(4):
        next(batches)
    state = loader.state_dict()
    following = [next(batches) for _ in range(2)]
    records = list(trace(paths, state=state, steps=2, rank=0, world_size=2, batch_size=B))
    assert sorted({r.step for r in records}) == [4, 5]
    for number, batch in zip((4, 5), following, strict=True):
        assert_records_hold_the_batch([r for r in records if r.step == number], batch,
                                      tokenizer)
    later = list(trace(paths, 1, state=state, rank=0, world_size=2, batch_size=B))
    assert {r.step for r in later} == {5}
    assert_records_hold_the_batch(later, following[1], tokenizer)


def test_trace_of_a_mixture_step_names_each_row_source_and_input(gapped, second,
                                                                  tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    paths = {"a": str(gapped), "b": str(second)}
    weights = {"a": 0.7, "b": 0.3}
    loader = MixtureLoader(paths, T, B, weights=weights, seed=2, rank=1, world_size=2)
    step = 6
    batch = next(b for index, b in enumerate(loader) if index == step)
    records = list(trace(paths, step, rank=1, world_size=2, seq_len=T, batch_size=B, seed=2,
                         weights=weights))
    names = dict(zip(sorted(paths), range(2), strict=True))
    for record in records:
        assert batch.source_ids[record.row] == names[record.source]
    assert {r.source for r in records} == {"a", "b"}
    assert_records_hold_the_batch(records, batch, tokenizer)


def test_trace_of_llmbatch_records_names_the_documents_they_were_packed_from(
        tmp_path, corpus_texts, tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    corpus = corpus_with_gaps(tmp_path / "corpus", corpus_texts[:300])
    out = tokenize(corpus, tmp_path / "tokens", tokenizer_path,
                   formats=["megatron", "llmbatch"], seq_len=T + 1, batch_size=B)
    loader = TokenLoader(out, mode="batches", seed=5)
    for step, batch in enumerate(loader):
        if step in (0, 4):
            records = list(trace(out, step, mode="batches", seed=5))
            assert_records_hold_the_batch(records, batch, tokenizer)
        if step == 4:
            break


def test_trace_of_a_jsonl_input_names_its_line(tmp_path, corpus_texts, tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    lines = []
    for index, text in enumerate(corpus_texts[:200]):
        lines.append(json.dumps({"text": text}))
        if index % 5 == 0:
            lines.append("")  # a blank line: a row that makes no document
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = tokenize(tmp_path / "c" / "a.jsonl", tmp_path / "tokens", tokenizer_path)
    loader = TokenLoader(out, T, B, seed=7)
    batch = next(iter(loader))
    bos = tokenizer.token_to_id("<|bos|>")
    for record in trace(out, 0, seq_len=T, batch_size=B, seed=7):
        text = json.loads(lines[record.input_row])["text"]
        document = [bos, *tokenizer.encode(text, add_special_tokens=False).ids]
        held = row_tokens(batch, record.row)[record.col_start:record.col_end]
        assert held == document[record.token_start:record.token_end]


def test_trace_text_decodes_each_piece(gapped, tokenizer_path):
    records = list(trace(gapped, 0, rank=0, seq_len=T, batch_size=B, text=True))
    tokenizer = Tokenizer.from_file(tokenizer_path)
    for record in records[:5]:
        tokens = source_tokens(record, tokenizer)[record.token_start:record.token_end]
        assert record.text == tokenizer.decode(tokens, skip_special_tokens=False)


def test_cli_trace_prints_one_json_line_per_piece(gapped, capsys):
    from raypipe.cli import main

    assert main(["trace", str(gapped), "--step", "2", "--rank", "0", "--world-size", "2",
                 "--seq-len", str(T), "--batch-size", str(B)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines
    keys = ["step", "rank", "row", "col_start", "col_end", "source", "document", "input",
            "input_row", "token_start", "token_end"]
    for line in lines:
        record = json.loads(line)
        assert all(key in record for key in keys) and record["step"] == 2
    expected = [r.to_json() for r in trace(gapped, 2, rank=0, world_size=2, seq_len=T,
                                           batch_size=B)]
    assert [json.loads(line) for line in lines] == expected


def held_targets_are_true(batch, records, seq_len: int) -> tuple[int, int]:
    """Every target with mask 1 stays inside one piece or crosses a true join (the piece
    before ends its document, the next starts its own); the sequences the batch lists
    (cu_seqlens) start exactly at the pieces and the padding. Returns (targets checked,
    joins masked)."""
    by_row: dict[int, list] = {}
    for record in records:
        by_row.setdefault(record.row, []).append(record)
    starts = set(batch.cu_seqlens[:-1].tolist())
    mask = batch.mask.numpy()
    checked = masked = 0
    for row, pieces in by_row.items():
        pieces.sort(key=lambda record: record.col_start)
        expected_starts = {row * seq_len + piece.col_start for piece in pieces
                           if piece.col_start < seq_len}
        end = pieces[-1].col_end
        if end < seq_len:
            expected_starts.add(row * seq_len + end)  # padding: a sequence of its own
        assert {s for s in starts if row * seq_len <= s < (row + 1) * seq_len} == \
            expected_starts
        for before, after in zip(pieces, pieces[1:], strict=False):
            join = after.col_start - 1  # the target that predicts `after`'s first token
            true = before.token_end == document_length(before) and after.token_start == 0
            if mask[row, join]:
                assert true, (before, after)
                checked += 1
            else:
                masked += 1
    return checked, masked


_LENGTHS: dict[str, np.ndarray] = {}


def document_length(record) -> int:
    return int(_LENGTHS[record.source or ""][record.document])


@pytest.mark.parametrize("mode, knobs", [("bestfit", {"packing": "fill"}),
                                         ("bestfit", {"packing": "split"}),
                                         ("bestfit", {"packing": "crop"}),
                                         ("windows", {"boundaries": True}),
                                         ("documents", {})])
def test_no_target_with_mask_1_crosses_into_another_document_over_an_epoch(
        gapped, mode, knobs):
    from raypipe.dataset import TokenDataset

    _LENGTHS[""] = TokenDataset(gapped).document_lengths()
    loader = TokenLoader(gapped, T, B, mode=mode, seed=8, **knobs)
    steps = loader.steps_in_epoch()
    plan_knobs = {k: v for k, v in knobs.items() if k != "boundaries"}
    records = list(trace(gapped, 0, steps=steps, seq_len=T, batch_size=B, mode=mode, seed=8,
                         **plan_knobs))
    trained = 0
    for step, batch in enumerate(loader):
        trained += held_targets_are_true(batch, [r for r in records if r.step == step], T)[0]
    assert step == steps - 1
    assert trained > 0 or mode == "documents"  # true joins are trained


def test_no_llmbatch_target_with_mask_1_crosses_into_another_document(
        tmp_path, corpus_texts, tokenizer_path):
    from raypipe.dataset import TokenDataset

    corpus = corpus_with_gaps(tmp_path / "corpus", corpus_texts[:300])
    out = tokenize(corpus, tmp_path / "tokens", tokenizer_path,
                   formats=["megatron", "llmbatch"], seq_len=T + 1, batch_size=B)
    _LENGTHS[""] = TokenDataset(out).document_lengths()
    loader = TokenLoader(out, mode="batches", seed=5)
    records = list(trace(out, 0, steps=loader.steps_in_epoch(), mode="batches", seed=5))
    checked = np.zeros(2, dtype=np.int64)
    for step, batch in enumerate(loader):
        checked += held_targets_are_true(batch, [r for r in records if r.step == step], T)
    assert checked.all()  # true joins trained, false ones masked


def test_no_mixture_target_with_mask_1_crosses_into_another_document(gapped, second):
    from raypipe.dataset import TokenDataset

    paths = {"a": str(gapped), "b": str(second)}
    for name, path in paths.items():
        _LENGTHS[name] = TokenDataset(path).document_lengths()
    loader = MixtureLoader(paths, T, B, seed=6)
    steps = 40
    records = list(trace(paths, 0, steps=steps, seq_len=T, batch_size=B, seed=6))
    checked = np.zeros(2, dtype=np.int64)
    for step, batch in enumerate(loader):
        checked += held_targets_are_true(batch, [r for r in records if r.step == step], T)
        if step == steps - 1:
            break
    assert checked[0] > 0


@pytest.mark.parametrize("ramp", [False, True], ids=["constant", "ramped"])
def test_trace_of_a_state_at_another_world_size_splits_the_runs_global_batch(
        gapped, tokenizer_path, tmp_path, ramp):
    """A state saved at world size 2 (2B per rank: global 4B; or a ramp from 4 to 4B), traced
    with --world-size 4: each rank's rows are the global batch's quarter, the pieces a
    loader resumed at world size 4 serves, not the saving rank's B rows."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    schedule = {"batch_schedule": [(0, 4), (2, 4 * B)]} if ramp else {}
    loader = TokenLoader(gapped, T, None if ramp else 2 * B, seed=4, rank=0, world_size=2,
                         **schedule)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    resumed = TokenLoader(gapped, T, None if ramp else B, seed=4, rank=3, world_size=4,
                          **schedule)
    resumed.load_state_dict(state)
    batch = next(iter(resumed))
    records = list(trace(gapped, state=state, rank=3, world_size=4))
    assert sorted({r.row for r in records}) == list(range(B)) == list(range(len(batch.inputs)))
    assert_records_hold_the_batch(records, batch, tokenizer)


@pytest.mark.parametrize("knobs", [{}, {"shuffle": "windowed", "block_bytes": 4096,
                                         "window_blocks": 4}])
def test_trace_history_after_a_resize_names_each_steps_ranks_as_its_world_took_them(
        token_dataset, tmp_path, knobs):
    """A run of 2 ranks resumed on 3 (global batch 8, then 12), global or windowed over
    blocks: `trace --history` of the final state, with no world size or knob given,
    replays both legs and names each step's rows by the rank and row that served them."""
    def ranks(world, state=None):
        loaders = [TokenLoader(str(token_dataset), 16, 4, rank=rank, world_size=world,
                               seed=2, **knobs) for rank in range(world)]
        for loader in loaders:
            if state:
                loader.load_state_dict(state)
        return loaders

    served = {}

    def serve(loaders, steps):
        for _, batches in zip(range(steps), zip(*loaders, strict=True), strict=False):
            for rank, batch in enumerate(batches):
                served[(batch.step, rank)] = torch.cat(
                    [batch.inputs, batch.targets[:, -1:]], 1).numpy()
        return loaders[0].state_dict()

    state = serve(ranks(2), 5)
    state = serve(ranks(3, state), 4)
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    from raypipe.dataset import TokenDataset

    dataset = TokenDataset(str(token_dataset))
    starts = np.concatenate([[0], np.cumsum(dataset.document_lengths())])
    tokens = np.concatenate(list(dataset.iter_documents()))
    for step, world in ((1, 2), (4, 2), (5, 3), (8, 3)):
        pieces = list(trace(str(token_dataset), step, history=str(saved)))
        assert {piece.rank for piece in pieces} == set(range(world)), step
        for piece in pieces:
            row = served[(step, piece.rank)][piece.row]
            first = int(starts[piece.document])
            assert row[piece.col_start:piece.col_end].tolist() == tokens[
                first + piece.token_start:first + piece.token_end].tolist(), step
    from raypipe.cli import main

    assert main(["trace", str(token_dataset), "--history", str(saved), "--step", "6"]) == 0
