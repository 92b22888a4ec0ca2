"""Chat templates and loss masks, exact to `transformers`: 1,000 generated multi-turn
conversations (system, user, assistant; some holding control-token literals in their
content; one far longer than the rest) under a ChatML template with generation blocks and
a Llama-3-style template without them."""

from __future__ import annotations

import importlib.util
import json
import random

import numpy as np
import pytest
import transformers  # a dev dependency: the reference these tests compare with
from tokenizers import AddedToken, Tokenizer

from raypipe.preprocess.chat import (
    CHATML,
    ChatEncoder,
    ChatTemplate,
    problem_of,
)
from raypipe.preprocess.encoding.backends import FAST_BACKENDS
from raypipe.preprocess.encoding.encoder import tokenizer_sha256

# Llama 3 Instruct's template (no generation blocks: the mask comes from content spans)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
LITERALS = ["<|im_end|>", "<|im_start|>assistant\n", "<|eot_id|>",
            "<|start_header_id|>assistant<|end_header_id|>"]


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer_path) -> Tokenizer:
    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    return tokenizer


def hf_tokenizer(tokenizer: Tokenizer, template: str):
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer.to_str()), chat_template=template,
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def conversations(texts: list[str], count: int = 1000) -> list[list[dict]]:
    """Multi-turn conversations from real text; every 7th holds a control-token literal in
    a user's or an assistant's content; the first is far longer than the others."""
    chooser = random.Random(1234)
    out = []
    for index in range(count):
        turns = [{"role": "system", "content": chooser.choice(texts)[:200]}] \
            if index % 3 == 0 else []
        for turn in range(chooser.randint(1, 4)):
            for role in ("user", "assistant"):
                text = chooser.choice(texts)[:chooser.randint(1, 400)]
                if index % 7 == 0 and turn == 0:
                    text = text + chooser.choice(LITERALS) + " forged?"
                turns.append({"role": role, "content": text})
        out.append(turns)
    out[0][-1]["content"] = " ".join(texts[:200])  # one longer than any row
    return out


@pytest.fixture(scope="module")
def chats(corpus_texts):
    return conversations([text for text in corpus_texts if text.strip()])


INSTALLED = [name for name in FAST_BACKENDS if importlib.util.find_spec(name)]


@pytest.fixture(params=["tokenizers", *INSTALLED[:1]])
def backend(request) -> str:
    """Who encodes the rendered chat: `tokenizers` (ids and offsets), or a fast backend
    whose spans come from the vocabulary (raypipe.preprocess.encoding.token_offsets)."""
    return request.param


def encoder(tokenizer: Tokenizer, source: str, policy: str, train_on: str = "assistant",
            backend: str = "tokenizers") -> ChatEncoder:
    variables = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    fast = (FAST_BACKENDS[backend].make(tokenizer, tokenizer_sha256(tokenizer), "special")
            if backend in FAST_BACKENDS else None)
    return ChatEncoder(tokenizer, ChatTemplate(source, variables), policy, train_on, fast)


@pytest.mark.parametrize("source", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_ids_under_the_special_policy_equal_apply_chat_template(chat_tokenizer, chats,
                                                                source, backend):
    hf = hf_tokenizer(chat_tokenizer, source)
    ours = encoder(chat_tokenizer, source, "special", backend=backend)
    for messages in chats:
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True)
        assert ours.encode(messages).ids.tolist() == list(expected["input_ids"])


@pytest.mark.parametrize("source", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_ids_under_the_text_policy_equal_sanitized_apply_chat_template(chat_tokenizer, chats,
                                                                      source, backend):
    """The default policy: a literal in a message's content is plain text (transformers'
    `sanitize_control_tokens=True`), so no user turn can forge an assistant turn."""
    hf = hf_tokenizer(chat_tokenizer, source)
    ours = encoder(chat_tokenizer, source, "text", backend=backend)
    forged = 0
    for messages in chats:
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          sanitize_control_tokens=True)
        got = ours.encode(messages).ids.tolist()
        assert got == list(expected["input_ids"])
        special = hf.apply_chat_template(messages, tokenize=True, return_dict=True)
        forged += list(special["input_ids"]) != got
    assert forged >= 100  # the literals made a difference in every 7th conversation


def with_trimmed_offsets(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer with GPT-2's `ByteLevel` post-processor (trim_offsets: a token's
    leading spaces are outside its offsets, so transformers' mask rule sees them moved)."""
    data = json.loads(tokenizer.to_str())
    data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True,
                              "trim_offsets": True, "use_regex": True}
    return Tokenizer.from_str(json.dumps(data))


def spaced(chats: list[list[dict]]) -> list[list[dict]]:
    """Every other conversation with spaces around each assistant message: tokens of
    spaces at a trained span's ends, where trimmed offsets move."""
    return [[dict(m, content=f"  {m['content']}  ") if m["role"] == "assistant" else m
             for m in messages] for messages in chats[::2]]


@pytest.mark.parametrize("trimmed", [False, True], ids=["offsets", "trimmed-offsets"])
def test_the_mask_equals_transformers_assistant_tokens_mask(chat_tokenizer, chats, backend,
                                                            trimmed):
    tokenizer = with_trimmed_offsets(chat_tokenizer) if trimmed else chat_tokenizer
    hf = hf_tokenizer(tokenizer, CHATML)
    ours = encoder(tokenizer, CHATML, "special", backend=backend)
    for messages in chats + spaced(chats):
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        got = ours.encode(messages)
        assert got.ids.tolist() == list(expected["input_ids"])
        assert got.trained.astype(int).tolist() == list(expected["assistant_masks"])


@pytest.mark.parametrize("backend_name", INSTALLED)
@pytest.mark.parametrize("source", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_under_the_text_policy_a_fast_backend_gives_the_same_ids_mask_and_turns(
        chat_tokenizer, chats, backend_name, source):
    """transformers cannot mask a sanitized render, so the fast path is held to the
    `tokenizers` path (whose ids equal transformers', above), trimmed offsets included."""
    tokenizer = with_trimmed_offsets(chat_tokenizer)
    reference = encoder(tokenizer, source, "text")
    fast = encoder(tokenizer, source, "text", backend=backend_name)
    for messages in chats[:300] + spaced(chats[:300]):
        expected, got = reference.encode(messages), fast.encode(messages)
        assert got.ids.tolist() == expected.ids.tolist()
        assert got.trained.tolist() == expected.trained.tolist()
        assert got.turns == expected.turns


@pytest.mark.parametrize("policy", ["text", "special"])
def test_without_generation_blocks_the_assistant_content_and_its_end_are_trained(
        chat_tokenizer, chats, policy, backend):
    """Llama-3-style: exactly the tokens of each assistant message's content as rendered,
    plus its <|eot_id|>, are trained; the headers and every other role are not."""
    ours = encoder(chat_tokenizer, LLAMA3, policy, backend=backend)
    eot = chat_tokenizer.token_to_id("<|eot_id|>")
    for messages in chats[:300]:
        encoded = ours.encode(messages)
        expected = np.zeros(encoded.ids.size, dtype=bool)
        for role, first, stop, _ in encoded.turns:
            if role == "assistant":
                assert encoded.ids[stop - 1] == eot
                expected[first:stop] = True
        assert (encoded.trained == expected).all()
        texts = [chat_tokenizer.decode(encoded.ids[first:stop - 1].tolist(),
                                       skip_special_tokens=False)
                 for role, first, stop, _ in encoded.turns if role == "assistant"]
        assert texts == [m["content"].strip() for m in messages if m["role"] == "assistant"]


def test_train_on_last_assistant_and_all(chat_tokenizer, chats):
    messages = next(m for m in chats if sum(t["role"] == "assistant" for t in m) > 1)
    every = encoder(chat_tokenizer, CHATML, "text").encode(messages)
    last = encoder(chat_tokenizer, CHATML, "text", "last-assistant").encode(messages)
    everything = encoder(chat_tokenizer, CHATML, "text", "all").encode(messages)
    assert everything.trained.all()
    assert 0 < last.trained.sum() < every.trained.sum()
    final = np.flatnonzero(every.trained)
    assert last.trained[final[-1]] and not last.trained[final[0]]


@pytest.mark.parametrize("messages,reason", [
    ("hello", "not_a_list"),
    ([], "empty"),
    ([{"role": "user"}], "malformed_message"),
    ([{"role": "narrator", "content": "x"}], "unknown_role"),
    ([{"role": "user", "content": "x"}], "no_assistant"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], None),
])
def test_a_malformed_conversation_has_a_reason(messages, reason):
    assert problem_of(messages) == reason
