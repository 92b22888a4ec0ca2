"""Whether a fast backend's library loads a tokenizer.json: one rule for every library that
loads it itself (gigatoken, fastokens).

Invariant: the library's own loader decides, and whatever it raises becomes the one-line
reason `auto` prints for passing it over (its ids are then checked by the self-check, not
here). Cost: one load, cached by the backend module per tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def cannot_load(library: str, load: Callable[[], Any]) -> str | None:
    """None if `load()` succeeds, else why `library` cannot load the tokenizer."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001  (each library raises its own types)
        return f"{library} cannot load it: {str(exc)[:200]}"
    return None
