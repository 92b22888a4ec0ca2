"""seq_len that changes inside an epoch, declared (a schedule by step or by tokens) or on a
resume (raypipe.sampling.schedule.Phase, bestfit's ContinuedPlan): every token of every
document is trained once per epoch across any number of changes and world sizes, the
batches equal an uninterrupted run's, `raypipe trace` names what each step after a change
held, and a change a mode cannot honour is refused naming the field.

The dataset's tokens are their own identity (document tokens numbered 1..N, pad 0), so
counting a token's appearances in the batches checks the claim without the plans."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.errors import ConfigError, StateError
from raypipe.loader import TokenLoader
from raypipe.sampling.schedule import BatchSchedule, Phase, seq_len_stages_by_tokens
from tests.helpers import (
    assert_every_token_once,
    document_starts,
    lockstep,
    numbered_dataset,
)

TOKENS = 120_000
SHORT, LONG = 32, 128  # the 512 -> 2048, scaled to a test's corpus
RAMP = BatchSchedule.ramp(24, 96, 24, 4)  # 8 -> 32 rows, x3 so 1, 2 and 3 ranks divide it


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """A megatron dataset whose token k (k = 1..N over all documents) is the id k."""
    return numbered_dataset(tmp_path_factory.mktemp("numbered"), TOKENS)


def a_third_then_long(total: int) -> list[tuple[int, int]]:
    """seq_len SHORT for the first third of the epoch's tokens, LONG after it."""
    return seq_len_stages_by_tokens([(0, SHORT), (total // 3, LONG)], BatchSchedule.of(RAMP, 1))


def run(path, world, state, steps, **options):
    """{step: (seq_len, [rows of every rank, rank-major, each its T + 1 tokens])} for at most
    `steps` steps from `state`, the state after, and rank 0's loader."""
    if options.get("mode", "bestfit") == "bestfit":
        options = {"block_documents": 64, **options}  # blocks of ~150-570 documents
    loaders = [TokenLoader(str(path), rank=rank, world_size=world, seed=3,
                           batch_schedule=RAMP, **options) for rank in range(world)]
    taken, state = lockstep(loaders, state, steps)
    return taken, state, loaders[0]


def assert_same_steps(resumed, whole):
    assert sorted(resumed) == sorted(whole) == list(range(len(whole)))
    for step, (seq_len, rows) in whole.items():
        assert resumed[step][0] == seq_len, step
        assert sorted(map(tuple, resumed[step][1])) == sorted(map(tuple, rows)), step


def test_seq_len_by_tokens_becomes_the_step_where_that_many_were_trained():
    stages = seq_len_stages_by_tokens([(0, 32), (10_000, 128)], BatchSchedule.of(RAMP, 1))
    # 4 steps x 24 x 32 = 3072, 4 x 48 x 32 = 6144 (9216), then 72 x 32 = 2304 a step
    assert stages == [(0, 32), (9, 128)]


def test_a_declared_long_context_phase_after_a_ramp_trains_every_token_once_across_world_sizes(
        numbered):
    path, total = numbered
    schedule = a_third_then_long(total)
    whole, _, loader = run(path, 2, None, 10**6, seq_len_schedule=schedule)
    _, tail_rows, tail_tokens = loader.dropped_tail
    assert tail_rows < 96
    assert_every_token_once(whole, total, tail_tokens)
    change = schedule[1][0]
    assert {whole[step][0] for step in whole if step < change} == {SHORT}
    assert {whole[step][0] for step in whole if step >= change} == {LONG}
    assert {len(whole[step][1]) for step in whole if step >= 12} == {96}
    first, state, _ = run(path, 2, None, 10, seq_len_schedule=schedule)
    second, state, _ = run(path, 3, state, change + 3 - 10, seq_len_schedule=schedule)
    assert state["phases"] == [[SHORT, 0], [LONG, state["phases"][1][1]]]
    third, state, _ = run(path, 1, state, 10**6, seq_len_schedule=schedule)
    assert_same_steps({**first, **second, **third}, whole)
    assert state["epoch"] == 1 and state["phases"] is None
    # each row: [first step, global batch, seq_len, the world size that took it]
    assert [change, 96, LONG, 3] in state["history"]
    assert [row[3] for row in state["history"]] == sorted(
        (row[3] for row in state["history"]), key=[2, 3, 1].index)


@pytest.mark.parametrize("knobs", [{"packing": "fill"}, {"packing": "split"},
                                   {"shuffle": "shard_local", "group_shards": 1}])
def test_a_seq_len_change_on_resume_trains_no_token_twice_and_skips_none(numbered, knobs):
    path, total = numbered
    first, state, _ = run(path, 2, None, 9, seq_len=SHORT, **knobs)
    second, state, _ = run(path, 3, state, 5, seq_len=LONG, **knobs)  # not declared
    assert state["phases"][0][0] == SHORT and state["phases"][-1][0] == LONG
    third, state, loader = run(path, 1, state, 10**6, seq_len=LONG // 2,  # and another
                               **knobs)
    assert len(json.loads(json.dumps(state))["history"]) >= 5
    taken = {**first, **second, **third}
    assert sorted(taken) == list(range(len(taken)))
    assert [taken[step][0] for step in (8, 9, 13, 14)] == [SHORT, LONG, LONG, LONG // 2]
    assert_every_token_once(taken, total, loader.dropped_tail[2])
    # the same changes declared: the same batches
    declared, _, _ = run(path, 2, None, 10**6, **knobs,
                         seq_len_schedule=[(0, SHORT), (9, LONG), (14, LONG // 2)])
    assert_same_steps(taken, declared)


def test_trace_after_each_change_names_the_tokens_the_batch_held(numbered):
    from raypipe import trace

    path, total = numbered
    schedule = a_third_then_long(total)
    wanted = {schedule[1][0] - 1, schedule[1][0], schedule[1][0] + 2}
    taken, state, _ = run(path, 2, None, max(wanted) + 1, seq_len_schedule=schedule)
    for step in sorted(wanted):
        records = list(trace(str(path), step, world_size=2, seed=3, batch_schedule=RAMP,
                             seq_len_schedule=schedule, block_documents=64))
        seq_len, rows = taken[step]
        assert_records_are_the_rows(records, rows, seq_len, document_starts(path))
        from_history = list(trace(str(path), step, history=state))
        assert [r.line() for r in from_history] == [r.line() for r in records]
    after_state = list(trace(str(path), state=state))  # the step after it, in its phase
    assert {r.step for r in after_state} == {max(wanted) + 1}
    assert [r.line() for r in after_state] == [
        r.line() for r in trace(str(path), max(wanted) + 1, history=state)]


def assert_records_are_the_rows(records, rows, seq_len, starts):
    """Each traced piece's tokens (the document's token range, as token ids) are the batch
    row's tokens at its columns, and every row of the step is traced."""
    per_rank = len(rows) // 2
    seen = set()
    for record in records:
        row = rows[record.rank * per_rank + record.row]
        first = int(starts[record.document])
        assert record.col_end <= seq_len + 1
        assert row[record.col_start:record.col_end].tolist() == list(
            range(first + record.token_start, first + record.token_end))
        seen.add((record.rank, record.row))
    assert len(seen) == len(rows)


def test_a_mode_that_cannot_re_plan_refuses_the_change_naming_seq_len(numbered):
    path, _ = numbered
    _, state, _ = run(path, 1, None, 2, seq_len=SHORT, mode="windows")
    with pytest.raises(StateError, match=f"seq_len: {SHORT} -> {LONG} inside epoch 0"):
        TokenLoader(str(path), LONG, rank=0, world_size=1, seed=3, mode="windows",
                    batch_schedule=RAMP).load_state_dict(state)
    with pytest.raises(ConfigError, match="seq_len_schedule: mode 'windows' cannot"):
        TokenLoader(str(path), mode="windows", batch_size=4,
                    seq_len_schedule=[(0, SHORT), (5, LONG)])
    with pytest.raises(StateError, match="seed: saved 3, now 4"):
        TokenLoader(str(path), SHORT, rank=0, world_size=1, seed=4, block_documents=64,
                    batch_schedule=RAMP).load_state_dict(run(path, 1, None, 2,
                                                             seq_len=SHORT)[1])


def test_trace_s_command_line_follows_a_run_s_history(numbered, tmp_path, capsys):
    from raypipe import trace
    from raypipe.cli import main

    path, _ = numbered
    _, state, _ = run(path, 2, None, 9, seq_len=SHORT)
    _, state, _ = run(path, 2, state, 3, seq_len=LONG)  # a change on resume at step 9
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    assert main(["trace", str(path), "--step", "10", "--history", str(saved)]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = [record.line() for record in trace(
        str(path), 10, world_size=2, seed=3, block_documents=64, batch_schedule=RAMP,
        seq_len_schedule=[(0, SHORT), (9, LONG)])]
    assert lines == expected and max(json.loads(line)["col_end"] for line in lines) > SHORT


def test_a_plan_from_a_block_boundary_slices_the_whole_epoch_s_block_sums():
    """The rest of an epoch whose block size held across the change reuses the epoch's
    block sums; both routes (slice, and a pass over the lengths) agree, and so do their
    rows."""
    from raypipe.sampling.modes.bestfit import BestFitPlan

    lengths = np.random.default_rng(1).integers(2, 300, 5000)
    whole = BestFitPlan(lengths, 64, 1, 0, block_documents=200)
    per_block = whole.block_documents
    tail = BestFitPlan(lengths, 64, 1, 0, block_documents=200, first_document=3 * per_block)
    assert np.array_equal(tail.kept_block_sums(), whole.kept_block_sums()[3:])
    assert np.array_equal(tail.kept_block_sums(), tail.block_token_sums())
    assert tail.size == whole.size - whole.row_offsets[3]
    for block in (0, 1, tail.num_blocks - 1):
        assert np.array_equal(tail.pack(block).doc_ids, whole.pack(block + 3).doc_ids)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=300),
       shapes=st.lists(st.integers(4, 160), min_size=2, max_size=4),
       cuts=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3),
       packing=st.sampled_from(["fill", "split", "crop"]), seed=st.integers(0, 5))
def test_any_chain_of_seq_len_changes_serves_each_token_at_most_once_and_fill_split_all(
        lengths, shapes, cuts, packing, seed):
    """Serve a plan to a position, continue at another seq_len, again: the served pieces
    cover every token exactly once (fill, split), at most once (crop, which crops)."""
    from raypipe.sampling.modes.bestfit import BestFitPlan, ContinuedPlan

    lengths = np.array(lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    counts = np.zeros(int(lengths.sum()), dtype=np.int64)

    def plan_at(seq_len, first=0):
        return BestFitPlan(lengths, seq_len, seed, 0, block_documents=8, packing=packing,
                           first_document=first)

    def serve(plan, stop):
        for _, row in (plan.rows(np.arange(stop, dtype=np.int64)) if stop else []):
            for document, start, take in zip(row.documents, row.starts, row.take,
                                             strict=True):
                counts[offsets[document] + start:offsets[document] + start + take] += 1

    plan = plan_at(shapes[0])
    for seq_len, cut in zip(shapes[1:], cuts, strict=False):
        position = int(cut * plan.size)
        serve(plan, position)
        remainder = plan.remaining(position)
        plan = ContinuedPlan(remainder, plan_at(seq_len, remainder.first(lengths.size)))
        assert all(row.length <= seq_len + 1 for _, row in plan.rows(np.arange(plan.size)))
    serve(plan, plan.size)
    assert counts.max() <= 1
    if packing != "crop":
        assert counts.min() == 1


def test_trace_of_steps_around_a_change_names_source_rows_that_tokenize_to_the_batch(
        token_dataset, tokenizer_path):
    """On a tokenized corpus: a seq_len change at step 6, then one made on resume at step 9;
    every piece `raypipe trace` names for steps 5, 6, 9 and 10 (from the run's history),
    its source row tokenized again, is the batch's tokens at its columns."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from raypipe import trace
    from tests.test_trace import assert_records_hold_the_batch

    tokenizer = Tokenizer.from_file(tokenizer_path)
    kept, state = {}, None
    for seq_len, last in (([(0, 16), (6, 48)], 8), (32, 10)):
        shape = ({"seq_len_schedule": seq_len} if isinstance(seq_len, list)
                 else {"seq_len": seq_len})
        loaders = [TokenLoader(str(token_dataset), batch_size=3, seed=5, rank=rank,
                               world_size=2, **shape) for rank in range(2)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
            for batch in loader:
                if batch.step in (5, 6, 9, 10):
                    kept[batch.step, loader.rank] = SimpleNamespace(
                        inputs=batch.inputs.clone(), targets=batch.targets.clone())
                if batch.step == last:
                    break
        state = loaders[0].state_dict()
    assert [kept[step, 0].inputs.shape[1] for step in (5, 6, 9, 10)] == [16, 48, 32, 32]
    for step in (5, 6, 9, 10):
        records = list(trace(str(token_dataset), step, history=state))
        for rank in range(2):
            mine = [record for record in records if record.rank == rank]
            assert sorted({record.row for record in mine}) == [0, 1, 2]
            assert_records_hold_the_batch(mine, kept[step, rank], tokenizer)


def test_a_continued_plan_counts_what_overlong_split_places_twice():
    """Overlong `split` places the token before each later piece again: the continued
    plan's count of those matches its rows' overlaps, head and tail."""
    from raypipe.sampling.modes.bestfit import BestFitPlan, ContinuedPlan

    lengths = np.random.default_rng(3).integers(2, 200, 400)
    plan = BestFitPlan(lengths, 32, 1, 0, block_documents=40, packing="split",
                       overlong="split")
    remainder = plan.remaining(plan.size // 3)
    continued = ContinuedPlan(remainder, BestFitPlan(
        lengths, 48, 1, 0, block_documents=40, packing="split", overlong="split",
        first_document=remainder.first(lengths.size)))
    positions = np.arange(continued.size, dtype=np.int64)
    placed = continued.counted_tokens(positions)
    assert placed - continued.repeated_tokens(positions) == remainder.tokens + int(
        lengths[BestFitPlan(lengths, 48, 1, 0, block_documents=40, packing="split",
                            overlong="split").document_order(
            np.arange(remainder.first(lengths.size), lengths.size))].sum())
    assert continued.repeated_tokens(positions[:continued.head_rows]) > 0


def test_a_mixture_changes_seq_len_declared_or_on_resume_and_serves_no_token_twice(
        numbered, tmp_path):
    """Two numbered sources (disjoint ids) at 0.6 / 0.4 on the ramp: seq_len 32 to step 12
    then 128, declared; the same run stopped on 2 ranks, changed on resume on 3 ranks,
    finished on 1, serves the same steps. No token is served twice, and each source's
    tokens served plus those its plan has left at the final position are all of its own."""
    from raypipe.loader import MixtureLoader

    web, web_tokens = numbered
    code, code_tokens = numbered_dataset(tmp_path, 80_000, first=TOKENS + 1, seed=9)
    paths = {"code": str(code), "web": str(web)}
    weights = {"code": 0.4, "web": 0.6}

    def mixture(world, state, stop, **shape):
        loaders = [MixtureLoader(paths, rank=rank, world_size=world, seed=3, device="cpu",
                                 batch_schedule=RAMP, weights=weights, block_documents=64,
                                 **shape) for rank in range(world)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        iterators, taken = [iter(loader) for loader in loaders], {}
        while loaders[0].steps < stop:
            batches = [next(iterator) for iterator in iterators]
            taken[batches[0].step] = (batches[0].inputs.shape[1], np.concatenate(
                [torch.cat([b.inputs, b.targets[:, -1:]], 1).numpy().copy() for b in batches]))
        for iterator in iterators:
            iterator.close()
        return taken, json.loads(json.dumps(loaders[0].state_dict())), loaders[0]

    declared, end, last = mixture(2, None, 20, seq_len_schedule=[(0, SHORT), (12, LONG)])
    first, state, _ = mixture(2, None, 12, seq_len=SHORT)
    second, state, _ = mixture(3, state, 16, seq_len=LONG)  # the change, on resume
    assert state["sources"]["web"]["phases"][-1][0] == LONG
    third, state, _ = mixture(1, state, 20, seq_len=LONG)
    assert_same_steps({**first, **second, **third}, declared)
    assert state["sources"] == end["sources"]
    counts = np.bincount(np.concatenate([rows.ravel() for _, rows in declared.values()]))
    assert counts[1:].max() == 1, "a token served twice"
    for name, first_id, total in (("web", 1, web_tokens), ("code", TOKENS + 1, code_tokens)):
        where = end["sources"][name]
        assert where["epoch"] == 0
        source = last.sources[last.names.index(name)]
        plan = source.planned.plan(0, tuple(Phase(*phase) for phase in where["phases"]))
        left = plan.counted_tokens(np.arange(where["position"], plan.size, dtype=np.int64))
        served = int((counts[first_id:first_id + total] == 1).sum())
        assert served + left == total, name
    from raypipe import trace

    starts = {"web": document_starts(web), "code": document_starts(code) + TOKENS}
    for step in (11, 12, 13):  # trace follows the change: rows rebuilt from its pieces
        seq_len, rows = declared[step]
        built = np.zeros_like(rows)
        for record in trace(paths, step, world_size=2, seed=3, weights=weights,
                            batch_schedule=RAMP, block_documents=64,
                            seq_len_schedule=[(0, SHORT), (12, LONG)]):
            first = int(starts[record.source][record.document])
            built[record.rank * (len(rows) // 2) + record.row,
                  record.col_start:record.col_end] = np.arange(
                first + record.token_start, first + record.token_end)
        assert np.array_equal(built, rows), step


def test_an_epoch_whose_drop_last_tail_passes_5_percent_warns_and_a_small_one_does_not(
        numbered, caplog):
    """The tail under one global step an epoch leaves is counted, and it is a warning (seen
    by default) the first time and whenever it passes 5% of the epoch's tokens (with a
    hint); a later small one is an info line."""
    path, total = numbered
    for batch_size, wasteful in ((400, True), (2, False)):
        caplog.clear()
        loader = TokenLoader(str(path), LONG, batch_size, rank=0, world_size=1, seed=3,
                             block_documents=64)
        with caplog.at_level("INFO", logger="raypipe"):
            sum(1 for _ in loader)
            served = sum(1 for _ in loader)  # a second epoch
        epoch, rows, tokens = loader.dropped_tail
        assert epoch == 1 and rows == loader.plan(1).size - served * batch_size
        assert (tokens / total > 0.05) is wasteful
        lines = [r for r in caplog.records if "drop-last" in r.getMessage()]
        assert [r.levelname for r in lines] == ["WARNING", "WARNING" if wasteful else "INFO"]
        assert ("hint: a smaller global batch" in lines[0].getMessage()) is wasteful
    documents = TokenLoader(str(path), LONG, 400, rank=0, world_size=1, mode="documents")
    served = sum(1 for _ in documents)  # one document a row: its tail's tokens counted too
    _, rows, tokens = documents.dropped_tail
    assert rows == documents.plan(0).size - served * 400 and tokens > 0
