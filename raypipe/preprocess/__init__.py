"""The tokenize job: inputs -> work units, text cleaning, encoders, one unit's shards, the
job driver with its serial executor, and LLMBATCH packing. No Ray here (raypipe.ray runs
units on a cluster)."""
