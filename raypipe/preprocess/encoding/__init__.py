"""Encoding: the tokenizer, its two backends (`tokenizers`, tiktoken over the converted
vocabulary) and the start-up self-check that picks between them."""
