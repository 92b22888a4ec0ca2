"""Histograms of document lengths: a readable chart with matplotlib (the `plot` extra: axes,
log-scale ticks, labels, title), else a dependency-free PNG of bars (numpy + zlib).

Invariant: writes a valid PNG atomically either way; the plain one is an 8-bit grayscale
PNG (signature, IHDR, one IDAT, IEND with CRCs) without text, and says so. Cost: seconds of
import with matplotlib; O(width x height), ~1 ms, for the plain one.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from raypipe.io.atomic import write_bytes_atomic


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(image: np.ndarray) -> bytes:
    """uint8 [H, W] grayscale -> PNG bytes."""
    height, width = image.shape
    rows = np.hstack([np.zeros((height, 1), np.uint8), image.astype(np.uint8)])
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"".join([b"\x89PNG\r\n\x1a\n", _chunk(b"IHDR", header),
                     _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)), _chunk(b"IEND", b"")])


def histogram_png(values: np.ndarray, path: Path, bins: int = 60, width: int = 640,
                  height: int = 360, log_x: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Bar chart of `values` (log-spaced bins by default); returns (counts, edges)."""
    values = np.asarray(values, dtype=np.float64)
    low, high = max(values.min(), 1.0), max(values.max(), 2.0)
    edges = (np.geomspace(low, high * 1.0001, bins + 1) if log_x
             else np.linspace(low, high, bins + 1))
    counts, _ = np.histogram(values, edges)
    image = np.full((height, width), 255, np.uint8)
    margin = 20
    plot_h, plot_w = height - 2 * margin, width - 2 * margin
    bar_w = max(1, plot_w // bins)
    scale = plot_h / max(int(counts.max()), 1)
    for index, count in enumerate(counts.tolist()):
        top = height - margin - int(round(count * scale))
        left = margin + index * bar_w
        image[top:height - margin, left:left + max(bar_w - 1, 1)] = 60
    image[height - margin, margin:width - margin] = 0  # x axis
    image[margin:height - margin, margin] = 0  # y axis
    write_bytes_atomic(Path(path), encode_png(image))
    return counts, edges


def histogram_chart(values: np.ndarray, path: Path, title: str, bins: int = 60) -> str:
    """A histogram of `values` (log-spaced bins) with axes, ticks, labels and a title;
    returns how it was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        histogram_png(values, path, bins)
        return "plain bars: pip install 'raypipe[plot]' (matplotlib) for axes and labels"
    import io

    values = np.asarray(values, dtype=np.float64)
    low, high = max(values.min(), 1.0), max(values.max(), 2.0)
    edges = np.geomspace(low, high * 1.0001, bins + 1)
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    axes.hist(values, bins=edges, color="#4c72b0", edgecolor="white", linewidth=0.3)
    axes.set_xscale("log")
    axes.set_xlabel("document length (tokens, log scale)")
    axes.set_ylabel("documents")
    axes.set_title(title)
    axes.grid(alpha=0.3, which="both")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    write_bytes_atomic(Path(path), buffer.getvalue())
    return "matplotlib, axes and labels"
