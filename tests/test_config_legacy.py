"""The tokenize config's retired shapes (raypipe.config.compat), one test each: 0.6's flat
per-format keys load as today's `formats: {name: {option: value}}` with one deprecation
line naming today's spelling, a key that no longer does anything loads with a warning, and
the config.yaml a 0.6 job wrote (tests/golden) loads and keeps the fingerprint its output
was made under, as today's spelling of the same job does, so a rerun reuses its shards."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from raypipe.config import compat as legacy
from raypipe.config import load_config
from raypipe.demo.train_tokenizer import SHIPPED

GOLDEN = Path(__file__).parent / "golden"
PLACES = {"inputs": ["corpus.jsonl"], "output": "out", "tokenizer": "t.json"}
# each retired key: (the job's formats, its 0.6 value, today's spelling of the same)
RETIRED = {
    "metadata": (["stream"], False, {"stream": {"metadata": False}}),
    "metadata_serializer": (["stream"], "msgpack", {"stream": {"serializer": "msgpack"}}),
    "mds_concat_tokens": (["mds"], 512, {"mds": {"concat_tokens": 512}}),
    "mds_compression": (["mds"], "zstd", {"mds": {"compression": "zstd"}}),
    "seq_len": (["llmbatch"], 129, {"llmbatch": {"record_len": 129}}),
    "batch_size": (["llmbatch"], 8, {"llmbatch": {"batch_size": 8}}),
    "packing": (["llmbatch"], "crop", {"llmbatch": {"packing": "crop"}}),
    "seed": (["llmbatch"], 3, {"llmbatch": {"seed": 3}}),
    "batches_per_shard": (["llmbatch"], 16, {"llmbatch": {"batches_per_shard": 16}}),
}
BATCH_SHAPE = {"seq_len": 65, "batch_size": 2}  # what a 0.6 llmbatch job had to give


def test_every_retired_key_is_covered_here():
    assert set(RETIRED) == set(legacy.FLAT_OPTIONS)


@pytest.mark.parametrize("key", sorted(RETIRED))
def test_a_0_6_flat_key_loads_as_today_s_format_option_with_one_deprecation_line(
        key, caplog, monkeypatch):
    monkeypatch.setattr(legacy, "_warned", set())
    formats, value, today = RETIRED[key]
    shape = {k: v for k, v in BATCH_SHAPE.items() if k != key} if "llmbatch" in formats else {}
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        old = load_config(None, **PLACES, formats=formats, **{key: value}, **shape)
        load_config(None, **PLACES, formats=formats, **{key: value}, **shape)  # once only
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(lines) == 1 and key in lines[0], lines
    option = next(iter(today.values()))
    flag = f"--{formats[0]}-{next(iter(option)).replace('_', '-')}"
    assert flag in lines[0]
    shaped = {"record_len": 65, "batch_size": 2} if "llmbatch" in formats else {}
    new = load_config(None, **PLACES, formats={name: {**shaped, **options}
                                               for name, options in today.items()})
    assert old.formats == new.formats
    assert old.output_fingerprint("x") == new.output_fingerprint("x")


def test_a_key_that_no_longer_does_anything_loads_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        config = load_config(None, **PLACES, head_start=2)
    assert tuple(config.formats) == ("megatron", "nanogpt")
    assert any("'head_start' ignored" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("job", ["rich", "default"])
def test_the_config_yaml_0_6_wrote_keeps_its_output_s_fingerprint(job):
    manifest = json.loads((GOLDEN / job / "manifest.json").read_text())
    recorded, identity = manifest["fingerprint"], manifest["tokenizer"]["sha256"]
    old = load_config(GOLDEN / job / "config.yaml", tokenizer=str(SHIPPED))
    assert old.output_fingerprint(identity) == recorded
    today = load_config(None, inputs=old.inputs, output=old.output, tokenizer=str(SHIPPED),
                        formats={name: options.settings()
                                 for name, options in old.formats.items()},
                        metadata_columns=list(old.metadata_columns), shard_tokens=6000,
                        unit_bytes=1 << 30, bos=old.bos, eos=old.eos)
    assert today.output_fingerprint(identity) == recorded


@pytest.mark.parametrize("flat", [
    {"chat": True, "messages_column": "conversation", "train_on": "all"},
    {"prompt_column": "question", "completion_column": "answer"},  # made a chat job in 0.6
])
def test_0_6_flat_chat_keys_load_as_today_s_chat_mapping(flat, caplog, monkeypatch):
    monkeypatch.setattr(legacy, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        old = load_config(None, **PLACES, **flat)
    today = load_config(None, **PLACES, chat={k: v for k, v in flat.items() if k != "chat"})
    assert old.chat == today.chat and old.is_chat
    assert old.output_fingerprint("x") == today.output_fingerprint("x")
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(lines) == 1 and "chat: {" in lines[0], lines


def test_a_chat_flag_alone_makes_a_chat_job_and_no_chat_a_text_one():
    from raypipe.cli import build_parser, config_from_args

    parser = build_parser()
    base = ["tokenize", "corpus", "--tokenizer", "t.json", "-o", "out"]
    chat = config_from_args(parser.parse_args([*base, "--train-on", "last-assistant"])).chat
    assert chat is not None and chat.train_on == "last-assistant"
    assert config_from_args(parser.parse_args([*base, "--chat"])).chat.messages_column \
        == "messages"
    assert config_from_args(parser.parse_args(base)).chat is None


def test_a_0_6_key_no_format_of_the_job_has_is_named_as_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        config = load_config(None, **PLACES, formats=["megatron"], seq_len=129,
                             metadata=True)  # seq_len: no batch format; metadata: its default
    assert tuple(config.formats) == ("megatron",)
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(ignored) == 1 and "seq_len" in ignored[0] and "metadata" not in ignored[0]
