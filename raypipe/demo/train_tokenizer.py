"""Train the demo's byte-level BPE tokenizer on the standard-library docstring corpus.

    python -m raypipe.demo.train_tokenizer [--vocab-size 8192] [--output PATH]

Special tokens: <|bos|> (id 0), <|eos|> (id 1), <|pad|> (id 2). The shipped
raypipe/demo/tokenizer.json was made with the defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
SHIPPED = Path(__file__).with_name("tokenizer.json")


# Llama-3's pre-tokenizer regex (one Split, then byte level without GPT-2's own regex)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe(texts: list[str], vocab_size: int = 8192, split_regex: str | None = None
              ) -> Tokenizer:
    """A byte-level BPE trained on `texts`: GPT-2's pre-tokenizer, or with `split_regex` a
    Llama-3-style one (that regex as a Split, then byte level without its own regex; a
    `Regex`: a plain string would split on the literal)."""
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=split_regex is None)
    tokenizer.pre_tokenizer = byte_level if split_regex is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split_regex), behavior="isolated"), byte_level])
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
