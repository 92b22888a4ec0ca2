"""SIGINT and SIGTERM end a command with one line and 130 / 143: no traceback, no crash, no
Ray process left after 15 s, nothing committed lost, and the rerun gives the clean bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raypipe import _faults as faults
from raypipe.config import load_config
from raypipe.preprocess.job import run_job
from tests.conftest import write_parquet
from tests.helpers import shard_files

ROOT = Path(__file__).resolve().parents[1]
RAYPIPE = [sys.executable, "-m", "raypipe.cli"]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_a_signal_raises_interrupted_with_its_exit_status():
    done = run_python(
        "import os, signal, sys\n"
        "from raypipe import interrupts\n"
        "interrupts.install()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    import time; time.sleep(5)\n"
        "except interrupts.Interrupted as exc:\n"
        "    print(exc.signal_name, exc.exit_status); sys.exit(exc.exit_status)\n")
    assert (done.returncode, done.stdout.strip()) == (143, "SIGTERM 143")


def test_a_signal_inside_a_deferred_section_is_raised_when_it_ends():
    done = run_python(
        "import os, signal\n"
        "from raypipe import interrupts\n"
        "interrupts.install()\n"
        "steps = []\n"
        "try:\n"
        "    with interrupts.deferred():\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        steps.append('section finished')\n"
        "except interrupts.Interrupted as exc:\n"
        "    steps.append(exc.signal_name)\n"
        "print(steps)\n")
    assert done.stdout.strip() == "['section finished', 'SIGINT']"


def test_a_second_signal_while_the_first_unwinds_exits_at_once():
    done = run_python(
        "import os, signal, time\n"
        "from raypipe import interrupts\n"
        "interrupts.install()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "except interrupts.Interrupted:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # a cleanup that would take long\n"
        "    time.sleep(30)\n")
    assert done.returncode == 143


@pytest.fixture
def big_corpus(tmp_path, corpus_texts):
    directory = tmp_path / "corpus"
    for index in range(6):
        write_parquet(directory / f"part-{index}.parquet", corpus_texts[index::6] * 3,
                      row_group_rows=40)
    return directory


def session_processes(session: int) -> list[str]:
    listing = subprocess.run(["ps", "-eo", "sid=,pid=,args="], capture_output=True,
                             text=True).stdout.splitlines()
    return [line for line in listing if line.split(None, 1)[0] == str(session)]


def interrupted_tokenize(corpus: Path, output: Path, tokenizer_path: str, fault: dict,
                         marker: Path, signum: int, group: bool, executor: str
                         ) -> tuple[int, str, list]:
    """`raypipe tokenize --executor <executor>` in its own session; once a worker pauses at
    the fault, the signal (to the whole process group, as a terminal's Ctrl-C, or to the
    driver alone); then its exit status, stderr, and what of its session is left 15 s
    later."""
    env = {**os.environ, faults.ENVIRONMENT_VARIABLE: json.dumps(fault)}
    process = subprocess.Popen(
        [*RAYPIPE, "tokenize", str(corpus), "--tokenizer", tokenizer_path, "--output",
         str(output), "--unit-bytes", "1", "--num-workers", "2", "--executor", executor],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        start_new_session=True)
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    assert marker.exists(), "no worker reached the fault"
    os.killpg(process.pid, signum) if group else os.kill(process.pid, signum)
    _, stderr = process.communicate(timeout=60)
    deadline = time.monotonic() + 15
    while session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return process.returncode, stderr, session_processes(process.pid)


@pytest.mark.slow
@pytest.mark.parametrize("executor", [pytest.param("ray", marks=pytest.mark.ray), "local"])
@pytest.mark.parametrize("signum,group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_an_interrupted_tokenize_exits_cleanly_and_its_rerun_gives_the_clean_bytes(
        tmp_path, big_corpus, tokenizer_path, signum, group, executor):
    marker = tmp_path / "paused"
    fault = {"point": "unit.rows", "action": "pause", "in": "worker",
             "marker": str(marker), "unit": "part-3"}
    status, stderr, left = interrupted_tokenize(big_corpus, tmp_path / "out", tokenizer_path,
                                                fault, marker, signum, group, executor)
    name = signal.Signals(signum).name
    assert status == 128 + signum, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"raypipe tokenize: interrupted by {name}; ") and \
        "rerun the same command to resume" in last, last
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not left, f"still running 15 s after the exit: {left}"
    config = load_config(None, inputs=[str(big_corpus)], output=str(tmp_path / "out"),
                         tokenizer=tokenizer_path, unit_bytes=1)
    run_job(config)
    clean = load_config(None, inputs=[str(big_corpus)], output=str(tmp_path / "clean"),
                        tokenizer=tokenizer_path, unit_bytes=1)
    run_job(clean)
    assert shard_files(tmp_path / "out") == shard_files(tmp_path / "clean")


@pytest.mark.ray
@pytest.mark.slow
def test_ctrl_c_during_ray_start_up_is_one_line_and_leaves_nothing(tmp_path, big_corpus,
                                                                   tokenizer_path):
    process = subprocess.Popen(
        [*RAYPIPE, "tokenize", str(big_corpus), "--tokenizer", tokenizer_path, "--output",
         str(tmp_path / "out"), "--unit-bytes", "1", "--num-workers", "2", "--executor",
         "ray"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        start_new_session=True)
    time.sleep(2.5)  # imports done; Ray starting (3-8 s on 2 busy cores)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    deadline = time.monotonic() + 15
    while session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert process.returncode in (0, 130), stderr[-3000:]  # 0: it finished first
    if process.returncode == 130:
        assert stderr.strip().splitlines()[-1].startswith(
            "raypipe tokenize: interrupted by SIGINT")
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not session_processes(process.pid)


def test_an_interrupted_verify_and_convert_say_so_in_one_line(tmp_path, monkeypatch, capsys,
                                                              token_dataset):
    from raypipe import interrupts
    from raypipe.cli import main

    def interrupt(*args, **kwargs):
        raise interrupts.Interrupted(signal.SIGTERM)

    monkeypatch.setattr("raypipe.tools.verify.verify_dataset", interrupt)
    monkeypatch.setattr("raypipe.tools.convert.convert_dataset", interrupt)
    before = {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS}
    assert main(["verify", str(token_dataset)]) == 143
    assert main(["convert", str(token_dataset), str(tmp_path / "to"), "--format",
                 "nanogpt"]) == 143
    # a command called from other code leaves that code's signal handlers as it found them
    assert {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS} == before
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == ("raypipe verify: interrupted by SIGTERM; nothing was changed: rerun "
                        "the same command")
    assert lines[1].startswith("raypipe convert: interrupted by SIGTERM; ") and \
        "no manifest yet" in lines[1]
