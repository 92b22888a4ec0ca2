"""The command line as a new user meets it: --version, help on every option, and user
errors as one line (never a traceback)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from raypipe._version import __version__
from raypipe.cli import build_parser, main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"raypipe {__version__}"


def test_every_option_of_every_subcommand_has_help():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {action.dest}" for name, sub in commands.choices.items()
               for action in sub._actions
               if not isinstance(action, argparse._HelpAction) and not action.help]
    assert missing == []


@pytest.mark.parametrize("case", ["output is a file", "tokenizer path missing"])
def test_user_errors_are_one_line(tmp_path, corpus_dir, tokenizer_path, capsys, case,
                                  monkeypatch):
    """A user's error is one line, found before Ray starts (seconds, and Ray's own log
    lines): the job never asks for Ray."""
    import raypipe.ray.executor

    def no_ray(*args, **kwargs):
        raise AssertionError("the job started Ray before finding the user's error")

    monkeypatch.setattr(raypipe.ray.executor, "ensure_ray", no_ray)
    output, tokenizer = str(tmp_path / "out"), tokenizer_path
    if case == "output is a file":
        (tmp_path / "out").write_text("not a directory")
    else:
        tokenizer = str(tmp_path / "missing" / "tokenizer.json")
    code = main(["tokenize", str(corpus_dir), "--tokenizer", tokenizer, "--output", output,
                 "--num-workers", "1"])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1 and "Traceback" not in error
    assert (output if case == "output is a file" else tokenizer) in error
    assert "Hub" not in error and "huggingface" not in error


def test_inspect_into_a_closed_pipe_prints_no_traceback(token_dataset):
    result = subprocess.run(f"{sys.executable} -m raypipe.cli inspect {token_dataset} "
                            "--samples 200 | head -1", shell=True, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.startswith("dataset ")
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_a_piped_job_prints_progress_lines_with_an_eta(tmp_path, corpus_dir, tokenizer_path,
                                                        capsys):
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    config = load_config(None, inputs=[str(corpus_dir)], output=str(tmp_path / "out"),
                         tokenizer=tokenizer_path, unit_bytes=1)
    summary = run_job(config, progress_every=0.0)
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("raypipe: ")]
    assert len(lines) == summary.units_run >= 3
    assert all("ETA" in line and "tokens/s" in line for line in lines)
    assert lines[-1].startswith(f"raypipe: {summary.units}/{summary.units} units (100%)")


def test_train_job_rerun_with_nothing_left_says_so_without_starting_ray(tmp_path, capsys,
                                                                        monkeypatch):
    import runpy

    import raypipe.ray.session

    def no_ray(*_: object) -> None:
        raise AssertionError("Ray was started for a run with nothing left to do")

    monkeypatch.setattr(raypipe.ray.session, "ensure_ray", no_ray)
    train = runpy.run_path("jobs/train.py")
    checkpoint = tmp_path / "runs" / "tiny" / "checkpoint_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer.json").write_text('{"step": 60}')
    code = train["main"](["--data", str(tmp_path), "--storage", str(tmp_path / "runs"),
                          "--name", "tiny", "--max-steps", "60"])
    assert code == 0
    assert "nothing to run" in capsys.readouterr().out


def test_record_len_today_and_its_0_6_spellings_set_the_llmbatch_record_length(caplog,
                                                                              monkeypatch):
    from raypipe.cli import config_from_args, convert_options
    from raypipe.config import compat as legacy

    monkeypatch.setattr(legacy, "_warned", set())  # the line is said once per process

    parser = build_parser()
    for flags in (["--llmbatch-record-len", "33", "--llmbatch-batch-size", "2"],
                  ["--record-len", "33", "--batch-size", "2"],
                  ["--seq-len", "33", "--batch-size", "2"]):
        args = parser.parse_args(["tokenize", "corpus", "--tokenizer", "t.json", "--output",
                                  "out", "--format", "llmbatch", *flags])
        options = config_from_args(args).format_options("llmbatch")
        assert (options.record_len, options.batch_size) == (33, 2)
    for flags in (["--llmbatch-record-len", "33", "--llmbatch-batch-size", "2"],
                  ["--record-len", "33", "--batch-size", "2"]):
        convert = parser.parse_args(["convert", "a", "b", "--format", "llmbatch", *flags])
        assert convert_options(convert) == {"record_len": 33, "batch_size": 2}
    retired = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(retired) == 1 and "seq_len -> formats: {llmbatch: {record_len: ...}}, " \
        "--llmbatch-record-len" in retired[0]


def test_train_job_refuses_a_checkpoint_state_it_cannot_resume_before_ray_starts(
        tmp_path, capsys, monkeypatch, token_dataset):
    import json
    import runpy

    import raypipe.ray.session
    from raypipe.loader import TokenLoader

    def no_ray(*_: object) -> None:
        raise AssertionError("Ray was started for a run that cannot resume")

    monkeypatch.setattr(raypipe.ray.session, "ensure_ray", no_ray)
    checkpoint = tmp_path / "runs" / "tiny" / "checkpoint_000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer.json").write_text('{"step": 4}')
    state = TokenLoader(token_dataset, 128, 8).state_dict()
    state["dataset"] = "0" * 16  # made for another dataset
    (checkpoint / "raypipe_loader_state.train.json").write_text(json.dumps(state))
    train = runpy.run_path("jobs/train.py")
    code = train["main"](["--data", str(token_dataset), "--storage", str(tmp_path / "runs"),
                          "--name", "tiny", "--max-steps", "60"])
    error = capsys.readouterr().err
    assert code == 2 and "cannot resume this run" in error and len(error.splitlines()) == 1


def test_on_a_terminal_progress_is_one_bar_redrawn_in_place(tmp_path):
    import io

    from raypipe.io.records import UnitRecord, WorkUnit
    from raypipe.preprocess.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    units = [WorkUnit(f"u{i}.parquet", 0, 1, 10, f"u{i}") for i in range(4)]
    screen = Terminal()
    progress = Progress(units, stream=screen)
    for unit in units:
        progress.update(UnitRecord(unit=unit, fingerprint="f", rows=10, documents=10,
                                   tokens=100, skipped={}, shards=()))
    text = screen.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert "[####################] raypipe: 4/4 units (100%)" in text


def test_progress_prints_between_commits_with_an_honest_eta():
    """A unit may take minutes: a piped run still prints a line every interval, and before
    any unit has committed its ETA says it is unknown instead of guessing."""
    import io
    import time

    from raypipe.io.records import UnitRecord, WorkUnit
    from raypipe.preprocess.progress import Progress

    units = [WorkUnit(f"u{i}.parquet", 0, 1, 10, f"u{i}", size_bytes=100) for i in range(4)]
    log = io.StringIO()
    with Progress(units, every=0.2, stream=log) as progress:
        time.sleep(0.9)  # no unit commits meanwhile
        waiting = log.getvalue().splitlines()
        progress.update(UnitRecord(unit=units[0], fingerprint="f", rows=10, documents=10,
                                   tokens=100, skipped={}, shards=()))
        time.sleep(0.5)
    assert len(waiting) >= 3
    assert all(line.endswith("ETA unknown until a unit commits") for line in waiting)
    after = log.getvalue().splitlines()[len(waiting):]
    assert after and all("raypipe: 1/4 units (25%)" in line and "unknown" not in line
                         for line in after)


def test_no_timed_progress_line_prints_while_ray_starts():
    """Under load Ray may take half a minute to start: no "0/N units" line comes before
    its "Ray up" line; timed lines resume after it."""
    import io
    import time

    from raypipe.io.records import WorkUnit
    from raypipe.preprocess.progress import Progress

    units = [WorkUnit(f"u{i}.parquet", 0, 1, 10, f"u{i}", size_bytes=100) for i in range(2)]
    log = io.StringIO()
    with Progress(units, every=0.1, stream=log) as progress:
        with progress.quiet():  # as the job holds it around the runner's connect()
            time.sleep(0.6)
        progress.note("Ray up in 25.81 s (2 CPUs)")
        time.sleep(0.5)
    lines = log.getvalue().splitlines()
    assert lines[0] == "raypipe: Ray up in 25.81 s (2 CPUs)", lines
    assert any("0/2 units" in line for line in lines[1:])


def test_progress_leaves_the_first_unit_out_of_the_workers_rate_and_notes_ray_start():
    """The workers' first unit carries their start-up: the ETA's rate window opens when it
    commits, so one slow start is never extrapolated over the job; Ray's start-up is a line
    of its own."""
    import io

    from raypipe.io.records import UnitRecord, WorkUnit
    from raypipe.preprocess.progress import Progress

    units = [WorkUnit(f"u{i}.parquet", 0, 1, 10, f"u{i}", size_bytes=100) for i in range(4)]
    records = [UnitRecord(unit=unit, fingerprint="f", rows=10, documents=10, tokens=100,
                          skipped={}, shards=()) for unit in units]
    log = io.StringIO()
    progress = Progress(units, every=1000, stream=log)
    progress.await_workers()
    progress._show(progress.started + 1, finished=False)
    assert log.getvalue().splitlines()[-1].endswith("ETA unknown until a unit commits")
    progress.note("Ray up in 3.20 s (2 CPUs)")
    assert log.getvalue().splitlines()[-1] == "raypipe: Ray up in 3.20 s (2 CPUs)"
    progress.update(records[0])  # the workers' first unit opens the rate window
    progress._show(progress.window[0] + 1, finished=False)
    assert "raypipe: 1/4 units (25%)" in log.getvalue().splitlines()[-1]
    assert log.getvalue().splitlines()[-1].endswith(
        "ETA unknown until the workers commit a unit")
    progress.update(records[1])
    since = progress.window[0]
    progress._show(since + 2, finished=False)  # 100 bytes in 2 s: 200 left take 4 s
    assert log.getvalue().splitlines()[-1].endswith("ETA 0:00:04")


def test_help_states_each_default_once_and_never_as_none(capsys):
    from raypipe.cli import main

    for command in (["tokenize"], ["pack-report"], ["convert"], ["trace"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: None)" not in text, command
        for option in text.split(" --")[1:]:  # each option's help, one default at most
            assert option.count("(default:") <= 1, (command, option)
    with pytest.raises(SystemExit):
        main(["pack-report", "--help"])
    assert "(default: 2048)" in " ".join(capsys.readouterr().out.split())


def test_tokenize_help_names_every_kind_of_input(capsys):
    from raypipe.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "tokenize parquet or JSON-lines files" in " ".join(capsys.readouterr().out.split())

    with pytest.raises(SystemExit):
        main(["tokenize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for kind in ("parquet", "JSON-lines", ".jsonl.zst", "directories", "globs", "s3://",
                 "ray.data.Dataset"):
        assert kind in text, kind


def test_a_comma_list_with_spaces_names_the_same_formats():
    from raypipe.config import load_config

    config = load_config(None, inputs=["a"], output="o", tokenizer="t",
                         formats="megatron, nanogpt")
    assert tuple(config.formats) == ("megatron", "nanogpt")


@pytest.mark.parametrize("options,message", [
    ({"formats": ["llmbatch"]}, r"llmbatch: needs record_len \(tokens per record, >= 2\) "
                                r"and batch_size .* flags: --llmbatch-record-len, "
                                r"--llmbatch-batch-size"),
    ({"formats": ["stream"], "metadata_columns": "id, source"},
     r"--metadata-columns: \['source'\] would overwrite the built-in"),
])
def test_config_errors_name_todays_flags(options, message):
    from raypipe.config import load_config
    from raypipe.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, inputs=["a"], output="o", tokenizer="t", **options)


def test_missing_options_are_named_by_flag_and_yaml_key():
    from raypipe.config import TokenizeConfig
    from raypipe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--tokenizer \(YAML key 'tokenizer'\)"):
        TokenizeConfig.from_dict({"inputs": ["a"], "output": "o"})


def test_a_config_change_is_described_by_flag_and_unset_values_say_so():
    from raypipe.io.records import JobRecord
    from raypipe.preprocess.output import describe_difference

    text = describe_difference(JobRecord("a", {"seq_len": 1025, "packing": "split"}, "x"),
                               JobRecord("b", {"seq_len": None, "packing": "fill"}, "x"))
    assert text == "--llmbatch-packing: 'split' -> 'fill'; --llmbatch-record-len: 1025 -> (not set)"


@pytest.mark.parametrize("fmt,option,value", [("mds", "compression", "lz4"),
                                               ("stream", "serializer", "pickle")])
@pytest.mark.parametrize("spelling", ["today", "0.6"])
def test_a_bad_format_option_is_refused_at_config_time_naming_the_flags(fmt, option, value,
                                                                        spelling):
    from raypipe.config import load_config
    from raypipe.config.compat import FLAT_OPTIONS
    from raypipe.errors import ConfigError

    given = ({"formats": {fmt: {option: value}}} if spelling == "today" else
             {"formats": [fmt], **{key: value for key, (owner, name) in FLAT_OPTIONS.items()
                                   if (owner, name) == (fmt, option)}})
    with pytest.raises(ConfigError, match=f"{value!r} not among") as caught:
        load_config(None, inputs=["x"], output="o", tokenizer="t", **given)
    assert f"--{fmt}-{option}" in str(caught.value)


def test_train_help_states_the_whole_description_and_helps_every_option():
    import runpy

    root = Path(__file__).resolve().parents[1]
    parser = runpy.run_path(str(root / "jobs" / "train.py"))["build_parser"]()
    text = " ".join(parser.format_help().split())
    assert "rerunning with the same --storage/--name resumes." in text  # the sentence, whole
    bare = [action.option_strings[0] for action in parser._actions if not action.help]
    assert not bare, f"options without help: {bare}"


def test_config_file_locations_expand_environment_variables_and_name_an_unset_one(
        tmp_path, monkeypatch):
    from raypipe.config import load_config
    from raypipe.errors import ConfigError

    path = tmp_path / "job.yaml"
    path.write_text("inputs:\n  - ${DEMO_ROOT}/corpus\noutput: $DEMO_ROOT/tokens\n"
                    "tokenizer: t.json\n")
    monkeypatch.setenv("DEMO_ROOT", "/data/demo")
    config = load_config(str(path))
    assert (config.inputs, config.output) == (("/data/demo/corpus",), "/data/demo/tokens")
    monkeypatch.delenv("DEMO_ROOT")
    with pytest.raises(ConfigError, match=r"names an environment variable that is not set"):
        load_config(str(path))


def test_the_cli_turns_faulthandler_on_so_a_native_crash_leaves_a_stack(tmp_path):
    """A segfault in native code under `raypipe` prints the Python stacks, not nothing."""
    crash = ("import ctypes, sys\n"
             "from raypipe import cli\n"
             "cli.run_command = lambda args: ctypes.string_at(0)\n"
             "cli.main(['inspect', 'x'])\n")
    done = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "Fatal Python error" in done.stderr, done.stderr[-2000:]
    assert "in main" in done.stderr


def test_a_read_only_output_directory_is_one_line(tmp_path, corpus_dir, tokenizer_path,
                                                  capsys):
    output = tmp_path / "ro"
    output.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(output)],
                          capture_output=True)
    if made.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {made.stderr.decode().strip()}")
    try:
        status = main(["tokenize", str(corpus_dir), "--output", str(output), "--tokenizer",
                       tokenizer_path])
    finally:
        subprocess.run(["umount", str(output)], check=True)
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and error == [f"raypipe: error: {output}: the output directory is not "
                                     "writable (a read-only file system, or no permission); "
                                     "give one raypipe can write"], error
