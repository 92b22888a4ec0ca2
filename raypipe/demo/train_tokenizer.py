"""Train the demo's byte-level BPE tokenizer on the standard-library docstring corpus.

    python -m raypipe.demo.train_tokenizer [--vocab-size 8192] [--output PATH]

Special tokens: <|bos|> (id 0), <|eos|> (id 1), <|pad|> (id 2). The shipped
raypipe/demo/tokenizer.json was made with the defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
SHIPPED = Path(__file__).with_name("tokenizer.json")


def train_bpe(texts: list[str], vocab_size: int = 8192) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    from raypipe.demo.corpus import gather_docstrings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--output", type=Path, default=SHIPPED)
    args = parser.parse_args(argv)
    tokenizer = train_bpe(gather_docstrings(), args.vocab_size)
    tokenizer.save(str(args.output))
    print(f"wrote {args.output} (vocab {tokenizer.get_vocab_size()})")


if __name__ == "__main__":
    main()
