"""Outputs of earlier releases read as today's: the one compatibility module of the manifest
and the files it lists.

Invariant: every way an earlier release's output differs from today's is named here and
read here as today's shape, so no other module names an old release:
- 0.1 manifests lack the unit list's last three fields and each file's `mtime_ns`, and the
  packing report's token counts are absent before 0.2; a batch section before 0.4 has no
  `pad_id`: each reads as "not recorded" (None, the records' defaults).
- A batch format's packing `bestfit` is crop's name before 0.4 (before 0.2 in the record
  plans' table, `PACKING_RENAMES`): a section recording it reads as crop, a config or
  flag that still gives it is taken (`former_packings`) and packs as crop
  (`current_packing`), its spelling kept in the output's fingerprint.
- LLMBATCH files of 0.3 have no `.lengths` sidecar: their padding positions hold
  `PAD_BEFORE_LENGTHS` instead of a pad token, always a record's tail, so the reader takes
  `SentinelLengths` as their `.lengths` (each record's length: the column of its first
  sentinel, found batch by batch as the batches are read); 0.4 files have no `.pieces` sidecar (the
  loader then finds boundaries by a BOS/EOS scan, and `raypipe trace` refuses them, as
  their records were cut by another rule); unit records before 0.5 do not list their
  skipped rows' runs, so trace names the input but not its row where rows were skipped.
- An output's lock written before leases (0.6 and before) has no `renewed_at`: its holder
  reads as one whose lease never expires (`upgrade_lock_record`), so a holder on another
  host is judged alive, as that release judged it.
- A batch format's section of 0.6 wrote its record length (T + 1) under `seq_len`; today's
  key is `record_len` (`SECTION_RENAMES`), so `seq_len` means T everywhere.
Cost: one dict copy per manifest section read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

PAD_BEFORE_LENGTHS = 0xFFFFFFFF  # LLMBATCH padding of files without a `.lengths` sidecar
SECTION_RENAMES = {"seq_len": "record_len"}  # a batch section's key then -> now
PACKING_RENAMES = {"bestfit": "crop"}  # a batch format's packing then -> now (0.4)


def upgrade_batch_section(options: dict[str, Any]) -> dict[str, Any]:
    """A batch format's section options with the keys of earlier releases renamed."""
    renamed = {SECTION_RENAMES.get(key, key): value for key, value in options.items()
               if key not in SECTION_RENAMES or SECTION_RENAMES[key] not in options}
    if isinstance(renamed.get("packing"), str):
        renamed["packing"] = current_packing(renamed["packing"])
    return renamed


def current_packing(packing: str) -> str:
    """Today's name of a batch format's packing (a former name: the packing it was)."""
    return PACKING_RENAMES.get(packing, packing)


def former_packings() -> tuple[str, ...]:
    """The former names of batch formats' packings that a config or flag still takes."""
    return tuple(PACKING_RENAMES)


class SentinelLengths:
    """The `.lengths` of a 0.3 LLMBATCH file, which has none: record r's length is the
    column of its first PAD_BEFORE_LENGTHS (its record_len where it has none), read from
    batch r // batch_size (`batch(index)`: that batch's [B, T] ids) when asked. Indexed as
    the sidecar's array is (an int, a slice, an index array), or whole (`np.asarray`)."""

    def __init__(self, batch: Callable[[int], np.ndarray], batch_size: int, records: int):
        self.batch, self.batch_size, self.size = batch, batch_size, records

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, item: Any) -> Any:
        records = np.arange(self.size, dtype=np.int64)[item]
        flat = np.atleast_1d(records)
        lengths = np.empty(flat.size, dtype=np.uint32)
        for index in np.unique(flat // self.batch_size).tolist():
            at = np.flatnonzero(flat // self.batch_size == index)
            rows = self.batch(index)[flat[at] % self.batch_size]
            padding = rows == PAD_BEFORE_LENGTHS
            lengths[at] = np.where(padding.any(axis=1), padding.argmax(axis=1),
                                   rows.shape[1])
        return lengths if np.ndim(records) else lengths[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


def upgrade_lock_record(data: dict[str, Any]) -> dict[str, Any]:
    """A lock file's record as today's: one written before leases renews forever."""
    return data if "renewed_at" in data else {**data, "renewed_at": math.inf}
