"""Chat data end to end: parquet or JSON-lines conversations -> `raypipe tokenize --chat`
-> Megatron shards with a loss-mask sidecar -> the loader's batch.mask, exact to
`transformers`' template and mask, with malformed rows counted, conversations kept whole
and resume across world sizes."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import AddedToken, Tokenizer

from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.errors import ConfigError, InputError
from raypipe.loader import TokenLoader
from raypipe.preprocess.chat import CHATML, ChatEncoder, ChatTemplate
from raypipe.preprocess.job import run_job
from tests.test_chat import LLAMA3, SPECIALS, conversations

T = 128
MALFORMED = [None, [], [{"role": "user", "content": "no answer"}],
             [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}],
             "not a list"]


@pytest.fixture(scope="module")
def chat_tokenizer_path(tmp_path_factory, tokenizer_path) -> str:
    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    path = tmp_path_factory.mktemp("chat-tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def chats(corpus_texts):
    return conversations([text for text in corpus_texts if text.strip()])


def write_chats(path, rows) -> None:
    """A parquet file of `rows` conversations (messages as JSON text where a row is not a
    list of messages: parquet needs one type per column)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    values = [json.dumps(row) for row in rows]
    pq.write_table(pa.table({"messages": pa.array(values, pa.string())}), path,
                   row_group_size=250)


def expected(tokenizer_path, template, rows, policy="text"):
    encoder = ChatEncoder(Tokenizer.from_file(tokenizer_path),
                          ChatTemplate(template, {"bos_token": "<|begin_of_text|>",
                                                  "eos_token": "<|eot_id|>"}), policy)
    return [encoder.encode(row) for row in rows]


@pytest.fixture(scope="module")
def chat_output(tmp_path_factory, chat_tokenizer_path, chats):
    """1,000 conversations and the 5 malformed rows, tokenized with the built-in ChatML."""
    root = tmp_path_factory.mktemp("chat-job")
    rows = chats[:500] + MALFORMED + chats[500:]
    write_chats(root / "in" / "chats.parquet", rows)
    summary = run_job(load_config(None, inputs=[str(root / "in")], output=str(root / "out"),
                                  tokenizer=chat_tokenizer_path, chat=True))
    return root / "out", summary


def test_documents_and_masks_equal_the_template_and_transformers_rule(
        chat_output, chat_tokenizer_path, chats):
    output, summary = chat_output
    assert summary.documents == len(chats)
    assert summary.skipped == {"empty": 1, "no_assistant": 1, "not_a_list": 2,
                               "unknown_role": 1}  # None reads as not a list either
    dataset = TokenDataset(output, "megatron")
    got_ids, got_masks = [], []
    for shard in range(dataset.num_shards):
        reader = dataset.reader(shard)
        starts = reader.document_starts
        for first, stop in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
            got_ids.append(np.asarray(reader.tokens[first:stop]).tolist())
            got_masks.append(np.asarray(reader.loss_mask[first:stop]).astype(bool).tolist())
    want = expected(chat_tokenizer_path, CHATML, chats)
    assert got_ids == [w.ids.tolist() for w in want]
    assert got_masks == [w.trained.tolist() for w in want]
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["tokenizer"]["chat_template_sha256"] == ChatTemplate(CHATML, {}).sha256
    assert manifest["tokenizer"]["bos_id"] is None and manifest["tokenizer"]["eos_id"] is None


@pytest.mark.parametrize("overlong", ["auto", "cut"])
def test_one_bestfit_epoch_trains_exactly_the_assistant_tokens(chat_output,
                                                              chat_tokenizer_path, chats,
                                                              overlong):
    """Every trained token of the data is a target with mask 1 exactly once (under
    overlong `cut`: except one that begins a row, no target predicting column 0: only
    pieces of the conversation longer than a row begin rows mid-conversation, and they
    are counted); no other target has mask 1; every conversation that fits a row is in one
    row, whole."""
    output, _ = chat_output
    want = expected(chat_tokenizer_path, CHATML, chats)
    loader = TokenLoader(output, seq_len=T, batch_size=1, mode="bestfit", seed=3,
                         device="cpu", overlong=overlong)
    assert loader.spec.packing == "split"  # chat data: conversations kept whole
    assert loader.spec.knobs.overlong == ("split" if overlong == "auto" else "cut")
    filler = loader.filler(0)
    targets: Counter = Counter()
    row_starts = set()
    pieces_of: Counter = Counter()
    for batch in loader:
        (segments,) = filler.segments(batch.positions)
        mask = batch.mask[0].numpy()
        for document, start, take, column in zip(segments.documents.tolist(),
                                                 segments.starts.tolist(),
                                                 segments.take.tolist(),
                                                 segments.columns.tolist(), strict=True):
            pieces_of[document] += 1
            if column < T:  # every piece is its own sequence: cu_seqlens per conversation
                assert column in batch.cu_seqlens.tolist()
            if column == 0:
                row_starts.add((document, start))
            for offset in range(take):
                if column + offset >= 1 and mask[column + offset - 1]:
                    targets[(document, start + offset)] += 1
        if batch.epoch > 0:
            break
    trained = {(document, offset) for document, encoded in enumerate(want)
               for offset in np.flatnonzero(encoded.trained).tolist()}
    assert max(targets.values()) == 1
    continued = {(document, start) for document, start in row_starts if start > 0}
    assert continued  # the long conversation begins rows mid-conversation
    report = loader.packing_report()
    if overlong == "cut":
        assert set(targets) == trained - row_starts
        assert report.continued_pieces == len(continued)  # counted
    else:  # each later piece starts with the token before it: no target lost
        assert set(targets) == trained
        assert not report.continued_pieces and report.repeated_tokens == len(continued)
    fits = [document for document, encoded in enumerate(want) if encoded.ids.size <= T + 1]
    assert all(pieces_of[document] == 1 for document in fits)
    assert pieces_of[0] > 1  # the long conversation, split into row-sized pieces


def test_a_two_rank_run_resumed_at_three_ranks_continues_exactly(chat_output):
    output, _ = chat_output

    def rows(world, state, steps=None):
        loaders = [TokenLoader(output, seq_len=T, batch_size=2, mode="bestfit", seed=3,
                               rank=rank, world_size=world, device="cpu")
                   for rank in range(world)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        iterators = [iter(loader) for loader in loaders]
        seen, done = {}, 0
        while steps is None or done < steps:
            batches = [next(iterator, None) for iterator in iterators]
            if batches[0] is None:
                break
            for batch in batches:
                for row, observation in enumerate(batch.observation_ids.tolist()):
                    seen[observation] = (batch.inputs[row].tolist(), batch.mask[row].tolist())
            done += 1
        for iterator in iterators:
            iterator.close()
        return seen, loaders[0].state_dict()

    whole, _ = rows(1, None)
    first, state = rows(2, None, steps=3)
    rest, _ = rows(3, state)
    assert not set(first) & set(rest)
    resumed = first | rest
    assert set(resumed) <= set(whole) and len(whole) - len(resumed) < 3 * 2
    assert all(resumed[observation] == whole[observation] for observation in resumed)


def test_a_template_from_tokenizer_config_and_json_lines_input(tmp_path, chat_tokenizer_path,
                                                               chats):
    """A Llama-3-style template from the tokenizer_config.json beside the tokenizer (its
    bos_token rendered), rows from JSON lines, the special policy: ids and masks as the
    library gives them."""
    import shutil

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    shutil.copy(chat_tokenizer_path, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>",
         "eos_token": {"content": "<|eot_id|>"}}))
    rows = chats[1:200]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "chats.jsonl").write_text(
        "".join(json.dumps({"messages": row}) + "\n" for row in rows))
    run_job(load_config(None, inputs=[str(tmp_path / "in")], output=str(tmp_path / "out"),
                        tokenizer=str(folder / "tokenizer.json"), chat=True,
                        special_tokens_in_text="special"))
    dataset = TokenDataset(tmp_path / "out")
    got = [document.tolist() for document in dataset.iter_documents()]
    want = expected(chat_tokenizer_path, LLAMA3, rows, policy="special")
    assert got == [w.ids.tolist() for w in want]
    assert got[0][0] == Tokenizer.from_file(chat_tokenizer_path).token_to_id(
        "<|begin_of_text|>")


def test_prompt_and_completion_columns_make_a_user_and_an_assistant_turn(
        tmp_path, chat_tokenizer_path):
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": ["What is 2 + 2?", "Name a color."],
                             "completion": ["4", "Blue."]}), tmp_path / "in" / "p.parquet")
    summary = run_job(load_config(None, inputs=[str(tmp_path / "in")],
                                  output=str(tmp_path / "out"),
                                  tokenizer=chat_tokenizer_path, prompt_column="prompt",
                                  completion_column="completion"))
    assert summary.documents == 2
    tokenizer = Tokenizer.from_file(chat_tokenizer_path)
    reader = TokenDataset(tmp_path / "out").reader(0)
    first = np.asarray(reader.tokens[:reader.document_starts[1]])
    trained = np.asarray(reader.loss_mask[:reader.document_starts[1]]).astype(bool)
    assert tokenizer.decode(first.tolist(), skip_special_tokens=False) == \
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert tokenizer.decode(first[trained].tolist(), skip_special_tokens=False) == \
        "4<|im_end|>"


def test_mostly_malformed_input_is_an_error_naming_the_file_and_row(tmp_path,
                                                                  chat_tokenizer_path,
                                                                  chats):
    write_chats(tmp_path / "in" / "bad.parquet",
                chats[:5] + [[{"role": "user", "content": "hi"}]] * 20)
    with pytest.raises(InputError, match=r"bad.parquet.*20 of 25 rows are not conversations "
                                         r"raypipe trains on \(first: row 5, no_assistant"):
        run_job(load_config(None, inputs=[str(tmp_path / "in")],
                            output=str(tmp_path / "out"), tokenizer=chat_tokenizer_path,
                            chat=True))


def test_a_format_that_cannot_hold_a_mask_refuses_chat_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"--chat: format\(s\) nanogpt cannot hold a loss "
                                          r"mask; the formats that can: llmbatch, mds, "
                                          r"megatron, stream$"):
        load_config(None, inputs=["x"], output=str(tmp_path / "o"), tokenizer="t",
                    chat=True, formats="megatron,nanogpt,mds")


def test_inspect_shows_a_conversation_with_its_trained_spans_marked(chat_output,
                                                                   chat_tokenizer_path,
                                                                   capsys):
    from raypipe.cli import main

    output, _ = chat_output
    assert main(["inspect", str(output), "--samples", "2",
                 "--tokenizer", chat_tokenizer_path]) == 0
    shown = capsys.readouterr().out
    line = next(line for line in shown.splitlines() if "conversation 1 (" in line)
    assert "between [[ ]]" in line and "<|im_start|>assistant\\n[[" in line
    assert "<|im_end|>]]" in line and "[[<|im_start|>" not in line


def test_a_mixture_of_text_and_chat_trains_each_as_its_data_says_and_resumes_exactly(
        tmp_path, chat_output, chat_tokenizer_path, corpus_dir):
    """Pretraining text and chat at 0.5 / 0.5: chat rows train only trained tokens, text
    rows every real target; 2 ranks stopped after 2 steps and resumed at 3 serve each
    row once, as an uninterrupted run does."""
    from raypipe.loader import open_loader

    text = tmp_path / "text"
    run_job(load_config(None, inputs=[str(corpus_dir)], output=str(text),
                        tokenizer=chat_tokenizer_path, formats=["megatron"]))
    sources = {"chat": str(chat_output[0]), "text": str(text)}
    weights = {"chat": 0.5, "text": 0.5}

    def run(world, state, steps=None):
        loaders = [open_loader(sources, T, 2, weights=weights, mode="bestfit", seed=4,
                               rank=rank, world_size=world, device="cpu")
                   for rank in range(world)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        iterators, seen, done = [iter(loader) for loader in loaders], {}, 0
        while steps is None or done < steps:
            batches = [next(iterator, None) for iterator in iterators]
            if batches[0] is None:
                break
            for batch in batches:
                for row, (source, position) in enumerate(zip(batch.source_ids.tolist(),
                                                             batch.positions.tolist(),
                                                             strict=True)):
                    seen[(source, position)] = (batch.inputs[row].tolist(),
                                                batch.mask[row].tolist())
            done += 1
        for iterator in iterators:
            iterator.close()
        return seen, loaders[0].state_dict()

    whole, _ = run(1, None, steps=12)
    chat_rows = [mask for (source, _), (_, mask) in whole.items() if source == 0]
    text_rows = [mask for (source, _), (_, mask) in whole.items() if source == 1]
    assert chat_rows and text_rows
    assert np.mean([np.mean(mask) for mask in chat_rows]) < 0.9  # prompts are not trained
    assert np.mean([np.mean(mask) for mask in text_rows]) > 0.99  # text: every real target
    first, state = run(2, None, steps=2)
    rest, _ = run(3, state, steps=2)
    assert not set(first) & set(rest)
    for key, row in (first | rest).items():
        assert key not in whole or whole[key] == row


def test_the_packing_report_counts_the_loss_masks_trained_tokens(chat_output,
                                                                 chat_tokenizer_path, chats,
                                                                 capsys):
    from raypipe.cli import main

    output, _ = chat_output
    trained = sum(int(w.trained.sum()) for w in expected(chat_tokenizer_path, CHATML, chats))
    assert f"trained    {trained:,} tokens by the loss mask" in chat_output[1].render()
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["totals"]["trained_tokens"] == trained
    assert main(["pack-report", str(output), "--seq-len", str(T)]) == 0
    report = capsys.readouterr().out
    assert "bestfit (split) rows" in report  # auto packing: split for chat data
    assert f"loss mask 1     {trained:,} (" in report
    assert "repeated        " in report  # the long conversation's overlapping pieces
    loader = TokenLoader(output, seq_len=T, batch_size=2, device="cpu")
    assert loader.packing_report().loss_mask_tokens == trained


def test_auto_encodes_chat_with_a_fast_backend_and_writes_the_bytes_tokenizers_writes(
        tmp_path, chat_output, chat_tokenizer_path):
    """The loss mask needs each token's characters; a byte-level vocabulary gives them
    from the ids, so `auto` takes the fast backend (self-checked on the rendered
    conversations) and every shard file is byte-identical to `tokenizers`' own."""
    pytest.importorskip("gigatoken")
    output, summary = chat_output
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["tokenizer"]["backend"] == "gigatoken"
    reference = tmp_path / "reference"
    run_job(load_config(None, inputs=[str(output.parent / "in")], output=str(reference),
                        tokenizer=chat_tokenizer_path, chat=True,
                        tokenizer_backend="tokenizers"))
    ours = sorted(p.relative_to(output) for p in (output / "megatron").iterdir())
    theirs = sorted(p.relative_to(reference) for p in (reference / "megatron").iterdir())
    assert ours == theirs and ours
    for path in ours:
        assert (output / path).read_bytes() == (reference / path).read_bytes(), path


def test_a_chat_job_on_local_worker_processes_writes_the_serial_runners_bytes(
        tmp_path, chat_output, chat_tokenizer_path):
    """On the local pool the workers build their encoder (and its ChatEncoder) from the
    backend the self-check most likely picks while it runs, and keep it once the check
    agrees: the shards are the serial job's bytes, unit for unit."""
    from raypipe.ray.launch import run_tokenize
    from tests.helpers import shard_files

    def config(output: str, **options):  # a unit a row group: 5 units
        return load_config(None, inputs=[str(chat_output[0].parent / "in")],
                           output=str(tmp_path / output), tokenizer=chat_tokenizer_path,
                           chat=True, unit_bytes=1, **options)

    serial = run_job(config("serial"))
    pooled = run_tokenize(config("pool", executor="local", num_workers=2))
    assert pooled.executor == "local" and pooled.units_run == serial.units_run > 2
    assert shard_files(tmp_path / "pool") == shard_files(tmp_path / "serial")


def test_a_chat_job_on_a_vocabulary_without_byte_level_ids_encodes_with_tokenizers(
        tmp_path, chat_tokenizer_path, chats):
    """A normalizer that moves characters: the ids cannot place the mask, so auto says so
    and `tokenizers` encodes with offsets; naming a fast backend is one ConfigError."""
    data = json.loads(open(chat_tokenizer_path).read())
    data["normalizer"] = {"type": "Lowercase"}
    path = tmp_path / "lower.json"
    path.write_text(json.dumps(data))
    write_chats(tmp_path / "in" / "chats.parquet", chats[:50])
    options = dict(inputs=[str(tmp_path / "in")], tokenizer=str(path), chat=True)
    summary = run_job(load_config(None, output=str(tmp_path / "out"), **options))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["tokenizer"]["backend"] == "tokenizers" and summary.documents == 50
    with pytest.raises(ConfigError, match="Lowercase normalizer"):
        run_job(load_config(None, output=str(tmp_path / "out2"), tokenizer_backend="gigatoken",
                            **options))


def test_special_token_literals_typed_in_messages_are_counted(chat_output, chats):
    """Every 7th conversation has a control token typed into a message: the summary and
    the manifest count those conversations, as they count text documents holding one."""
    output, summary = chat_output
    holding = sum(any(literal in message["content"] for message in messages
                      for literal in SPECIALS) for messages in chats)
    assert holding >= 100
    assert summary.special_literals == holding
    assert f"special-token literals in {holding:,} documents" in summary.render()
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["totals"]["special_literals"] == holding
