"""What raypipe 0.6 wrote still holds: tests/golden/ keeps a corpus, the outputs the 0.6
code made of it (the shipped demo tokenizer; a job of Megatron, stream and LLMBATCH, and a
job of the default formats) and loader states the 0.6 code saved on them, each with the
digest of the batch that followed it. Today's code writes the same bytes from the same
corpus (and beside each Megatron shard the `.sums` 0.6 did not write), and resumes every
old state (the `llmbatch` mode's included) at that very batch."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from raypipe.config import load_config
from raypipe.demo.train_tokenizer import SHIPPED
from raypipe.io.manifest import read_manifest
from raypipe.io.store import Store
from raypipe.loader import TokenLoader
from raypipe.preprocess.job import run_job

GOLDEN = Path(__file__).parent / "golden"
# the jobs the golden outputs come from, as 0.6 ran them (unit_bytes 1 GiB: one unit)
JOBS = {
    "rich": dict(formats=["megatron", "stream", "llmbatch"], metadata_columns=["id"],
                 seq_len=129, batch_size=4, batches_per_shard=8, shard_tokens=6000),
    "default": dict(shard_tokens=6000),
}
STATES = json.loads((GOLDEN / "states.json").read_text())
# the sidecars each format's shards gained since 0.6 (its readers ignore them): checksums of
# the token file, and the document lengths of a format without an index of its own
SIDECARS_SINCE_0_6 = {"megatron": ("sums",), "nanogpt": ("sums",), "stream": ("lengths", "sums"),
                      "mds": ("lengths",)}


def shard_contents(root: Path) -> dict[str, list[tuple[str, int, str]]]:
    """Per format: each shard file's kind (its suffix), size and sha256, in manifest order
    (shard names carry the input's location, which differs from run to run)."""
    manifest = read_manifest(Store(str(root)))
    return {name: [(Path(f.path).name.split(".", 1)[1], f.bytes, f.sha256)
                   for shard in section.shards for f in shard.files]
            for name, section in manifest.formats.items()}


@pytest.mark.parametrize("job", sorted(JOBS))
def test_todays_code_writes_the_bytes_0_6_wrote(tmp_path, job):
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(GOLDEN / "corpus.jsonl", corpus)
    run_job(load_config(None, inputs=[str(corpus)], output=str(tmp_path / "out"),
                        tokenizer=str(SHIPPED), unit_bytes=1 << 30, **JOBS[job]))
    today = shard_contents(tmp_path / "out")
    manifest = read_manifest(Store(str(tmp_path / "out")))
    for name, kinds in SIDECARS_SINCE_0_6.items():
        for kind in kinds if name in today else ():  # one a shard, then 0.6's files, as were
            sidecars = [entry for entry in today[name] if entry[0] == kind]
            assert len(sidecars) == len(manifest.formats[name].shards)
            today[name] = [entry for entry in today[name] if entry[0] != kind]
    assert today == shard_contents(GOLDEN / job)


@pytest.mark.parametrize("entry", STATES, ids=[f"{e['mode']}-{e['dataset']}" for e in STATES])
def test_a_0_6_state_resumes_at_the_batch_it_was_saved_before(tmp_path, entry):
    dataset = tmp_path / entry["dataset"]
    shutil.copytree(GOLDEN / entry["dataset"], dataset)  # the loader may cache beside it
    shape = () if entry["mode"] == "llmbatch" else (32, 2)
    loader = TokenLoader(str(dataset), *shape, mode=entry["mode"], seed=7, device="cpu")
    loader.load_state_dict(entry["state"])
    following = next(iter(loader)).inputs.numpy()
    assert hashlib.sha256(following.tobytes()).hexdigest() == entry["next_inputs_sha256"]
