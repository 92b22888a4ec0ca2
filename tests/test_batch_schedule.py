"""A global batch size that ramps by step (raypipe.sampling.schedule): the walk of an
epoch's steps is a pure function of the schedule and the state, the loader follows it at
any world size across interrupts (every observation of the epoch once, the uninterrupted
run's batches), and `raypipe trace` maps a step of the ramp to the loader's rows."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.errors import ConfigError
from raypipe.loader import TokenLoader
from raypipe.sampling.schedule import BatchSchedule, Cursor, Phase

T = 16
RAMP = BatchSchedule.ramp(6, 24, 6, 5)  # 6 rows a step, 12 from step 5, 18 from 10, 24 from 15


def test_a_ramp_is_stages_of_rising_global_batch():
    assert RAMP == [(0, 6), (5, 12), (10, 18), (15, 24)]
    schedule = BatchSchedule.of(RAMP, 3)
    assert [schedule.at(step) for step in (0, 4, 5, 14, 15, 10**6)] == [6, 6, 12, 18, 24, 24]
    with pytest.raises(ConfigError, match="not a multiple of the world size 4"):
        BatchSchedule.of(RAMP, 4)
    with pytest.raises(ConfigError, match="must start at step 0"):
        BatchSchedule.of([(3, 6)], 1)


@settings(max_examples=80, deadline=None)
@given(stages=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       gaps=st.lists(st.integers(1, 7), min_size=3, max_size=3),
       sizes=st.lists(st.integers(10, 60), min_size=3, max_size=3),
       start=st.integers(0, 30), steps=st.integers(0, 40))
def test_walking_k_steps_stands_where_the_steps_taken_one_by_one_end(stages, gaps, sizes,
                                                                     start, steps):
    """`walk` (what trace and a resume use) agrees with the segments the loader serves, and
    `steps_before` counts the steps that reach a walked position."""
    starts = [0, *np.cumsum(gaps[:len(stages) - 1]).tolist()]
    schedule = BatchSchedule(tuple(starts), tuple(stages))
    size = lambda epoch, phases=(): sizes[epoch % 3]  # noqa: E731
    cursor = schedule.walk(size, Cursor(0, 0, 0, (Phase(T),)), start)
    epoch, position, step = cursor.epoch, cursor.position, cursor.step
    assert step == start and schedule.steps_before(size, epoch, position, (Phase(T),)) == start
    taken = []
    for segment in schedule.segments(size, cursor):
        taken += [(segment.epoch, segment.step_start(i), segment.global_batch)
                  for i in range(segment.steps)]
        if len(taken) > steps:
            break
    for index, (where, first, rows) in enumerate(taken[:steps]):
        assert first + rows <= size(where), "a step past its epoch's end"
        assert rows == schedule.at(start + index)
    walked = schedule.walk(size, cursor, steps)
    nxt = taken[steps]
    assert walked.step == start + steps
    assert (walked.epoch, walked.position) == (nxt[0], nxt[1]) or (
        walked.epoch == nxt[0] - 1 and nxt[1] == 0)  # at an epoch's tail, before rolling over


def rows_by_step(loader_factory, world, state, steps):
    """{step: [observation ids of every rank, rank-major]} for `steps` steps from `state`,
    and the state after."""
    loaders = [loader_factory(rank, world) for rank in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    taken: dict[int, list[int]] = {}
    for _ in range(steps):
        batches = [next(it, None) for it in iterators]
        if batches[0] is None:
            break
        assert len({batch.step for batch in batches}) == 1
        taken[batches[0].step] = [i for b in batches for i in b.observation_ids.tolist()]
    for iterator in iterators:
        iterator.close()
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states)
    return taken, json.loads(json.dumps(states[0]))


@pytest.mark.parametrize("mode", ["bestfit", "windows"])
def test_a_ramp_resumed_on_3_then_1_ranks_serves_the_uninterrupted_run_s_steps(
        token_dataset, mode):
    def factory(rank, world):
        return TokenLoader(str(token_dataset), T, mode=mode, seed=5, rank=rank,
                           world_size=world, batch_schedule=RAMP)

    whole, _ = rows_by_step(factory, 2, None, 10**6)  # one epoch, to its end
    assert {len(ids) for step, ids in whole.items() if step < 5} == {6}
    assert {len(ids) for step, ids in whole.items() if step >= 15} == {24}
    first, state = rows_by_step(factory, 2, None, 7)
    second, state = rows_by_step(factory, 3, state, 6)
    third, state = rows_by_step(factory, 1, state, 10**6)
    resumed = {**first, **second, **third}
    assert sorted(resumed) == sorted(whole) == list(range(len(whole)))
    for step, ids in whole.items():
        assert sorted(resumed[step]) == sorted(ids), step
    served = [i for ids in whole.values() for i in ids]
    size = factory(0, 1).plan(0).size
    assert len(served) == len(set(served)) and size - len(served) < 24  # the tail: < 1 step
    assert state["epoch"] == 1 and state["steps"] == len(whole)


def test_trace_of_steps_of_the_ramp_names_the_tokens_the_loader_served(token_dataset,
                                                                        tokenizer_path):
    from tokenizers import Tokenizer

    from raypipe import trace
    from tests.test_trace import assert_records_hold_the_batch

    tokenizer = Tokenizer.from_file(tokenizer_path)
    batches = {}
    for rank in range(2):
        loader = TokenLoader(str(token_dataset), T, mode="bestfit", seed=5, rank=rank,
                             world_size=2, batch_schedule=RAMP)
        for batch in loader:
            if batch.step in (3, 16):  # its tokens kept (its ring slot is reused)
                batches[batch.step, rank] = SimpleNamespace(inputs=batch.inputs.clone(),
                                                            targets=batch.targets.clone())
            if batch.step == 16:
                break
    for step, rows in ((3, 3), (16, 12)):
        records = list(trace(str(token_dataset), step, world_size=2, seq_len=T, seed=5,
                             batch_schedule=RAMP))
        assert {r.step for r in records} == {step}
        for rank in range(2):
            assert batches[step, rank].inputs.shape[0] == rows
            mine = [r for r in records if r.rank == rank]
            assert sorted({r.row for r in mine}) == list(range(rows))
            assert_records_hold_the_batch(mine, batches[step, rank], tokenizer)


def test_trace_s_command_line_takes_the_schedule(token_dataset, capsys):
    from raypipe import trace
    from raypipe.cli import main

    spelled = ",".join(f"{step}:{rows}" for step, rows in RAMP)
    assert main(["trace", str(token_dataset), "--step", "16", "--world-size", "2",
                 "--seq-len", str(T), "--seed", "5", "--batch-schedule", spelled]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = [record.line() for record in trace(str(token_dataset), 16, world_size=2,
                                                   seq_len=T, seed=5, batch_schedule=RAMP)]
    assert lines == expected and len({json.loads(line)["row"] for line in lines}) == 12
    with pytest.raises(SystemExit) as refused:  # argparse: usage and the error, status 2
        main(["trace", str(token_dataset), "--batch-schedule", "0-6"])
    assert refused.value.code == 2 and "is not STEP:ROWS" in capsys.readouterr().err


def test_batch_size_and_a_schedule_together_are_refused(token_dataset):
    with pytest.raises(ConfigError, match="batch_size .* or batch_schedule"):
        TokenLoader(str(token_dataset), T, 4, batch_schedule=RAMP, world_size=1, rank=0)


def test_a_mixture_follows_the_ramp_resumed_on_3_then_1_ranks(token_dataset, rich_dataset,
                                                                tokenizer_path):
    from tokenizers import Tokenizer

    from raypipe import trace
    from raypipe.loader import MixtureLoader
    from tests.test_trace import assert_records_hold_the_batch

    paths = {"web": str(token_dataset), "code": str(rich_dataset)}

    def factory(rank, world):
        return MixtureLoader(paths, T, weights={"web": 0.6, "code": 0.4}, seed=5, rank=rank,
                             world_size=world, mode="documents", batch_schedule=RAMP)

    def rows_of(batches):  # {step: [(source, position) of every rank, rank-major]}
        return [(int(s), int(p)) for b in batches
                for s, p in zip(b.source_ids, b.positions, strict=True)]

    def run(world, state, steps):
        loaders = [factory(rank, world) for rank in range(world)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        iterators = [iter(loader) for loader in loaders]
        taken = {}
        for _ in range(steps):  # each batch's tokens kept (its ring slot is reused)
            batches = [next(it) for it in iterators]
            kept = [SimpleNamespace(inputs=b.inputs.clone(), targets=b.targets.clone())
                    for b in batches]
            taken[batches[0].step] = (rows_of(batches), kept)
        for iterator in iterators:
            iterator.close()
        states = [loader.state_dict() for loader in loaders]
        assert all(s == states[0] for s in states)
        return taken, json.loads(json.dumps(states[0]))

    whole, _ = run(2, None, 20)
    assert [len(whole[step][0]) for step in (0, 5, 10, 19)] == [6, 12, 18, 24]
    first, state = run(2, None, 4)
    second, state = run(3, state, 9)
    third, _ = run(1, state, 7)
    resumed = {**first, **second, **third}
    assert sorted(resumed) == list(range(20))
    for step in range(20):
        assert sorted(resumed[step][0]) == sorted(whole[step][0]), step
    tokenizer = Tokenizer.from_file(tokenizer_path)
    records = list(trace(paths, 16, world_size=2, seq_len=T, seed=5, mode="documents",
                         weights={"web": 0.6, "code": 0.4}, batch_schedule=RAMP))
    for rank, batch in enumerate(whole[16][1]):
        assert batch.inputs.shape[0] == 12
        assert_records_hold_the_batch([r for r in records if r.rank == rank], batch, tokenizer)
