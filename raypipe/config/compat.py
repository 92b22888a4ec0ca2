"""The tokenize config's shapes of earlier releases, upgraded on read: its one
compatibility module (the loader state's is raypipe.sampling.state_compat, the manifest's
raypipe.io.manifest_compat), the command line's retired flags included.

Invariant: a config of raypipe 0.1-0.6 loads as today's. Its YAML keys and keywords
(`seq_len`, `mds_compression`, ...: options of one format, flat beside the job's own fields)
move into `formats: {name: {option: value}}`, and its flat chat keys (`messages_column`,
`train_on`, ...) into the `chat:` mapping, with one deprecation line per process naming each
retired key and its new spelling; keys that no longer do anything load with a warning.
`fingerprint_fields` lays today's options out in 0.6's flat shape, so an output made by any
earlier release keeps its fingerprint and a rerun still reuses its shards; and
`spelled_fingerprint` is the fingerprint of 0.1-0.2, which hashed the locations as spelled.
0.6's flat flags (--record-len, --no-metadata, ...) still parse (`add_former_flags`), with
the same deprecation line as their YAML keys. Cost:
microseconds, once per config.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import typing
from collections.abc import Callable
from typing import Any

from raypipe.formats import BatchOptions, FormatOptions, batch_formats, get_format, of_kind

logger = logging.getLogger("raypipe")

EVERY_BATCH_FORMAT = "batches"  # a retired key of the batch formats' options: each of them
# retired flat key -> (the format it set: a name, or every batch format; its option today)
FLAT_OPTIONS = {
    "metadata": ("stream", "metadata"),
    "metadata_serializer": ("stream", "serializer"),
    "mds_concat_tokens": ("mds", "concat_tokens"),
    "mds_compression": ("mds", "compression"),
    "seq_len": (EVERY_BATCH_FORMAT, "record_len"),
    "batch_size": (EVERY_BATCH_FORMAT, "batch_size"),
    "packing": (EVERY_BATCH_FORMAT, "packing"),
    "seed": (EVERY_BATCH_FORMAT, "seed"),
    "batches_per_shard": (EVERY_BATCH_FORMAT, "batches_per_shard"),
}
# the command-line flags of the retired keys that today's flags do not spell the same way
# (--mds-compression and --mds-concat-tokens are today's flags too)
FLAT_FLAGS = {"metadata": ("--metadata",), "metadata_serializer": ("--metadata-serializer",),
              "seq_len": ("--record-len", "--seq-len"), "batch_size": ("--batch-size",),
              "packing": ("--packing",), "seed": ("--seed",),
              "batches_per_shard": ("--batches-per-shard",)}
# a retired key's value in 0.6's fingerprint where the job wrote no format that has it
FLAT_DEFAULTS = {"metadata": True, "metadata_serializer": "json", "mds_concat_tokens": None,
                 "mds_compression": None, "seq_len": None, "batch_size": None,
                 "seed": 0, "batches_per_shard": 1024}  # packing: "auto" for the data
# unit_bytes' one default until it was sized from the input (0.6 and before), and still a
# Dataset job's value: its units are its blocks, so it shapes nothing, and the fingerprint
# of an earlier Dataset job's output holds
UNIT_BYTES_BEFORE_AUTO = 64 << 20
# fields added after 0.1 -> the value that behaves as 0.1 did (not part of the fingerprint)
ADDED_FIELDS = {"special_tokens_in_text": "special", "worker_memory_budget": 2 << 30,
                "chat": False, "messages_column": "messages", "prompt_column": None,
                "completion_column": None, "chat_template": None, "train_on": "assistant",
                "mds_concat_tokens": None}
# the chat keys 0.6 kept flat beside the job's own (today: the `chat:` mapping's)
CHAT_KEYS = ("messages_column", "prompt_column", "completion_column", "chat_template",
             "train_on")
CHAT_DEFAULTS = {"messages_column": "messages", "prompt_column": None,
                 "completion_column": None, "chat_template": None, "train_on": "assistant"}
# `packing` as 0.6's config.yaml wrote it for a job without a batch format (its default)
PACKINGS_OF_0_6 = ("auto", "fill", "split")
# keys of earlier releases that no longer do anything -> why (a config holding one loads,
# with a warning)
RETIRED_KEYS = {"head_start": "removed in 0.6: every unit runs on Ray Data"}
RETIRED_FLAG = "retired_key"  # an argparse dest prefix: retired_key:<key> (a 0.6 flag)
_warned: set[str] = set()


def add_former_flags(parser: argparse.ArgumentParser,
                      add_typed: Callable[..., None]) -> None:
    """0.6's flat flags, hidden from the help: `add_typed(parser, flags, dest, hint,
    choices, help)` adds each as an option of its option's type."""
    for key, flags in FLAT_FLAGS.items():
        target, option = FLAT_OPTIONS[key]
        owner = BatchOptions if target == EVERY_BATCH_FORMAT else \
            get_format(target).options_type
        add_typed(parser, list(flags), f"{RETIRED_FLAG}:{key}",
                  typing.get_type_hints(owner)[option], None, argparse.SUPPRESS)


def given_former_flags(args: argparse.Namespace) -> dict[str, Any]:
    """0.6's flat flags given, by their config key (which `upgrade` moves)."""
    return {dest.split(":", 1)[1]: value for dest, value in vars(args).items()
            if dest.startswith(RETIRED_FLAG + ":") and value is not None}


def spelled_fingerprint(output_fields: dict[str, Any], tokenizer_sha256: str) -> str:
    """The fingerprint of raypipe 0.1-0.2, which hashed the locations as spelled: an output
    made then with the same spelling is still recognized."""
    payload = json.dumps({"config": output_fields, "tokenizer_sha256": tokenizer_sha256},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def targets(key: str, names: list[str]) -> list[str]:
    """The formats among `names` that retired key `key` sets."""
    target = FLAT_OPTIONS[key][0]
    if target == EVERY_BATCH_FORMAT:
        return list(of_kind(names, "batches"))
    return [name for name in names if name == target]


def upgrade(data: dict[str, Any], formats: dict[str, Any] | None) -> dict[str, Any]:
    """`data` (a config's keys) with the retired ones moved into its formats' options
    (`formats`: the job's, each with the options it gives; None: the defaults, which have
    no options), warned about once per process."""
    for key in sorted(set(data) & set(RETIRED_KEYS)):
        logger.warning("config key %r ignored (%s)", key, RETIRED_KEYS[key])
    kept = upgrade_chat({k: v for k, v in data.items() if k not in RETIRED_KEYS})
    flat = {key: kept.pop(key) for key in FLAT_OPTIONS if key in kept}
    if not flat:
        return kept
    warn_once(sorted(flat))
    if formats is None:
        return kept
    upgraded = dict(formats)
    warn_unused(flat, list(upgraded))
    for key, value in flat.items():
        for name in targets(key, list(upgraded)):
            given = upgraded[name]
            given = given.settings() if isinstance(given, FormatOptions) else dict(given or {})
            upgraded[name] = {FLAT_OPTIONS[key][1]: value, **given}  # today's spelling wins
    return {**kept, "formats": upgraded}


def warn_unused(flat: dict[str, Any], names: list[str]) -> None:
    """Warn of retired keys set away from 0.6's default that no format of the job has: they
    change nothing (as in 0.6), and saying so beats a job that quietly ignores them."""
    unused = [key for key, value in flat.items() if not targets(key, names)
              and value not in (FLAT_DEFAULTS.get(key),
                                *(PACKINGS_OF_0_6 if key == "packing" else ()))]
    if unused:
        logger.warning("config key(s) %s set, but no format of this job (%s) has that option: "
                       "ignored", ", ".join(unused), ", ".join(names))


def upgrade_chat(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with 0.6's flat chat keys moved into its `chat` mapping (a chat job: `chat`
    true, or a prompt and completion column; else they did nothing and are dropped)."""
    flat = {key: data[key] for key in CHAT_KEYS if key in data}
    if not flat:
        return data
    warn_once(sorted(flat))
    kept = {k: v for k, v in data.items() if k not in flat}
    chat = kept.get("chat")
    if chat or flat.get("prompt_column") or flat.get("completion_column"):
        kept["chat"] = {**flat, **(chat if isinstance(chat, dict) else {})}
    return kept


def flat_chat(chat: dict[str, Any] | None) -> dict[str, Any]:
    """A job's chat options as 0.6's fingerprint held them: `chat` a bool, its options
    flat (their defaults for a text job)."""
    return {"chat": chat is not None, **CHAT_DEFAULTS, **(chat or {})}


def warn_once(keys: list[str]) -> None:
    fresh = [key for key in keys if key not in _warned]
    if fresh:
        _warned.update(fresh)
        logger.warning("deprecated config key(s), kept working; today's config says: %s",
                       "; ".join(f"{key} -> {spelling(key)}" for key in fresh))


def spelling(key: str) -> str:
    """Today's YAML and flag for retired key `key`."""
    if key in CHAT_KEYS:
        return f"chat: {{{key}: ...}} (the flag --{key.replace('_', '-')} is unchanged)"
    target, option = FLAT_OPTIONS[key]
    name = batch_formats()[0] if target == EVERY_BATCH_FORMAT else target
    return f"formats: {{{name}: {{{option}: ...}}}}, {flag_of_option(key)}"


def flag_of_option(name: str) -> str | None:
    """Today's flag of a format option as a fingerprint names it: a retired key
    (`seq_len`), or `<format>.<option>` (None: `name` is no format option)."""
    if "." not in name and name not in FLAT_OPTIONS:
        return None
    if "." in name:
        fmt, option = name.split(".", 1)
    else:
        target, option = FLAT_OPTIONS[name]
        fmt = batch_formats()[0] if target == EVERY_BATCH_FORMAT else target
    return f"--{fmt}-{option}".replace("_", "-")


def without_added_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` without those added after 0.1 that hold the value that behaves as 0.1 did
    (`ADDED_FIELDS`), so an earlier output's fingerprint still holds."""
    return {k: v for k, v in fields.items() if ADDED_FIELDS.get(k, object()) != v}


def recorded_unit_bytes(config: dict[str, Any]) -> int:
    """The unit size a job record's config planned with: its `unit_bytes`, or (a release
    that did not record it) the one default of then, `UNIT_BYTES_BEFORE_AUTO`."""
    value = config.get("unit_bytes")
    return value if isinstance(value, int) and value > 0 else UNIT_BYTES_BEFORE_AUTO


def dataset_job_unit_bytes() -> int:
    """A Dataset job's unit size: its units are its blocks, so the size shapes nothing,
    and it stays 0.6's one default so an earlier Dataset job's fingerprint holds."""
    return UNIT_BYTES_BEFORE_AUTO


def fingerprint_fields(names: list[str], formats: dict[str, FormatOptions],
                       packing_default: str) -> dict[str, Any]:
    """The formats' options as 0.6's fingerprint held them: each retired key at the value
    of the first format it sets (else 0.6's default), and every other option (a plugin
    format's, a second batch format's) as `<format>.<option>`."""
    fields: dict[str, Any] = {**FLAT_DEFAULTS, "packing": packing_default}
    covered: set[tuple[str, str]] = set()
    for key, (_, option) in FLAT_OPTIONS.items():
        chosen = targets(key, names)
        if chosen:
            fields[key] = getattr(formats[chosen[0]], option)
            covered.add((chosen[0], option))
    for name in names:
        for option, value in formats[name].settings().items():
            if (name, option) not in covered:
                fields[f"{name}.{option}"] = value
    return fields

