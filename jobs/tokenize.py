"""Tokenize job for `ray job submit`: the same config and code path as `raypipe tokenize`.

    ray job submit --working-dir . -- python jobs/tokenize.py --config jobs/configs/demo.yaml
"""

import sys

from raypipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["tokenize", *sys.argv[1:]]))
