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
    from raypipe.ray.session import ensure_ray, shutdown_local_ray, started_here

    assert ensure_ray(None, 2) == 0.0  # the caller's session: joined, nothing started
    assert not started_here()
    shutdown_local_ray()
    assert ray_session.is_initialized()
