"""Chat conversations -> the ids a model trains on and which of them it learns, exact to
`transformers`.

Invariant: a conversation (`messages`: [{"role", "content"}, ...]) is rendered by its chat
template as `transformers`' `apply_chat_template(messages, tokenize=False)` renders it: the
same sandboxed Jinja2 environment (trim_blocks, lstrip_blocks, loop controls, `tojson`,
`raise_exception`, `strftime_now`, `dict`, `namespace`, `{% generation %}` blocks), the
tokenizer's special tokens as variables, `None`-valued message keys dropped. Its ids:
- policy `special`: the rendered text encoded with added tokens matched everywhere, which
  is `apply_chat_template(..., tokenize=True)`;
- policy `text` (the default): control tokens inside the caller's strings (a user typing
  `<|im_end|>`) are encoded as plain text and only the template's own are control ids,
  which is `apply_chat_template(..., tokenize=True, sanitize_control_tokens=True)`: the
  same markers, pieces and encode calls. A user turn cannot forge an assistant turn.
Which ids are trained: the tokens overlapping the trained character spans (transformers'
rule for `return_assistant_tokens_mask`): the template's `{% generation %}` blocks where it
has them, else each assistant message's content as rendered plus the control token right
after it (its end of turn); `last-assistant` keeps the last span, `all` trains every token.
A malformed conversation is not encoded: `problem_of` names why (counted by the job).
Who encodes: the job's fast backend where the self-check passed under the `special`
policy and the vocabulary places each id's characters (byte-level BPE:
raypipe.preprocess.encoding.token_offsets gives `tokenizers`' exact offsets from the ids,
trimmed offsets included); a literal typed in a message (`text` policy) is encoded by
`tokenizers`, once per distinct literal. Elsewhere `tokenizers` encodes with offsets.
Cost: one render and one encode call per conversation (`text`: one per piece between
marked tokens). Measured (bench/chat_bench.py, 20,000 conversations, GPT-2 + ChatML, one
core): gigatoken 2.9x a transformers `apply_chat_template(..., return_assistant_tokens_mask
=True)` loop, every conversation's ids and mask equal (`tokenizers` with offsets:
docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from raypipe.config import TRAIN_ON
from raypipe.errors import ConfigError
from raypipe.preprocess.encoding.token_offsets import TokenOffsets

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_VARIABLES = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers' private-use markers around control tokens in the caller's strings
MARK_START, MARK_END = "\U000f0000", "\U000f0001"

# ChatML, with the assistant's content and its <|im_end|> in a generation block
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def problem_of(messages: Any) -> str | None:
    """Why `messages` is not a conversation raypipe trains on (None: it is)."""
    if not isinstance(messages, list | tuple):
        return "not_a_list"
    if not messages:
        return "empty"
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            return "malformed_message"
        if message["role"] not in ROLES:
            return "unknown_role"
    if not any(message["role"] == "assistant" for message in messages):
        return "no_assistant"
    return None


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template sees them: plain dicts, keys whose value is None dropped."""
    return [{key: value for key, value in message.items() if value is not None}
            for message in messages]


def compile_template(source: str) -> Any:
    """The chat template in transformers' environment (see the module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span of each
        block while a render is tracked."""

        tags = {"generation"}

        def __init__(self, environment: Any):
            super().__init__(environment)
            self.tracked: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = \
                ContextVar("raypipe_generation", default=None)
            environment.extend(track_generation=self.track)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body
                                          ).set_lineno(lineno)

        def _block(self, caller: Any) -> str:
            text = caller()
            tracked = self.tracked.get()
            if tracked is not None:
                blocks, spans = tracked
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
            token = self.tracked.set((blocks, spans))
            try:
                yield
            finally:
                self.tracked.reset(token)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(form: str) -> str:
        return datetime.now().strftime(form)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any):
            self, rest = args[0], args[1:]
            attributes = dict(*rest, **kwargs)
            for name in attributes:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes: {name!r}")

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                               dict=TemplateDict(), namespace=TemplateNamespace)
    return environment.from_string(source)


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation and the character spans of its generation blocks."""

    text: str
    generation: tuple[tuple[int, int], ...]


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens as its variables."""

    def __init__(self, source: str, variables: dict[str, str]):
        self.source = source
        self.variables = dict(variables)
        self.sha256 = hashlib.sha256(source.encode()).hexdigest()
        self.has_generation = bool(re.search(r"\{%-?\s*generation\s*-?%\}", source))
        self.compiled = compile_template(source)

    def render(self, messages: list[dict[str, Any]]) -> RenderedChat:
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with self.compiled.environment.track_generation(blocks, spans):
            for block in self.compiled.generate(messages=messages, tools=None,
                                                documents=None, add_generation_prompt=False,
                                                **self.variables):
                blocks.append(block)
        return RenderedChat("".join(blocks), tuple(spans))

    def literal_text(self) -> str:
        """Every literal string of the template, joined by NUL (no match across two)."""
        import jinja2.nodes

        tree = self.compiled.environment.parse(self.source)
        literals = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
        literals |= {node.value for node in tree.find_all(jinja2.nodes.Const)
                     if isinstance(node.value, str)}
        return "\0".join(literals)


def control_tokens(tokenizer: Tokenizer, template: ChatTemplate) -> tuple[str, ...]:
    """The added tokens a conversation's own strings may not produce as ids under the
    `text` policy: every special one, and the non-special ones the template writes
    (transformers' default, for a tokenizer without `chat_control_tokens`)."""
    literals = template.literal_text()
    return tuple(token.content for token in tokenizer.get_added_tokens_decoder().values()
                 if token.special or (token.content in literals and not token.content.isspace()))


def mark(value: Any, pattern: re.Pattern[str]) -> Any:
    """`value` with every control token in its strings wrapped in the markers (markers
    already there dropped first, so none can be forged)."""
    if isinstance(value, str):
        if MARK_START in value or MARK_END in value:
            value = value.replace(MARK_START, "").replace(MARK_END, "")
        elif pattern.search(value) is None:  # most strings: nothing to mark
            return value
        return pattern.sub(f"{MARK_START}\\g<0>{MARK_END}", value)
    if isinstance(value, dict):
        return {key: mark(item, pattern) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [mark(item, pattern) for item in value]
    return value


@dataclass(frozen=True)
class EncodedChat:
    """A conversation's ids, which of them are trained, and its turns: (role, first token,
    end token, trained) per message found in the render."""

    ids: np.ndarray  # uint32
    trained: np.ndarray  # bool, one per id
    turns: tuple[tuple[str, int, int, bool], ...]
    holds_literal: bool = False  # a message's own text holds a special token's literal


class ChatEncoder:
    """Encodes conversations with one tokenizer and template under one special-token
    policy (`text` or `special`) and one `train_on` choice."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, policy: str = "text",
                 train_on: str = "assistant", fast: Any | None = None):
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on {train_on!r} not among {list(TRAIN_ON)}")
        self.template, self.policy, self.train_on = template, policy, train_on
        serialized = tokenizer.to_str()  # two private copies: their flags differ
        self.tokenizer = Tokenizer.from_str(serialized)
        self.tokenizer.encode_special_tokens = False
        self.as_text = Tokenizer.from_str(serialized)
        self.as_text.encode_special_tokens = True  # transformers' split_special_tokens=True
        controls = control_tokens(tokenizer, template)
        longest_first = sorted(controls, key=len, reverse=True)
        self.controls = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        added = sorted((token.content for token in
                        tokenizer.get_added_tokens_decoder().values()), key=len, reverse=True)
        added_pattern = "|".join(map(re.escape, added)) or "(?!)"
        self.markers = re.compile(f"{MARK_START}({added_pattern}){MARK_END}"
                                  f"|[{MARK_START}{MARK_END}]")
        self.newline_ids = self.tokenizer.encode("\n", add_special_tokens=False).ids
        specials = sorted((token.content for token in
                           tokenizer.get_added_tokens_decoder().values() if token.special),
                          key=len, reverse=True)
        self.special_literals = re.compile("|".join(map(re.escape, specials)) or "(?!)")
        self.fast, self.spans = fast, TokenOffsets(tokenizer) if fast is not None else None
        self.as_text_pieces: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def encode(self, messages: list[dict[str, Any]]) -> EncodedChat:
        """Raises ValueError("content_not_rendered") when a message's content cannot be
        found in the render of a template without generation blocks."""
        messages = plain_messages(messages)
        holds_literal = any(self.special_literals.search(message["content"])
                            for message in messages)
        if self.policy == "text":
            messages = mark(messages, self.controls)
        rendered = self.template.render(messages)
        ids, offsets = self._ids(rendered.text)
        turns = self._turn_spans(rendered, messages)
        spans = self._trained_spans(rendered, turns)
        trained = overlapping(offsets, spans) if self.train_on != "all" else \
            np.ones(len(ids), dtype=bool)
        ranges = token_ranges(offsets, [(start, end) for _, start, end, _ in turns])
        token_turns = tuple((role, first, stop, is_trained) for (role, _, _, is_trained),
                            (first, stop) in zip(turns, ranges, strict=True))
        return EncodedChat(np.asarray(ids, dtype=np.uint32), trained, token_turns,
                           holds_literal)

    def _ids(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The ids of a rendered chat and each id's character span in `text`."""
        if self.policy != "text":
            return self._encoded(text, False)
        ids: list[np.ndarray] = []
        offsets: list[np.ndarray] = []
        at, first = 0, True
        for match in [*self.markers.finditer(text), None]:
            stop = match.start() if match is not None else len(text)
            self._piece(text[at:stop], at, False, first, ids, offsets)
            first = False
            if match is None:
                break
            if match.group(1):  # a marked control token: encoded as plain text
                self._piece(match.group(1), match.start(1), True, False, ids, offsets)
            at = match.end()
        if len(ids) == 1:
            return ids[0], offsets[0]
        return (np.concatenate(ids) if ids else np.zeros(0, np.int64),
                np.concatenate(offsets) if offsets else np.zeros((0, 2), np.int64))

    def _piece(self, piece: str, at: int, as_text: bool, first: bool, ids: list[np.ndarray],
               offsets: list[np.ndarray]) -> None:
        """transformers' `_encode_chat_piece`: a piece after the first is encoded behind a
        newline (SentencePiece adds no prefix space then), the newline's ids dropped."""
        if not piece:
            return
        if not first:
            behind, spans = self._encoded("\n" + piece, as_text)
            skip = len(self.newline_ids)
            if behind[:skip].tolist() == self.newline_ids:  # offsets shift by the newline
                ids.append(behind[skip:])
                offsets.append(spans[skip:] + at - 1)
                return
        encoded, spans = self._encoded(piece, as_text)
        ids.append(encoded)
        offsets.append(spans + at)

    def _encoded(self, text: str, as_text: bool) -> tuple[np.ndarray, np.ndarray]:
        """(ids, [n, 2] character spans) of `text`: control tokens matched, or (`as_text`)
        left as text. The fast backend's ids with spans from the vocabulary where it
        runs (a marked literal's few ids are kept once encoded), else `tokenizers`'."""
        if as_text:
            if text not in self.as_text_pieces:
                self.as_text_pieces[text] = self._by_tokenizers(text, self.as_text)
            return self.as_text_pieces[text]
        if self.fast is not None:
            ids = self.fast.encode_one(text)
            spans = self.spans.offsets(ids, text)
            if spans is not None:
                return ids, spans
        return self._by_tokenizers(text, self.tokenizer)

    @staticmethod
    def _by_tokenizers(text: str, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        return (np.asarray(encoding.ids, dtype=np.int64),
                np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2))

    def _turn_spans(self, rendered: RenderedChat, messages: list[dict[str, Any]]
                    ) -> list[tuple[str, int, int, bool]]:
        """(role, start, end, trained) character spans of each message's content in the
        render, an assistant's extended over the control token that ends its turn."""
        turns, at = [], 0
        text = rendered.text
        for message in messages:
            content = message["content"]
            start = text.find(content, at) if content else at
            if start < 0 and content.strip():
                content = content.strip()
                start = text.find(content, at)
            if start < 0:
                if self.template.has_generation or self.train_on == "all":
                    continue
                raise ValueError("content_not_rendered")
            end = start + len(content)
            if message["role"] == "assistant":
                ending = self.controls.match(text, end)
                end = ending.end() if ending else end
            turns.append((message["role"], start, end, message["role"] == "assistant"))
            at = end
        return turns

    def _trained_spans(self, rendered: RenderedChat, turns: list[tuple[str, int, int, bool]]
                       ) -> list[tuple[int, int]]:
        if self.train_on == "all":
            return [(0, len(rendered.text))]
        spans = list(rendered.generation) if self.template.has_generation else \
            [(start, end) for _, start, end, trained in turns if trained]
        return spans[-1:] if self.train_on == "last-assistant" else spans


def overlapping(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Per token (char span [start, end)): does it overlap one of the sorted `spans`
    (transformers' assistant-mask rule)."""
    trained = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        trained |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return trained


def token_ranges(offsets: np.ndarray, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """For each character span [start, end): the tokens [first, stop) that overlap it
    (none: an empty range where the span's first token would start). One pass for all
    spans."""
    if not spans:
        return []
    bounds = np.asarray(spans, dtype=np.int64)
    inside = ((offsets[:, 0][None, :] < bounds[:, 1:2])
              & (offsets[:, 1][None, :] > bounds[:, 0:1]))
    found = inside.any(axis=1)
    first = np.where(found, inside.argmax(axis=1),
                     np.searchsorted(offsets[:, 0], bounds[:, 0]))
    stop = np.where(found, offsets.shape[0] - inside[:, ::-1].argmax(axis=1), first)
    return list(zip(first.tolist(), stop.tolist(), strict=True))


@dataclass(frozen=True)
class TemplateSource:
    """A job's chat template: its text, where it came from, and the special-token
    variables it renders with (the tokenizer_config.json's, else the detected ones)."""

    text: str
    origin: str
    variables: dict[str, str]

    def compiled(self) -> ChatTemplate:
        return ChatTemplate(self.text, self.variables)


def tokenizer_config(tokenizer_spec: str) -> dict[str, Any]:
    """The tokenizer_config.json beside a tokenizer.json path ({} if none)."""
    from pathlib import Path

    beside = Path(tokenizer_spec).parent / "tokenizer_config.json"
    if not Path(tokenizer_spec).is_file() or not beside.is_file():
        return {}
    try:
        data = json.loads(beside.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{beside}: not a readable tokenizer_config.json: {exc}") from None
    return data if isinstance(data, dict) else {}


def token_text(value: Any) -> str | None:
    """A tokenizer_config special token: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def resolve_template(choice: str | None, tokenizer_spec: str, tokenizer: Tokenizer,
                     bos: str | None, eos: str | None) -> TemplateSource:
    """`--chat-template` (a .jinja file, or `chatml`), else the tokenizer_config.json's
    chat_template beside the tokenizer, else the built-in ChatML, which needs the
    tokenizer to have its two control tokens."""
    from pathlib import Path

    config = tokenizer_config(tokenizer_spec)
    variables = {name: text for name in SPECIAL_VARIABLES
                 if (text := token_text(config.get(name))) is not None}
    variables.setdefault("bos_token", bos or "")
    variables.setdefault("eos_token", eos or "")
    if choice and choice != "chatml":
        try:
            return TemplateSource(Path(choice).read_text(), choice, variables)
        except OSError as exc:
            raise ConfigError(f"chat_template: {choice}: cannot read it: "
                              f"{exc.strerror or exc}") from None
    found = config.get("chat_template")
    if isinstance(found, list):  # [{name, template}, ...]: the default one
        found = next((item.get("template") for item in found if isinstance(item, dict)
                      and item.get("name") == "default"), None)
    if choice is None and isinstance(found, str):
        return TemplateSource(found, "tokenizer_config.json", variables)
    missing = [token for token in CHATML_TOKENS if tokenizer.token_to_id(token) is None]
    if missing:
        raise ConfigError(f"chat: the tokenizer has no chat template (no tokenizer_config.json "
                          f"beside it with one) and lacks {missing} for the built-in chatml; "
                          "give --chat-template FILE.jinja")
    return TemplateSource(CHATML, "chatml (built in)", variables)
