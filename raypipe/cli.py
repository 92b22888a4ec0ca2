"""The `raypipe` command line: tokenize, demo, pack-report, verify, inspect, convert.

Invariant: the CLI and `jobs/tokenize.py` build the same TokenizeConfig (YAML file, then
command-line overrides); any RaypipeError prints as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raypipe.errors import RaypipeError


def add_tokenize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", help="parquet files, directories or globs")
    parser.add_argument("--config", help="YAML config; command-line options override it")
    parser.add_argument("--tokenizer", help="tokenizer.json path or hub name")
    parser.add_argument("--format", dest="formats",
                        help="comma list of megatron, nanogpt, stream, llmbatch")
    parser.add_argument("--output", "-o", help="output directory")
    parser.add_argument("--text-column", help="column holding the documents (default: text)")
    parser.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                        help="prepend BOS to every document (NanoGPT/nanochat style)")
    parser.add_argument("--eos", action=argparse.BooleanOptionalAction, default=None,
                        help="append EOS/EOD to every document (Megatron --append-eod)")
    parser.add_argument("--bos-token", help="BOS token string (default: detected)")
    parser.add_argument("--eos-token", help="EOS token string (default: detected)")
    parser.add_argument("--shard-tokens", type=int, help="max tokens per shard")
    parser.add_argument("--unit-bytes", type=int, help="parquet bytes per work unit")
    parser.add_argument("--max-document-chars", type=int, help="skip longer documents")
    parser.add_argument("--encode-batch-rows", type=int, help="rows per tokenizer call")
    parser.add_argument("--metadata", action=argparse.BooleanOptionalAction, default=None,
                        help="stream: write metadata records (--no-metadata: pure tokens)")
    parser.add_argument("--metadata-columns", help="stream: comma list of per-document columns")
    parser.add_argument("--span-column", help="stream: column of [{start, end, labels}] spans")
    parser.add_argument("--metadata-serializer", help="json (default) or msgpack")
    parser.add_argument("--seq-len", type=int, help="llmbatch: tokens per record")
    parser.add_argument("--batch-size", type=int, help="llmbatch: records per batch")
    parser.add_argument("--packing", help="llmbatch: bestfit (default) or concat")
    parser.add_argument("--seed", type=int, help="llmbatch: record shuffle seed")
    parser.add_argument("--batches-per-shard", type=int, help="llmbatch: batches per file")
    parser.add_argument("--num-workers", type=int, help="tokenizer actors (default: all CPUs)")
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or local)")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="replace an output made with a different config")


def config_from_args(args: argparse.Namespace):
    from raypipe.config import load_config

    fields = ("tokenizer", "formats", "output", "text_column", "bos", "eos", "bos_token",
              "eos_token", "shard_tokens", "unit_bytes", "max_document_chars",
              "encode_batch_rows", "metadata", "metadata_columns", "span_column",
              "metadata_serializer", "seq_len", "batch_size", "packing", "seed",
              "batches_per_shard", "num_workers", "address", "overwrite")
    overrides = {name: getattr(args, name) for name in fields}
    overrides["inputs"] = args.inputs or None
    return load_config(args.config, **overrides)


def command_tokenize(args: argparse.Namespace) -> int:
    from raypipe.ray.tokenize import run_tokenize

    summary = run_tokenize(config_from_args(args))
    print(summary.render())
    return 0


def command_demo(args: argparse.Namespace) -> int:
    from raypipe.demo.run import run_demo

    run_demo(Path(args.output), num_workers=args.num_workers)
    return 0


def command_pack_report(args: argparse.Namespace) -> int:
    from raypipe.core.dataset import TokenDataset
    from raypipe.core.epoch import make_plan

    dataset = TokenDataset(args.dataset, args.format)
    print(f"{args.dataset}: {args.mode} rows of {args.seq_len} + 1 tokens, seed {args.seed}, "
          f"epoch {args.epoch} ({dataset.num_documents:,} documents, format "
          f"{dataset.format_name})")
    for epoch in range(args.epoch, args.epoch + args.epochs):
        plan = make_plan(args.mode, dataset.num_tokens, dataset.document_lengths, args.seq_len,
                         args.seed, epoch, args.block_documents)
        if args.epochs > 1:
            print(f"-- epoch {epoch}")
        print(plan.report().render())
    return 0


def command_verify(args: argparse.Namespace) -> int:
    from raypipe.core.verify import verify_dataset

    counts = verify_dataset(args.dataset)
    print(f"{args.dataset}: OK ({counts['files']} files in {counts['shards']} shards of "
          f"{counts['formats']} format(s) match the manifest)")
    return 0


def command_inspect(args: argparse.Namespace) -> int:
    from raypipe.core.inspect import inspect_dataset

    print(inspect_dataset(args.dataset, samples=args.samples, tokenizer=args.tokenizer,
                          plot=args.plot))
    return 0


def command_convert(args: argparse.Namespace) -> int:
    from raypipe.core.convert import convert_dataset

    manifest = convert_dataset(args.source, args.destination, args.format, seq_len=args.seq_len,
                               batch_size=args.batch_size, packing=args.packing, seed=args.seed,
                               batches_per_shard=args.batches_per_shard,
                               overwrite=args.overwrite)
    section = manifest["formats"][args.format]
    print(f"{args.source} -> {args.destination}: {len(section['shards'])} {args.format} shards")
    if "llmbatch" in read_formats(args.source) and args.format != "llmbatch":
        print("note: an LLMBATCH source yields its records (packed rows), not the original "
              "documents")
    return 0


def read_formats(path: str) -> list[str]:
    from raypipe.core.manifest import read_manifest

    return list(read_manifest(path)["formats"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypipe", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tokenize = commands.add_parser("tokenize", help="tokenize parquet into token shards")
    add_tokenize_arguments(tokenize)
    tokenize.set_defaults(handler=command_tokenize)
    demo = commands.add_parser("demo", help="run the whole pipeline on the embedded corpus")
    demo.add_argument("--output", default="demo_out")
    demo.add_argument("--num-workers", type=int, default=None)
    demo.set_defaults(handler=command_demo)
    report = commands.add_parser("pack-report", help="tokens used/cropped/padded per epoch")
    report.add_argument("dataset", help="a raypipe output directory")
    report.add_argument("--seq-len", type=int, default=2048)
    report.add_argument("--mode", default="bestfit", choices=["bestfit", "windows", "documents"])
    report.add_argument("--seed", type=int, default=0)
    report.add_argument("--epoch", type=int, default=0)
    report.add_argument("--epochs", type=int, default=1)
    report.add_argument("--block-documents", type=int, default=4096)
    report.add_argument("--format", default=None, help="megatron or nanogpt (default: any)")
    report.set_defaults(handler=command_pack_report)
    verify = commands.add_parser("verify", help="re-check every shard against the manifest")
    verify.add_argument("dataset")
    verify.set_defaults(handler=command_verify)
    inspect = commands.add_parser("inspect", help="counts, shards, lengths, samples")
    inspect.add_argument("dataset")
    inspect.add_argument("--samples", type=int, default=3)
    inspect.add_argument("--tokenizer", help="tokenizer.json to decode samples with")
    inspect.add_argument("--plot", help="write a PNG histogram of document lengths here")
    inspect.set_defaults(handler=command_inspect)
    convert = commands.add_parser("convert", help="convert an output to another format")
    convert.add_argument("source")
    convert.add_argument("destination")
    convert.add_argument("--format", required=True,
                         choices=["megatron", "nanogpt", "stream", "llmbatch"])
    convert.add_argument("--seq-len", type=int)
    convert.add_argument("--batch-size", type=int)
    convert.add_argument("--packing", default="bestfit", choices=["bestfit", "concat"])
    convert.add_argument("--seed", type=int, default=0)
    convert.add_argument("--batches-per-shard", type=int, default=1024)
    convert.add_argument("--overwrite", action="store_true")
    convert.set_defaults(handler=command_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except RaypipeError as exc:
        print(f"raypipe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
