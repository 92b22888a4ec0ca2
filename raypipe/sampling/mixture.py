"""How a mixture splits each global step's rows between its sources.

Invariant: `allocate` is a pure function of (weights, rows each source has served, rows in
the step): what each source is owed, weight x (rows so far + rows) - served, rounded by
largest remainder (ties to the lower index), so every source stays within one row of its
weight after every step, whatever the step size was before. `spread` places each source's
rows evenly over the step. Cost: O(sources) and O(rows) per step.
"""

from __future__ import annotations

import numpy as np

from raypipe.errors import ConfigError


def allocate(weights: np.ndarray, consumed: np.ndarray, rows: int) -> np.ndarray:
    """Rows per source for the next step (largest remainder of what each source is owed)."""
    owed = np.maximum(weights * (consumed.sum() + rows) - consumed, 0.0)
    if owed.sum() <= 0:
        owed = weights.copy()
    quota = owed / owed.sum() * rows
    counts = np.floor(quota).astype(np.int64)
    remainder = rows - int(counts.sum())
    order = np.argsort(-(quota - counts), kind="stable")
    counts[order[:remainder]] += 1
    return counts


def spread(counts: np.ndarray) -> np.ndarray:
    """Source index of each of the step's slots, each source's slots evenly spaced."""
    keys = [((j + 0.5) / count, source) for source, count in enumerate(counts.tolist())
            for j in range(count)]
    return np.array([source for _, source in sorted(keys)], dtype=np.int64)


def realized_shares(weights: np.ndarray, rows_per_step: int, steps: int) -> np.ndarray:
    """Rows each source serves over `steps` steps from the start, as shares."""
    consumed = np.zeros(len(weights))
    for _ in range(steps):
        consumed += allocate(weights, consumed, rows_per_step)
    return consumed / consumed.sum()


def mixture_weights(names: list[str], weights: dict[str, float] | None,
                    tokens: dict[str, int]) -> np.ndarray:
    """Normalized weights in `names` order: the ones given (every source named, >= 0, not all
    0), else proportional to each source's tokens."""
    if weights is None:
        values = np.array([tokens[name] for name in names], dtype=np.float64)
    else:
        if sorted(weights) != sorted(names):
            raise ConfigError(f"mixture weights name {sorted(weights)}, the sources are "
                              f"{sorted(names)}")
        values = np.array([float(weights[name]) for name in names])
        if not np.all(np.isfinite(values)) or (values < 0).any() or values.sum() <= 0:
            raise ConfigError(f"mixture weights {weights} must be >= 0 and not all 0")
    return values / values.sum()


def step_rows(weights: np.ndarray, consumed: np.ndarray, world_size: int, batch_size: int
              ) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """One global step of a mixture: rows per source, and per slot of the step (rank-major
    spread, so every rank gets its share: slot b * W + r is row b of rank r) the tuple
    (rank, row in the rank's batch, source, the source's n-th row of this step)."""
    counts = allocate(weights, consumed, world_size * batch_size)
    slots = spread(counts).reshape(world_size, batch_size).T.reshape(-1)
    seen = np.zeros(len(weights), dtype=np.int64)
    rows = []
    for slot, source in enumerate(slots.tolist()):
        rows.append((slot % world_size, slot // world_size, source, int(seen[source])))
        seen[source] += 1
    return counts, rows
