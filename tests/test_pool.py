"""The local process pool (raypipe.preprocess.pool) and the choice between it and Ray
(raypipe.ray.launch, raypipe.ray.record): same bytes as the serial runner, bad input named
with the committed units kept, a bug raised as itself, and `auto` taking Ray exactly where a
user has one. No test here starts Ray (the pool's worker deaths are tested with Ray's in
tests/test_reliability.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from raypipe import _faults as faults
from raypipe.config import load_config
from raypipe.errors import InputError
from raypipe.preprocess.job import run_job
from raypipe.preprocess.planning import plan_units
from raypipe.ray.launch import executor_for, run_tokenize
from raypipe.ray.record import ray_address_file
from tests.helpers import expected_documents, shard_files

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ["megatron", "nanogpt", "stream", "mds"]


def config_for(corpus, output, tokenizer_path, **options):
    options = {"unit_bytes": 1, "formats": FORMATS, "encode_batch_rows": 50,
               "executor": "local", **options}
    return load_config(None, inputs=[str(corpus)], output=str(output), tokenizer=tokenizer_path,
                       **options)


@pytest.mark.parametrize("workers", [1, 3])
def test_the_pool_writes_the_serial_runners_bytes_at_any_worker_count(
        tmp_path, corpus_dir, tokenizer_path, workers):
    serial = run_job(config_for(corpus_dir, tmp_path / "serial", tokenizer_path))
    pooled = run_tokenize(config_for(corpus_dir, tmp_path / "pool", tokenizer_path,
                                     num_workers=workers))
    assert pooled.executor == "local" and pooled.units_run == serial.units_run > workers
    assert shard_files(tmp_path / "pool") == shard_files(tmp_path / "serial")
    assert "local worker processes (no Ray)" in pooled.render()
    from raypipe.dataset import TokenDataset

    documents = [d.tolist() for d in TokenDataset(tmp_path / "pool", "nanogpt").iter_documents()]
    assert documents == expected_documents(corpus_dir, tokenizer_path)


def test_a_bad_line_fails_the_job_naming_it_and_keeps_the_units_other_workers_committed(
        tmp_path, corpus_texts, tokenizer_path):
    corpus = tmp_path / "in"
    corpus.mkdir()
    for name in ("a", "c", "d"):
        (corpus / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in corpus_texts[:40] if t))
    lines = [json.dumps({"text": t}) + "\n" for t in corpus_texts[40:46]]
    lines[2] = "not json at all\n"
    (corpus / "b.jsonl").write_text("".join(lines))
    config = config_for(corpus, tmp_path / "out", tokenizer_path, num_workers=2,
                        formats=["megatron"])
    with pytest.raises(InputError, match="b.jsonl: line 3: not valid JSON"):
        run_tokenize(config)
    records = sorted(path.name for path in (tmp_path / "out" / "_units").glob("?-*.json"))
    assert any(name.startswith("a-") for name in records), records  # the other worker's
    assert not (tmp_path / "out" / "manifest.json").exists()
    (corpus / "b.jsonl").write_text("".join(line for i, line in enumerate(lines) if i != 2))
    again = run_tokenize(config)  # the other files' committed units do not run again
    assert again.units_run == again.units - sum(not name.startswith("b-") for name in records)


def test_an_error_that_is_not_bad_input_is_raised_as_itself_once_not_retried(
        tmp_path, corpus_dir, tokenizer_path, monkeypatch):
    marker = tmp_path / "fault"
    unit = plan_units([str(corpus_dir)], "text", 1)[4]
    fault = {"point": "unit.rows", "unit": unit.name, "action": "raise", "always": True,
             "marker": str(marker), "in": "worker"}
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, json.dumps(fault))
    with pytest.raises(faults.InjectedFault) as caught:
        run_tokenize(config_for(corpus_dir, tmp_path / "out", tokenizer_path, num_workers=2))
    assert "raised by the worker tokenizing" in "".join(caught.value.__notes__)
    assert "Traceback" in "".join(caught.value.__notes__)
    assert len(marker.read_text().split()) == 1  # one worker raised it, once: no retry
    assert unit.location in "".join(caught.value.__notes__)


def test_a_local_job_on_the_command_line_never_imports_ray(tmp_path, corpus_dir,
                                                            tokenizer_path):
    code = (
        "import sys\n"
        "from raypipe.cli import main\n"
        f"status = main(['tokenize', {str(corpus_dir)!r}, '--tokenizer', "
        f"{tokenizer_path!r}, '--output', {str(tmp_path / 'out')!r}, '--unit-bytes', '1'])\n"
        "print('ray imported' if 'ray' in sys.modules else 'no ray', status)\n")
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    environment["RAY_TMPDIR"] = str(tmp_path / "no-cluster")  # no `ray start` record here
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=environment, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "no ray 0", done.stderr[-2000:]
    assert "local worker processes, no Ray" in done.stderr
    assert "raypipe tokenize -> " in done.stdout


def test_auto_runs_on_ray_exactly_where_a_user_has_one(tmp_path, corpus_dir, tokenizer_path,
                                                       monkeypatch):
    from raypipe.ray import launch

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray-tmp"))
    # this test process may hold the session of a Ray test run before it on its worker:
    # whether one is held is set here, both ways
    monkeypatch.setattr(launch, "ray_session_running", lambda: True)
    auto = config_for(corpus_dir, tmp_path / "out", tokenizer_path, executor="auto")
    assert executor_for(auto) == ("ray", "this process holds a Ray session")
    monkeypatch.setattr(launch, "ray_session_running", lambda: False)
    assert executor_for(auto)[0] == "local"
    assert executor_for(dataclasses.replace(auto, executor="ray"))[0] == "ray"
    assert executor_for(auto, dataset=object())[0] == "ray"
    with pytest.raises(TypeError, match="a ray.data.Dataset input runs on Ray"):
        executor_for(dataclasses.replace(auto, executor="local"), dataset=object())
    assert executor_for(dataclasses.replace(auto, address="10.0.0.1:6379"))[0] == "ray"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert executor_for(auto)[0] == "ray"
    monkeypatch.delenv("RAY_ADDRESS")
    record = Path(ray_address_file())
    record.parent.mkdir(parents=True)
    with socket.socket() as head:  # a head that accepts connections, as `ray start`'s does
        head.bind(("127.0.0.1", 0))
        head.listen()
        record.write_text(f"127.0.0.1:{head.getsockname()[1]}")
        where, why = executor_for(auto)
        assert where == "ray" and "ray start" in why
    assert executor_for(auto)[0] == "local"  # the record of a head that is gone


@pytest.mark.parametrize("variables", [{"RAY_TMPDIR": "/somewhere/else"},
                                       {"TMPDIR": "/scratch"}, {}])
def test_the_cluster_record_is_where_ray_itself_looks(monkeypatch, variables):
    from ray._common.utils import get_ray_address_file  # Ray's own answer (no Ray started)

    for name in ("RAY_TMPDIR", "TMPDIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert ray_address_file() == get_ray_address_file(None)


@pytest.mark.parametrize("quota,expected", [("max 100000", None), ("150000 100000", 2),
                                            ("50000 100000", 1), ("garbage", None)])
def test_the_default_worker_count_keeps_to_the_cgroup_cpu_quota(tmp_path, quota, expected):
    from raypipe.preprocess.pool import local_cpus

    cpus = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text(quota + "\n")
    assert local_cpus(str(tmp_path / "cpu.max")) == min(cpus, expected or cpus)
    assert local_cpus(str(tmp_path / "absent")) == cpus


def test_a_worker_that_died_before_its_first_unit_costs_a_retry_not_the_job(
        tmp_path, corpus_dir, tokenizer_path):
    from raypipe.preprocess.pool import ProcessPoolRunner

    class OneWorkerDiesAtOnce(ProcessPoolRunner):
        def connect(self) -> None:
            super().connect()
            doomed = self.workers[0].process
            doomed.kill()  # gone before the job hands it its settings and first unit
            doomed.wait()

    serial = run_job(config_for(corpus_dir, tmp_path / "serial", tokenizer_path))
    runner = OneWorkerDiesAtOnce(2)
    summary = run_job(config_for(corpus_dir, tmp_path / "pool", tokenizer_path), runner)
    assert runner.retries == 1 and summary.units_run == serial.units_run
    assert shard_files(tmp_path / "pool") == shard_files(tmp_path / "serial")


def test_a_job_that_fails_before_its_run_leaves_no_worker_process(tmp_path, corpus_dir,
                                                                  tokenizer_path):
    import psutil

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path, num_workers=2,
                        text_column="no_such_column")
    with pytest.raises(InputError, match="no_such_column"):
        run_tokenize(config)  # the workers start before the plan finds the column missing
    left = [child for child in psutil.Process().children(recursive=True)
            if child.pid not in before and child.is_running()
            and child.status() != psutil.STATUS_ZOMBIE]
    assert not left, [child.cmdline() for child in left]


def test_a_worker_keeps_its_warmed_up_encoder_only_where_the_check_chose_the_same(
        tmp_path, corpus_dir, tokenizer_path):
    """The encoder built from the likely settings is the one a unit gets where the check
    returns them; where it chose another backend, the worker builds that one."""
    from raypipe.preprocess.job import likely_settings, resolve
    from raypipe.preprocess.runners import encoder_for, warmed_up

    pytest.importorskip("gigatoken")
    resolved = resolve(config_for(corpus_dir, tmp_path / "out", tokenizer_path))
    likely = likely_settings(resolved)
    assert likely is not None and likely.tokenizer.backend == "gigatoken"
    warm = warmed_up(likely)
    assert warm is not None
    checked = dataclasses.replace(likely, tokenizer=dataclasses.replace(likely.tokenizer))
    assert encoder_for(checked, warm) is warm[1]
    passed_over = dataclasses.replace(
        likely, tokenizer=dataclasses.replace(likely.tokenizer, backend="tokenizers"))
    rebuilt = encoder_for(passed_over, warm)
    assert rebuilt is not warm[1] and rebuilt.backend == "tokenizers"


def test_a_guess_the_worker_cannot_build_is_dropped_not_fatal(tmp_path, corpus_dir,
                                                                tokenizer_path):
    from raypipe.preprocess.job import likely_settings, resolve
    from raypipe.preprocess.runners import warmed_up

    likely = likely_settings(resolve(config_for(corpus_dir, tmp_path / "out", tokenizer_path)))
    assert likely is not None
    broken = "{not a tokenizer"  # with its own fingerprint, as the driver would give it
    assert warmed_up(dataclasses.replace(likely, tokenizer_json=broken, tokenizer=(
        dataclasses.replace(likely.tokenizer, sha256=hashlib.sha256(
            broken.encode()).hexdigest())))) is None
