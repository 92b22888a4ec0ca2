"""The `raypipe` command line: tokenize, demo, pack-report, verify, inspect, convert.

Invariant: argument parsing only. The tokenize options are generated from TokenizeConfig's
fields (name, type, default, help), so the CLI, `jobs/tokenize.py`, the YAML keys and the
Python API never drift apart; any RaypipeError prints as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import io
import os
import sys
import typing
from pathlib import Path
from typing import Any

from raypipe import interrupts
from raypipe.config import ChatConfig, TokenizeConfig, compat, load_config
from raypipe.errors import ConfigError, RaypipeError
from raypipe.formats import FORMATS
from raypipe.knobs import knob_choices
from raypipe.sampling.modes import knob_fields


def _scalar_type(hint: Any) -> Any:
    """int/str/bool of a field's type hint (`int | None` -> int, tuples -> str)."""
    options = [h for h in typing.get_args(hint) if h is not type(None)] or [hint]
    base = typing.get_origin(options[0]) or options[0]
    return str if base is tuple else base


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per TokenizeConfig field; every default is None so that only what the
    user typed overrides the YAML file."""
    parser.add_argument("--config", help="YAML config; command-line options override it")
    hints = typing.get_type_hints(TokenizeConfig)
    for spec in dataclasses.fields(TokenizeConfig):
        meta = spec.metadata
        kind = meta.get("type") or _scalar_type(hints[spec.name])
        default = spec.default if spec.default is not dataclasses.MISSING else None
        shown = ",".join(default) if isinstance(default, tuple) else default
        text = meta.get("help", "") + ("" if default is None else f" (default: {shown})")
        if meta.get("positional"):
            parser.add_argument(spec.name, nargs="*", help=meta.get("help"))
            continue
        flags = [meta.get("flag", "--" + spec.name.replace("_", "-"))]
        if meta.get("short"):
            flags.append(meta["short"])
        flags += list(meta.get("aliases", ()))
        if meta.get("nested"):  # --chat, and one flag per ChatConfig field
            parser.add_argument(*flags, dest=spec.name, default=None, help=text,
                                action=argparse.BooleanOptionalAction)
            add_chat_arguments(parser)
        elif kind is bool:
            parser.add_argument(*flags, dest=spec.name, default=None, help=text,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(*flags, dest=spec.name, type=kind, default=None, help=text,
                                metavar=flags[0].lstrip("-").replace("-", "_").upper())
    add_format_arguments(parser)


CHAT_OPTION = "chat_option"  # an argparse dest prefix: chat_option:<field>


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ChatConfig field (--messages-column, --train-on, ...); giving one makes
    the job a chat job."""
    hints = typing.get_type_hints(ChatConfig)
    for spec in dataclasses.fields(ChatConfig):
        text = spec.metadata.get("help", "") + ("" if spec.default is None
                                                else f" (default: {spec.default})")
        _add_typed(parser, [f"--{spec.name.replace('_', '-')}"], f"{CHAT_OPTION}:{spec.name}",
                   hints[spec.name], None, text)


def given_chat(args: argparse.Namespace) -> Any:
    """`chat` as the command line gives it: False (--no-chat), the chat flags given (a chat
    job), True (--chat alone), or None (not said)."""
    given = given_under(args, CHAT_OPTION)
    if args.chat is False:
        return False
    return given or args.chat


FORMAT_OPTION = "format_option"  # an argparse dest prefix: format_option:<format>:<option>


def add_format_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option a registered format declares, `--<format>-<option>` (made from
    its options type), and the flags the config's compatibility module still takes
    (raypipe.config.compat)."""
    for name, fmt in FORMATS.items():
        hints = typing.get_type_hints(fmt.options_type)
        for spec in fmt.options_type.settable():
            text = f"{name}: {spec.metadata['help']}" + (
                "" if spec.default is None else f" (default: {spec.default})")
            _add_typed(parser, [f"--{name}-{spec.name}".replace("_", "-")],
                       f"{FORMAT_OPTION}:{name}:{spec.name}", hints[spec.name],
                       knob_choices(spec), text)
    compat.add_former_flags(parser, _add_typed)


def _add_typed(parser: argparse.ArgumentParser, flags: list[str], dest: str, hint: Any,
               choices: tuple[Any, ...] | None, text: str) -> None:
    """An option of a field's type (a bool: --flag / --no-flag), None when left out."""
    kind = _scalar_type(hint)
    if kind is bool:
        parser.add_argument(*flags, dest=dest, default=None, help=text,
                            action=argparse.BooleanOptionalAction)
        return
    parser.add_argument(*flags, dest=dest, type=kind, default=None, help=text,
                        choices=None if choices is None else [c for c in choices if c is not None],
                        metavar=None if choices else flags[0].lstrip("-").replace("-", "_").upper())


def given_format_options(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The --<format>-<option> flags given: {format: {option: value}}."""
    chosen: dict[str, dict[str, Any]] = {}
    for key, value in given_under(args, FORMAT_OPTION).items():
        name, option = key.split(":")
        chosen.setdefault(name, {})[option] = value
    return chosen


def given_under(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The options given (not None) whose argparse dest is `<prefix>:<key>`, by key."""
    return {dest.split(":", 1)[1]: value for dest, value in vars(args).items()
            if dest.startswith(prefix + ":") and value is not None}


def config_from_args(args: argparse.Namespace) -> TokenizeConfig:
    overrides = {spec.name: getattr(args, spec.name)
                 for spec in dataclasses.fields(TokenizeConfig)}
    overrides["inputs"] = overrides["inputs"] or None
    overrides["chat"] = given_chat(args)
    return load_config(args.config, given_format_options(args),
                       **overrides, **compat.given_former_flags(args))


def command_tokenize(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    args.output_location = config.output  # what an interrupt reports on
    from raypipe.ray.launch import leave_ray, run_tokenize

    try:
        summary = run_tokenize(config)
        print(summary.render(), flush=True)
    finally:
        leave_ray()  # 0.3 s, where Ray's exit hook takes 1.35-2 s
    return 0


def command_demo(args: argparse.Namespace) -> int:
    from raypipe.demo.run import run_demo
    from raypipe.ray.session import leave_ray

    args.output_location = str(Path(args.output) / "tokens")  # what an interrupt reports on
    try:
        run_demo(Path(args.output), num_workers=args.num_workers)
    finally:
        leave_ray()
    return 0


def command_pack_report(args: argparse.Namespace) -> int:
    from raypipe.tools.pack_report import pack_report

    print(pack_report(args.dataset, args.seq_len, epoch=args.epoch, epochs=args.epochs,
                      format_name=args.format, **plan_knobs(args)))
    return 0


def command_trace(args: argparse.Namespace) -> int:
    from raypipe.tools.trace import trace

    knobs = plan_knobs(args)
    for record in trace(args.data, args.step, steps=args.steps, rank=args.rank,
                        world_size=args.world_size, seq_len=args.seq_len,
                        batch_size=args.batch_size, state=args.state, text=args.text,
                        tokenizer=args.tokenizer, format_name=args.format,
                        batch_schedule=args.batch_schedule,
                        seq_len_schedule=args.seq_len_schedule, history=args.history, **knobs):
        print(record.line())
    return 0


def command_verify(args: argparse.Namespace) -> int:
    from raypipe.tools.verify import verify_dataset

    counts = verify_dataset(args.dataset)
    print(f"{args.dataset}: OK ({counts.files} files in {counts.shards} shards of "
          f"{counts.formats} format(s) match the manifest)")
    if counts.unlisted:
        shown = counts.unlisted[:10]
        print(f"{args.dataset}: {len(counts.unlisted)} file(s) the manifest does not list "
              f"(not raypipe's): " + ", ".join(shown)
              + (f" and {len(counts.unlisted) - 10} more" if len(counts.unlisted) > 10 else ""))
    return 0


def trainer_formats() -> list[str]:
    """Formats whose trainer takes a data-path argument (Megatron's --data-path)."""
    from raypipe.formats import document_format, document_formats

    return [name for name in document_formats()
            if document_format(name).trainer_prefix is not None]


def command_inspect(args: argparse.Namespace) -> int:
    from raypipe.tools.inspect import inspect_dataset, list_rejects, trainer_data_path

    if args.rejects:
        print(list_rejects(args.dataset))
        return 0
    wanted = [name for name in trainer_formats() if getattr(args, f"{name}_data_path")]
    if wanted:
        print(trainer_data_path(args.dataset, wanted[0]))
        return 0
    print(inspect_dataset(args.dataset, samples=args.samples, tokenizer=args.tokenizer,
                          plot=args.plot))
    return 0


def command_convert(args: argparse.Namespace) -> int:
    from raypipe.tools.convert import conversion_note, convert_dataset

    manifest = convert_dataset(args.source, args.destination, args.format,
                               convert_options(args), overwrite=args.overwrite,
                               source_format=args.source_format)
    section = manifest.formats[args.format]
    print(f"{args.source} -> {args.destination}: {len(section.shards)} {args.format} shards")
    note = conversion_note(args.source, args.format, args.source_format)
    if note:
        print(f"note: {note}")
    return 0


def convert_options(args: argparse.Namespace) -> dict[str, Any]:
    """The destination format's options from its --<format>-<option> flags (and those
    raypipe.config.compat still takes); a flag of another format is refused."""
    given = given_format_options(args)
    others = sorted(set(given) - {args.format})
    if others:
        raise ConfigError(f"convert --format {args.format}: options of {', '.join(others)} "
                          f"given ({', '.join(f'--{name}-...' for name in others)})")
    upgraded = compat.upgrade(compat.given_former_flags(args),
                              {args.format: given.get(args.format)})
    return (upgraded.get("formats") or {}).get(args.format) or given.get(args.format) or {}


def batch_schedule(text: str) -> list[tuple[int, int]]:
    """`STEP:ROWS,...` (trace's --batch-schedule) -> [(step, global rows), ...]."""
    return step_stages(text, "STEP:ROWS,... (e.g. 0:256,1000:512)")


def seq_len_schedule(text: str) -> list[tuple[int, int]]:
    """`STEP:SEQ_LEN,...` (trace's --seq-len-schedule) -> [(step, seq_len), ...]."""
    return step_stages(text, "STEP:SEQ_LEN,... (e.g. 0:512,3000:8192)")


def add_schedule_arguments(parser: argparse.ArgumentParser, whose: str = "") -> None:
    """--batch-schedule and --seq-len-schedule (a loader's batch_schedule and
    seq_len_schedule: trace, jobs/train.py)."""
    parser.add_argument("--batch-schedule", type=batch_schedule, default=None,
                        metavar="STEP:ROWS,...",
                        help=f"{whose}global rows by step, e.g. 0:256,1000:512 (a ramp), "
                        "instead of --batch-size")
    parser.add_argument("--seq-len-schedule", type=seq_len_schedule, default=None,
                        metavar="STEP:SEQ_LEN,...",
                        help=f"{whose}seq_len by step, e.g. 0:512,3000:8192 (a long-context "
                        "phase), instead of --seq-len; bestfit plans the rest of the epoch "
                        "again at each change (docs/loader.md)")


def step_stages(text: str, spelling: str) -> list[tuple[int, int]]:
    try:
        return [(int(step), int(value)) for step, value in
                (part.split(":") for part in text.split(",") if part.strip())]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {spelling}") from None


DATASET_HELP = "a raypipe output: a directory or a URI (s3://, gs://, ...)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help only where the help does not say its
    default already and there is one to say (config options default to None: the YAML's
    value, else the field's default, which their help states)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "(default:" in text:
            return text
        return super()._get_help_string(action) or text


def add_plan_arguments(parser: argparse.ArgumentParser, seq_len: int | None) -> None:
    """The loader knobs that shape observations (pack-report, trace), one option per knob
    that PlanSpec or a registered mode declares (raypipe.sampling.modes.knob_fields). An
    option left out is None: the loader's default (trace: the state's value first)."""
    for name, spec in knob_fields().items():
        choices = spec.metadata["choices"]
        choices = choices() if callable(choices) else choices
        default = seq_len if name == "seq_len" else None
        shown = (default if default is not None else "the state's" if name == "seq_len"
                 else spec.default)
        kind = ({"action": argparse.BooleanOptionalAction} if isinstance(spec.default, bool)
                else {"type": type(spec.default), "choices": choices})
        parser.add_argument(f"--{name.replace('_', '-')}", default=default, **kind,
                            help=f"{spec.metadata['help']} (default: {shown})")
    parser.add_argument("--format", default=None, help="the document format to read "
                        "(default: the dataset's first)")


def plan_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs given on the command line (those left out take their defaults)."""
    return {name: getattr(args, name) for name in knob_fields()
            if name != "seq_len" and getattr(args, name) is not None}


def build_parser() -> argparse.ArgumentParser:
    from raypipe._version import __version__

    parser = argparse.ArgumentParser(prog="raypipe", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"raypipe {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    subcommand = functools.partial(commands.add_parser,
                                   formatter_class=HelpFormatter)
    tokenize = commands.add_parser("tokenize", help="tokenize parquet or JSON-lines files into "
                                   "token shards")
    add_config_arguments(tokenize)
    tokenize.set_defaults(handler=command_tokenize)
    demo = subcommand("demo", help="run the whole pipeline on the embedded corpus")
    demo.add_argument("--output", default="demo_out", help="where the demo writes its corpus "
                      "and tokens")
    demo.add_argument("--num-workers", type=int, default=None,
                      help="tokenize workers: Ray map tasks at once, or local processes "
                           "(default: all CPUs)")
    demo.set_defaults(handler=command_demo)
    report = subcommand("pack-report", help="tokens used/cropped/padded per epoch")
    report.add_argument("dataset", help=DATASET_HELP)
    add_plan_arguments(report, seq_len=2048)
    report.add_argument("--epoch", type=int, default=0, help="first epoch to report")
    report.add_argument("--epochs", type=int, default=1, help="how many epochs")
    report.set_defaults(handler=command_pack_report)
    trace = subcommand("trace", help="which documents and input rows a training step held: "
                       "one JSON line per piece of every row")
    trace.add_argument("data", help=DATASET_HELP + ", or a mixture YAML")
    trace.add_argument("--step", type=int, default=None,
                       help="global step from the start of training (default 0; with "
                       "--state: steps after the state's)")
    trace.add_argument("--steps", type=int, default=1, help="how many steps from there")
    trace.add_argument("--rank", type=int, default=None, help="one rank (default: every rank)")
    trace.add_argument("--world-size", type=int, default=None,
                       help="the run's ranks (default: the state's, else 1)")
    trace.add_argument("--batch-size", type=int, default=None,
                       help="rows per rank (default: the global batch of the state's run, "
                       "its ramp included, split over --world-size; LLMBATCH: its own)")
    add_schedule_arguments(trace, "the loader's ")
    trace.add_argument("--history", default=None,
                       help="a loader's state_dict() saved as JSON whose record of changes "
                       "(global batch and seq_len, declared or on a resume; a mixture's: "
                       "each leg's sources, weights and world size) gives the run's shape "
                       "and its knobs: --step counts from the start of training")
    trace.add_argument("--state", default=None,
                       help="a loader's state_dict() saved as JSON: trace the steps after it "
                       "(its knobs are the defaults of the options below)")
    trace.add_argument("--text", action="store_true", help="add each piece's decoded text")
    trace.add_argument("--tokenizer", default=None,
                       help="--text: the tokenizer.json to decode with (default: the "
                       "manifest's, where its path still holds it)")
    add_plan_arguments(trace, seq_len=None)
    trace.set_defaults(handler=command_trace)
    verify = subcommand("verify", help="re-check every shard against the manifest")
    verify.add_argument("dataset", help=DATASET_HELP)
    verify.set_defaults(handler=command_verify)
    inspect = subcommand("inspect", help="counts, shards, lengths, samples")
    inspect.add_argument("dataset", help=DATASET_HELP + "; or a loader state's JSON file "
                         "(where its run stands, and every change it records)")
    inspect.add_argument("--samples", type=int, default=3, help="documents shown per format")
    inspect.add_argument("--tokenizer", help="tokenizer.json to decode samples with")
    inspect.add_argument("--plot", help="write a PNG histogram of document lengths here")
    inspect.add_argument("--rejects", action="store_true",
                         help="list the input files skipped as bad, and the rows that made "
                              "no document (file, row, reason; the first 100 of each unit)")
    for name in trainer_formats():
        inspect.add_argument(f"--{name}-data-path", action="store_true",
                             help=f"print only the data-path argument of {name}'s trainer for "
                             "every shard prefix (a mixture spec: the weighted blend); "
                             "thousands of prefixes fit in a --data-args-path file")
    inspect.set_defaults(handler=command_inspect)
    convert = subcommand("convert", help="convert an output to another format")
    convert.add_argument("source", help=DATASET_HELP)
    convert.add_argument("destination", help="a directory or URI for the converted dataset")
    convert.add_argument("--format", required=True, choices=list(FORMATS),
                         help="the destination's format")
    convert.add_argument("--source-format", choices=list(FORMATS), default=None,
                         help="the source format to read (default: its first document "
                         "format, else its batches)")
    add_format_arguments(convert)
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a dataset already at the destination")
    convert.set_defaults(handler=command_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    enable_faulthandler()
    with interrupts.handled():
        return run_command(build_parser().parse_args(argv))


def enable_faulthandler() -> None:
    """A crash in native code (Ray, Arrow) prints the Python stacks on the process's stderr
    (its file descriptor: a replaced sys.stderr, as under pytest, has none)."""
    try:
        faulthandler.enable()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        if sys.__stderr__ is not None:
            faulthandler.enable(file=sys.__stderr__)


def run_command(args: argparse.Namespace) -> int:
    """The command's handler; errors and interrupts as one line and an exit status."""
    try:
        return args.handler(args)
    except interrupts.Interrupted as exc:
        stop_ray_started_here()
        print(interrupted_line(args, exc), file=sys.stderr, flush=True)
        return exc.exit_status
    except RaypipeError as exc:
        print(f"raypipe: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `raypipe inspect out/ | head`: the reader left; say nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def stop_ray_started_here() -> None:
    """Stop a local Ray this process started (a no-op where Ray was never imported)."""
    if "ray" in sys.modules:
        from raypipe.ray.session import shutdown_local_ray

        shutdown_local_ray()


def interrupted_line(args: argparse.Namespace, exc: interrupts.Interrupted) -> str:
    """One line: the command, what is committed, and what rerunning does."""
    what = f"raypipe {args.command}: interrupted by {exc.signal_name}"
    if args.command in ("tokenize", "demo"):
        output = getattr(args, "output_location", None)
        committed = committed_units(output) if output else None
        if committed is None:
            return f"{what} before any unit was committed; rerun the same command to start"
        return (f"{what}; {committed} unit(s) committed in {output} are kept: rerun the same "
                "command to resume")
    if args.command == "convert":
        return (f"{what}; {args.destination} has no manifest yet (it is written last): "
                "rerun the same command to convert it again from the start")
    return f"{what}; nothing was changed: rerun the same command"


def committed_units(output: str) -> int | None:
    """How many unit records the output holds (None where it cannot be listed)."""
    from raypipe.io.manifest import unit_record_paths
    from raypipe.io.store import Store

    try:
        return len(unit_record_paths(Store(output)))
    except (RaypipeError, OSError):
        return None


if __name__ == "__main__":
    sys.exit(main())
