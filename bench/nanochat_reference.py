"""nanochat's streaming best-fit packing, re-implemented from its loader's description, as
the reference the benchmarks and tests compare raypipe's packing against (not shipped in
the package: nothing in raypipe runs it)."""

from __future__ import annotations

import numpy as np


def nanochat_bestfit_crop(lengths: np.ndarray, capacity: int, buffer_size: int = 1000) -> dict:
    """Reference: nanochat's streaming best-fit (1000-document buffer, largest that fits,
    else crop the shortest) on documents in the given order; for benchmark comparison."""
    buffer: list[int] = []
    stream = iter(lengths.tolist())
    used = cropped = 0
    exhausted = False
    while True:
        room = capacity
        while room > 0:
            while not exhausted and len(buffer) < buffer_size:
                nxt = next(stream, None)
                if nxt is None:
                    exhausted = True
                else:
                    buffer.append(nxt)
            if not buffer:
                break
            best = max((i for i, n in enumerate(buffer) if n <= room), key=buffer.__getitem__,
                       default=None)
            if best is not None:
                room -= buffer.pop(best)
            else:
                shortest = min(range(len(buffer)), key=buffer.__getitem__)
                cropped += buffer.pop(shortest) - room
                room = 0
        if room > 0:
            break
        used += capacity
    total = int(lengths.sum())
    return {"used": used, "cropped": cropped, "dropped": total - used - cropped}
