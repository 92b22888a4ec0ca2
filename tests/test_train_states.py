"""Named loader states in Ray Train checkpoints (no cluster needed): a train and a validation
loader keep separate files, the unnamed file of earlier releases still reads, a missing state
or no checkpoint restores nothing, and only the state file is read."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.train")

import ray.train  # noqa: E402

from raypipe.errors import StateError  # noqa: E402
from raypipe.loader import TokenLoader  # noqa: E402
from raypipe.ray.train import read_loader_state, save_loader_state  # noqa: E402


def test_named_states_restore_independently(token_dataset, tmp_path):
    train = TokenLoader(token_dataset, 16, 2, seed=1)
    validation = TokenLoader(token_dataset, 16, 2, seed=1, mode="documents")
    next(iter(train))
    train.state_name, validation.state_name = "train", "validation"
    save_loader_state(train, tmp_path)
    save_loader_state(validation, tmp_path)
    unnamed = TokenLoader(token_dataset, 16, 2, seed=1)
    save_loader_state(unnamed, tmp_path)  # an unnamed (pre-0.3) state as well
    checkpoint = ray.train.Checkpoint.from_directory(str(tmp_path))
    assert read_loader_state(checkpoint, "train") == train.state_dict()
    assert read_loader_state(checkpoint, "validation") == validation.state_dict()
    assert read_loader_state(checkpoint, "train")["position"] > 0
    assert read_loader_state(checkpoint, "validation")["position"] == 0
    assert read_loader_state(checkpoint) == json.loads(
        (tmp_path / "raypipe_loader_state.json").read_text())
    assert read_loader_state(checkpoint, "eval") is None
    assert read_loader_state(None, "train") is None


def test_a_state_name_that_is_a_path_and_a_garbled_state_are_refused(token_dataset, tmp_path):
    loader = TokenLoader(token_dataset, 16, 2)
    with pytest.raises(StateError, match="plain word"):
        save_loader_state(loader, tmp_path, name="../x")
    (tmp_path / "raypipe_loader_state.train.json").write_text("{not json")
    with pytest.raises(StateError, match="not a loader state"):
        read_loader_state(ray.train.Checkpoint.from_directory(str(tmp_path)), "train")
