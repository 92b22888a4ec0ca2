"""The embedded demo: a real English corpus gathered from Python's own docstrings, and a
BPE tokenizer trained on it by `raypipe.demo.train_tokenizer` (shipped as tokenizer.json)."""
