"""The tokenize job with the serial runner (no Ray): round trip, determinism, reruns,
config changes, bad input, shard rolling, conservation."""

from __future__ import annotations

import json
import logging
import threading

import pyarrow as pa
import pytest

from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.errors import ConfigError, InputError
from raypipe.io.store import Store
from raypipe.preprocess.job import SerialRunner, run_job
from raypipe.preprocess.output import unit_records
from tests.conftest import write_parquet
from tests.helpers import expected_documents, file_identities, shard_files


class SlowSerialRunner(SerialRunner):
    """The serial runner as if connecting took long (as a local Ray's start does): the
    job gives the driver a head start."""

    starts_slowly = True


def config_for(corpus, output, tokenizer_path, **options):
    options = {"unit_bytes": 1, "formats": ["megatron", "nanogpt"], **options}
    return load_config(None, inputs=[str(corpus)], output=str(output), tokenizer=tokenizer_path,
                       **options)


@pytest.mark.parametrize("bos,eos", [(True, False), (False, True), (True, True)])
def test_round_trip_equals_direct_tokenization(tmp_path, corpus_dir, tokenizer_path, bos, eos):
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path, bos=bos, eos=eos)
    summary = run_job(config)
    expected = expected_documents(corpus_dir, tokenizer_path, bos, eos)
    for fmt in ("megatron", "nanogpt"):  # nanogpt without BOS: boundaries after each EOS
        got = [doc.tolist() for doc in TokenDataset(tmp_path / "out", fmt).iter_documents()]
        assert got == expected, fmt
    assert summary.documents == len(expected)
    assert summary.tokens == sum(map(len, expected))


def test_output_is_independent_of_batch_size(tmp_path, corpus_dir, tokenizer_path):
    run_job(config_for(corpus_dir, tmp_path / "a", tokenizer_path, encode_batch_rows=7))
    run_job(config_for(corpus_dir, tmp_path / "b", tokenizer_path, encode_batch_rows=1000))
    assert shard_files(tmp_path / "a") == shard_files(tmp_path / "b")


def test_shards_roll_at_shard_tokens_without_splitting_documents(tmp_path, corpus_dir,
                                                                 tokenizer_path):
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path, shard_tokens=3000,
                        unit_bytes=1 << 30)
    run_job(config)
    dataset = TokenDataset(tmp_path / "out")
    assert dataset.num_shards > 3
    lengths = [dataset.reader(i).document_lengths for i in range(dataset.num_shards)]
    for shard_lengths in lengths:
        assert shard_lengths.sum() <= 3000 or len(shard_lengths) == 1
    # a shard closes only when the next document of its unit does not fit: shards are full
    units = [shard.name.rsplit("-", 1)[0] for shard in dataset.shards]
    for index in range(dataset.num_shards - 1):
        if units[index] == units[index + 1]:
            assert lengths[index].sum() + lengths[index + 1][0] > 3000, index
    got = [d.tolist() for d in dataset.iter_documents()]
    assert got == expected_documents(corpus_dir, tokenizer_path)


def test_rerun_of_finished_job_rewrites_nothing(tmp_path, corpus_dir, tokenizer_path):
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path)
    run_job(config)
    before = file_identities(tmp_path / "out")
    summary = run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, encode_batch_rows=3))
    assert summary.units_run == 0
    assert file_identities(tmp_path / "out") == before


def test_rerun_after_partial_run_only_runs_missing_units(tmp_path, corpus_dir, tokenizer_path):
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path)
    first = run_job(config)
    clean = shard_files(tmp_path / "out")
    (tmp_path / "out" / "manifest.json").unlink()
    records = sorted((tmp_path / "out" / "_units").glob("part-1*.json"))
    for record in records:
        record.unlink()
    kept = {k: v for k, v in file_identities(tmp_path / "out").items() if "part-0" in k}
    second = run_job(config)
    assert second.units_run == len(records) < first.units
    assert shard_files(tmp_path / "out") == clean
    now = file_identities(tmp_path / "out")
    assert all(now[k] == v for k, v in kept.items())


def test_rerun_with_other_config_is_refused_unless_overwrite(tmp_path, corpus_dir,
                                                             tokenizer_path):
    run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path))
    before = file_identities(tmp_path / "out")
    with pytest.raises(ConfigError, match=r"eos: False -> True"):
        run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, eos=True))
    assert file_identities(tmp_path / "out") == before
    run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, eos=True, overwrite=True))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["config"]["eos"] is True


def test_bad_rows_are_skipped_and_counted(tmp_path, tokenizer_path):
    corpus = tmp_path / "corpus"
    write_parquet(corpus / "a.parquet", ["hello world", None, "", "more text", None])
    write_parquet(corpus / "c.parquet", [b"bytes ok", b"\xff\xfe"], text_type=pa.binary())
    summary = run_job(config_for(corpus, tmp_path / "out", tokenizer_path))
    assert summary.skipped == {"empty": 1, "invalid_utf8": 1, "null": 2}
    assert summary.documents == 3 and summary.rows == 7
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    totals = manifest["totals"]
    assert totals["rows"] == totals["documents"] + sum(totals["skipped"].values())
    assert "invalid_utf8=1" in summary.render()


def test_missing_column_fails_before_any_work(tmp_path, corpus_dir, tokenizer_path):
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path, text_column="body")
    with pytest.raises(InputError, match=r"'body' not found; available columns: \['id', 'text'\]"):
        run_job(config)
    assert not (tmp_path / "out").exists()  # nothing was created


def test_manifest_records_counts_checksums_and_config(tmp_path, corpus_dir, tokenizer_path):
    run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["tokenizer"]["bos_id"] == 0 and manifest["tokenizer"]["largest_id"] == 1023
    assert manifest["formats"]["megatron"]["dtype"] == "uint16"
    assert manifest["config"]["formats"] == ["megatron", "nanogpt"]
    assert {"raypipe", "pyarrow", "tokenizers"} <= set(manifest["versions"])
    shard = manifest["formats"]["nanogpt"]["shards"][0]
    entry = shard["files"][0]
    import hashlib

    data = (tmp_path / "out" / entry["path"]).read_bytes()
    assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "out" / "config.yaml").exists()
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_rerun_of_finished_job_does_not_touch_ray(tmp_path, corpus_dir, tokenizer_path):
    """In a fresh process (this one may hold the shared Ray session): the rerun through the
    Ray entry point finishes without ever initializing Ray."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("ray")
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path)
    run_job(config)
    root = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path.insert(0, {str(root)!r})\n"
            "import ray\n"
            "from tests.test_job import config_for\n"
            "from raypipe.ray.executor import run_tokenize\n"
            f"summary = run_tokenize(config_for({str(corpus_dir)!r}, {str(tmp_path / 'out')!r}, "
            f"{tokenizer_path!r}))\n"
            "print(summary.units_run, ray.is_initialized())\n"
            "print(summary.render())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.splitlines()[0] == "0 False"
    assert "nothing to run" in done.stdout


def test_the_same_job_spelled_another_way_is_a_no_op(tmp_path, corpus_dir, tokenizer_path,
                                                      monkeypatch):
    import shutil

    shutil.copy(tokenizer_path, tmp_path / "tok.json")
    monkeypatch.chdir(tmp_path)
    first = run_job(config_for(corpus_dir, tmp_path / "out", str(tmp_path / "tok.json")))
    before = file_identities(tmp_path / "out")
    again = run_job(config_for(f"{corpus_dir}/*.parquet", "out", "tok.json"))
    assert again.units_run == 0 and again.units == first.units
    assert file_identities(tmp_path / "out") == before, "a respelled rerun rewrote files"


def test_an_added_input_runs_alone_and_a_removed_one_is_refused_naming_it(
        tmp_path, corpus_dir, tokenizer_path, corpus_texts, caplog):
    corpus = corpus_dir  # this test's own copy
    first = run_job(config_for(corpus, tmp_path / "out", tokenizer_path))
    write_parquet(corpus / "part-9.parquet", corpus_texts[900:960])
    grown = run_job(config_for(corpus, tmp_path / "out", tokenizer_path))
    assert grown.units_run == 1 and grown.units == first.units + 1
    (corpus / "part-0.parquet").unlink()
    with pytest.raises(ConfigError, match=r"1 input file\(s\) no longer given \(.*part-0"):
        run_job(config_for(corpus, tmp_path / "out", tokenizer_path))
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        rebuilt = run_job(config_for(corpus, tmp_path / "out", tokenizer_path,
                                     overwrite=True))
    assert "--overwrite removed" in caplog.text and "1 input file(s)" in caplog.text
    manifest = read_manifest_json(tmp_path / "out")
    assert rebuilt.units_run == 0 and len(manifest["units"]) == rebuilt.units < grown.units
    assert not any("part-0" in unit["uri"] for unit in manifest["units"])
    assert not list((tmp_path / "out" / "megatron").glob("part-0-*")), \
        "the removed input's shards were left behind"


def test_an_output_of_the_previous_release_is_still_recognized(tmp_path, corpus_dir,
                                                                tokenizer_path):
    """0.1-0.2 hashed the paths as spelled: their job and unit records still count."""
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path)
    summary = run_job(config)
    legacy = config.spelled_fingerprint(read_manifest_json(tmp_path / "out")["tokenizer"]
                                        ["sha256"])
    for record in (tmp_path / "out" / "_units").glob("*.json"):
        data = json.loads(record.read_text())
        data["fingerprint"] = legacy
        data.pop("inputs", None)
        record.write_text(json.dumps(data))
    again = run_job(config)
    assert again.units_run == 0 and again.units == summary.units


def read_manifest_json(output):
    return json.loads((output / "manifest.json").read_text())


def test_a_runner_connects_while_the_encoder_self_checks(tmp_path, corpus_dir, tokenizer_path,
                                                         monkeypatch):
    """The self-check (~1 s) runs on a thread while the runner connects (a local Ray starts
    in 3-4 s): it waits here until `connect` has begun, which a sequential job never does."""
    import threading

    from raypipe.preprocess import job

    connecting = threading.Event()
    overlapped = []
    real_with_backend = job.with_backend

    def with_backend(*args):
        overlapped.append(connecting.wait(timeout=20))
        return real_with_backend(*args)

    class ConnectingRunner(SlowSerialRunner):
        def connect(self):
            connecting.set()

    monkeypatch.setattr(job, "with_backend", with_backend)
    summary = run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path),
                      ConnectingRunner())
    assert overlapped == [True]
    assert summary.units_run == summary.units and summary.backend != "tokenizers"
    assert shard_files(tmp_path / "out")


def test_a_failed_head_start_unit_stops_the_runner_at_its_next_record(tmp_path, corpus_dir,
                                                                      tokenizer_path,
                                                                      monkeypatch):
    """The driver's own unit fails (here an injected fault) while Ray starts: the runner is
    closed after one record instead of running every other unit first."""
    import time

    from raypipe import _faults as faults

    marker = tmp_path / "fault-marker"
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, json.dumps(
        {"point": "unit.rows", "action": "raise", "marker": str(marker)}))

    class Runner(SlowSerialRunner):
        ran, given, closed = 0, 0, False

        def connect(self):  # returns once the driver's unit has hit the fault
            deadline = time.monotonic() + 30
            while not marker.exists():
                assert time.monotonic() < deadline, "the driver tokenized nothing meanwhile"
                time.sleep(0.01)
            time.sleep(0.2)  # the head start's thread has raised by now

        def run(self, units, settings):
            self.given = len(units)
            try:
                for record in SerialRunner.run(self, units, settings):
                    self.ran += 1
                    yield record
            finally:
                self.closed = True

    runner = Runner()
    with pytest.raises(faults.InjectedFault):
        run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, unit_bytes=1), runner)
    assert runner.given >= 5 and runner.ran == 1 and runner.closed
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_the_driver_tokenizes_units_while_the_runner_connects(tmp_path, corpus_dir,
                                                              tokenizer_path):
    """While `connect` runs (Ray starting), the driver takes units from the front of the
    queue; the runner gets only the rest, and the output equals a serial run's."""
    import time

    from raypipe.preprocess.summary import steady_seconds

    output = tmp_path / "out"

    class SlowConnectingRunner(SlowSerialRunner):
        given: list = []

        def connect(self):  # returns once the driver has committed a unit (or after 30 s)
            deadline = time.monotonic() + 30
            while not list((output / "_units").glob("part-*.json")):
                assert time.monotonic() < deadline, "the driver tokenized nothing meanwhile"
                time.sleep(0.01)

        def run(self, units, settings):
            self.given = list(units)
            self.records = list(SerialRunner.run(self, units, settings))
            return self.records

    runner = SlowConnectingRunner()
    summary = run_job(config_for(corpus_dir, output, tokenizer_path, unit_bytes=1), runner)
    assert 1 <= summary.units_on_driver < summary.units == summary.units_run
    assert len(runner.given) == summary.units - summary.units_on_driver
    assert "on the driver while Ray started" in summary.render()
    # worker figures come from the runner's units alone (the driver's start before Ray)
    assert summary.steady_seconds == steady_seconds(runner.records)
    assert summary.run_seconds > summary.steady_seconds  # the run began with the driver's
    run_job(config_for(corpus_dir, tmp_path / "serial", tokenizer_path, unit_bytes=1))
    assert shard_files(output) == shard_files(tmp_path / "serial")


def test_the_driver_claims_units_from_the_back_until_the_runners_first_record(
        tmp_path, corpus_dir, tokenizer_path):
    """After connecting, a runner whose workers start slowly (Ray Data's actors) lets the
    driver claim units from the back of its list; each unit is tokenized exactly once, by
    whoever claimed it first, and the output equals a serial run's."""
    import threading
    import time

    output = tmp_path / "out"

    class ClaimingRunner(SlowSerialRunner):
        def __init__(self):
            super().__init__()
            self.lock, self.owner, self.first = threading.Lock(), {}, threading.Event()
            self.ran: list[str] = []

        def claim(self, unit):
            with self.lock:
                return not self.first.is_set() and \
                    self.owner.setdefault(unit.name, "driver") == "driver"

        def run(self, units, settings):  # workers start once the driver has claimed 2
            deadline = time.monotonic() + 30
            while sum(owner == "driver" for owner in self.owner.values()) < 2:
                assert time.monotonic() < deadline, "the driver claimed nothing meanwhile"
                time.sleep(0.01)
            for unit in units:
                with self.lock:
                    if self.owner.setdefault(unit.name, "worker") != "worker":
                        continue
                self.ran.append(unit.name)
                yield from SerialRunner.run(self, [unit], settings)
                self.first.set()

    runner = ClaimingRunner()
    summary = run_job(config_for(corpus_dir, output, tokenizer_path, unit_bytes=1), runner)
    claimed = [name for name, owner in runner.owner.items() if owner == "driver"]
    assert len(claimed) >= 2 and not set(claimed) & set(runner.ran)
    assert summary.units_on_driver >= 2 and summary.units_run == summary.units
    run_job(config_for(corpus_dir, tmp_path / "serial", tokenizer_path, unit_bytes=1))
    assert shard_files(output) == shard_files(tmp_path / "serial")


def test_an_input_of_zero_rows_is_refused_before_anything_starts(tmp_path, tokenizer_path,
                                                                  capsys):
    from raypipe.cli import main

    write_parquet(tmp_path / "corpus" / "empty.parquet", [])
    config = load_config(None, inputs=[str(tmp_path / "corpus")], output=str(tmp_path / "out"),
                         tokenizer=tokenizer_path)
    with pytest.raises(InputError, match=r"empty.parquet: the input \(1 file\(s\)\) has 0 rows"):
        run_job(config)
    assert not (tmp_path / "out").exists()
    assert main(["tokenize", str(tmp_path / "corpus"), "--tokenizer", tokenizer_path,
                 "--output", str(tmp_path / "out")]) == 2
    assert "--allow-empty" in capsys.readouterr().err and not (tmp_path / "out").exists()
    summary = run_job(load_config(None, inputs=[str(tmp_path / "corpus")],
                                  output=str(tmp_path / "out"), tokenizer=tokenizer_path,
                                  allow_empty=True))
    assert summary.documents == 0 and (tmp_path / "out" / "manifest.json").exists()


def test_rows_that_yield_no_document_fail_the_job_unless_allowed(tmp_path, tokenizer_path):
    write_parquet(tmp_path / "corpus" / "nulls.parquet", [None, "", None])
    options = {"inputs": [str(tmp_path / "corpus")], "output": str(tmp_path / "out"),
               "tokenizer": tokenizer_path}
    with pytest.raises(InputError, match=r"yielded no document \(3 row\(s\); skipped: "):
        run_job(load_config(None, **options))
    assert (tmp_path / "out" / "manifest.json").exists()  # committed: a rerun is quick
    with pytest.raises(InputError, match="pass --allow-empty"):
        run_job(load_config(None, **options))
    assert run_job(load_config(None, allow_empty=True, **options)).documents == 0


def test_a_unit_record_keeps_the_cpu_time_its_unit_took(tmp_path, corpus_dir, tokenizer_path):
    """`cpu_seconds` is the unit's own thread's CPU time: a thread spinning beside it while
    the unit runs adds nothing to it (the benchmarks' core-second accounting relies on it)."""
    spinning = threading.Event()

    def spin() -> None:
        while not spinning.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path))
    finally:
        spinning.set()
        spinner.join()
    records = [record for _, record in unit_records(Store(str(tmp_path / "out")))]
    assert records and all(record.cpu_seconds > 0 for record in records)
    unit_cpu, unit_wall = (sum(r.cpu_seconds for r in records), sum(r.seconds for r in records))
    assert unit_cpu < 0.8 * unit_wall  # the spinner held the GIL part of each unit's time
