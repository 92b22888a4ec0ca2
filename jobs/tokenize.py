"""Tokenize job for `ray job submit`: the same config and code path as `raypipe tokenize`.

    ray job submit --working-dir . -- python jobs/tokenize.py --config jobs/configs/demo.yaml

Inside a submitted job the working directory is Ray's temporary copy of `--working-dir`
(without gitignored files): relative inputs are read from that copy, and a relative output is
refused (it would be written into the copy and lost); give an absolute path or a bucket URI.
The demo config reads the demo corpus from $RAYPIPE_DEMO_DIR/corpus (default
<tmp>/raypipe-demo-<user>: two users never share it, and the output lock keeps one job per
output) and builds it there when it is missing (a local cluster; on several nodes use a
shared or bucket location).
"""

import os
import sys

# This folder holds tokenize.py, which would shadow the standard library's `tokenize`
# module for everything imported below: take the script's folder off the import path.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

from raypipe import interrupts  # noqa: E402
from raypipe.cli import build_parser, config_from_args, main  # noqa: E402
from raypipe.errors import RaypipeError  # noqa: E402
from raypipe.io.paths import check_lasting_location  # noqa: E402

DEMO_DIR_VARIABLE = "RAYPIPE_DEMO_DIR"


def demo_dir() -> str:
    """Where the demo config's corpus and output live (set in the environment if unset)."""
    import getpass
    import tempfile

    default = os.path.join(tempfile.gettempdir(), f"raypipe-demo-{getpass.getuser()}")
    return os.environ.setdefault(DEMO_DIR_VARIABLE, default)
def build_demo_corpus(inputs: tuple[str, ...]) -> None:
    """Write the stdlib docstring corpus where the demo config reads it, if it is missing."""
    import shutil
    import tempfile
    from pathlib import Path

    from raypipe.demo.corpus import gather_docstrings, write_corpus

    corpus = Path(demo_dir()) / "corpus"
    if str(corpus) in inputs and not any(corpus.glob("*.parquet")):
        documents = gather_docstrings()
        corpus.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=".corpus-", dir=corpus.parent))
        write_corpus(documents, staged, files=4, row_group_rows=500)
        try:  # whole or not at all: a concurrent run may have built it meanwhile
            staged.rename(corpus)
        except OSError:
            shutil.rmtree(staged, ignore_errors=True)
        print(f"demo corpus: {len(documents):,} docstrings -> {corpus}")


def run(argv: list[str]) -> int:
    interrupts.install()  # `ray job stop` sends SIGTERM: one line, exit 143, output resumable
    demo_dir()  # the demo config's $RAYPIPE_DEMO_DIR
    try:
        config = config_from_args(build_parser().parse_args(["tokenize", *argv]))
        check_lasting_location(config.output, "output")
        build_demo_corpus(config.inputs)
    except RaypipeError as exc:
        print(f"raypipe: error: {exc}", file=sys.stderr)
        return 2
    except interrupts.Interrupted as exc:
        print(f"raypipe tokenize: interrupted by {exc.signal_name} before it started; rerun "
              "the same command", file=sys.stderr)
        return exc.exit_status
    return main(["tokenize", *argv])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
