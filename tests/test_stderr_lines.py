"""The driver's stderr filter: Ray's one known error line dropped, everything else through
in order, a traceback raised inside printed after it (a fresh process: fd 2 is real)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("[2026-11-25 01:22:12,662 E 26554 26554] core_worker.cc:2465: Actor with class "
         "name: 'MapWorker(MapBatches(TokenizeUnits))' and ID: '1418ae' has constructor "
         "arguments in the object store and max_restarts > 0. If the arguments in the object "
         "store go out of scope or are lost, the actor restart will fail.")

SCRIPT = f"""
import os, sys
from raypipe.ray.stderr_lines import dropping_ray_noise
with dropping_ray_noise():
    os.write(2, b"before\\n")
    os.write(2, {NOISE.encode()!r} + b"\\n")
    sys.stderr.write("\\r[####] progress without a newline")
    sys.stderr.flush()
    os.write(2, b"\\nafter\\n" + {NOISE.encode()!r} + b"\\nlast line\\n")
    raise SystemExit("the error raised inside")
"""


def test_the_known_ray_line_is_dropped_and_the_rest_kept_in_order():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, cwd=ROOT,
                          timeout=60)
    assert done.returncode == 1
    err = done.stderr.decode()  # bytes: "\r" kept as written
    assert "constructor arguments" not in err
    assert err == ("before\n\r[####] progress without a newline\nafter\nlast line\n"
                           "the error raised inside\n")
