"""A batch of chat rows -> conversations' tokens, lengths and loss mask, skips by reason.

Invariant: a row is one conversation: its `messages` column, or its prompt and completion
columns as a user turn and an assistant turn. A malformed conversation (not a list, empty,
a message without a string role and content, an unknown role, no assistant turn, a
template that raises, content the template does not render) makes no document and is
counted by reason; a unit whose malformed rows are at least MALFORMED_AT_LEAST and over
MALFORMED_SHARE of its rows fails naming the file, the first such row and its reason (its
shards are not committed; committed units stay). BOS/EOS, when asked, wrap each
conversation untrained. Cost: the ChatEncoder's, per conversation.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from raypipe.config import TokenizeConfig
from raypipe.errors import InputError
from raypipe.preprocess.chat import ChatEncoder, ChatTemplate, plain_messages, problem_of
from raypipe.preprocess.jsonl import fields_as_json

MALFORMED_SHARE = 0.10
MALFORMED_AT_LEAST = 10


@dataclass
class ChatBatch:
    """What a batch of chat rows became."""

    tokens: np.ndarray
    lengths: np.ndarray
    loss_mask: np.ndarray
    kept: np.ndarray  # rows that made a conversation
    skipped: Counter
    # per conversation kept: its turns (role, first token, stop token, trained), separator
    # included in the token offsets
    turns: list[list[tuple[str, int, int, bool]]] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)  # each skipped row's reason
    special_literals: int = 0  # conversations whose messages hold a special token's literal


@dataclass
class MalformedRows:
    """A unit's malformed conversations: how many, and the first one (row, reason)."""

    count: int = 0
    first: tuple[int, str] | None = None
    reasons: Counter = field(default_factory=Counter)

    def add(self, row: int, reason: str) -> None:
        self.count += 1
        self.reasons[reason] += 1
        if self.first is None:
            self.first = (row, reason)

    def check(self, where: str, rows: int) -> None:
        """Fail the unit when its malformed rows pass the threshold."""
        if self.count >= MALFORMED_AT_LEAST and self.count > MALFORMED_SHARE * rows:
            row, reason = self.first or (0, "")
            raise InputError(f"{where}: {self.count} of {rows} rows are not conversations "
                             f"raypipe trains on (first: row {row}, {reason}; all: "
                             f"{dict(sorted(self.reasons.items()))}); check --messages-column "
                             "or the input")


def column_values(batch: pa.RecordBatch, name: str) -> list[Any]:
    """A column's values; JSON text decoded (JSON-lines chat rows, or a parquet column of
    conversations stored as JSON strings)."""
    values = batch.column(name).to_pylist()
    if not (fields_as_json(batch) or pa.types.is_string(batch.schema.field(name).type)
            or pa.types.is_large_string(batch.schema.field(name).type)):
        return values
    return [decode_json(value) if isinstance(value, str) else value for value in values]


def decode_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: a plain string (a prompt), or a malformed conversation


def conversations_of(batch: pa.RecordBatch, config: TokenizeConfig) -> list[Any]:
    """The batch's rows as conversations (None where a prompt or completion is missing)."""
    if config.chat.prompt_column and config.chat.completion_column:
        if fields_as_json(batch):
            prompts = column_values(batch, config.chat.prompt_column)
            completions = column_values(batch, config.chat.completion_column)
        else:  # plain strings, taken as they are
            prompts = batch.column(config.chat.prompt_column).to_pylist()
            completions = batch.column(config.chat.completion_column).to_pylist()
        return [[{"role": "user", "content": prompt},
                 {"role": "assistant", "content": completion}]
                for prompt, completion in zip(prompts, completions, strict=True)]
    return column_values(batch, config.chat.messages_column)


def encode_chat_batch(batch: pa.RecordBatch, config: TokenizeConfig, encoder: ChatEncoder,
                      bos_id: int | None, eos_id: int | None, first_row: int,
                      malformed: MalformedRows, where: str = "",
                      separated: bool = False) -> ChatBatch:
    """`separated`: a format finds conversations by their BOS/EOS, so neither may occur
    inside one (InputError naming the row)."""
    import jinja2

    ids, masks, kept, skipped, turns, reasons = [], [], [], Counter(), [], {}
    literals = 0
    separators = [token for token in (bos_id, eos_id) if token is not None and separated]
    for row, messages in enumerate(conversations_of(batch, config)):
        reason = problem_of(messages)
        if reason is None:
            try:
                encoded = encoder.encode(messages)
            except jinja2.TemplateError:
                reason = "template_error"
            except ValueError as exc:
                reason = str(exc) if str(exc) == "content_not_rendered" else "template_error"
        if reason is not None:
            skipped[reason] += 1
            reasons[row] = reason
            malformed.add(first_row + row, reason)
            continue
        tokens, trained = encoded.ids, encoded.trained
        literals += encoded.holds_literal
        if separators and np.isin(tokens, separators).any():
            inside = int(tokens[np.isin(tokens, separators)][0])
            raise InputError(f"{where}: row {first_row + row}: the conversation holds the "
                             f"separator token (id {inside}) inside it, so its end could not "
                             "be found: choose the other of --bos/--eos, or formats with an "
                             "index (megatron, mds)")
        shift = int(bos_id is not None)
        turns.append([(role, first + shift, stop + shift, bool(trained[first:stop].any()))
                      for role, first, stop, _ in encoded.turns])
        if bos_id is not None:
            tokens, trained = np.concatenate([[bos_id], tokens]), np.concatenate([[False],
                                                                                  trained])
        if eos_id is not None:
            tokens, trained = np.concatenate([tokens, [eos_id]]), np.concatenate([trained,
                                                                                  [False]])
        ids.append(tokens.astype(np.uint32))
        masks.append(trained.astype(np.uint8))
        kept.append(row)
    lengths = np.array([part.size for part in ids], dtype=np.int64)
    return ChatBatch(np.concatenate(ids) if ids else np.empty(0, np.uint32), lengths,
                     np.concatenate(masks) if masks else np.empty(0, np.uint8),
                     np.array(kept, dtype=np.int64), skipped, turns, reasons, literals)


def rendered_texts(table: pa.Table, config: TokenizeConfig, template: ChatTemplate,
                   limit_chars: int) -> list[str]:
    """The well-formed conversations of `table` as their template renders them, up to
    `limit_chars` characters (a longer one passed over): the encoder's self-check sample
    for a chat job."""
    import jinja2

    texts, chars = [], 0
    for batch in table.to_batches():
        for messages in conversations_of(batch, config):
            if problem_of(messages) is not None:
                continue
            try:
                text = template.render(plain_messages(messages)).text
            except (jinja2.TemplateError, ValueError):
                continue
            if len(text) <= limit_chars:
                texts.append(text)
                chars += len(text)
            if chars >= limit_chars:
                return texts
    return texts
