"""Training while the tokenize job runs (`follow=True`, raypipe.loader.follow and
raypipe.io.live): the loader opens once the job's first units commit, the rest join the
epoch in progress as they commit, and every token of every unit the epoch held is trained
once (the drop-last tail counted); the state records each join, so `raypipe trace` of the
finished output replays the steps; a job that fails leaves what it committed, and a rerun's
units join; a loader that does not follow names the running job."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from raypipe.errors import ConfigError
from raypipe.io.live import LIVE_STATUS
from raypipe.loader import TokenLoader
from tests.conftest import write_parquet
from tests.helpers import tokenize

SEQ_LEN, ROWS = 32, 6


@pytest.fixture
def corpus(tmp_path, corpus_texts):
    """Three parquet files of 4 row groups each: 12 units of 50 documents."""
    directory = tmp_path / "corpus"
    for index in range(3):
        write_parquet(directory / f"part-{index}.parquet", corpus_texts[index:600:3],
                      row_group_rows=50)
    return directory


def run_job_in_background(corpus, output, tokenizer_path, monkeypatch, seconds, fault=None):
    """The tokenize job on a thread, each unit slowed by `seconds` (a test-only delay at
    its commit), or `fault` instead; (thread, [its summary, or the exception it raised])."""
    spec = fault or {"point": "unit.before_record", "action": "delay", "seconds": seconds,
                     "always": True}
    monkeypatch.setenv("RAYPIPE_TEST_FAULT", json.dumps(
        {"marker": str(output.parent / f"fault-{time.monotonic_ns()}"), **spec}))
    outcome: list = []  # its summary, or the exception it raised

    def job() -> None:
        from raypipe.config import load_config
        from raypipe.preprocess.job import run_job

        try:
            outcome.append(run_job(load_config(
                None, inputs=[str(corpus)], output=str(output), tokenizer=tokenizer_path,
                shard_tokens=9_000, unit_bytes=1, bos=True)))
        except BaseException as exc:  # noqa: BLE001  (the test looks at it)
            outcome.append(exc)

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    return thread, outcome


def train(loader, until, slow=lambda: True, step_seconds=0.03):
    """Batches from `loader` (a training step taking `step_seconds` each while `slow()`)
    until `until()` holds at an epoch's end: {step: (epoch, rows)}, and each epoch's
    dropped tail."""
    import torch

    taken, tails = {}, {}
    while True:
        for batch in loader:
            taken[batch.step] = (batch.epoch, torch.cat([batch.inputs, batch.targets[:, -1:]],
                                                        1).numpy().copy())
            if slow():
                time.sleep(step_seconds)
        tails[loader.epoch - 1] = loader.dropped_tail[2]
        if until():
            return taken, tails


def traced_tokens(path, dataset, taken, state, world=1):
    """Every step's rows as `raypipe trace` of the finished output names them, each piece
    checked against the row served, counted per document (of `dataset`: the run's data,
    numbered as the run numbers them) and epoch: ({epoch: token counts}, lengths)."""
    from raypipe import trace

    lengths = dataset.document_lengths()
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate(list(dataset.iter_documents()))
    counts: dict[int, np.ndarray] = {}
    for step, (epoch, rows) in taken.items():
        per_epoch = counts.setdefault(epoch, np.zeros(lengths.size, dtype=np.int64))
        for piece in trace(str(path), step, history=state):
            row = rows[piece.rank * (ROWS // world) + piece.row]
            first = int(starts[piece.document])
            assert row[piece.col_start:piece.col_end].tolist() == tokens[
                first + piece.token_start:first + piece.token_end].tolist(), step
            per_epoch[piece.document] += piece.token_end - piece.token_start
    return counts, lengths


@pytest.mark.slow
def test_a_loader_follows_a_running_job_and_trains_every_token_of_each_epoch_once(
        corpus, tmp_path, tokenizer_path, monkeypatch, caplog):
    output = tmp_path / "tokens"
    job, outcome = run_job_in_background(corpus, output, tokenizer_path, monkeypatch, 0.15)
    caplog.set_level(logging.INFO, logger="raypipe")
    loader = TokenLoader(str(output), SEQ_LEN, ROWS, seed=5, follow=True, follow_steps=2,
                         device="cpu")
    opened_with = loader.dataset.num_documents
    taken, tails = train(loader, lambda: not job.is_alive() and not loader.follower.active
                         and loader.epoch >= 2, slow=job.is_alive)
    job.join()
    summary = outcome[0]
    assert summary.live_updates > 1
    assert f"live       {summary.live_updates} live manifest(s) written" in summary.render()
    state = loader.state_dict()
    joins = state["units_added"]
    # it opened on the first units, and the rest joined epochs in progress, each recorded
    assert opened_with < 600 and loader.dataset.num_documents == 600
    assert any(record["joins"] for record in joins)
    assert joins[-1]["documents"] == 600
    assert "its units join this run as they commit" in caplog.text
    assert "the tokenize job finished" in caplog.text
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    from raypipe.tools.inspect import inspect_state

    first_join = next(record for record in joins if record["joins"])
    assert (f"from step {first_join['step']:,}: the output's units added: "
            f"{first_join['units']} units") in inspect_state(saved)
    assert f"joining epoch {first_join['epoch'] - 1} here" in inspect_state(saved)
    # every token of every document an epoch held is trained once in it, but its tail
    counts, lengths = traced_tokens(output, loader.dataset, taken, state)
    for epoch, per_document in counts.items():
        held = int(np.flatnonzero(per_document).max()) + 1
        assert (per_document[:held] <= lengths[:held]).all(), epoch
        missing = int((lengths[:held] - per_document[:held]).sum())
        assert missing == tails[epoch], epoch
    last = max(counts)
    assert int(np.flatnonzero(counts[last]).max()) + 1 == 600  # the last epoch: every unit


def test_a_loader_that_does_not_follow_names_the_running_job(corpus, tmp_path,
                                                             tokenizer_path, monkeypatch):
    output = tmp_path / "tokens"
    job, _ = run_job_in_background(corpus, output, tokenizer_path, monkeypatch, 0.1)
    deadline = time.monotonic() + 60
    while not (output / LIVE_STATUS).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(ConfigError, match=r"no manifest yet: the tokenize job writing .* is "
                                           r"running: \d+ of 12 unit\(s\) committed; pass "
                                           "follow=True"):
        TokenLoader(str(output), SEQ_LEN, ROWS)
    job.join()


def test_a_failed_job_leaves_its_units_and_a_rerun_s_units_join(corpus, tmp_path,
                                                                tokenizer_path, monkeypatch,
                                                                caplog):
    from raypipe.io.live import LiveOutput
    from raypipe.io.store import Store

    output = tmp_path / "tokens"
    job, outcome = run_job_in_background(
        corpus, output, tokenizer_path, monkeypatch, 0,
        fault={"point": "unit.before_record", "action": "raise", "unit": "part-1"})
    job.join()
    assert isinstance(outcome[0], Exception)  # the job failed at part-1's first unit
    status = LiveOutput(Store(output)).status()
    assert status.state == "failed" and "injected fault" in status.error
    caplog.set_level(logging.INFO, logger="raypipe")
    loader = TokenLoader(str(output), SEQ_LEN, ROWS, seed=5, follow=True, follow_steps=1,
                         device="cpu")
    assert loader.dataset.num_documents == 200  # the 4 units committed before it failed
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    assert "failed (InjectedFault: injected fault at unit.before_record)" in caplog.text
    monkeypatch.delenv("RAYPIPE_TEST_FAULT")
    tokenize(corpus, output, tokenizer_path)  # the rerun commits the rest, and finishes
    batch = next(iterator)
    state = loader.state_dict()
    assert state["units_added"][-1]["documents"] == 600
    assert state["units_added"][-1]["step"] == batch.step + 1  # the step after the rerun
    assert not loader.follower.active


RANK_SCRIPT = """
import json, sys, time, numpy as np, torch
import torch.distributed as dist
from raypipe.loader import TokenLoader
output, port, rank, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
knobs = json.loads(sys.argv[5])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
if rank == 0:
    open(out + ".ready", "w").close()  # the job starts now: the ranks wait for its units
loader = TokenLoader(output, 32, 3, seed=5, follow=True, follow_steps=2, device="cpu",
                     **knobs)
rows, epochs, tails = {}, {}, {}
while True:
    for batch in loader:
        rows[str(batch.step)] = torch.cat([batch.inputs, batch.targets[:, -1:]], 1).tolist()
        epochs[str(batch.step)] = batch.epoch
        dist.barrier()  # a training step's all-reduce, taking a while as the job runs
        if loader.follower.active:
            time.sleep(0.03)
    tails[str(loader.epoch - 1)] = loader.dropped_tail[2]
    if not loader.follower.active and loader.epoch >= 2:
        break
json.dump({"rows": rows, "epochs": epochs, "tails": tails, "state": loader.state_dict()},
          open(out, "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [{}, {"shuffle": "windowed", "window_blocks": 1, "lanes": 2}],
                         ids=["global", "windowed-2-lanes"])
def test_two_ranks_following_a_job_add_each_unit_at_the_same_step(corpus, tmp_path,
                                                                 tokenizer_path,
                                                                 monkeypatch, knobs):
    """Two processes of one torch.distributed (gloo) group follow the job: rank 0 decides
    when units join and every rank adds them at that step, so both save one state, and
    trace of it replays what each rank was served, every token of each epoch once; under
    a windowed shuffle of 2 lanes too (each lane takes its share of the joined windows)."""
    import socket
    import subprocess
    import sys

    output = tmp_path / "tokens"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = [tmp_path / f"rank-{rank}.json" for rank in range(2)]
    environment = {key: value for key, value in __import__("os").environ.items()
                   if key != "RAYPIPE_TEST_FAULT"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(output), str(port),
                               str(rank), str(results[rank]), json.dumps(knobs)],
                              env=environment)
             for rank in range(2)]  # started first: they wait for the job's first units
    ready = Path(f"{results[0]}.ready")
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    job, outcome = run_job_in_background(corpus, output, tokenizer_path, monkeypatch, 0.2)
    assert [rank.wait(timeout=300) for rank in ranks] == [0, 0]
    job.join()
    assert not isinstance(outcome[0], Exception)
    served = [json.loads(path.read_text()) for path in results]
    assert served[0]["state"] == served[1]["state"]
    state = served[0]["state"]
    assert any(record["joins"] for record in state["units_added"])
    assert state["units_added"][-1]["documents"] == 600
    taken = {int(step): (served[0]["epochs"][step],
                         np.array(served[0]["rows"][step] + served[1]["rows"][step]))
             for step in served[0]["rows"]}
    from raypipe.loader import TokenLoader as Loader

    replayed = Loader(str(output), SEQ_LEN, ROWS // 2, rank=0, world_size=2, seed=5,
                      device="cpu", **knobs)
    replayed.load_state_dict(state)
    counts, lengths = traced_tokens(output, replayed.dataset, taken, state, world=2)
    tails = {int(epoch): tokens for epoch, tokens in served[0]["tails"].items()}
    for epoch, per_document in counts.items():
        held = int(np.flatnonzero(per_document).max()) + 1
        assert int((lengths[:held] - per_document[:held]).sum()) == tails[epoch], epoch


def test_following_refuses_up_front_what_could_not_take_units_mid_run(
        token_dataset, corpus, tmp_path, tokenizer_path, monkeypatch):
    """An output whose job finished is followed with nothing to follow; for one a job may
    still add to (here: it failed, and a rerun would), a shuffle that could not take units
    into the epoch in progress, and ranks with no process group to agree through, are
    refused when the loader opens, naming the way out."""
    finished = TokenLoader(str(token_dataset), SEQ_LEN, ROWS, follow=True, device="cpu")
    assert not finished.follower.active
    output = tmp_path / "tokens"
    job, _ = run_job_in_background(
        corpus, output, tokenizer_path, monkeypatch, 0,
        fault={"point": "unit.before_record", "action": "raise", "unit": "part-1"})
    job.join()
    with pytest.raises(ConfigError, match="shuffle 'shard_local': .*units_join='next_epoch'"):
        TokenLoader(str(output), SEQ_LEN, ROWS, follow=True, shuffle="shard_local",
                    device="cpu")
    TokenLoader(str(output), SEQ_LEN, ROWS, follow=True, shuffle="shard_local",
                units_join="next_epoch", device="cpu")
    for mode in ("bestfit", "documents"):  # each lane's rest is planned again
        TokenLoader(str(output), SEQ_LEN, ROWS, follow=True, mode=mode, shuffle="windowed",
                    lanes=2, device="cpu")
    with pytest.raises(ConfigError, match="follow=True on 2 ranks: .*torch.distributed"):
        TokenLoader(str(output), SEQ_LEN, 3, rank=0, world_size=2, follow=True,
                    device="cpu")


def test_a_mixture_follows_its_running_source_and_trains_each_of_its_tokens_once(
        corpus, tmp_path, tokenizer_path, token_dataset, monkeypatch):
    """A mixture of a finished dataset and one a running job writes: the running source's
    units join its epoch as they commit; replayed by trace from the states the loader saved
    where its data changed, every step's rows are what the loader served, and every token
    of the running source's first epoch is trained once."""
    import torch

    from raypipe import trace
    from raypipe.loader import MixtureLoader

    output = tmp_path / "tokens"
    paths = {"live": str(output), "web": str(token_dataset)}
    options = {"seq_len": SEQ_LEN, "batch_size": ROWS, "seed": 5, "device": "cpu"}
    job, outcome = run_job_in_background(corpus, output, tokenizer_path, monkeypatch, 0.15)
    loader = MixtureLoader(paths, follow=True, follow_steps=2, **options)
    states = [loader.state_dict()]  # the state before each step
    rows = {}
    for batch in loader:
        rows[batch.step] = torch.cat([batch.inputs, batch.targets[:, -1:]], 1).numpy()
        states.append(loader.state_dict())
        if job.is_alive():
            time.sleep(0.03)
        if batch.mixture_state["live"].epoch >= 1 and not job.is_alive():
            break
    job.join()
    assert not isinstance(outcome[0], Exception) and not loader.followers["live"].active
    joins = states[-1]["units_added"]["live"]
    assert any(record["joins"] for record in joins) and joins[-1]["documents"] == 600
    saved = tmp_path / "mixture-state.json"
    saved.write_text(json.dumps(states[-1]))
    from raypipe.tools.inspect import inspect_state

    assert f"from step {joins[0]['step']:,}: source live: the output's units added" in \
        inspect_state(saved)
    # trace from the state before each stretch of steps whose data held
    changes = [0] + [step for step in range(1, len(rows))
                     if states[step]["units_added"] != states[step - 1]["units_added"]]
    live = loader.sources[loader.names.index("live")].dataset
    lengths = live.document_lengths()
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate(list(live.iter_documents()))
    covered = np.zeros(lengths.size, dtype=np.int64)
    for begin, end in zip(changes, [*changes[1:], len(rows)], strict=True):
        for piece in trace(paths, state=states[begin], steps=end - begin, batch_size=ROWS,
                           **{key: value for key, value in options.items()
                              if key not in ("batch_size", "device")}):
            row = rows[piece.step][piece.row]
            if piece.source != "live":
                continue
            first = int(starts[piece.document])
            assert row[piece.col_start:piece.col_end].tolist() == tokens[
                first + piece.token_start:first + piece.token_end].tolist(), piece.step
            if piece.epoch == 0:
                covered[piece.document] += piece.token_end - piece.token_start
    assert np.array_equal(covered, lengths)  # every token once (a mixture drops no tail)


def test_jobs_train_sends_follow_and_units_join_to_the_train_loader(token_dataset):
    import runpy

    job = runpy.run_path(str(Path(__file__).resolve().parents[1] / "jobs" / "train.py"))
    args = job["build_parser"]().parse_args(["--data", str(token_dataset), "--follow",
                                             "--units-join", "next_epoch"])
    options = job["run_config"](args)["options"]
    assert (options["follow"], options["units_join"]) == (True, "next_epoch")
    loader = TokenLoader(str(token_dataset), SEQ_LEN, ROWS, device="cpu", **options)
    assert loader.follower is not None and loader.run.units_join == "next_epoch"


@pytest.mark.slow
def test_a_fast_loop_following_a_slow_job_ends_no_epoch_before_the_job_does(
        corpus, tmp_path, tokenizer_path, monkeypatch, caplog):
    """The user's case: a training loop much faster than the job, two epochs. Each epoch
    waits (visibly) for the job's units rather than ending on what was committed, so both
    epochs train every token of the finished job once, but their drop-last tails."""
    output = tmp_path / "tokens"
    job, _ = run_job_in_background(corpus, output, tokenizer_path, monkeypatch, 0.15)
    caplog.set_level(logging.INFO, logger="raypipe")
    loader = TokenLoader(str(output), SEQ_LEN, ROWS, seed=5, follow=True, follow_steps=2,
                         device="cpu")
    assert loader.dataset.num_documents < 600  # it opened while the job ran
    taken, tails = {}, {}
    for epoch in range(2):
        for batch in loader:  # no training step: as fast as the loader goes
            taken[batch.step] = (batch.epoch, __import__("torch").cat(
                [batch.inputs, batch.targets[:, -1:]], 1).numpy().copy())
        tails[epoch] = loader.dropped_tail[2]
        if epoch == 0:
            assert not job.is_alive() and not loader.follower.active  # it ended with the job
    job.join()
    assert "waiting for its next units, which join this epoch" in caplog.text
    gained = [r.levelname for r in caplog.records if "the output gained" in r.getMessage()]
    assert gained.count("WARNING") == 1  # however many joins: a warning a minute at most
    assert "join(s) while following" in caplog.text  # and how many, when the job ends
    state = loader.state_dict()
    counts, lengths = traced_tokens(output, loader.dataset, taken, state)
    assert sorted(counts) == [0, 1]
    for epoch, per_document in counts.items():
        assert (per_document <= lengths).all(), epoch
        assert int((lengths - per_document).sum()) == tails[epoch], epoch
