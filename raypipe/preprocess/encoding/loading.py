"""Whether a fast backend's library loads a tokenizer.json: one rule for every library that
loads it itself (gigatoken, fastokens).

Invariant: the library's own loader decides, and whatever it raises becomes the one-line
reason `auto` prints for passing it over (its ids are then checked by the self-check, not
here). Cost: one load, cached by the backend module per tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

REASON_CHARS = 200  # a reason's length at most, cut at a word
# lines of a library's error report that say nothing of why: a header naming the temporary
# file it was given, "Caused by:", a source location
NOISE = re.compile(r"^(Failed to parse \S+|Caused by:?|Location:.*|(at )?\S+:\d+(:\d+)?)$")


def one_line(message: str) -> str:
    """A library's (multi-line) error as one line: its informative lines joined, cut at a
    word within REASON_CHARS."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not NOISE.match(line)] or \
        [line for line in lines if line]
    text = "; ".join(kept)
    if len(text) <= REASON_CHARS:
        return text
    return text[:REASON_CHARS].rsplit(" ", 1)[0] + " ..."


def cannot_load(library: str, load: Callable[[], Any]) -> str | None:
    """None if `load()` succeeds, else why `library` cannot load the tokenizer."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001  (each library raises its own types)
        return f"{library} cannot load it: {one_line(str(exc))}"
    return None
