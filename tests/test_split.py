"""Train / validation split: disjoint, covering, the same at every world size, validation
served in order once with nothing dropped, and refused where whole documents cannot be held
out."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.errors import ConfigError
from raypipe.loader import TokenLoader
from raypipe.sampling.split import DocumentSplit, validation_mask


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 5000), st.floats(0.001, 0.999), st.text("0123456789abcdef", min_size=16,
                                                              max_size=16))
def test_train_and_validation_are_disjoint_and_cover_every_document(count, fraction, key):
    train = DocumentSplit.of("train", fraction, count, key).ids
    validation = DocumentSplit.of("validation", fraction, count, key).ids
    assert not set(train.tolist()) & set(validation.tolist())
    assert sorted(train.tolist() + validation.tolist()) == list(range(count))


def test_the_validation_share_follows_the_fraction():
    held = validation_mask(200_000, "0123456789abcdef", 0.01)
    assert abs(held.mean() - 0.01) < 3 * np.sqrt(0.01 * 0.99 / 200_000) * 2


def served(path, world: int, **options) -> dict[int, list[int]]:
    """Every rank's rows of one epoch: global document id -> its tokens."""
    rows: dict[int, list[int]] = {}
    for rank in range(world):
        for batch in TokenLoader(path, 64, 2, rank=rank, world_size=world, seed=4, **options):
            for row, document in enumerate(batch.observation_ids.tolist()):
                if document >= 0:
                    assert document not in rows, "a document was served twice"
                    rows[document] = batch.inputs[row].tolist()
    return rows


def served_order(path, world: int, **options) -> list[int]:
    """Every rank's documents of one epoch, in the order of their global positions."""
    found = []
    for rank in range(world):
        for batch in TokenLoader(path, 64, 2, rank=rank, world_size=world, seed=4, **options):
            found += zip(batch.positions.tolist(), batch.observation_ids.tolist(), strict=True)
    return [document for _, document in sorted(found) if document >= 0]


def test_validation_is_served_once_in_order_whatever_the_world_size(token_dataset):
    options = {"mode": "documents", "split": "validation", "validation_fraction": 0.25}
    expected = DocumentSplit.of("validation", 0.25, TokenLoader(token_dataset, 64, 2)
                                .dataset.num_documents,
                                TokenLoader(token_dataset, 64, 2).dataset.fingerprint).ids
    one, three = served(token_dataset, 1, **options), served(token_dataset, 3, **options)
    assert sorted(one) == expected.tolist() and one == three
    for world in (1, 3):  # in global position order, the documents ascend: in order
        assert served_order(token_dataset, world, **options) == expected.tolist()
    loader = TokenLoader(token_dataset, 64, 2, world_size=3, rank=0, **options)
    assert loader.packing_report().dropped_tokens == 0
    first = next(iter(loader))
    assert first.observation_ids.tolist() == expected[[0, 3]].tolist()  # rank 0: 0, 3


def test_train_never_serves_a_validation_document(token_dataset):
    train = TokenLoader(token_dataset, 64, 4, mode="documents", split="train",
                        validation_fraction=0.25)
    validation = served(token_dataset, 1, mode="documents", split="validation",
                        validation_fraction=0.25)
    seen = {int(d) for batch in train for d in batch.observation_ids}
    assert seen and not seen & set(validation)


def test_a_split_is_refused_where_documents_cannot_be_held_out(token_dataset):
    for options, words in (({"mode": "windows", "split": "validation"}, "in order"),
                           ({"mode": "bestfit", "split": "validation"}, "documents"),
                           ({"mode": "documents", "split": "train",
                             "validation_fraction": 1.5}, r"\(0, 1\)"),
                           ({"mode": "documents", "split": "test"}, "not among")):
        with pytest.raises(ConfigError, match=words):
            TokenLoader(token_dataset, 64, 2, **options)


def test_train_windows_are_cut_from_the_train_documents_alone(token_dataset):
    from raypipe.dataset import TokenDataset

    loader = TokenLoader(token_dataset, 32, 4, mode="windows", split="train",
                         validation_fraction=0.3)
    dataset = TokenDataset(token_dataset)
    documents = list(dataset.iter_documents())
    stream = np.concatenate([documents[i] for i in loader.run.planned.split.ids.tolist()])
    assert loader.plan().size == (stream.size - 1) // 32
    for batch in loader:
        for row, window in enumerate(batch.observation_ids.tolist()):
            expected = stream[window * 32:window * 32 + 33]
            assert batch.inputs[row].tolist() == expected[:-1].tolist()
            assert batch.targets[row].tolist() == expected[1:].tolist()
