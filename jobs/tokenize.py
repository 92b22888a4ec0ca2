"""Tokenize job for `ray job submit`: the same config and code path as `raypipe tokenize`.

    ray job submit --working-dir . -- python jobs/tokenize.py --config jobs/configs/demo.yaml
"""

import os
import sys

# This folder holds tokenize.py, which would shadow the standard library's `tokenize`
# module for everything imported below: take the script's folder off the import path.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

from raypipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["tokenize", *sys.argv[1:]]))
