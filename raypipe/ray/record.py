"""The cluster `ray start` recorded on this machine: the one a plain `ray.init()` would join.

Invariant: found without importing Ray (a job that runs without Ray never pays its ~0.65 s
import), at the path Ray 2.60 looks at (`ray._common.utils.get_ray_address_file(None)`; a
test holds the two equal). Cost: one small file read and, where a record exists, one TCP
connect to its head (refused at once on loopback; at most RECORD_PROBE_SECONDS where the
address drops packets).
"""

from __future__ import annotations

import os
import socket
import sys

RECORD_PROBE_SECONDS = 3.0  # how long a recorded cluster's head gets to accept a connection


def ray_address_file() -> str:
    """Where `ray start` records its cluster's address."""
    if "RAY_TMPDIR" in os.environ:
        temp = os.environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and "TMPDIR" in os.environ:
        temp = os.environ["TMPDIR"]
    else:
        temp = "/tmp"
    return os.path.join(temp, "ray", "ray_current_cluster")


def cluster_record() -> str | None:
    """The recorded address (None: no record)."""
    try:
        with open(ray_address_file()) as handle:
            return handle.read().strip()
    except OSError:
        return None


def unanswered(address: str) -> OSError | ValueError | None:
    """Why `address`'s head does not accept a connection (None: it does)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=RECORD_PROBE_SECONDS):
            return None
    except (OSError, ValueError) as exc:
        return exc


def recorded_cluster() -> str | None:
    """The recorded cluster's address, if its head answers."""
    address = cluster_record()
    return address if address is not None and unanswered(address) is None else None
