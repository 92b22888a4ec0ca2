"""Reliability: killed workers and drivers, crashes at every commit step, disk full, reruns,
conservation, bad inputs, vanished shards. Each test records a figure (printed at the end
of the run under "raypipe figures")."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

from raypipe import _faults as faults
from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.errors import FormatError, InputError, StorageError
from raypipe.preprocess.job import run_job
from raypipe.preprocess.planning import plan_units
from raypipe.tools.verify import verify_dataset
from tests.conftest import write_parquet
from tests.helpers import expected_documents, file_identities, shard_files

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ["megatron", "nanogpt"]


def config_for(corpus, output, tokenizer_path, **options):
    options = {"unit_bytes": 1, "formats": FORMATS, "encode_batch_rows": 50, **options}
    return load_config(None, inputs=[str(corpus)], output=str(output), tokenizer=tokenizer_path,
                       **options)


@pytest.fixture
def clean_run(tmp_path, corpus_dir, tokenizer_path):
    run_job(config_for(corpus_dir, tmp_path / "clean", tokenizer_path))
    return shard_files(tmp_path / "clean")


def temp_files(output: Path) -> list[Path]:
    return sorted(output.rglob("*.tmp"))


def run_driver_subprocess(corpus, output, tokenizer_path, fault) -> int:
    """The serial driver in its own process, crashing (os._exit / SIGKILL) at `fault`."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.test_reliability import config_for\n"
        "from raypipe.preprocess.job import run_job\n"
        f"run_job(config_for({str(corpus)!r}, {str(output)!r}, {tokenizer_path!r}))\n"
    )
    env = {**os.environ, faults.ENVIRONMENT_VARIABLE: json.dumps(fault)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, env=env,
                          timeout=300).returncode


def assert_visible_files_are_clean(output: Path, clean: dict[str, bytes]) -> int:
    """Every file under a final name equals the clean run's file of that name."""
    visible = shard_files(output)
    for name, data in visible.items():
        assert data == clean[name], f"{name} is visible but differs from the clean run"
    return len(visible)


# every runner a job's units run on, as the harness of the tests on workers that die
RUNNERS = [pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow]), "local"]


def runner_job(runner: str, request: pytest.FixtureRequest):
    """The function that runs a job's config on `runner` (Ray Data on the test session's
    Ray, or the local process pool)."""
    if runner == "ray":
        request.getfixturevalue("ray_session")
        from raypipe.ray.executor import run_on_ray

        return run_on_ray
    from raypipe.ray.launch import run_tokenize

    return lambda config: run_tokenize(dataclasses.replace(config, executor="local"))


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("point,action", [("unit.rows", "kill"), ("megatron.after_bin", "kill"),
                                          ("unit.rows", "pause")])
def test_killed_worker_job_finishes_byte_identical(request, tmp_path, corpus_dir,
                                                   tokenizer_path, clean_run, figure, point,
                                                   action, monkeypatch, runner):
    run_tokenize = runner_job(runner, request)
    marker = tmp_path / "fault"
    # the fault fires in workers only (the driver tokenizes nothing itself)
    fault = {"point": point, "unit": "part-0", "action": action, "marker": str(marker),
             "after_rows": 60 if point == "unit.rows" else 0, "in": "worker"}
    killer = None
    if action == "pause":  # a real kill from outside: SIGKILL the paused actor process
        def kill_when_paused():
            while not marker.exists() or not marker.read_text():
                time.sleep(0.05)
            os.kill(int(marker.read_text()), 9)
        killer = threading.Thread(target=kill_when_paused, daemon=True)
        killer.start()
    began = time.perf_counter()
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, json.dumps(fault))
    summary = run_tokenize(config_for(corpus_dir, tmp_path / "out", tokenizer_path,
                                      num_workers=2))
    assert marker.exists()  # the worker really died
    assert summary.unit_retries == 1 and "retried    1 unit run(s)" in summary.render()
    assert shard_files(tmp_path / "out") == clean_run
    assert temp_files(tmp_path / "out") == []
    verify_dataset(tmp_path / "out")
    figure(f"worker killed ({point}, {action}, {runner})",
           f"pid {marker.read_text()} died; job finished {summary.units} units in "
           f"{time.perf_counter() - began:.1f} s, output byte-identical, 0 temp files")


@pytest.mark.parametrize("runner,per_block", [
    pytest.param("ray", 1, marks=[pytest.mark.ray, pytest.mark.slow], id="ray, a unit a block"),
    pytest.param("ray", 4, marks=[pytest.mark.ray, pytest.mark.slow],
                 id="ray, 4 units a block"),
    pytest.param("local", None, id="local")])
def test_a_unit_that_kills_every_worker_fails_naming_its_file_and_keeps_the_rest(
        request, tmp_path, corpus_dir, tokenizer_path, clean_run, figure, monkeypatch,
        runner, per_block):
    from raypipe.preprocess.runners import UNIT_RETRIES

    run_tokenize = runner_job(runner, request)
    if runner == "ray":
        from raypipe.ray import executor

        monkeypatch.setattr(executor, "UNITS_PER_BLOCK", per_block)  # the driver cuts blocks
        monkeypatch.setattr(executor, "BLOCKS_PER_WORKER", 1)
    output = tmp_path / "out"
    config = config_for(corpus_dir, output, tokenizer_path, num_workers=2)
    unit = plan_units(config.inputs, "text", 1)[0]
    fault = {"point": "unit.rows", "unit": unit.name, "action": "kill", "always": True,
             "marker": str(tmp_path / "fault"), "after_rows": 60, "in": "worker"}
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, json.dumps(fault))
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            run_tokenize(config)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    job = threading.Thread(target=run, daemon=True)
    job.start()
    job.join(timeout=240)
    assert outcome, "the job still runs after 240 s: a unit's retries are not bounded"
    assert isinstance(outcome[0], InputError), outcome
    message = str(outcome[0])
    assert message.startswith(f"{unit.uri}: row groups {unit.row_group_start}..")
    assert f"died {UNIT_RETRIES + 1} times" in message
    killed = set((tmp_path / "fault").read_text().split())
    assert len(killed) == UNIT_RETRIES + 1  # each run of the unit killed a worker process
    monkeypatch.delenv(faults.ENVIRONMENT_VARIABLE)
    assert_visible_files_are_clean(output, clean_run)
    # an actor killed as the job failed may still commit the unit it was running (ray.kill
    # is asynchronous): the rerun runs at most what was uncommitted here, and the bad unit
    committed = len(list((output / "_units").glob("part-*.json")))
    assert committed >= 1 and not (output / "_units" / f"{unit.name}.json").exists()
    summary = run_tokenize(config_for(corpus_dir, output, tokenizer_path, num_workers=2))
    assert 1 <= summary.units_run <= summary.units - committed
    assert shard_files(output) == clean_run
    figure(f"a unit that kills every worker ({runner})",
           f"{message[:160]}...; {committed} units kept, rerun ran {summary.units_run}")


def test_killed_driver_rerun_keeps_committed_shards(tmp_path, corpus_dir, tokenizer_path,
                                                    clean_run, figure):
    output = tmp_path / "out"
    fault = {"point": "unit.rows", "unit": "part-2", "after_rows": 60, "action": "exit",
             "marker": str(tmp_path / "fault")}
    assert run_driver_subprocess(corpus_dir, output, tokenizer_path, fault) == 137
    committed = {k: v for k, v in file_identities(output).items()
                 if k.startswith(("megatron/", "nanogpt/")) and not Path(k).name.startswith(".")}
    records = len(list((output / "_units").glob("part-*.json")))
    assert committed and records and not (output / "manifest.json").exists()
    summary = run_job(config_for(corpus_dir, output, tokenizer_path))
    after = file_identities(output)
    assert all(after[name] == identity for name, identity in committed.items())
    assert summary.units_run == summary.units - records
    assert shard_files(output) == clean_run and temp_files(output) == []
    figure("driver killed", f"{records} of {summary.units} units committed before the kill; "
           f"rerun ran {summary.units_run}; {len(committed)} committed files untouched "
           "(same inode and mtime)")


def refusing_runner(units, settings):
    raise AssertionError(f"a rerun of a finished job ran {len(units)} units")


@pytest.mark.slow
def test_rerun_of_1000_shards_runs_nothing_and_rewrites_nothing(tmp_path, tokenizer_path,
                                                                corpus_texts, figure):
    path = tmp_path / "corpus" / "many.parquet"
    write_parquet(path, corpus_texts[:1000], row_group_rows=1)
    config = config_for(path.parent, tmp_path / "out", tokenizer_path, formats=["megatron"])
    first = run_job(config)
    assert first.units == first.shards == 1000
    before = file_identities(tmp_path / "out")
    began = time.perf_counter()
    again = run_job(config, refusing_runner)  # any unit sent to a runner fails the test
    seconds = time.perf_counter() - began
    assert again.units_run == 0 and file_identities(tmp_path / "out") == before
    assert again.shards == 1000 and again.tokens == first.tokens
    figure("rerun of a finished job", f"1000 shards in the manifest: nothing launched, "
           f"decided in {seconds:.2f} s")


CRASH_POINTS = ["shard.commit", "megatron.mid_index", "megatron.after_bin",
                "unit.before_record", "manifest.before_rename", "manifest.after_rename"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_at_every_commit_step_converges(tmp_path, corpus_dir, tokenizer_path, clean_run,
                                              figure, point):
    output = tmp_path / "out"
    fault = {"point": point, "action": "exit", "marker": str(tmp_path / "fault"),
             "unit": None if point.startswith("manifest") else "part-1"}
    assert run_driver_subprocess(corpus_dir, output, tokenizer_path, fault) == 137
    visible = assert_visible_files_are_clean(output, clean_run)
    if (output / "manifest.json").exists():
        verify_dataset(output)  # the manifest is the commit record: all it lists is whole
    else:
        with pytest.raises(FormatError, match="no manifest"):
            verify_dataset(output)  # visibly incomplete
    hidden = len(temp_files(output))
    run_job(config_for(corpus_dir, output, tokenizer_path))
    assert shard_files(output) == clean_run and temp_files(output) == []
    verify_dataset(output)
    figure(f"crash at {point}", f"{visible} files visible, all complete; {hidden} hidden "
           "temp files; rerun converged to the clean output")


def test_injected_disk_full_names_the_path_and_rerun_converges(tmp_path, corpus_dir,
                                                               tokenizer_path, clean_run, figure,
                                                               monkeypatch):
    output = tmp_path / "out"
    fault = {"point": "write", "unit": "part-1", "after_rows": 0, "action": "enospc",
             "marker": str(tmp_path / "fault")}
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, json.dumps(fault))
    with pytest.raises(StorageError) as info:
        run_job(config_for(corpus_dir, output, tokenizer_path))
    monkeypatch.delenv(faults.ENVIRONMENT_VARIABLE)
    assert str(output) in str(info.value) and "No space left on device" in str(info.value)
    assert_visible_files_are_clean(output, clean_run)
    assert temp_files(output) == []
    run_job(config_for(corpus_dir, output, tokenizer_path))
    assert shard_files(output) == clean_run
    figure("disk full (injected ENOSPC)", str(info.value))


def test_real_full_tmpfs_names_the_path_and_rerun_converges(tmp_path, corpus_dir,
                                                            tokenizer_path, clean_run, figure):
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        output = mount / "out"
        with pytest.raises(StorageError) as info:
            run_job(config_for(corpus_dir, output, tokenizer_path))
        assert str(output) in str(info.value)
        assert_visible_files_are_clean(output, clean_run)
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)
        run_job(config_for(corpus_dir, output, tokenizer_path))
        assert shard_files(output) == clean_run and temp_files(output) == []
        figure("disk full (256 KiB tmpfs)", f"{info.value}; after growing it the rerun "
               "converged")
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_conservation_of_documents_and_tokens(tmp_path, tokenizer_path, corpus_texts, figure):
    texts = corpus_texts[:300] + [None, "", None] + corpus_texts[300:330]
    corpus = tmp_path / "corpus"
    write_parquet(corpus / "a.parquet", texts, row_group_rows=40)
    write_parquet(corpus / "b.parquet", [b"ok bytes", b"\xff\xfe bad"], text_type=pa.binary())
    summary = run_job(config_for(corpus, tmp_path / "out", tokenizer_path))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    totals = manifest["totals"]
    assert totals["rows"] == len(texts) + 2
    assert totals["rows"] == totals["documents"] + sum(totals["skipped"].values())
    documents = expected_documents(corpus, tokenizer_path)
    shard_tokens = sum(TokenDataset(tmp_path / "out", fmt).num_tokens for fmt in FORMATS) // 2
    read_tokens = sum(d.size for d in TokenDataset(tmp_path / "out").iter_documents())
    assert totals["tokens"] == shard_tokens == read_tokens == sum(map(len, documents))
    assert summary.documents == len(documents)
    figure("conservation", f"rows {totals['rows']} = documents {totals['documents']} + "
           f"skipped {totals['skipped']}; tokens manifest {totals['tokens']:,} = shards "
           f"{read_tokens:,} = direct {sum(map(len, documents)):,}")


def test_bad_inputs_fail_clearly_or_are_counted(tmp_path, tokenizer_path, corpus_texts,
                                                figure):
    good = write_parquet(tmp_path / "good" / "a.parquet", corpus_texts[:20])
    truncated = tmp_path / "trunc" / "t.parquet"
    truncated.parent.mkdir()
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    fifo = tmp_path / "fifo" / "f.parquet"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    under_file = good / "x.parquet"
    cases = {"truncated parquet": truncated, "not a regular file (FIFO)": fifo,
             "path under a file": under_file, "empty glob": tmp_path / "none" / "*.parquet"}
    messages = {}
    for name, path in cases.items():
        with pytest.raises(InputError) as info:
            run_job(config_for(path, tmp_path / f"out-{len(messages)}", tokenizer_path))
        messages[name] = str(info.value)
        assert str(path) in messages[name] or str(path.parent) in messages[name], name
    figure("bad inputs", "; ".join(f"{k}: {v[:90]}" for k, v in messages.items()))


PEAK_RSS_CODE = """
import resource, sys
sys.path.insert(0, {root!r})
from tests.test_reliability import config_for
from raypipe.preprocess.job import run_job
summary = run_job(config_for({corpus!r}, {output!r}, {tokenizer!r}))
print(summary.skipped, summary.documents, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.slow
def test_100_mb_document_is_skipped_with_bounded_memory(tmp_path, tokenizer_path, corpus_texts,
                                                        figure):
    huge = "All work and no play makes Jack a dull boy. " * (100_000_000 // 44)
    corpus = tmp_path / "corpus"
    write_parquet(corpus / "a.parquet", corpus_texts[:10] + [huge] + corpus_texts[10:20],
                  row_group_rows=5)
    del huge
    code = PEAK_RSS_CODE.format(root=str(ROOT), corpus=str(corpus), output=str(tmp_path / "out"),
                                tokenizer=tokenizer_path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    skipped, documents, peak_kib = done.stdout.split("{")[1].split("}")[0], *map(
        int, done.stdout.split("}")[1].split())
    peak_mib = peak_kib / 1024
    assert "'too_long': 1" in skipped and documents == 20
    # the job's whole process (interpreter, tokenizer, arrow decoding the 100 MB row group:
    # measured 0.6-2.1 GiB, the spread depending on what ran before in the same pytest
    # session, not on this job) stays far below what tokenizing that document would take
    # (~17 GiB at the ~170 bytes of worker memory per character measured at 9.9 M chars)
    assert peak_mib < 3072, f"peak RSS {peak_mib:.0f} MiB"
    figure("100 MB document", f"skipped as too_long (limit 10,000,000 chars); the job's "
           f"process peaked at {peak_mib:.0f} MiB RSS")


def test_loader_refuses_to_open_a_vanished_or_changed_shard(token_dataset, tmp_path, figure):
    import shutil

    from raypipe.loader import TokenLoader

    copy = tmp_path / "copy"
    shutil.copytree(token_dataset, copy)
    def read_an_epoch():  # shards open when first read, not all when the loader starts
        for _ in TokenLoader(copy, 16, 2, mode="windows"):
            pass

    read_an_epoch()  # reads cleanly before the edits
    victim = sorted((copy / "megatron").glob("*.bin"))[1]
    with open(victim, "ab") as handle:
        handle.write(b"\\0\\0")
    with pytest.raises(FormatError, match="size differs from the manifest") as changed:
        read_an_epoch()
    victim.unlink()
    with pytest.raises(FormatError, match="missing") as missing:
        read_an_epoch()
    assert str(victim) in str(changed.value) and str(victim) in str(missing.value)
    figure("loader over a changed dataset", f"{changed.value} | {missing.value}")
