"""Train a small GPT on raypipe output with Ray Train (TorchTrainer), checkpointing model,
optimizer and loader state every k steps; rerunning with the same --storage/--name resumes.

    python jobs/train.py --data demo_out/tokens --workers 2            # local CPU, gloo
    ray job submit --working-dir . -- python jobs/train.py --data s3://bucket/tokens \\
        --storage s3://bucket/train_out --use-gpu --workers 8 --seq-len 1024 \\
        --batch-size 16 --wait-for-resources

In a submitted job the working directory is Ray's throw-away copy of `--working-dir`, so
`--storage` must be a path every node sees or a URI: a relative one, or one inside that
copy (the default ./train_out), is refused in one line.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from pathlib import Path

# This folder holds tokenize.py, which would shadow the standard library's `tokenize`
# module for everything imported below: take the script's folder off the import path.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

from raypipe.cli import (  # noqa: E402
    HelpFormatter,
    add_plan_arguments,
    add_schedule_arguments,
    plan_knobs,
)
from raypipe.errors import RaypipeError, StateError  # noqa: E402
from raypipe.examples.gpt_train import fit, newest_checkpoint, open_loaders  # noqa: E402
from raypipe.io.paths import check_lasting_location  # noqa: E402
from raypipe.provenance.rows import document_names  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=HelpFormatter)
    parser.add_argument("--data", required=True,
                        help="a raypipe output (a directory or a URI: s3://, gs://, ...) or "
                        "a mixture YAML (sources: {name: {path, weight}})")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per worker per step")
    add_schedule_arguments(parser)
    # every loader knob (mode, seed, shuffle, ... and each mode's own), as the CLI's; a
    # --validation-fraction holds documents out and reports val_loss at checkpoints (a
    # validation loader with its own state)
    add_plan_arguments(parser, seq_len=128)
    parser.add_argument("--exclude", default=None, metavar="FILE",
                        help="documents to leave out from where the run resumes on, one a "
                        "line (numbers, <input>:<row>, or raypipe trace's JSON records), read "
                        "here and sent to every worker; the loader states record them")
    parser.add_argument("--follow", action="store_true",
                        help="train on the output of a tokenize job that is still running: "
                        "its units join the run as they commit, at a step rank 0 decides "
                        "for every worker (docs/loader.md, \"When the data changes\")")
    parser.add_argument("--units-join", choices=("epoch", "next_epoch"), default="epoch",
                        help="where units the output gained are served: the rest of the "
                        "epoch in progress (default) or from the next epoch")
    parser.add_argument("--cache-dir", default=None,
                        help="node-local shard cache for URI data (None: "
                        "$RAYPIPE_CACHE_DIR, else ~/.cache/raypipe)")
    parser.add_argument("--workers", type=worker_count, default=2,
                        help="Ray Train workers: N, or MIN-MAX for Ray Train's elastic mode "
                        "(the group restarts at another size after a failure or when nodes "
                        "come; every loader resumes at the new world size)")
    parser.add_argument("--use-gpu", action="store_true",
                        help="one GPU per worker, nccl (default: CPU, gloo)")
    parser.add_argument("--max-steps", type=int, default=60, help="steps to train in all")
    parser.add_argument("--checkpoint-every", type=int, default=10,
                        help="steps between checkpoints (model, optimizer, loader states)")
    parser.add_argument("--max-failures", type=int, default=2,
                        help="worker failures Ray Train retries (FailureConfig)")
    parser.add_argument("--storage", default=None,
                        help="where runs and their checkpoints are kept: in a submitted job "
                             "a path every node sees, or a URI (s3://...); default: "
                             "./train_out (refused in a submitted job: Ray's copy of "
                             "--working-dir is thrown away)")
    parser.add_argument("--name", default="tiny-gpt",
                        help="the run's name: the same --storage and --name resume it")
    parser.add_argument("--address", default=None, help="Ray address (None: local)")
    parser.add_argument("--wait-for-resources", action="store_true",
                        help="start even if the cluster lacks the workers' CPUs/GPUs now "
                        "(an autoscaling cluster adds them); without it, fail at once")
    return parser


def storage_location(storage: str | None) -> str:
    """The run's storage as an absolute path or a URI; in a submitted job, a ConfigError if
    it would land in Ray's temporary copy of the working directory."""
    check_lasting_location(storage or "train_out", "--storage")
    return storage if storage and "://" in storage else os.path.abspath(storage or "train_out")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.storage = storage_location(args.storage)
    except RaypipeError as exc:
        print(f"raypipe: error: {exc}", file=sys.stderr)
        return 2
    done = last_checkpoint_step(Path(args.storage) / args.name)
    if done is not None and done >= args.max_steps:
        print(f"nothing to run: {Path(args.storage) / args.name} already holds a checkpoint "
              f"at step {done} (--max-steps {args.max_steps}); raise --max-steps to train "
              "further, or pass another --name for a new run")
        return 0
    try:
        check_loader_states(Path(args.storage) / args.name, run_config(args))
    except RaypipeError as exc:  # a state that cannot resume: fail now, not per retry
        print(f"raypipe: error: {exc}", file=sys.stderr)
        return 2
    from raypipe.ray.session import ensure_ray

    ensure_ray(args.address, dashboard=True)  # Ray Train's controller polls its State API
    from raypipe.ray.train import missing_worker_resources, watch_for_preemption_only_on_a_cluster

    fewest = args.workers[0] if isinstance(args.workers, tuple) else args.workers
    missing = missing_worker_resources(fewest, args.use_gpu)
    if missing and not args.wait_for_resources:
        print(f"raypipe: error: {missing}; pass fewer --workers, or --wait-for-resources "
              "on a cluster that autoscales", file=sys.stderr)
        return 2
    watch_for_preemption_only_on_a_cluster()
    config = {**run_config(args), "max_steps": args.max_steps,
              "checkpoint_every": args.checkpoint_every}
    from raypipe.ray.stderr_lines import dropping_ray_noise

    with dropping_ray_noise():  # Ray's error line for the controller's PreemptionWatcher
        result = fit(config, args.workers, args.storage, args.name, args.use_gpu,
                     args.max_failures)
    print(f"finished: {result.metrics}; checkpoint {result.checkpoint}")
    return 0


def worker_count(text: str) -> int | tuple[int, int]:
    """`--workers`: N, or MIN-MAX (elastic)."""
    low, _, high = text.partition("-")
    try:
        counts = (int(low), int(high)) if high else int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of workers, or MIN-MAX") from None
    if (isinstance(counts, tuple) and not 1 <= counts[0] <= counts[1]) or \
            (isinstance(counts, int) and counts < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: workers must be >= 1 (MIN <= MAX)")
    return counts


def run_config(args: argparse.Namespace) -> dict:
    """The loaders' part of the run's config (raypipe.examples.gpt_train.open_loaders):
    the data, seq_len and batch size or their schedules (which replace them), the share of
    documents held out, and every loader option given on the command line."""
    knobs = plan_knobs(args)
    held_out = knobs.pop("validation_fraction", None)
    where = {"cache_dir": args.cache_dir, "format": args.format,
             "exclude": document_names(args.exclude) if args.exclude else None,
             "follow": args.follow or None,
             "units_join": args.units_join if args.units_join != "epoch" else None}
    return {"data": args.data if "://" in args.data else os.path.abspath(args.data),
            "seq_len": None if args.seq_len_schedule else args.seq_len,
            "batch_size": None if args.batch_schedule else args.batch_size,
            "batch_schedule": args.batch_schedule, "seq_len_schedule": args.seq_len_schedule,
            "validation_fraction": held_out,
            "options": {**knobs, **{name: value for name, value in where.items() if value}}}


def check_loader_states(run: Path, config: dict) -> None:
    """Load the newest checkpoint's loader states into loaders of this run's settings, on
    the driver: a state made for another dataset or other knobs is refused here, once,
    instead of failing every worker and every Ray Train retry."""
    newest = newest_checkpoint(run, loaders=None)
    if newest is None:
        return
    from raypipe.loader import open_loader
    from raypipe.ray.train import state_file_name

    def resumed(data: str, seq_len: int | None, batch_size: int | None, name: str,
                **options: object) -> object:
        loader = open_loader(data, seq_len, batch_size, **options)
        path = newest[1] / state_file_name(name)
        if path.exists():
            try:
                loader.load_state_dict(json.loads(path.read_text()))
            except RaypipeError as exc:
                raise StateError(f"{path}: cannot resume this run: {exc}") from exc
        return loader

    open_loaders(config, resumed)


def last_checkpoint_step(run: Path) -> int | None:
    """The step of the newest checkpoint of a local run directory (None: no checkpoint)."""
    newest = newest_checkpoint(run, loaders=None)
    return None if newest is None else newest[0]


if __name__ == "__main__":
    faulthandler.enable()  # a crash in native code (Ray, torch) leaves the Python stacks
    sys.exit(main())
