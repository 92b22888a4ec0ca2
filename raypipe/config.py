"""The tokenize job's configuration: one frozen dataclass shared by the CLI, the job script
and the Python API.

Invariant: a config is built from (defaults <- YAML file <- explicit overrides) and is
validated on construction; an unknown key or a bad value is a ConfigError naming the key.
`output_fingerprint` hashes exactly the fields that change the bytes written, so a rerun
with, say, more workers or another batch size reuses the committed shards, while a rerun
with another tokenizer or format set is refused (unless `overwrite`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raypipe.errors import ConfigError

KNOWN_FORMATS = ("megatron", "nanogpt", "stream", "llmbatch")
DOCUMENT_FORMATS = ("megatron", "nanogpt", "stream")
PACKINGS = ("bestfit", "concat")
# Fields that do not change output bytes: excluded from the fingerprint.
EXECUTION_FIELDS = frozenset({"encode_batch_rows", "num_workers", "address", "overwrite",
                              "test_fault"})
NANOGPT_MAX_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class TokenizeConfig:
    """What `raypipe tokenize` does. Field names are the YAML keys."""

    inputs: tuple[str, ...]
    output: str
    tokenizer: str
    formats: tuple[str, ...] = ("megatron", "nanogpt")
    text_column: str = "text"
    bos: bool = True
    eos: bool = False
    bos_token: str | None = None
    eos_token: str | None = None
    shard_tokens: int = 1 << 29
    unit_bytes: int = 64 << 20
    max_document_chars: int | None = 10_000_000
    metadata: bool = True
    metadata_columns: tuple[str, ...] = ()
    span_column: str | None = None
    metadata_serializer: str = "json"
    seq_len: int | None = None
    batch_size: int | None = None
    packing: str = "bestfit"
    seed: int = 0
    batches_per_shard: int = 1024
    encode_batch_rows: int = 1024
    num_workers: int | None = None
    address: str | None = None
    overwrite: bool = False
    test_fault: dict[str, Any] | None = None  # tests only: raypipe.core.faults
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", _as_tuple(self.inputs, "inputs"))
        object.__setattr__(self, "formats", _as_tuple(self.formats, "formats"))
        object.__setattr__(self, "metadata_columns",
                           _as_tuple(self.metadata_columns, "metadata_columns"))
        if not self.inputs:
            raise ConfigError("inputs: no input given (a glob, a directory or a list of files)")
        if not self.output:
            raise ConfigError("output: no output directory given")
        if not self.tokenizer:
            raise ConfigError("tokenizer: no tokenizer given (a tokenizer.json path or hub name)")
        unknown = [f for f in self.formats if f not in KNOWN_FORMATS]
        if unknown or not self.formats:
            raise ConfigError(f"formats: {unknown or 'none'} not among {list(KNOWN_FORMATS)}")
        if not 1 <= self.shard_tokens <= NANOGPT_MAX_TOKENS:
            raise ConfigError(f"shard_tokens: {self.shard_tokens} not in [1, 2^31-1]")
        for name in ("encode_batch_rows", "unit_bytes", "batches_per_shard"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if "llmbatch" in self.formats:
            if not self.seq_len or not self.batch_size or self.seq_len < 2 or self.batch_size < 1:
                raise ConfigError("llmbatch: needs --seq-len T (>= 2) and --batch-size B")
            if self.packing not in PACKINGS:
                raise ConfigError(f"packing: {self.packing!r} not among {list(PACKINGS)}")
        if self.num_workers is not None and self.num_workers < 1:
            raise ConfigError(f"num_workers: must be >= 1, got {self.num_workers}")
        if not self.bos and not self.eos:
            raise ConfigError(
                "bos/eos: at least one of --bos/--eos is needed, or document boundaries are lost"
            )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("extra")
        data["inputs"] = list(self.inputs)
        data["formats"] = list(self.formats)
        data["metadata_columns"] = list(self.metadata_columns)
        return data

    @property
    def document_formats(self) -> tuple[str, ...]:
        """Formats written per work unit; LLMBATCH is packed afterwards from Megatron."""
        chosen = tuple(f for f in self.formats if f in DOCUMENT_FORMATS)
        return chosen if chosen else ("megatron",)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenizeConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known: {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc

    def output_fields(self) -> dict[str, Any]:
        """The fields that determine output bytes."""
        return {k: v for k, v in self.to_dict().items() if k not in EXECUTION_FIELDS}

    def output_fingerprint(self, tokenizer_sha256: str) -> str:
        payload = json.dumps(
            {"config": self.output_fields(), "tokenizer_sha256": tokenizer_sha256},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _as_tuple(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.split(",") if v] if name != "inputs" else [value]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{name}: expected a list, got {type(value).__name__}")
    return tuple(str(v) for v in value)


def load_config(path: str | Path | None = None, **overrides: Any) -> TokenizeConfig:
    """Defaults <- YAML file at `path` <- overrides whose value is not None."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot read config: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of config keys")
        data.update(loaded or {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    return TokenizeConfig.from_dict(data)


def dump_config_yaml(config: TokenizeConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
