"""The tokenize job with the serial runner (no Ray): round trip, determinism, reruns,
config changes, bad input, shard rolling, conservation."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

import pyarrow as pa
import pytest

from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.errors import ConfigError, InputError
from raypipe.io.store import Store
from raypipe.preprocess import planning
from raypipe.preprocess.job import SerialRunner, run_job
from raypipe.preprocess.output import unit_records
from raypipe.preprocess.planning import auto_unit_bytes
from raypipe.preprocess.summary import describe_bytes
from tests.conftest import write_parquet
from tests.helpers import expected_documents, file_identities, shard_files


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
    assert got == expected_documents(corpus_dir, tokenizer_path, bos=False, eos=True)


def test_rerun_of_finished_job_rewrites_nothing(tmp_path, corpus_dir, tokenizer_path):
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path)
    run_job(config)
    before = file_identities(tmp_path / "out")
    summary = run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, encode_batch_rows=3))
    assert summary.units_run == 0
    assert file_identities(tmp_path / "out") == before


def test_a_unit_size_left_to_raypipe_follows_the_input_bytes_within_its_bounds():
    assert auto_unit_bytes(0) == planning.MIN_AUTO_UNIT_BYTES
    assert auto_unit_bytes(200_000_000) == -(-200_000_000 // planning.AUTO_UNITS)
    assert auto_unit_bytes(10**13) == planning.MAX_AUTO_UNIT_BYTES


def test_a_small_corpus_left_to_raypipe_is_cut_by_its_bytes_and_a_rerun_plans_the_same(
        tmp_path, corpus_dir, tokenizer_path, monkeypatch):
    monkeypatch.setattr(planning, "MIN_AUTO_UNIT_BYTES", 1)  # the fixture's corpus is KBs
    total = sum(path.stat().st_size for path in corpus_dir.iterdir())
    config = config_for(corpus_dir, tmp_path / "out", tokenizer_path, unit_bytes=None)
    first = run_job(config)
    assert first.units > 3  # three files: under 64 MiB they made one unit before
    job = json.loads((tmp_path / "out" / "_units" / "_job.json").read_text())
    assert job["config"]["unit_bytes"] == -(-total // planning.AUTO_UNITS)
    assert f"{describe_bytes(job['config']['unit_bytes'])} of input a unit" in first.render()
    monkeypatch.setattr(planning, "AUTO_UNITS", 3)  # another size now: the output's holds
    again = run_job(config)
    assert (again.units, again.units_run) == (first.units, 0)


@pytest.mark.parametrize("records_its_config", [True, False])
def test_an_output_of_the_former_default_unit_size_reruns_without_work(
        tmp_path, corpus_dir, tokenizer_path, records_its_config):
    run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, unit_bytes=64 << 20))
    if not records_its_config:  # as the job records of the first releases were
        path = tmp_path / "out" / "_units" / "_job.json"
        path.write_text(json.dumps({"fingerprint": json.loads(path.read_text())["fingerprint"]}))
    before = file_identities(tmp_path / "out")
    again = run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, unit_bytes=None))
    assert (again.units, again.units_run) == (1, 0)
    assert {name: identity for name, identity in file_identities(tmp_path / "out").items()
            if not name.endswith("_job.json")} == \
        {name: identity for name, identity in before.items() if not name.endswith("_job.json")}


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


def test_adding_a_format_to_an_output_points_to_convert_which_makes_the_same_documents(
        tmp_path, corpus_dir, tokenizer_path):
    """A rerun that only adds a format is refused naming `raypipe convert`; the command it
    names, run as given, writes the documents tokenizing with that format would (with the
    same separators; where the new format's own would differ, the message says so)."""
    from raypipe.cli import main

    out = tmp_path / "out"
    separators = {"eos": True, "bos": False}
    run_job(config_for(corpus_dir, out, tokenizer_path, formats=["megatron"], **separators))
    with pytest.raises(ConfigError) as refused:
        run_job(config_for(corpus_dir, out, tokenizer_path, formats=["megatron", "nanogpt"],
                           **separators))
    hint = f"raypipe convert {out} <new output> --format nanogpt"
    assert str(refused.value).endswith("(its documents keep the separators they hold): "
                                       + hint)
    argv = hint.replace("<new output>", str(tmp_path / "added")).split()[1:]
    assert main(argv) == 0
    run_job(config_for(corpus_dir, tmp_path / "direct", tokenizer_path, formats=["nanogpt"],
                       **separators))

    def documents(path):
        return [d.tolist() for d in TokenDataset(path, "nanogpt").iter_documents()]

    assert documents(tmp_path / "added") == documents(tmp_path / "direct")
    with pytest.raises(ConfigError) as own:  # nanogpt's own default: BOS, not EOS
        run_job(config_for(corpus_dir, out, tokenizer_path, formats=["megatron", "nanogpt"]))
    assert "separators they hold, not each new format's own): " + hint in str(own.value)
    with pytest.raises(ConfigError) as other:
        run_job(config_for(corpus_dir, out, tokenizer_path, formats=["megatron", "nanogpt"],
                           shard_tokens=99, **separators))
    assert "convert" not in str(other.value)


def test_rerun_with_other_config_is_refused_unless_overwrite(tmp_path, corpus_dir,
                                                             tokenizer_path):
    run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path))
    before = file_identities(tmp_path / "out")
    with pytest.raises(ConfigError, match=r"--eos: \(not set\) -> True"):
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
    assert manifest["config"]["formats"] == {"megatron": {}, "nanogpt": {}}
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
            "from raypipe.ray.executor import run_on_ray as run_tokenize\n"
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
    from raypipe.config import compat

    legacy = compat.spelled_fingerprint(
        config.output_fields(), read_manifest_json(tmp_path / "out")["tokenizer"]["sha256"])
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

    class ConnectingRunner(SerialRunner):
        def connect(self):
            connecting.set()

    monkeypatch.setattr(job, "with_backend", with_backend)
    summary = run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path),
                      ConnectingRunner())
    assert overlapped == [True]
    assert summary.units_run == summary.units and summary.backend != "tokenizers"
    assert shard_files(tmp_path / "out")


@pytest.mark.skipif(sys.platform != "linux", reason="niceness per thread is Linux's")
def test_the_self_check_runs_at_its_runner_s_worker_niceness_on_a_thread_of_its_own(
        tmp_path, corpus_dir, tokenizer_path, monkeypatch):
    """A runner whose workers run niced (Ray's, at 15) has the driver's self-check thread
    take their niceness, so the check shares the cores with the starting workers; the
    driver's main thread keeps its own."""
    from raypipe.preprocess import job

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    real_with_backend = job.with_backend

    def with_backend(*args):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_with_backend(*args)

    class NicedWorkersRunner(SerialRunner):
        check_niceness = min(19, main_before + 3)

    monkeypatch.setattr(job, "with_backend", with_backend)
    summary = run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path),
                      NicedWorkersRunner())
    assert seen == [NicedWorkersRunner.check_niceness]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
    assert summary.units_run == summary.units > 0


@pytest.mark.skipif(sys.platform != "linux", reason="niceness per thread is Linux's")
def test_a_thread_takes_a_niceness_only_upwards_and_the_main_thread_never():
    from raypipe.preprocess.job import at_niceness

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = niceness()
    at_niceness(min(19, before + 2))
    assert niceness() == before  # the main thread: never raised (it could not come back)
    seen = {}

    def worker():
        at_niceness(min(19, before + 2))
        seen["raised"] = niceness()
        at_niceness(before)  # lower: left as it is
        seen["after lower"] = niceness()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"raised": min(19, before + 2), "after lower": min(19, before + 2)}


def test_every_pending_unit_runs_on_the_runner_however_slowly_it_starts(
        tmp_path, corpus_dir, tokenizer_path, capsys):
    """A runner that takes long to connect (a local Ray on a loaded machine) still gets
    every pending unit: the driver tokenizes none itself, and its start-up is a progress
    line of its own."""
    import time

    output = tmp_path / "out"

    class SlowStartRunner(SerialRunner):
        given: list = []

        def connect(self):
            time.sleep(1.0)
            self.startup_seconds = 1.0

        def startup_line(self):
            return f"runner up in {self.startup_seconds:.2f} s"

        def run(self, units, settings):
            assert not list((output / "_units").glob("part-*.json")), "a unit ran elsewhere"
            self.given = list(units)
            return SerialRunner.run(self, units, settings)

    runner = SlowStartRunner()
    summary = run_job(config_for(corpus_dir, output, tokenizer_path, unit_bytes=1), runner,
                      progress_every=0.0)
    assert len(runner.given) == summary.units == summary.units_run > 1
    assert "raypipe: runner up in 1.00 s" in capsys.readouterr().err
    run_job(config_for(corpus_dir, tmp_path / "serial", tokenizer_path, unit_bytes=1))
    assert shard_files(output) == shard_files(tmp_path / "serial")


def test_a_config_of_the_previous_release_with_head_start_loads_with_a_warning(
        tmp_path, caplog):
    config_file = tmp_path / "job.yaml"
    config_file.write_text("inputs: [a.parquet]\noutput: out\ntokenizer: t.json\n"
                           "head_start: false\n")
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        config = load_config(str(config_file))
    assert config.inputs == ("a.parquet",)
    assert "config key 'head_start' ignored (removed in 0.6" in caplog.text


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


def test_a_directory_of_parquet_and_json_lines_reads_both_and_records_what_it_passed_over(
        tmp_path, corpus_dir, tokenizer_path, corpus_texts):
    """A user's tree of .parquet, .jsonl and .jsonl.gz files: every file is read (the text
    column found in each kind), and a stats file beside them is named in the summary, in
    the manifest, and by `raypipe inspect`, also after a rerun that runs nothing."""
    import gzip
    import shutil

    from raypipe.io.manifest import read_manifest
    from raypipe.tools.inspect import inspect_output

    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    extra = corpus_texts[900:960]
    (data / "more").mkdir()
    (data / "more" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                   for t in extra[:30]))
    (data / "more" / "b.jsonl.gz").write_bytes(gzip.compress("".join(
        json.dumps({"text": t}) + "\n" for t in extra[30:]).encode()))
    (data / "corpus_stats.txt").write_text("rows: 960\n")
    summary = run_job(config_for(data, tmp_path / "out", tokenizer_path))
    assert summary.documents == len(expected_documents(corpus_dir, tokenizer_path)) + \
        sum(1 for t in extra if t)
    stats = str((data / "corpus_stats.txt").resolve())
    assert f"passed over 1 file(s) of the input directories, not read (listed in " \
        f"manifest.json's passed_over): {stats} (not parquet or JSON lines" in summary.render()
    manifest = read_manifest(str(tmp_path / "out"))
    assert [(m.uri, m.bytes) for m in manifest.passed_over] == [(stats, 10)]
    assert f"passed over 1 file(s) of the input directories, not read: {stats}" in \
        inspect_output(str(tmp_path / "out"), samples=0)
    rerun = run_job(config_for(data, tmp_path / "out", tokenizer_path))
    assert rerun.units_run == 0 and stats in rerun.render()


def test_a_listed_json_that_is_not_json_lines_is_passed_over_and_named_a_named_one_fails(
        tmp_path, corpus_texts, tokenizer_path):
    """A stats or notes `.json` beside JSON-lines data (one JSON document, or records
    without the text field) is passed over and named, as a README is; named on its own,
    it fails the job naming it."""
    from raypipe.errors import InputError
    from raypipe.io.manifest import read_manifest

    data = tmp_path / "data"
    data.mkdir()
    (data / "part.json").write_text("".join(json.dumps({"text": t}) + "\n"
                                            for t in corpus_texts[:40] if t))
    (data / "notes.json").write_text(json.dumps({"about": "x", "rows": 40}, indent=2))
    (data / "stats.json").write_text(json.dumps({"rows": 40}) + "\n")
    summary = run_job(config_for(data, tmp_path / "out", tokenizer_path))
    assert summary.documents == sum(1 for t in corpus_texts[:40] if t)
    passed = {m.uri.rsplit("/", 1)[-1]: m.reason
              for m in read_manifest(str(tmp_path / "out")).passed_over}
    assert set(passed) == {"notes.json", "stats.json"}
    assert "not valid JSON" in passed["notes.json"]
    assert "'text' not found" in passed["stats.json"]
    assert "notes.json" in summary.render() and "stats.json" in summary.render()
    with pytest.raises(InputError, match="stats.json"):
        run_job(config_for(data / "stats.json", tmp_path / "out2", tokenizer_path))


@pytest.mark.parametrize("stray", ["notes.txt", "megatron/mine.bin"])
def test_a_non_empty_directory_that_is_not_a_raypipe_output_is_refused(
        tmp_path, corpus_dir, tokenizer_path, stray):
    output = tmp_path / "out"
    (output / stray).parent.mkdir(parents=True, exist_ok=True)
    (output / stray).write_text("the user's own")
    with pytest.raises(ConfigError, match=f"{output}: not a raypipe output and not empty "
                                          rf"\({stray}\)"):
        run_job(config_for(corpus_dir, output, tokenizer_path))
    assert sorted(p.relative_to(output).as_posix() for p in output.rglob("*")
                  if p.is_file()) == [stray]  # nothing written beside it, nothing removed
    with pytest.raises(ConfigError, match="not a raypipe output"):
        run_job(config_for(corpus_dir, output, tokenizer_path, overwrite=True))
    assert (output / stray).read_text() == "the user's own"


def test_verify_names_files_the_manifest_does_not_list(tmp_path, corpus_dir, tokenizer_path,
                                                       capsys):
    from raypipe.cli import main

    output = tmp_path / "out"
    run_job(config_for(corpus_dir, output, tokenizer_path))
    assert main(["verify", str(output)]) == 0
    assert "does not list" not in capsys.readouterr().out
    (output / "notes.txt").write_text("mine")
    (output / "megatron" / "mine.bin").write_bytes(b"\0" * 8)
    assert main(["verify", str(output)]) == 0
    out = capsys.readouterr().out
    assert ": OK (" in out
    assert "2 file(s) the manifest does not list (not raypipe's): megatron/mine.bin, " \
        "notes.txt" in out


@pytest.mark.parametrize("formats,flags,separators", [
    (["megatron"], {}, {"megatron": (False, True)}),  # Megatron's --append-eod
    (["mds"], {}, {"mds": (False, True)}),  # LLM Foundry's eos_text
    (["megatron", "mds"], {}, {"megatron": (False, True), "mds": (False, True)}),
    (["nanogpt"], {}, {"nanogpt": (True, False)}),
    (["megatron", "nanogpt"], {}, {"megatron": (False, True), "nanogpt": (True, False)}),
    (["megatron", "stream"], {}, {"megatron": (False, True), "stream": (True, False)}),
    (["megatron", "nanogpt"], {"eos": True}, {"megatron": (False, True),
                                              "nanogpt": (False, True)}),  # --eos alone
    (["megatron", "llmbatch"], {"seq_len": 129, "batch_size": 4},
     {"megatron": (True, False)}),  # batches are packed from it: one separator
    (["megatron"], {"bos": True}, {"megatron": (True, False)}),
    (["nanogpt"], {"bos": False}, {"nanogpt": (False, True)}),
    (["megatron"], {"bos": True, "eos": True}, {"megatron": (True, True)}),
])
def test_each_format_gets_its_ecosystems_separator_by_default(tmp_path, tokenizer_path,
                                                              formats, flags, separators):
    config = load_config(None, inputs=["x.parquet"], output=str(tmp_path / "out"),
                         tokenizer=tokenizer_path, formats=formats, **flags)
    assert {name: config.format_separators(name) for name in separators} == separators


def test_a_default_job_ends_megatron_documents_with_eos_and_starts_nanogpt_ones_with_bos(
        tmp_path, corpus_dir, tokenizer_path):
    """No --format, no --bos/--eos: each format as its trainer expects it, the manifest
    records each one's separators, and the summary names them."""
    summary = run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, formats=None))
    megatron = TokenDataset(tmp_path / "out", "megatron")
    nanogpt = TokenDataset(tmp_path / "out", "nanogpt")
    assert [d.tolist() for d in megatron.iter_documents()] == \
        expected_documents(corpus_dir, tokenizer_path, bos=False, eos=True)
    assert [d.tolist() for d in nanogpt.iter_documents()] == \
        expected_documents(corpus_dir, tokenizer_path, bos=True, eos=False)
    eos, bos = megatron.eos_id, nanogpt.bos_id
    assert (megatron.bos_id, nanogpt.eos_id) == (None, None) and None not in (bos, eos)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["formats"]["megatron"]["separators"] == {"bos_id": None, "eos_id": eos}
    assert manifest["formats"]["nanogpt"]["separators"] == {"bos_id": bos, "eos_id": None}
    assert megatron.num_tokens == nanogpt.num_tokens == summary.tokens
    rendered = summary.render()
    assert "megatron: EOS <|eos|> after each document" in rendered
    assert "nanogpt: BOS <|bos|> before each document" in rendered


def test_megatron_output_with_eos_has_one_separator_between_documents(tmp_path, corpus_dir,
                                                                      tokenizer_path):
    """`--format megatron --eos` writes `doc EOS doc EOS`: no BOS beside the EOS."""
    run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, formats=["megatron"],
                       eos=True))
    got = [doc.tolist() for doc in TokenDataset(tmp_path / "out", "megatron").iter_documents()]
    assert got == expected_documents(corpus_dir, tokenizer_path, bos=False, eos=True)


def test_bos_and_eos_that_are_one_token_are_refused_together(tmp_path, corpus_dir,
                                                             tokenizer_path):
    """GPT-2's <|endoftext|> is both: --bos with --eos would write it twice in a row."""
    with pytest.raises(ConfigError, match=r"BOS and EOS are the same token .*keep one: "
                                          r"--no-bos"):
        run_job(config_for(corpus_dir, tmp_path / "out", tokenizer_path, bos=True, eos=True,
                           bos_token="<|eos|>", eos_token="<|eos|>"))
    assert not (tmp_path / "out").exists()
