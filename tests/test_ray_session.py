"""Connecting to Ray (raypipe.ray.session): raypipe stops only the local session it started,
autoscaler monitor first, and leaves no process of it behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]

STARTS_AND_STOPS_A_LOCAL_SESSION = """
import json, psutil, ray
from raypipe.ray.session import (ensure_ray, node_processes, shutdown_local_ray,
                                 started_here, stop_autoscaler_monitor)
ensure_ray(None, 1)
started = {kind: [record.process for record in records]
           for kind, records in node_processes().items()}
spawned = psutil.Process().children(recursive=True)
stop_autoscaler_monitor()
report = {"started_here": started_here(), "kinds": sorted(started),
          "monitor_exit": started["monitor"][0].returncode,
          "gcs_alive": started["gcs_server"][0].poll() is None,
          "raylet_alive": started["raylet"][0].poll() is None}
shutdown_local_ray()
_, alive = psutil.wait_procs(spawned, timeout=30)
report.update(alive=[process.pid for process in alive], initialized=ray.is_initialized(),
              spawned=len(spawned))
print(json.dumps(report))
"""


@pytest.mark.slow
def test_the_local_session_raypipe_started_stops_monitor_first_and_leaves_no_process():
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="t-", dir=os.environ["RAY_TMPDIR"]),
           "RAY_ADDRESS": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", STARTS_AND_STOPS_A_LOCAL_SESSION], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["started_here"]
    assert {"gcs_server", "raylet", "monitor"} <= set(report["kinds"])
    # killed (SIGKILL) while the GCS still runs: its SIGTERM handler never waits on a dead GCS
    assert report["monitor_exit"] == -9
    assert report["gcs_alive"] and report["raylet_alive"]
    assert report["spawned"] >= 5 and report["alive"] == []
    assert not report["initialized"]


def test_a_session_raypipe_did_not_start_is_left_running(ray_session):
    from raypipe.ray.session import ensure_ray, leave_ray, shutdown_local_ray, started_here

    assert ensure_ray(None, 2) == 0.0  # the caller's session: joined, nothing started
    assert not started_here()
    shutdown_local_ray()
    assert ray_session.is_initialized()
    leave_ray()  # nor does raypipe disconnect from it
    assert ray_session.is_initialized()


def dead_record(tmp: Path, address: str) -> dict[str, str]:
    """An environment whose Ray temp dir holds a `ray start` record of `address`, a head
    that is gone (its processes stopped by pid; the record stayed)."""
    (tmp / "ray").mkdir(parents=True, exist_ok=True)
    (tmp / "ray" / "ray_current_cluster").write_text(address)
    return {**os.environ, "RAY_TMPDIR": str(tmp), "RAY_ADDRESS": "", "PYTHONPATH": str(ROOT)}


def test_a_stale_cluster_record_is_named_in_one_line(tmp_path, monkeypatch):
    """No Ray started: the probe alone, against a closed port on loopback."""
    import socket

    from raypipe.ray.session import stale_cluster_record

    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert stale_cluster_record() is None  # no record: nothing to say
    dead_record(tmp_path, f"127.0.0.1:{port}")
    line = stale_cluster_record()
    assert f"127.0.0.1:{port}" in line and "does not answer" in line and "\n" not in line
    assert str(tmp_path / "ray" / "ray_current_cluster") in line and "--address" in line
    with socket.socket() as alive:  # a head that answers: joined as before
        alive.bind(("127.0.0.1", 0))
        alive.listen()
        dead_record(tmp_path, f"127.0.0.1:{alive.getsockname()[1]}")
        assert stale_cluster_record() is None


STARTS_BESIDE_A_DEAD_RECORD = """
import time
from raypipe.ray.session import ensure_ray, shutdown_local_ray, started_here
began = time.perf_counter()
ensure_ray(None, 1)
print("STARTED", started_here(), round(time.perf_counter() - began, 1))
shutdown_local_ray()
"""


@pytest.mark.slow
def test_a_dead_recorded_cluster_gives_one_line_and_a_local_ray_within_30_s(tmp_path):
    """The user's case: a `ray start` head stopped by pid at an address that drops packets
    (TEST-NET-1, never routed), its record left behind; the job starts its own Ray."""
    env = dead_record(Path(tempfile.mkdtemp(prefix="t-", dir=os.environ["RAY_TMPDIR"])),
                      "192.0.2.2:6390")
    done = subprocess.run([sys.executable, "-c", STARTS_BESIDE_A_DEAD_RECORD], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    started = next(line for line in done.stdout.splitlines() if line.startswith("STARTED"))
    assert started.split()[1] == "True" and float(started.split()[2]) < 30, started
    warnings = [line for line in done.stderr.splitlines() if "does not answer" in line]
    assert len(warnings) == 1 and "192.0.2.2:6390" in warnings[0], done.stderr[-2000:]
    assert "Failed to connect to GCS" not in done.stderr


def test_ray_data_s_finished_notice_is_dropped_only_while_stopping_on_a_signal():
    """After Ctrl-C, the Dataset whose iteration raypipe closed says "execution finished":
    false then, so it is dropped; any other time it passes."""
    import logging

    from raypipe import interrupts
    from raypipe.ray.session import quiet_ray_notices

    quiet_ray_notices()
    target = logging.getLogger("ray.data._internal.execution.streaming_executor")
    record = target.makeRecord(target.name, logging.INFO, __file__, 1,
                               "✔️ Dataset dataset_3_0 execution finished in 2.10 seconds",
                               (), None)
    assert target.filter(record)
    interrupts._State.raised = 2  # as the SIGINT handler leaves it
    try:
        assert not target.filter(record)
    finally:
        interrupts.reset()


def test_the_ledger_s_module_imports_no_arrow_and_nothing_of_the_job():
    """The cluster's ledger actor runs in one of the workers a session starts with (`ray`
    imported): its module adds nothing heavy there, on cores the map tasks need."""
    import subprocess
    import sys

    probe = ("import sys, ray, raypipe.ray.ledger; "
             "print(sorted(m for m in ('pyarrow', 'numpy', 'raypipe.preprocess', "
             "'raypipe.ray.executor', 'ray.data') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_ledger_keeps_a_job_from_its_first_call_and_a_closed_job_starts_nothing():
    """Ray orders one caller's calls only: a map task's call may reach the cluster's ledger
    before the driver's `open`, and must find the job (not start nothing); once the job is
    closed, a late call changes nothing, and a task waiting for the settings is told."""
    import asyncio

    from raypipe.ray.ledger import ENDED, UnitLedger

    ledger = UnitLedger()
    assert ledger.attempts_before("job", ["a"]) == [0]  # before the driver's open
    ledger.started("job", "a")
    ledger.open("job")  # arriving late, it keeps what the job has
    ledger.started("job", "a")
    assert ledger.attempts_before("job", ["a", "b"]) == [2, 0]
    assert ledger.close("job") == 1  # one start again after a worker died
    ledger.started("job", "a")
    assert ledger.attempts_before("job", ["a"]) is None
    assert asyncio.run(ledger.first_sample("job")) is None

    async def waiting_when_closed() -> None:
        waiting = asyncio.ensure_future(ledger.job_shared("other"))
        await asyncio.sleep(0)
        ledger.close("other")
        with pytest.raises(RuntimeError, match=ENDED):
            await waiting

    asyncio.run(waiting_when_closed())
    assert ledger.guess("job", ["late"]) is None  # a closed job's guess is dropped
    assert asyncio.run(ledger.likely("job")) is None  # and a head start does not wait


def test_the_ledger_s_name_is_its_code_s_the_same_in_every_process_and_not_another_s(
        monkeypatch):
    """Drivers find the cluster's ledger by name: the same code gives the same name in any
    process (no address or id in it), and a ledger whose code differs gets another."""
    import subprocess
    import sys

    from raypipe.ray import ledger as ledger_module

    probe = "from raypipe.ray.ledger import ledger_name; print(ledger_name())"
    names = {subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120).stdout.strip() for _ in range(2)}
    assert names == {ledger_module.ledger_name()}

    def fail(self, job: str) -> None:  # another version's `fail`
        self.jobs.pop(job, None)

    monkeypatch.setattr(ledger_module.UnitLedger, "fail", fail)
    assert ledger_module.ledger_name() not in names


def test_a_recorded_cluster_listening_on_loopback_alone_is_found_and_a_missing_one_named(
        tmp_path):
    """Ray records the machine's address for a head started with --node-ip-address
    127.0.0.1, which listens on loopback alone: the record's port on 127.0.0.1 is tried
    (here the record names 127.0.0.2, where nothing listens). With no record, the line
    says what was looked for and where. No Ray started: probes alone, in a process of its
    own (this one may hold another test's Ray session)."""
    import socket

    code = ("import sys\n"
            "from raypipe.config import load_config\n"
            "from raypipe.ray.launch import executor_for\n"
            "config = load_config(None, inputs=[sys.argv[1]], output=sys.argv[1] + '/out', "
            "tokenizer='unused.json')\n"
            "print('|'.join(executor_for(config)))\n")

    def executor(env: dict[str, str]) -> list[str]:
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().split("|", 1)

    env = {**os.environ, "RAY_TMPDIR": str(tmp_path), "RAY_ADDRESS": "",
           "PYTHONPATH": str(ROOT)}
    where, why = executor(env)
    assert where == "local" and str(tmp_path / "ray" / "ray_current_cluster") in why
    assert "no cluster recorded" in why and "\n" not in why
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        port = head.getsockname()[1]
        where, why = executor(dead_record(tmp_path, f"127.0.0.2:{port}"))
        assert where == "ray" and f"127.0.0.1:{port}" in why
