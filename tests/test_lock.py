"""The output's lock: a dead holder (exited, a zombie, its pid reused, before a reboot, or
a lease not renewed on another host) is taken over with a warning; a live one is refused."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest

from raypipe.errors import ConfigError
from raypipe.io import lock
from raypipe.io.lock import LOCK_NAME, LockRecord, output_lock, process_start
from raypipe.io.store import Store


def write_lock(output, record: LockRecord) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / LOCK_NAME).write_text(json.dumps(asdict(record)))


def record_of(pid: int, **fields) -> LockRecord:
    found = process_start(pid)
    return replace(LockRecord.mine(), pid=pid, process_start=found[1] if found else None,
                   **fields)


def takes_over(output, caplog, reason: str) -> None:
    with caplog.at_level(logging.WARNING, logger="raypipe"), output_lock(Store(output)):
        held = json.loads((output / LOCK_NAME).read_text())
        assert held["pid"] == os.getpid()
    assert "taking over the lock of a job that is gone" in caplog.text
    assert reason in caplog.text
    assert not (output / LOCK_NAME).exists()


@pytest.fixture
def sleeper():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_a_live_holder_on_this_host_is_refused(tmp_path, sleeper):
    write_lock(tmp_path / "out", record_of(sleeper.pid))
    with pytest.raises(ConfigError, match=f"another raypipe job is writing this output "
                                          f"\\(pid {sleeper.pid} on this host"), \
            output_lock(Store(tmp_path / "out")):
        pass


def test_a_zombie_holder_is_dead(tmp_path, caplog):
    """A SIGKILLed driver whose parent never reaps it: `kill(pid, 0)` still succeeds."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    record = record_of(child.pid)
    deadline = time.monotonic() + 30
    while process_start(child.pid)[0] != "Z":  # exited, not reaped (no wait() yet)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(child.pid, 0)  # what the old check relied on: it succeeds for a zombie
    write_lock(tmp_path / "out", record)
    try:
        takes_over(tmp_path / "out", caplog, f"pid {child.pid} is a zombie")
    finally:
        child.wait()


def test_a_dead_holders_pid_reused_by_a_live_process_is_dead(tmp_path, caplog, sleeper):
    record = record_of(sleeper.pid)
    write_lock(tmp_path / "out", replace(record, process_start=record.process_start - 1))
    takes_over(tmp_path / "out", caplog, f"pid {sleeper.pid} is now another process")


def test_an_exited_holder_and_one_from_before_a_reboot_are_dead(tmp_path, caplog):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    record = record_of(child.pid)
    child.wait()
    write_lock(tmp_path / "a", record)
    takes_over(tmp_path / "a", caplog, f"pid {child.pid} has exited")
    write_lock(tmp_path / "b", replace(LockRecord.mine(), boot_id="another-boot"))
    takes_over(tmp_path / "b", caplog, "this host rebooted since")


def test_another_hosts_lease_is_refused_while_renewed_and_taken_over_once_expired(
        tmp_path, caplog):
    other = replace(LockRecord.mine(), host="other-" + socket.gethostname(), pid=4242)
    write_lock(tmp_path / "out", other)
    with pytest.raises(ConfigError, match="pid 4242 on host 'other-.*its lease is taken "
                                          "over once 60 s pass without renewal"), \
            output_lock(Store(tmp_path / "out")):
        pass
    write_lock(tmp_path / "out", replace(other, renewed_at=time.time() - 61))
    takes_over(tmp_path / "out", caplog, "its lease expired: not renewed for 61 s")


def test_the_holder_renews_its_lease_while_it_holds_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "LEASE_SECONDS", 0.3)
    with output_lock(Store(tmp_path / "out")):
        first = json.loads((tmp_path / "out" / LOCK_NAME).read_text())["renewed_at"]
        deadline = time.monotonic() + 10
        while json.loads((tmp_path / "out" / LOCK_NAME).read_text())["renewed_at"] == first:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
    assert not (tmp_path / "out" / LOCK_NAME).exists()


def test_another_hosts_lock_from_before_leases_is_refused_however_old(tmp_path):
    """A lock written by a release before leases (no `renewed_at`) reads as a lease that
    never expires: its holder on another host is refused, not taken over, and the refusal
    promises no lease."""
    other = asdict(replace(LockRecord.mine(), host="other-" + socket.gethostname(), pid=4243,
                           started_at=time.time() - 86_400))
    del other["renewed_at"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(ConfigError, match=r"pid 4243 on host 'other-[^;]*, since [0-9:]+\); "
                                          "wait for it"), \
            output_lock(Store(tmp_path / "out")):
        pass
    assert not LockRecord.from_json(other).expires
