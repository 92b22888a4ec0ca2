"""Output formats, registered by name. Each module holds one Writer and one Reader."""

from __future__ import annotations

from raypipe.errors import ConfigError
from raypipe.formats.base import Format, ShardReader, ShardWriter
from raypipe.formats.megatron import MEGATRON
from raypipe.formats.nanogpt import NANOGPT
from raypipe.formats.stream import STREAM

FORMATS: dict[str, Format] = {f.name: f for f in (MEGATRON, NANOGPT, STREAM)}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"format {name!r} unknown; known: {sorted(FORMATS)}") from None


__all__ = ["FORMATS", "Format", "ShardReader", "ShardWriter", "get_format"]
