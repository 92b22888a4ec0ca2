"""The tokenize job on a local Ray (2 CPUs): same bytes at any parallelism, CLI, job
script config, Python API."""

from __future__ import annotations

import json
import runpy
import sys
import time

import pytest
import yaml

import raypipe
from raypipe.cli import main
from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.errors import ConfigError
from raypipe.preprocess.job import run_job
from raypipe.ray.executor import run_on_ray as run_tokenize
from tests.helpers import expected_documents, file_identities, shard_files

pytestmark = pytest.mark.ray


@pytest.mark.slow
def test_same_bytes_at_one_and_two_workers_and_any_batch_size(ray_session, tmp_path,
                                                              corpus_dir, tokenizer_path):
    outputs = {}
    for name, workers, batch in (("w1", 1, 64), ("w2", 2, 5), ("w2b", 2, 4096)):
        config = load_config(None, inputs=[str(corpus_dir / "*.parquet")],
                             output=str(tmp_path / name), tokenizer=tokenizer_path,
                             unit_bytes=1, num_workers=workers, encode_batch_rows=batch)
        summary = run_tokenize(config)
        assert summary.units_run == summary.units > 4
        outputs[name] = shard_files(tmp_path / name)
    serial = load_config(None, inputs=[str(corpus_dir)], output=str(tmp_path / "serial"),
                         tokenizer=tokenizer_path, unit_bytes=1)
    run_job(serial)
    assert outputs["w1"] == outputs["w2"] == outputs["w2b"] == shard_files(tmp_path / "serial")
    got = [d.tolist() for d in TokenDataset(tmp_path / "w2").iter_documents()]
    assert got == expected_documents(corpus_dir, tokenizer_path, bos=False, eos=True)


def test_python_api_and_rerun(ray_session, tmp_path, corpus_dir, tokenizer_path):
    summary = raypipe.tokenize(str(corpus_dir), str(tmp_path / "out"), tokenizer=tokenizer_path,
                               formats="megatron", unit_bytes=1)
    assert summary.tokens > 0 and summary.shards == summary.units
    before = file_identities(tmp_path / "out")
    again = raypipe.tokenize(str(corpus_dir), str(tmp_path / "out"), tokenizer=tokenizer_path,
                             formats="megatron", unit_bytes=1, num_workers=1)
    assert again.units_run == 0 and file_identities(tmp_path / "out") == before
    assert not (tmp_path / "out" / "nanogpt").exists()


@pytest.mark.slow
def test_cli_and_job_script_share_the_config(ray_session, tmp_path, corpus_dir, tokenizer_path,
                                             capsys, monkeypatch):
    code = main(["tokenize", str(corpus_dir), "--tokenizer", tokenizer_path, "--format",
                 "megatron,nanogpt", "--output", str(tmp_path / "cli"), "--eos",
                 "--shard-tokens", "5000", "--unit-bytes", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "documents" in printed and "tokens/s" in printed
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump({
        "inputs": [str(corpus_dir)], "tokenizer": tokenizer_path, "output": str(tmp_path / "x"),
        "eos": True, "shard_tokens": 5000, "unit_bytes": 1}))
    monkeypatch.setattr(sys, "argv", ["jobs/tokenize.py", "--config", str(config_file),
                                      "--output", str(tmp_path / "job")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path("jobs/tokenize.py", run_name="__main__")
    assert exit_info.value.code == 0
    assert shard_files(tmp_path / "cli") == shard_files(tmp_path / "job")
    recorded = yaml.safe_load((tmp_path / "job" / "config.yaml").read_text())
    assert recorded["eos"] is True and recorded["output"] == str(tmp_path / "job")
    manifest = json.loads((tmp_path / "job" / "manifest.json").read_text())
    assert manifest["config"]["shard_tokens"] == 5000


def test_cli_missing_column_exits_2_listing_columns(ray_session, tmp_path, corpus_dir,
                                                    tokenizer_path, capsys):
    code = main(["tokenize", str(corpus_dir), "--tokenizer", tokenizer_path,
                 "--output", str(tmp_path / "o"), "--text-column", "body"])
    assert code == 2
    assert "available columns: ['id', 'text']" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_runs_end_to_end(ray_session, tmp_path, capsys):
    from raypipe.demo.run import run_demo

    run_demo(tmp_path / "demo")
    printed = capsys.readouterr().out
    # its first line says where it writes (a demo_out/ in the current directory, unasked)
    assert printed.splitlines()[0].startswith(
        f"raypipe demo: writing its corpus, token shards and loader state under "
        f"{(tmp_path / 'demo').resolve()}")
    for needle in ("docstrings of Python's standard library", "documents", "tokens/s",
                   "first document of", "checkpointed loader state", "resumed rank 1/2"):
        assert needle in printed, needle
    from raypipe.tools.verify import verify_dataset

    assert verify_dataset(tmp_path / "demo" / "tokens").formats == 2


def ray_data_plans(stage: str) -> set[str]:
    """The Datasets whose execution plan, as Ray Data logged it in this Ray session, names
    `stage` (a plan is in the session's log and in its Dataset's own)."""
    import re
    from pathlib import Path

    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    return {match.group(1)
            for log in sorted((session / "logs" / "ray-data").glob("ray-data*.log"))
            for line in log.read_text(errors="replace").splitlines()
            if stage in line
            for match in [re.search(r"Execution plan of Dataset (\S+):", line)] if match}


@pytest.mark.slow
def test_a_small_job_on_a_loaded_machine_runs_as_a_ray_data_dataset(ray_session, tmp_path,
                                                                     corpus_dir,
                                                                     tokenizer_path):
    """A busy process holds a core while a small job (its three small files one group
    unit) runs: the unit still runs in Ray Data's tokenize map stage (one plan more in Ray
    Data's log), not on the driver."""
    import subprocess

    before = ray_data_plans("MapBatches(tokenize_units)")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        summary = run_tokenize(load_config(None, inputs=[str(corpus_dir)],
                                           output=str(tmp_path / "out"),
                                           tokenizer=tokenizer_path, unit_bytes=1 << 30))
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert summary.units_run == summary.units == 1
    assert len(ray_data_plans("MapBatches(tokenize_units)") - before) == 1
    assert summary.data_startup_seconds > 0 and "Ray start" in summary.render()


def test_a_run_prints_no_ray_line_at_error_level_and_no_progress_bar_notice(
        ray_session, tmp_path, corpus_dir, tokenizer_path, capfd):
    """What reaches the terminal (fd 2, where Ray's C++ core worker writes): raypipe's lines
    and Ray Data's plan, not Ray's error line for an actor pool's actors (ray-project/ray#57733)
    nor its "Progress bars disabled" notice."""
    code = main(["tokenize", str(corpus_dir), "--tokenizer", tokenizer_path, "--output",
                 str(tmp_path / "out"), "--unit-bytes", "1", "--num-workers", "2"])
    captured = capfd.readouterr()
    err = captured.err
    assert code == 0 and "raypipe tokenize -> " in captured.out
    assert "has constructor arguments in the object store" not in err
    assert "Progress bars disabled" not in err
    assert "units (100%)" in err  # raypipe's own progress still gets through the filter


def jsonl_with_a_truncated_gzip(directory, texts):
    """Four good JSON-lines files, then (last in order) a truncated .jsonl.gz."""
    import gzip

    directory.mkdir()
    for index in range(4):
        (directory / f"good{index}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in texts[index * 40:index * 40 + 40]))
    packed = gzip.compress("".join(json.dumps({"text": t}) + "\n"
                                   for t in texts[300:900]).encode())
    bad = directory / "zbad.jsonl.gz"
    bad.write_bytes(packed[:len(packed) // 2])
    return bad


@pytest.mark.slow
def test_a_truncated_gzip_fails_in_one_line_and_the_units_in_flight_commit(
        ray_session, tmp_path, corpus_texts, tokenizer_path, capsys):
    from raypipe.io.manifest import record_problem, unit_record_paths
    from raypipe.io.records import UnitRecord
    from raypipe.io.store import Store

    bad = jsonl_with_a_truncated_gzip(tmp_path / "in", corpus_texts)
    args = ["tokenize", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
            "--tokenizer", tokenizer_path, "--unit-bytes", "2000", "--num-workers", "2"]
    assert main(args) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    error = [line for line in printed if str(bad) in line]
    assert len(error) == 1 and "Traceback" not in "\n".join(printed), printed
    store = Store(tmp_path / "out")
    committed = [UnitRecord.from_json(store.read_json(path), path)
                 for path in unit_record_paths(store)]
    assert committed and all(record_problem(store, r) is None for r in committed)
    summary = run_tokenize(load_config(None, inputs=[str(tmp_path / "in")],
                                       output=str(tmp_path / "out"), tokenizer=tokenizer_path,
                                       unit_bytes=2000, skip_bad_files=True))
    assert summary.units_run == summary.units - len(committed)
    [skipped] = summary.bad_files  # its complete lines before the damage are kept
    assert skipped.uri == str(bad) and skipped.rows_read > 100
    assert summary.documents == 160 + sum(
        1 for text in corpus_texts[300:300 + skipped.rows_read] if text)


@pytest.mark.slow
def test_the_workers_start_while_the_self_check_runs_and_encode_with_its_choice(
        ray_session, tmp_path, corpus_dir, tokenizer_path, monkeypatch):
    from raypipe.preprocess import job
    from raypipe.ray.executor import RayDataRunner

    moments: dict[str, float] = {}
    check, launch = job.with_backend, RayDataRunner.run

    def slow_check(*args, **kwargs):
        time.sleep(2.0)  # the workers are started meanwhile
        checked = check(*args, **kwargs)
        moments["checked"] = time.monotonic()
        return checked

    def launched(self, units, settings):
        moments.setdefault("launched", time.monotonic())
        yield from launch(self, units, settings)

    monkeypatch.setattr(job, "with_backend", slow_check)
    monkeypatch.setattr(RayDataRunner, "run", launched)
    config = load_config(None, inputs=[str(corpus_dir)], output=str(tmp_path / "out"),
                         tokenizer=tokenizer_path, formats=["megatron"], unit_bytes=1,
                         tokenizer_backend="tiktoken")
    summary = run_tokenize(config)
    assert moments["launched"] < moments["checked"]
    assert summary.backend == "tiktoken" and summary.units_run == summary.units > 1
    serial = load_config(None, inputs=[str(corpus_dir)], output=str(tmp_path / "serial"),
                         tokenizer=tokenizer_path, formats=["megatron"], unit_bytes=1)
    run_job(serial)
    assert shard_files(tmp_path / "out") == shard_files(tmp_path / "serial")


def test_a_self_check_that_fails_after_the_workers_started_fails_the_job_with_its_error(
        ray_session, tmp_path, corpus_dir, tokenizer_path, monkeypatch):
    from raypipe.preprocess import job

    def failing_check(*args, **kwargs):
        time.sleep(1.0)
        raise ConfigError("tokenizer_backend: the check's own words")

    monkeypatch.setattr(job, "with_backend", failing_check)
    config = load_config(None, inputs=[str(corpus_dir)], output=str(tmp_path / "out"),
                         tokenizer=tokenizer_path, formats=["megatron"], unit_bytes=1)
    with pytest.raises(ConfigError, match="the check's own words"):
        run_tokenize(config)
    assert not list((tmp_path / "out" / "_units").glob("part-*.json"))


def test_a_job_that_fails_in_planning_after_ray_connected_closes_its_seat_at_the_ledger(
        ray_session, tmp_path, tokenizer_path, monkeypatch):
    """A new output connects Ray while the job plans; a plan that fails then (an input that
    is not parquet) still closes the job at the cluster's ledger: nothing of it is left
    open there."""
    import ray

    from raypipe.errors import InputError
    from raypipe.ray import executor

    seats = []

    class Runner(executor.RayDataRunner):
        def connect(self) -> None:
            super().connect()
            seats.append(self.seat)

    monkeypatch.setattr(executor, "RayDataRunner", Runner)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="bad.parquet"):
        run_tokenize(load_config(None, inputs=[str(tmp_path / "in")],
                                 output=str(tmp_path / "out"), tokenizer=tokenizer_path))
    [seat] = seats
    assert ray.get(seat.ledger.attempts_before.remote(seat.job, ["a unit"])) is None


def test_a_head_start_builds_the_guessed_encoder_that_the_job_keeps_where_its_settings_agree(
        ray_session, tmp_path, tokenizer_path):
    """A head start (in a fresh worker process) waits for the driver's guess at the ledger
    and builds its encoder: the job's first block takes it where the job's settings encode
    alike, and builds another where the self-check chose otherwise; no guess (or a job that
    ended) builds nothing and does not wait."""
    import uuid

    from raypipe.preprocess.job import likely_settings, resolve
    from raypipe.ray.executor import cluster_ledger
    from raypipe.ray.unit_tasks import JobShared, LedgerJob

    pytest.importorskip("gigatoken")
    ledger = cluster_ledger()

    def likely(policy: str):
        return likely_settings(resolve(load_config(
            None, inputs=[str(tmp_path)], output=str(tmp_path / "out"),
            tokenizer=tokenizer_path, special_tokens_in_text=policy)))

    @ray_session.remote(num_cpus=0)
    class MapWorkerProcess:
        def warm_up(self, seat: LedgerJob) -> int | None:
            from raypipe.ray.unit_tasks import WORKER_JOBS, warm_up_worker

            WORKER_JOBS.loaded = None  # as in a new process
            warm_up_worker(seat)
            return None if WORKER_JOBS.loaded is None else id(WORKER_JOBS.loaded.encoder)

        def load(self, seat: LedgerJob) -> int:
            from raypipe.ray.unit_tasks import WORKER_JOBS

            return id(WORKER_JOBS.load(seat).encoder)

    process = MapWorkerProcess.remote()

    def job(guess, checked) -> tuple[int | None, int]:
        """(the head start's encoder, the first block's)."""
        seat = LedgerJob(ledger, uuid.uuid4().hex)
        try:
            warmed = process.warm_up.remote(seat)  # waits for the guess
            ledger.guess.remote(seat.job, None if guess is None else [ray_session.put(guess)])
            ledger.publish.remote(seat.job, [ray_session.put(JobShared(checked, None))])
            return ray_session.get(warmed), ray_session.get(process.load.remote(seat))
        finally:
            ledger.close.remote(seat.job)

    text, special = likely("text"), likely("special")
    assert text is not None and text.tokenizer.backend == "gigatoken"
    try:
        warmed, used = job(text, text)
        assert warmed is not None and used == warmed  # built ahead, kept
        warmed, used = job(text, special)
        assert warmed is not None and used != warmed  # the check's choice differs: built anew
        assert job(None, text)[0] is None  # no guess: nothing built ahead
        ended = LedgerJob(ledger, uuid.uuid4().hex)
        ray_session.get(ledger.close.remote(ended.job))
        # a job that has ended: its head start returns at once, building nothing
        assert ray_session.get(process.warm_up.remote(ended), timeout=60) is None
    finally:
        ray_session.kill(process)


def test_a_worker_process_keeps_its_encoder_for_the_session_s_next_job_that_encodes_alike(
        ray_session, tmp_path, tokenizer_path):
    """A map worker process loads the tokenizer once a session for the jobs that encode
    alike: a second job (another output, the same tokenizer and policy) takes the job's own
    settings and the process's encoder; a job under another special-token policy gets an
    encoder of its own."""
    import uuid

    from raypipe.preprocess.job import resolve
    from raypipe.ray.executor import cluster_ledger
    from raypipe.ray.unit_tasks import JobShared, LedgerJob

    ledger = cluster_ledger()
    seats = []

    def opened(output: str, policy: str) -> LedgerJob:
        settings = resolve(load_config(None, inputs=[str(tmp_path)],
                                       output=str(tmp_path / output), tokenizer=tokenizer_path,
                                       special_tokens_in_text=policy)).settings
        seat = LedgerJob(ledger, uuid.uuid4().hex)
        ray_session.get(ledger.open.remote(seat.job))
        ledger.publish.remote(seat.job, [ray_session.put(JobShared(settings, None))])
        seats.append(seat)
        return seat

    @ray_session.remote(num_cpus=0)
    class MapWorkerProcess:
        def load(self, seat: LedgerJob) -> tuple[int, str]:
            from raypipe.ray.unit_tasks import WORKER_JOBS

            job = WORKER_JOBS.load(seat)
            return id(job.encoder), str(job.settings.config.output)

    process = MapWorkerProcess.remote()
    try:
        first, second, other = (ray_session.get(process.load.remote(seat)) for seat in (
            opened("a", "text"), opened("b", "text"), opened("c", "special")))
    finally:
        ray_session.kill(process)
        for seat in seats:
            ledger.close.remote(seat.job)
    assert first[0] == second[0] and first[1] != second[1]  # one encoder, each job's settings
    assert other[0] != second[0]
