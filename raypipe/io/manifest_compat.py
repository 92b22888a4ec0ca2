"""Outputs of earlier releases read as today's: the one compatibility module of the manifest
and the files it lists.

Invariant: every way an earlier release's output differs from today's is named here and
read here as today's shape, so no other module names an old release:
- 0.1 manifests lack the unit list's last three fields and each file's `mtime_ns`, and the
  packing report's token counts are absent before 0.2; a batch section before 0.4 has no
  `pad_id`: each reads as "not recorded" (None, the records' defaults).
- A batch format's packing `bestfit` is crop's name before 0.4 (before 0.2 in the record
  plans' table): it still reads, as crop.
- LLMBATCH files of 0.3 have no `.lengths` sidecar: their padding positions hold
  `PAD_BEFORE_LENGTHS` instead of a pad token; 0.4 files have no `.pieces` sidecar (the
  loader then finds boundaries by a BOS/EOS scan, and `raypipe trace` refuses them, as
  their records were cut by another rule); unit records before 0.5 do not list their
  skipped rows' runs, so trace names the input but not its row where rows were skipped.
- A batch format's section of 0.6 wrote its record length (T + 1) under `seq_len`; today's
  key is `record_len` (`SECTION_RENAMES`), so `seq_len` means T everywhere.
Cost: one dict copy per manifest section read.
"""

from __future__ import annotations

from typing import Any

PAD_BEFORE_LENGTHS = 0xFFFFFFFF  # LLMBATCH padding of files without a `.lengths` sidecar
SECTION_RENAMES = {"seq_len": "record_len"}  # a batch section's key then -> now


def upgrade_batch_section(options: dict[str, Any]) -> dict[str, Any]:
    """A batch format's section options with the keys of earlier releases renamed."""
    renamed = {SECTION_RENAMES.get(key, key): value for key, value in options.items()
               if key not in SECTION_RENAMES or SECTION_RENAMES[key] not in options}
    return renamed
