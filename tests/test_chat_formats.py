"""Chat data in every format that can hold its loss mask: Megatron's `.mask` sidecar, MDS's
`loss_mask` column (read by `streaming.StreamingDataset`), the stream format's `.mask`
sidecar and span record per turn, and LLMBATCH's `.mask` sidecar, each equal to the
conversations' own mask and each reaching the loader's `batch.mask`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raypipe.config import load_config
from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError, FormatError, InputError
from raypipe.loader import TokenLoader
from raypipe.loader.mosaic_streaming import import_streaming
from raypipe.preprocess.chat import CHATML
from raypipe.preprocess.job import run_job
from raypipe.sampling.plans import PackingReport
from tests.test_chat_job import chat_tokenizer_path, chats, expected, write_chats  # noqa: F401

RECORD_LEN, BATCH = 65, 4
MASK_FORMATS = ["megatron", "mds", "stream", "llmbatch"]


@pytest.fixture(scope="module")
def every_mask_format(tmp_path_factory, chat_tokenizer_path, chats):  # noqa: F811
    """300 conversations into every format that holds a mask, EOS after each (stream finds
    conversations by it)."""
    root = tmp_path_factory.mktemp("chat-formats")
    write_chats(root / "in" / "chats.parquet", chats[:300])
    run_job(load_config(None, inputs=[str(root / "in")], output=str(root / "out"),
                        tokenizer=chat_tokenizer_path, chat=True, formats=MASK_FORMATS,
                        eos=True, seq_len=RECORD_LEN, batch_size=BATCH,
                        shard_tokens=20_000))
    return root / "out"


def document_tokens(dataset, index):
    """Document `index` (global numbering) of `dataset` as a list of ids."""
    shard = int(np.searchsorted(dataset.document_offsets, index, side="right")) - 1
    local = index - int(dataset.document_offsets[shard])
    return np.asarray(dataset.reader(shard).document(local)).tolist()


def documents_and_masks(output, name):
    dataset = TokenDataset(output, name)
    assert dataset.has_loss_mask
    return ([np.asarray(document).tolist() for document in dataset.iter_documents()],
            [dataset.document_loss_mask(index).tolist()
             for index in range(dataset.num_documents)])


def test_each_document_format_stores_the_conversations_ids_and_mask(
        every_mask_format, chat_tokenizer_path, chats):  # noqa: F811
    want = expected(chat_tokenizer_path, CHATML, chats[:300])
    eos = json.loads((every_mask_format / "manifest.json").read_text())["tokenizer"]["eos_id"]
    want_ids = [[*w.ids.tolist(), eos] for w in want]
    want_masks = [[*w.trained.astype(int).tolist(), 0] for w in want]  # EOS: untrained
    for name in ("megatron", "mds", "stream"):
        ids, masks = documents_and_masks(every_mask_format, name)
        assert ids == want_ids, name
        assert masks == want_masks, name


def test_stream_keeps_a_span_record_per_turn_with_its_role_and_whether_it_is_trained(
        every_mask_format, chats):  # noqa: F811
    dataset = TokenDataset(every_mask_format, "stream")
    reader = dataset.reader(0)
    starts = reader.document_starts
    for index in range(5):
        first, stop = int(starts[index]), int(starts[index + 1])
        ids = np.asarray(reader.metadata_ids[first:stop])
        records = reader.read_records(int(ids.min()), int(ids.max()))
        document, turns = records[0], records[1:]
        assert document["row"] == index and document["source"] == "chats.parquet"
        assert [turn["role"] for turn in turns] == [m["role"] for m in chats[index]]
        mask = np.asarray(reader.loss_mask[first:stop])
        for offset, turn in enumerate(turns, start=int(ids.min()) + 1):
            at = np.flatnonzero(ids == offset)  # the turn's tokens carry its record's id
            assert turn["trained"] == bool(mask[at].any())
            assert turn["trained"] == (turn["role"] == "assistant")


def test_mds_loss_mask_column_is_read_by_streaming_dataset(every_mask_format):
    streaming = import_streaming()
    samples = streaming.StreamingDataset(local=str(every_mask_format / "mds"), batch_size=1,
                                         shuffle=False)
    ids, masks = documents_and_masks(every_mask_format, "megatron")
    assert len(samples) == len(ids)
    for index in (0, 1, len(ids) - 1):
        sample = samples[index]
        assert sample["tokens"].tolist() == ids[index]
        assert sample["loss_mask"].dtype == np.uint8
        assert sample["loss_mask"].tolist() == masks[index]


def test_llmbatch_records_carry_the_mask_of_the_tokens_they_hold(every_mask_format):
    """Every record position's stored mask is the document shards' mask of the token there
    (0 on padding), and the llmbatch loader's batch.mask is it shifted to the targets,
    ANDed with the records' own join and padding rule."""
    documents = TokenDataset(every_mask_format, "megatron")
    batches = BatchDataset(every_mask_format)
    loader = TokenLoader(every_mask_format, seq_len=RECORD_LEN - 1, batch_size=BATCH,
                         mode="batches", device="cpu")
    assert batches.options.packing == "split"  # chat data's default: conversations whole
    filler = loader.filler(0)
    trained = 0
    for batch in loader:
        (index,) = filler.describe(batch.positions[None, :1])[0].rows
        stored = batches.loss_mask(index)
        want = np.zeros_like(stored)
        for row, segments in enumerate(filler.segments(batch.positions[None, :1])[:BATCH]):
            for document, start, take, column in zip(
                    segments.documents.tolist(), segments.starts.tolist(),
                    segments.take.tolist(), segments.columns.tolist(), strict=True):
                mask = documents.document_loss_mask(document)
                want[row, column:column + take] = mask[start:start + take]
        assert np.array_equal(stored, want)
        got = batch.mask.numpy().astype(bool)
        assert not (got & ~stored[:, 1:].astype(bool)).any()  # nothing untrained trains
        trained += int(got.sum())
    assert trained > 0
    report = PackingReport.from_options(batches.section.options)  # what the section records
    assert report.used_tokens + report.cropped_tokens + report.dropped_tokens == \
        documents.num_tokens
    assert report.repeated_tokens > 0  # conversations longer than a record overlap by one
    assert report.positions == batches.num_batches * BATCH * RECORD_LEN


def test_stream_in_a_chat_job_needs_a_separator_and_mds_concat_is_refused(tmp_path):
    common = dict(inputs=["x"], output=str(tmp_path / "o"), tokenizer="t", chat=True)
    with pytest.raises(ConfigError, match="stream finds conversations by a separator token"):
        load_config(None, formats=["megatron", "stream"], **common)
    with pytest.raises(ConfigError, match="chat data keeps a sample per conversation"):
        load_config(None, formats=["mds"], mds_concat_tokens=64, **common)


def test_a_separator_inside_a_conversation_is_an_error_naming_the_row(
        tmp_path, chat_tokenizer_path, chats):  # noqa: F811
    """Under `special`, a literal EOS in a message is the EOS id: stream could not find
    where that conversation ends, so the job stops and names the row."""
    from tokenizers import Tokenizer

    eos_text = Tokenizer.from_file(chat_tokenizer_path).id_to_token(
        _eos_id(chat_tokenizer_path))
    rows = chats[:20]
    rows[7] = [{"role": "user", "content": f"say {eos_text}"},
               {"role": "assistant", "content": "ok"}]
    write_chats(tmp_path / "in" / "c.parquet", rows)
    with pytest.raises(InputError, match=r"c\.parquet.*row 7: the conversation holds the "
                                         r"separator token"):
        run_job(load_config(None, inputs=[str(tmp_path / "in")], output=str(tmp_path / "o"),
                            tokenizer=chat_tokenizer_path, chat=True, formats=["stream"],
                            eos=True, special_tokens_in_text="special"))


def _eos_id(tokenizer_path: str) -> int:
    from raypipe.preprocess.encoding.encoder import describe_tokenizer, load_tokenizer

    return describe_tokenizer(load_tokenizer(tokenizer_path), tokenizer_path, False,
                              True).eos_id


@pytest.mark.parametrize("mode", ["bestfit", "windows", "documents"])
def test_every_loader_mode_masks_every_target_the_data_does_not_train(every_mask_format,
                                                                      mode):
    """batch.mask is 1 only on targets whose token the loss mask trains (the token each row
    holds there, from the mode's own description of its rows), in every mode that cuts rows
    from documents; and such targets exist."""
    documents = TokenDataset(every_mask_format, "megatron")
    loader = TokenLoader(every_mask_format, seq_len=RECORD_LEN - 1, batch_size=2, mode=mode,
                         seed=5, device="cpu")
    filler = loader.filler(0)
    trained = 0
    for step, batch in enumerate(loader):
        for row, segments in enumerate(filler.segments(batch.positions)):
            want = np.zeros(RECORD_LEN, dtype=bool)
            for document, start, take, column in zip(
                    segments.documents.tolist(), segments.starts.tolist(),
                    segments.take.tolist(), segments.columns.tolist(), strict=True):
                mask = documents.document_loss_mask(document)[start:start + take]
                want[column:column + take] = mask.astype(bool)
            got = batch.mask[row].numpy().astype(bool)
            assert not (got & ~want[1:]).any(), (mode, step, row)
            trained += int(got.sum())
        if step == 40:
            break
    assert trained > 0


def test_inspect_marks_trained_tokens_in_every_format(every_mask_format,
                                                      chat_tokenizer_path):  # noqa: F811
    from raypipe.tools.inspect import inspect_dataset

    shown = inspect_dataset(every_mask_format, samples=1, tokenizer=chat_tokenizer_path)
    sections = shown.split("\nformat ")[1:]
    assert sorted(section.split(":", 1)[0] for section in sections) == sorted(MASK_FORMATS)
    for section in sections:
        marked = [line for line in section.splitlines()
                  if "trained, between [[ ]]" in line]
        assert len(marked) == 1 and "[[" in marked[0].split("]]): ", 1)[1], section[:80]


@pytest.mark.parametrize("target", ["mds", "stream", "megatron"])
def test_convert_carries_the_loss_mask_and_refuses_a_format_that_cannot_hold_it(
        every_mask_format, tmp_path, target):
    from raypipe.tools.convert import convert_dataset

    source = "stream" if target == "megatron" else "megatron"
    convert_dataset(every_mask_format, tmp_path / target, target, source_format=source)
    assert documents_and_masks(tmp_path / target, target) == \
        documents_and_masks(every_mask_format, source)
    with pytest.raises(ConfigError, match="nanogpt cannot hold its mask: convert to one of"):
        convert_dataset(every_mask_format, tmp_path / "nanogpt", "nanogpt")


def test_the_padding_warning_on_chat_data_never_advises_cutting_conversations(
        tmp_path, chat_tokenizer_path, chats, caplog):  # noqa: F811
    """Split packing pads chat data by design (here: conversations of 0.6 rows, one a row);
    the warning's hint says so instead of naming a packing that would cut them."""
    write_chats(tmp_path / "in" / "c.parquet", [chats[1]] * 40)
    run_job(load_config(None, inputs=[str(tmp_path / "in")], output=str(tmp_path / "o"),
                        tokenizer=chat_tokenizer_path, chat=True))
    length = int(TokenDataset(tmp_path / "o").document_lengths()[0])
    loader = TokenLoader(tmp_path / "o", seq_len=int(length / 0.6), batch_size=1,
                         device="cpu")
    with caplog.at_level("WARNING", logger="raypipe"):
        loader.plan(0)
    (message,) = [record.getMessage() for record in caplog.records if "padding" in
                  record.getMessage()]
    assert "hint: the padding is what keeps conversations whole" in message


def test_trace_of_a_chat_state_names_the_overlapping_pieces_the_loader_served(
        every_mask_format):
    """A chat loader's state (overlong `split` recorded) traces the rows served next: every
    record's tokens are the document's tokens it names, later pieces starting one token
    before the previous piece's end."""
    from raypipe.tools.trace import trace

    documents = TokenDataset(every_mask_format, "megatron")
    loader = TokenLoader(every_mask_format, seq_len=RECORD_LEN - 1, batch_size=4, seed=2,
                         device="cpu")
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    assert state["knobs"]["overlong"] == "split"
    served = [next(batches) for _ in range(6)]
    batches.close()
    records = list(trace(every_mask_format, state=state, steps=6))
    assert {record.step for record in records} == {batch.step for batch in served}
    for record in records:
        batch = next(b for b in served if b.step == record.step)
        row = [*batch.inputs[record.row].tolist(), int(batch.targets[record.row, -1])]
        held = row[record.col_start:record.col_end]
        assert held == document_tokens(documents, record.document)[
            record.token_start:record.token_end], record
    assert any(record.token_start > 0 for record in records)  # overlapping later pieces


def test_convert_to_llmbatch_packs_chat_data_with_split_unless_told(every_mask_format,
                                                                   tmp_path):
    """`--packing auto` (the default) keeps every conversation that fits a record whole;
    the loss mask comes along."""
    from raypipe.tools.convert import convert_dataset

    convert_dataset(every_mask_format, tmp_path / "b", "llmbatch",
                    {"record_len": RECORD_LEN, "batch_size": BATCH})
    converted = BatchDataset(tmp_path / "b")
    assert converted.options.packing == "split"
    assert converted.loss_mask(0) is not None


@pytest.mark.parametrize("fmt", ["megatron", "stream"])
def test_a_loss_mask_byte_changed_in_place_is_refused_before_an_altered_mask_is_served(
        every_mask_format, tmp_path, fmt):
    """A byte flipped in a `.mask` sidecar with its modification time put back (bit rot, a
    copy that kept times): the shard's `.mask.sums` refuses it, naming the file, and every
    batch served before (inputs and mask) is the unchanged output's."""
    import os
    import shutil

    def served(root):
        batches = []
        loader = TokenLoader(root, 32, 4, format=fmt, seed=5, device="cpu")
        try:
            for batch in loader:
                batches.append((batch.inputs.numpy().tobytes(), batch.mask.numpy().tobytes()))
        except FormatError as refused:
            return batches, refused
        finally:
            loader.close()
        return batches, None

    copy = tmp_path / "copy"
    shutil.copytree(every_mask_format, copy)  # times kept
    clean, _ = served(copy)
    victim = sorted((copy / fmt).glob("*.mask"))[1]
    before = victim.stat()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    batches, refused = served(copy)
    assert refused is not None and str(victim) in str(refused) and "\n" not in str(refused)
    assert "differ from what the job wrote" in str(refused)
    assert batches == clean[:len(batches)] and len(batches) < len(clean)


def test_chat_data_is_read_in_blocks_only_where_its_mask_carries_sums(every_mask_format,
                                                                       tmp_path):
    """A chat output of this release (`.mask.sums` beside `.mask`) resolves block_bytes 0
    to blocks; one written before (no `.mask.sums`) to whole shards, locally as on a
    bucket, and still serves its mask."""
    import shutil

    from raypipe.sampling.blocks import WHOLE_SHARDS
    from tests.helpers import without_sidecar

    def opened(root):
        return TokenLoader(str(root), 32, 4, shuffle="windowed", format="megatron",
                           device="cpu")

    assert opened(every_mask_format).spec.block_bytes < WHOLE_SHARDS
    older = without_sidecar(shutil.copytree(every_mask_format, tmp_path / "older"),
                            "megatron", ".mask.sums")
    assert not list((older / "megatron").glob("*.mask.sums"))
    assert list((older / "megatron").glob("*.sums"))  # the tokens' own are kept
    loader = opened(older)
    assert loader.spec.block_bytes == WHOLE_SHARDS
    assert any(batch.mask.numpy().any() for batch in loader)
