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
    """The recorded cluster's address, if its head answers: as recorded, or on loopback
    (`answering`)."""
    address = cluster_record()
    return None if address is None else answering(address)


def answering(address: str) -> str | None:
    """`address`, or the same port on 127.0.0.1, whichever head accepts a connection (Ray
    records the machine's address even for a head started with --node-ip-address
    127.0.0.1, which listens on loopback alone); None where neither does."""
    if unanswered(address) is None:
        return address
    loopback = f"127.0.0.1:{address.rpartition(':')[2]}"
    if loopback != address and unanswered(loopback) is None:
        return loopback
    return None


def no_cluster_here() -> str:
    """Why no recorded cluster is used, naming what was looked for and where."""
    address = cluster_record()
    if address is None:
        return (f"no Ray session, no address (--address, RAY_ADDRESS) and no cluster "
                f"recorded at {ray_address_file()} (`ray start` writes it there under this "
                "RAY_TMPDIR)")
    return (f"no Ray session or address, and the cluster recorded at {ray_address_file()} "
            f"({address}) does not answer ({unanswered(address)})")
