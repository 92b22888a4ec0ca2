"""The tokenize job's configuration: one frozen dataclass shared by the CLI, the job script
and the Python API, holding each format the job writes with its typed options (declared by
the format: raypipe.formats) and, for chat data, a ChatConfig.

Invariant: a config is built from (defaults <- YAML file <- explicit overrides) and is
validated on construction; an unknown key or a bad value is a ConfigError naming the key.
`output_fingerprint` hashes exactly the fields that change the bytes written, so a rerun
with, say, more workers or another batch size reuses the committed shards, while a rerun
with another tokenizer or format set is refused (unless `overwrite`). Where things are
(inputs, output, tokenizer path) is not hashed as spelled: the tokenizer counts by its
contents (sha256) and the job compares the resolved input files (raypipe.preprocess.job),
so `corpus/` and `corpus/*.parquet`, or `out` and its absolute path, are the same job.
Cost: microseconds, once per config (options typed and checked here, earlier releases'
shapes upgraded by raypipe.config.compat); a unit reads its formats' options from the config's
dict, nothing per unit or per row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raypipe.config import compat
from raypipe.errors import ConfigError, FormatError
from raypipe.formats import (
    DEFAULT_FORMATS,
    FORMATS,
    PACKING_BY_DATA,
    DocumentFormat,
    FormatOptions,
    document_format,
    document_formats,
    of_kind,
    packing_for_data,
)

# Fields that do not change output bytes: excluded from the fingerprint.
EXECUTION_FIELDS = frozenset({"encode_batch_rows", "num_workers", "address", "executor",
                              "overwrite",
                              "tokenizer_backend", "allow_empty", "skip_bad_files"})
EXECUTORS = ("auto", "ray", "local")
TOKENIZER_BACKENDS = ("auto", "gigatoken", "fastokens", "tiktoken", "tokenizers")
LOCATION_FIELDS = frozenset({"inputs", "output", "tokenizer"})
NANOGPT_MAX_TOKENS = 2**31 - 1
TRAIN_ON = ("assistant", "last-assistant", "all")
# worker memory to tokenize one document, per character: measured 122 B (8k BPE) and ~180 B
# (GPT-2 vocabulary) at 2-10 M characters; planned with 200 B
BYTES_PER_CHARACTER = 200


logger = logging.getLogger("raypipe")

BUILT_IN_METADATA_FIELDS = ("source", "row")  # every stream metadata record has these
# formats whose ecosystem separates documents with EOS (the default separator of a job
# that writes only these)
EOS_FORMATS = tuple(name for name, fmt in FORMATS.items()
                    if isinstance(fmt, DocumentFormat) and fmt.separator == "eos")


def flag_of(name: str) -> str:
    """The command-line flag of TokenizeConfig field `name` (what messages call it); of a
    format's option as a fingerprint names it (`seq_len`, `stream.serializer`): today's."""
    option_flag = compat.flag_of_option(name)
    if option_flag is not None:
        return option_flag
    spec = next((f for f in dataclasses.fields(TokenizeConfig) if f.name == name), None)
    if spec is None or spec.metadata.get("positional"):
        return name
    return spec.metadata.get("flag", "--" + name.replace("_", "-"))


def default_formats(chat: bool) -> tuple[str, ...]:
    """The formats a job writes unless told: megatron and nanogpt; for chat data, those of
    them that hold a loss mask (megatron)."""
    if not chat:
        return DEFAULT_FORMATS
    return tuple(name for name in DEFAULT_FORMATS if FORMATS[name].holds_loss_mask)


def document_separators(formats: tuple[str, ...], bos: bool | None, eos: bool | None,
                        chat: bool = False) -> tuple[bool | None, bool | None]:
    """(bos, eos) for every format of the job: as given, the unset one the opposite of the
    one given (`--eos` alone means EOS is the separator). Neither given: each ecosystem's
    habit, EOS for the formats whose ecosystem appends it (Megatron, MDS), else BOS; where
    the job's document formats differ in it, (None, None): each format gets its own
    (`format_separators`). A job with a batch format keeps one separator (its batches are
    packed from the document shards): EOS only if every format is an EOS one. Chat data adds
    neither unless asked: the rendered template is the document."""
    if chat:
        return bool(bos), bool(eos)
    if bos is None and eos is None:
        habits = {name in EOS_FORMATS for name in formats}
        if len(habits) > 1 and not of_kind(formats, "batches"):
            return None, None
        eos_only = all(name in EOS_FORMATS for name in formats)
        return not eos_only, eos_only
    if bos is None:
        return not eos, bool(eos)
    if eos is None:
        return bool(bos), not bos
    return bos, eos


def option(default: Any = dataclasses.MISSING, help: str = "", **cli: Any) -> Any:
    """A config field with its command-line help (the CLI is generated from these)."""
    kwargs = {"default_factory": default} if callable(default) else {"default": default}
    if default is dataclasses.MISSING:
        kwargs = {}
    return field(**kwargs, metadata={"help": help, **cli})


@dataclass(frozen=True)
class ChatConfig:
    """How a chat job reads and renders its conversations (TokenizeConfig.chat; None: the
    input is text). Field names are the keys of the YAML's `chat:` mapping; each field's
    help is its command-line help (its flag: --<field>)."""

    messages_column: str = option("messages", help="chat: column of [{role, content}, ...]")
    prompt_column: str | None = option(None, help="chat: a prompt column (a user turn); "
                                                  "with --completion-column")
    completion_column: str | None = option(None, help="chat: a completion column (the "
                                                      "assistant's turn)")
    chat_template: str | None = option(None, help="chat: a .jinja file, or chatml (the "
                                                  "built-in); default: the chat_template of "
                                                  "the tokenizer_config.json beside the "
                                                  "tokenizer, else chatml")
    train_on: str = option("assistant", help="chat: which tokens are trained: assistant "
                                             "(each assistant turn and its end), "
                                             "last-assistant, or all")

    def __post_init__(self) -> None:
        if self.train_on not in TRAIN_ON:
            raise ConfigError(f"train_on: {self.train_on!r} not among {list(TRAIN_ON)}")
        if bool(self.prompt_column) != bool(self.completion_column):
            raise ConfigError("chat: --prompt-column and --completion-column go together")

    @property
    def columns(self) -> list[str]:
        """The columns a chat unit reads: the messages, or the prompt and completion."""
        if self.prompt_column and self.completion_column:
            return [self.prompt_column, self.completion_column]
        return [self.messages_column]

    @classmethod
    def of(cls, value: Any) -> ChatConfig | None:
        """A config's `chat` as given: None/false (text), true (the defaults), a mapping of
        its fields, or a ChatConfig."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"chat: expected true, false or a mapping of "
                              f"{[f.name for f in dataclasses.fields(cls)]}, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"chat: unknown key(s) {unknown}; known: {sorted(names)}")
        return cls(**value)


@dataclass(frozen=True)
class TokenizeConfig:
    """What `raypipe tokenize` does. Field names are the YAML keys; each field's help is
    its command-line help."""

    inputs: tuple[str, ...] = option(help="parquet or JSON-lines files (.jsonl, .json, "
                                          ".jsonl.gz, .jsonl.zst), directories (every such "
                                          "file below), globs (** crosses directories), "
                                          "local or s3:// gs:// ...; from Python also a "
                                          "ray.data.Dataset (raypipe.tokenize)",
                                     positional=True)
    output: str = option(help="output directory", short="-o")
    tokenizer: str = option(help="a tokenizer.json path, a tiktoken encoding name "
                                 "(cl100k_base, o200k_base, gpt2, ...) or a Hugging Face hub "
                                 "name (from the local cache, or the hub when it answers)")
    formats: Any = option(
        None, help="comma list of " + ", ".join(FORMATS) + " (default: "
                   + ",".join(DEFAULT_FORMATS) + "; with --chat, the formats that hold a "
                   "loss mask); in YAML and Python also {name: {option: value}}, each "
                   "format's options (flags --<format>-<option>)", flag="--format", type=str)
    text_column: str = option("text", help="column holding the documents")
    chat: Any = option(None, help="the input holds conversations (--messages-column, or "
                                  "--prompt-column with --completion-column), rendered by "
                                  "the chat template, with a loss mask; in YAML and Python "
                                  "true, or a mapping of the chat options below",
                       nested=True)
    bos: bool | None = option(None, help="prepend BOS to every document of every format "
                                         "(nanoGPT/nanochat style; default: each format "
                                         "its ecosystem's separator: EOS for "
                                         + "/".join(EOS_FORMATS) + ", BOS for the others; "
                                         "--eos alone means no BOS)")
    eos: bool | None = option(None, help="append EOS/EOD to every document of every format "
                                         "(Megatron --append-eod, LLM Foundry eos_text; "
                                         "default: each format its ecosystem's separator; "
                                         "--bos alone means no EOS)")
    bos_token: str | None = option(None, help="BOS token string (default: detected)")
    eos_token: str | None = option(None, help="EOS token string (default: detected)")
    shard_tokens: int = option(1 << 29, help="a shard rolls over before the document that "
                                             "would exceed this many tokens")
    unit_bytes: int | None = option(None, help="input bytes per work unit (the unit of "
                                               "parallelism): larger files are cut, smaller "
                                               "ones grouped (default: the value the "
                                               "output's earlier job used, else the input's "
                                               "bytes / 64 within [1 MiB, 64 MiB]: from the "
                                               "input alone, never the cluster)")
    max_document_chars: int | None = option(10_000_000, help="longer documents are skipped "
                                                             "and counted as too_long")
    worker_memory_budget: int = option(2 << 30, help="bytes a worker may spend tokenizing one "
                                                     "document; documents over budget / 200 "
                                                     "characters are skipped as too_long")
    metadata_columns: tuple[str, ...] = option((), help="comma list of per-document columns "
                                                        "each document's metadata record "
                                                        "holds (formats that keep "
                                                        "metadata: stream, mds)")
    span_column: str | None = option(None, help="stream: column of [{start, end, ...}] "
                                                "character spans")
    special_tokens_in_text: str = option(
        "text", help="a special token's literal typed in a document (e.g. <|endoftext|>): "
                     "text (encode its characters; no document can forge a BOS/EOS id) or "
                     "special (the special id, tokenizers' default)")
    tokenizer_backend: str = option(
        "auto", help="auto (the fastest of gigatoken, fastokens and tiktoken that is "
                     "installed, runs the tokenizer.json and passes the start-up "
                     "self-check, else tokenizers), gigatoken, fastokens, tiktoken or "
                     "tokenizers; the shards are the same bytes either way")
    encode_batch_rows: int = option(1024, help="rows per tokenizer call (bounds worker "
                                               "memory)")
    num_workers: int | None = option(None, help="tokenizer actors, or local worker "
                                     "processes (default: all CPUs); also the CPUs of a "
                                     "local Ray raypipe starts")
    address: str | None = option(None, help="Ray cluster address (default: RAY_ADDRESS or "
                                            "a local Ray)")
    executor: str = option("auto", help="where the units run: ray (Ray Data, on the "
                                        "caller's Ray session, the --address cluster or a "
                                        "local Ray raypipe starts), local (processes on this "
                                        "machine, no Ray: input files only) or auto (ray "
                                        "for a Dataset, an address, RAY_ADDRESS, a running "
                                        "Ray session or a cluster `ray start` left here, "
                                        "else local); the shards are the same bytes")
    overwrite: bool = option(False, help="replace an output made with a different config")
    skip_bad_files: bool = option(False, help="skip an input file that cannot be read (a "
                                              "truncated .gz, a corrupt parquet footer or "
                                              "page, a line that is not JSON), keeping the "
                                              "rows read before the error; each is named in "
                                              "the summary and the manifest (without it, "
                                              "such a file fails the job, naming it)")
    allow_empty: bool = option(False, help="accept inputs that yield no document (without it, "
                                           "such a job is an error: exit status 2)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", _as_tuple(self.inputs, "inputs"))
        object.__setattr__(self, "chat", ChatConfig.of(self.chat))
        entries = format_entries(self.formats)
        object.__setattr__(self, "formats", {name: None for name in
                                             default_formats(self.is_chat)}
                           if entries is None else entries)
        object.__setattr__(self, "metadata_columns",
                           _as_tuple(self.metadata_columns, "metadata_columns"))
        if not self.inputs:
            raise ConfigError("inputs: no input given (a glob, a directory or a list of files)")
        if not self.output:
            raise ConfigError("output: no output directory given")
        if not self.tokenizer:
            raise ConfigError("tokenizer: no tokenizer given (a tokenizer.json path or hub name)")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            raise ConfigError(f"formats: {unknown or 'none'} not among {list(FORMATS)}")
        if not 1 <= self.shard_tokens <= NANOGPT_MAX_TOKENS:
            raise ConfigError(f"shard_tokens: {self.shard_tokens} not in [1, 2^31-1]")
        for name in ("encode_batch_rows", "unit_bytes", "worker_memory_budget"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.special_tokens_in_text not in ("text", "special"):
            raise ConfigError(f"special_tokens_in_text: {self.special_tokens_in_text!r} not "
                              "among ['text', 'special']")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"executor: {self.executor!r} not among {list(EXECUTORS)}")
        if self.tokenizer_backend not in TOKENIZER_BACKENDS:
            raise ConfigError(f"tokenizer_backend: {self.tokenizer_backend!r} not among "
                              f"{list(TOKENIZER_BACKENDS)}")
        if self.num_workers is not None and self.num_workers < 1:
            raise ConfigError(f"num_workers: must be >= 1, got {self.num_workers}")
        clashing = sorted(set(self.metadata_columns) & set(BUILT_IN_METADATA_FIELDS))
        if clashing:
            raise ConfigError(
                f"{flag_of('metadata_columns')}: {clashing} would overwrite the built-in "
                f"field(s) of every metadata record ({', '.join(BUILT_IN_METADATA_FIELDS)}: "
                "the input file and row); rename the column(s) in the input")
        bos, eos = document_separators(self.formats, self.bos, self.eos, self.is_chat)
        object.__setattr__(self, "bos", bos)
        object.__setattr__(self, "eos", eos)
        self._check_chat()
        if self.bos is False and self.eos is False and not self.chat:
            raise ConfigError(
                "bos/eos: at least one of --bos/--eos is needed, or document boundaries are lost"
            )
        object.__setattr__(self, "formats", {  # each format's options, typed once, here
            name: typed_options(name, given, self.is_chat)
            for name, given in self.formats.items()})

    def to_dict(self) -> dict[str, Any]:
        """The config as its YAML says it: each format with the options a user sets."""
        data = {spec.name: getattr(self, spec.name) for spec in dataclasses.fields(self)}
        data["inputs"] = list(self.inputs)
        data["formats"] = {name: options.settings() for name, options in self.formats.items()}
        data["metadata_columns"] = list(self.metadata_columns)
        data["chat"] = None if self.chat is None else dataclasses.asdict(self.chat)
        return data

    @property
    def document_formats(self) -> tuple[str, ...]:
        """Formats written per work unit; batch formats are packed afterwards from the
        first of them (a batch format alone: from the preferred document format)."""
        chosen = of_kind(self.formats, "documents")
        return chosen if chosen else document_formats()[:1]

    def format_separators(self, name: str) -> tuple[bool, bool]:
        """(bos, eos) of format `name`: the job's, or (where its document formats differ in
        their ecosystems' habit and no --bos/--eos was given) the format's own."""
        if self.bos is not None and self.eos is not None:
            return self.bos, self.eos
        own_eos = name in EOS_FORMATS
        return not own_eos, own_eos

    @property
    def per_format_separators(self) -> bool:
        """Whether formats of this job get different separators."""
        return self.bos is None

    @property
    def batch_formats(self) -> tuple[str, ...]:
        """Formats packed from the document shards after the units (pre-formed batches)."""
        return of_kind(self.formats, "batches")

    @property
    def is_chat(self) -> bool:
        """The input holds conversations (`chat` is set)."""
        return self.chat is not None

    @property
    def document_char_limit(self) -> int:
        """The longest document tokenized: the explicit limit, or what the worker memory
        budget allows, whichever is smaller."""
        budget_chars = self.worker_memory_budget // BYTES_PER_CHARACTER
        if self.max_document_chars is None:
            return budget_chars
        return min(self.max_document_chars, budget_chars)

    @property
    def char_limit_capped(self) -> str | None:
        """Why the longest document tokenized is below `max_document_chars` (None: it is
        not): the worker memory budget caps it."""
        budget_chars = self.worker_memory_budget // BYTES_PER_CHARACTER
        if self.max_document_chars is None or self.max_document_chars <= budget_chars:
            return None
        return (f"{flag_of('max_document_chars')} {self.max_document_chars:,} is capped at "
                f"{budget_chars:,} characters by {flag_of('worker_memory_budget')} "
                f"{self.worker_memory_budget:,} (tokenizing takes ~{BYTES_PER_CHARACTER} "
                "bytes a character); longer documents are skipped as too_long: raise the "
                "budget to keep them")

    def _check_chat(self) -> None:
        if not self.chat:
            return
        cannot = [name for name in self.formats if not FORMATS[name].holds_loss_mask]
        if cannot:
            able = [name for name, fmt in FORMATS.items() if fmt.holds_loss_mask]
            raise ConfigError(f"--chat: format(s) {', '.join(cannot)} cannot hold a loss mask; "
                              f"the formats that can: {', '.join(able)}")
        by_separator = [name for name in self.document_formats
                        if document_format(name).finds_documents_by_separator]
        if by_separator and not (self.bos or self.eos):
            raise ConfigError(f"--chat: {', '.join(by_separator)} finds conversations by a "
                              "separator token, and chat data adds none unless asked: add "
                              "--bos or --eos (an untrained token around each conversation)")

    def format_options(self, name: str) -> Any:
        """Format `name`'s typed options, as this job writes with them (the data's part
        decided: chat data's loss mask, "auto" packing); a document format written only to
        pack a batch format from: its defaults."""
        if name in self.formats:
            return self.formats[name]
        return typed_options(name, None, self.is_chat)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenizeConfig:
        """A config from its keys, upgraded by raypipe.config.compat."""
        names = {f.name for f in dataclasses.fields(cls)}
        data = compat.upgrade(data, format_entries(data.get("formats")))
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known: {sorted(names)}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in data and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError("missing required option(s): " + ", ".join(
                f"{flag_of(name)} (YAML key {name!r})" for name in missing))
        return cls(**data)

    def output_fields(self) -> dict[str, Any]:
        """The fields that determine output bytes, laid out as raypipe.config.compat lays
        them, so an output of any earlier release keeps its fingerprint (a field added
        since is left out at the value that reproduces the bytes written before it)."""
        names = list(self.formats)
        flat = {**self.to_dict(), "formats": names,
                **compat.fingerprint_fields(names, self.formats,
                                            packing_for_data(PACKING_BY_DATA, self.is_chat)),
                **compat.flat_chat(None if self.chat is None else dataclasses.asdict(self.chat))}
        return compat.without_added_defaults({k: v for k, v in flat.items()
                                              if k not in EXECUTION_FIELDS})

    def meaning_fields(self) -> dict[str, Any]:
        """The output-shaping fields without the locations (inputs, output, tokenizer path)."""
        return {k: v for k, v in self.output_fields().items() if k not in LOCATION_FIELDS}

    def output_fingerprint(self, tokenizer_sha256: str) -> str:
        payload = json.dumps({"config": self.meaning_fields(), "fingerprint_version": 2,
                              "tokenizer_sha256": tokenizer_sha256}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def format_entries(value: Any) -> dict[str, Any] | None:
    """The formats a config names, each with what it gives of its options (None: nothing):
    from a comma list, a list of names, or a mapping of names to options."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {str(name): options for name, options in value.items()}
    return {name: None for name in _as_tuple(value, "formats")}


def typed_options(name: str, given: Any, chat: bool) -> FormatOptions:
    """Format `name`'s typed options from what a config gives (a mapping, typed options or
    nothing), checked: a ConfigError names the format, the option and its flag."""
    if name not in FORMATS:
        raise ConfigError(f"formats: {name!r} not among {list(FORMATS)}")
    if given is not None and not isinstance(given, dict | FormatOptions):
        raise ConfigError(f"formats: {name}: options must be a mapping of option: value, "
                          f"got {type(given).__name__}")
    try:
        return FORMATS[name].options_for(given, chat)
    except FormatError as exc:
        flags = [f"--{name}-{spec.name.replace('_', '-')}"
                 for spec in FORMATS[name].options_type.settable()]
        raise ConfigError(f"formats: {name}: {exc.what}"
                          + (f" (its options' flags: {', '.join(flags)})" if flags else "")
                          ) from None


def _as_tuple(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = ([v.strip() for v in value.split(",") if v.strip()] if name != "inputs"
                 else [value])
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{name}: expected a list, got {type(value).__name__}")
    return tuple(str(v) for v in value)


def load_config(path: str | Path | None = None,
                format_options: dict[str, dict[str, Any]] | None = None,
                **overrides: Any) -> TokenizeConfig:
    """Defaults <- YAML file at `path` <- overrides whose value is not None <- the
    `format_options` given ({format: {option: value}}, the CLI's --<format>-<option>: each
    names a format the job writes). An override of `formats` that lists names keeps the
    options the YAML gives those formats. In the file, the locations (inputs, output,
    tokenizer) may name environment variables ($NAME or ${NAME}); an unset one is an error
    naming it."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot read config: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of config keys")
        data.update(expand_locations(loaded or {}, path))
    given = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(given.get("chat"), dict) and isinstance(data.get("chat"), dict):
        given["chat"] = {**data["chat"], **given["chat"]}  # the flags' over the YAML's
    elif given.get("chat") is True and isinstance(data.get("chat"), dict):
        del given["chat"]  # --chat: the YAML's chat options stand
    if "formats" in given:
        given["formats"] = merged_formats(format_entries(data.get("formats")),
                                          format_entries(given["formats"]))
    data.update(given)
    if format_options:
        data["formats"] = with_options(format_entries(data.get("formats")), format_options)
    return TokenizeConfig.from_dict(data)


def merged_formats(base: dict[str, Any] | None, chosen: dict[str, Any] | None
                   ) -> dict[str, Any] | None:
    """The formats `chosen` names, each with the options `base` gives it unless `chosen`
    gives its own."""
    return None if chosen is None else {
        name: options if options is not None else (base or {}).get(name)
        for name, options in chosen.items()}


def with_options(entries: dict[str, Any] | None, options: dict[str, dict[str, Any]]
                 ) -> dict[str, Any]:
    """`entries` with each format's options in `options` set over its own; a format the job
    does not write is a ConfigError naming its flag."""
    for name, values in options.items():
        if entries is None or name not in entries:
            flags = ", ".join(f"--{name}-{option.replace('_', '-')}" for option in values)
            raise ConfigError(f"{flags}: format {name!r} is not written by this job "
                              f"(formats: {', '.join(entries or DEFAULT_FORMATS)}); add it "
                              "to --format")
    entries = dict(entries or {})
    for name, values in options.items():
        own = entries[name]
        own = own.settings() if isinstance(own, FormatOptions) else dict(own or {})
        entries[name] = {**own, **values}
    return entries


LOCATION_KEYS = ("inputs", "output", "tokenizer")


def expand_locations(data: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """`data` with environment variables expanded in its location values."""
    def expand(key: str, value: Any) -> Any:
        if isinstance(value, list):
            return [expand(key, item) for item in value]
        if not isinstance(value, str) or "$" not in value:
            return value
        expanded = os.path.expandvars(value)
        if "$" in expanded:
            raise ConfigError(f"{path}: {key} {value!r} names an environment variable that "
                              "is not set")
        return expanded

    return {key: expand(key, value) if key in LOCATION_KEYS else value
            for key, value in data.items()}


def dump_config_yaml(config: TokenizeConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
