"""Chat benchmark: raypipe tokenize --chat end to end against a loop of transformers'
`apply_chat_template(..., tokenize=True, return_assistant_tokens_mask=True)`, and what the
loader trains of chat data at T = 2048 and 8192.

- Conversations: multi-turn (system sometimes, 1-4 user/assistant exchanges) from the
  machine's docstrings, generated with a fixed seed, as a parquet `messages` column.
- Tokenizer: GPT-2's vocabulary (`--tokenizer shipped`: the demo BPE) with ChatML's two
  control tokens added; the built-in
  ChatML template (with generation blocks, so transformers can return its mask).
- Baseline: the transformers loop in 2 processes (half the conversations each), one
  `apply_chat_template` call per conversation, timed from the first call to the last.
- raypipe: `raypipe tokenize --chat` in a fresh process, timed from launch to exit, as
  typed (no Ray here: 2 local worker processes) and with `--executor ray` (it starts its
  local Ray with 2 CPUs and stops it); and its units' CPU seconds / 2.
- Packing: one epoch of the bestfit loader (packing auto = split for chat data) over the
  output at each T: the share of target positions trained (mask 1), of padding, and how
  many conversations were cut (only those longer than a row may be); and at a short row
  (`--overlong-seq-len`, 256) that many conversations pass, each `overlong` rule's share of
  the loss mask's trained tokens that one epoch trains (split: all of them, once).

Prints a table and RATIO lines; nothing is asserted (bench/README conventions).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402

HERE = Path(__file__).resolve().parents[1]

LOOP = r"""
import json, sys, time
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerFast
from tokenizers import Tokenizer
tokenizer_path, template, corpus, part, parts = sys.argv[1:6]
hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(tokenizer_path),
                             chat_template=open(template).read())
rows = [json.loads(v) for v in pq.read_table(corpus).column("messages").to_pylist()]
rows = rows[int(part)::int(parts)]
started = time.perf_counter()
tokens = trained = 0
outputs = []
for messages in rows:
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    tokens += len(out["input_ids"])
    trained += sum(out["assistant_masks"])
    outputs.append(out)
seconds = time.perf_counter() - started
import hashlib  # each conversation's digest, after the timed loop
digests = [hashlib.blake2b(repr((list(out["input_ids"]), list(out["assistant_masks"])))
                           .encode(), digest_size=8).hexdigest() for out in outputs]
print(json.dumps({"seconds": seconds, "rows": len(rows), "tokens": tokens,
                  "trained": trained, "digests": digests}))
"""

JOB = r"""
import json, sys
from raypipe.config import load_config
from raypipe.io.manifest import read_manifest
from raypipe.io.store import Store
from raypipe.preprocess.output import unit_records
from raypipe.ray.launch import leave_ray, run_tokenize
corpus, output, tokenizer, executor = sys.argv[1:5]
summary = run_tokenize(load_config(None, inputs=[corpus], output=output, tokenizer=tokenizer,
                                   chat=True, num_workers=2, unit_bytes=1 << 20,
                                   executor=executor))
print(json.dumps({"documents": summary.documents, "tokens": summary.tokens_run,
                  "trained": read_manifest(Store(output)).totals.trained_tokens,
                  "skipped": summary.skipped, "ray_start": summary.startup_seconds,
                  "unit_cpu": sum(r.cpu_seconds for _, r in unit_records(Store(output)))}))
leave_ray()
"""


def conversations(count: int, seed: int = 7) -> list[list[dict]]:
    from raypipe.demo.corpus import gather_docstrings, stdlib_root

    texts = [text for text in gather_docstrings([stdlib_root()]) if text.strip()]
    chooser = random.Random(seed)
    out = []
    for index in range(count):
        turns = [{"role": "system", "content": chooser.choice(texts)[:300]}] \
            if index % 3 == 0 else []
        for _ in range(chooser.randint(1, 4)):
            turns.append({"role": "user", "content": chooser.choice(texts)[:600]})
            turns.append({"role": "assistant", "content": chooser.choice(texts)[:1200]})
        out.append(turns)
    return out


def base_tokenizer(workdir: Path, name: str) -> str:
    """GPT-2's tokenizer.json (fetched once: bench/gpt2_tokenizer.py), or the shipped demo
    BPE (no download: the tiny run the tests make)."""
    from bench.gpt2_tokenizer import gpt2_tokenizer_json
    from raypipe.demo.train_tokenizer import SHIPPED

    return Path(SHIPPED).read_text() if name == "shipped" else \
        gpt2_tokenizer_json(workdir).read_text()


def prepare(workdir: Path, count: int, base: str) -> tuple[Path, Path, Path]:
    """(corpus folder, tokenizer.json, template file), built once per size and tokenizer."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import AddedToken, Tokenizer

    from raypipe.preprocess.chat import CHATML

    corpus = workdir / f"chats-{count}"
    tokenizer_path = workdir / f"chat-tokenizer-{base}" / "tokenizer.json"
    template = workdir / "chatml.jinja"
    if not tokenizer_path.exists():
        tokenizer = Tokenizer.from_str(base_tokenizer(workdir, base))
        tokenizer.add_special_tokens([AddedToken("<|im_start|>", special=True),
                                      AddedToken("<|im_end|>", special=True)])
        tokenizer_path.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(tokenizer_path))
    template.write_text(CHATML)
    if not corpus.exists():
        corpus.mkdir(parents=True)
        rows = [json.dumps(row) for row in conversations(count)]
        pq.write_table(pa.table({"messages": pa.array(rows, pa.string())}),
                       corpus / "chats.parquet", row_group_size=2000)
    return corpus, tokenizer_path, template


def run_json(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, cwd=HERE, env={**os.environ, "RAYON_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def transformers_loop(corpus: Path, tokenizer: Path, template: Path) -> dict:
    """Two processes, half the conversations each, run side by side."""
    started = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, "-c", LOOP, str(tokenizer), str(template),
                                   str(corpus / "chats.parquet"), str(part), "2"],
                                  stdout=subprocess.PIPE, text=True, cwd=HERE)
                 for part in range(2)]
    results = [json.loads(process.communicate()[0].strip().splitlines()[-1])
               for process in processes]
    digests = [""] * sum(r["rows"] for r in results)
    for part, result in enumerate(results):
        digests[part::2] = result["digests"]
    return {"seconds": max(r["seconds"] for r in results), "digests": digests,
            "wall": time.perf_counter() - started,
            "rows": sum(r["rows"] for r in results),
            "tokens": sum(r["tokens"] for r in results),
            "trained": sum(r["trained"] for r in results)}


def raypipe_job(corpus: Path, output: Path, tokenizer: Path, executor: str = "auto") -> dict:
    import shutil

    shutil.rmtree(output, ignore_errors=True)
    started = time.perf_counter()
    result = run_json(JOB, str(corpus), str(output), str(tokenizer), executor)
    return {**result, "wall": time.perf_counter() - started}


def same_shards(first: Path, second: Path) -> bool:
    """Whether two outputs hold the same shard files, byte for byte (every format's folder)."""
    from raypipe.formats import FORMATS

    def shards(output: Path) -> dict[str, bytes]:
        return {str(path.relative_to(output)): path.read_bytes() for name in FORMATS
                for path in sorted((output / name).glob("[!.]*"))}

    return bool(shards(first)) and shards(first) == shards(second)


def conversation_digests(output: Path) -> list[str]:
    """Each stored conversation's digest of (ids, loss mask), as the transformers loop
    makes them (a chat job adds no BOS/EOS here)."""
    import hashlib

    from raypipe.dataset import TokenDataset

    dataset = TokenDataset(output)
    digests = []
    for index, document in enumerate(dataset.iter_documents()):
        mask = dataset.document_loss_mask(index)
        key = repr((document.tolist(), mask.astype(int).tolist()))
        digests.append(hashlib.blake2b(key.encode(), digest_size=8).hexdigest())
    return digests


def packing(output: Path, seq_len: int, overlong: str = "auto") -> dict:
    """One epoch of bestfit over the chat output: trained, padded and cut shares."""
    from raypipe.loader import TokenLoader

    loader = TokenLoader(output, seq_len=seq_len, batch_size=1, mode="bestfit", seed=1,
                         device="cpu", prefetch=2, overlong=overlong)
    filler = loader.filler(0)
    positions = trained = padded = 0
    pieces: dict[int, int] = {}
    for batch in loader:
        (segments,) = filler.segments(batch.positions)
        positions += seq_len
        trained += int(batch.mask.sum())
        padded += seq_len + 1 - segments.length
        for document in segments.documents.tolist():
            pieces[document] = pieces.get(document, 0) + 1
    lengths = loader.dataset.document_lengths()
    longer = int((lengths > seq_len + 1).sum())
    cut = sum(1 for count in pieces.values() if count > 1)
    return {"positions": positions, "trained": trained, "padded": padded, "cut": cut,
            "longer": longer, "packing": loader.spec.packing,
            "overlong": loader.spec.knobs.overlong,
            "repeated": loader.packing_report().repeated_tokens}


def mask_cost(output: Path, seq_len: int = 2048, batch_size: int = 8,
              batches: int = 200) -> dict:
    """Seconds to fill `batches` bestfit batches with the loss mask applied (the loader's
    filler) and without it (the mode's own filler underneath), alternated, best of 3."""
    import numpy as np

    from raypipe.loader import TokenLoader
    from raypipe.sampling.buffers import BatchBuffers

    loader = TokenLoader(output, seq_len=seq_len, batch_size=batch_size, mode="bestfit",
                         seed=1, device="cpu")
    masked = loader.filler(0)
    plain = masked.inner
    host = np.empty(BatchBuffers.size(batch_size, seq_len), dtype=np.int64)
    buffers = BatchBuffers.over(host, batch_size, seq_len)
    steps = min(batches, loader.plan(0).size // batch_size)
    positions = np.arange(steps * batch_size, dtype=np.int64).reshape(steps, batch_size)
    plans = masked.describe(positions)
    best = {"masked": float("inf"), "plain": float("inf")}
    for _ in range(3):
        for name, filler in (("plain", plain), ("masked", masked)):
            filler.prepare(buffers)
            started = time.perf_counter()
            for plan in plans:
                filler.fill(plan, buffers)
            best[name] = min(best[name], time.perf_counter() - started)
    return {**best, "batches": steps, "rows": steps * batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--workdir", default="bench_out/chat")
    parser.add_argument("--repeats", type=int, default=2, help="best of N for each side")
    parser.add_argument("--seq-lens", default="2048,8192")
    parser.add_argument("--overlong-seq-len", type=int, default=256,
                        help="a row length some conversations pass: each overlong rule's "
                        "share of the assistant tokens trained")
    parser.add_argument("--tokenizer", choices=["gpt2", "shipped"], default="gpt2")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer, template = prepare(workdir, args.conversations, args.tokenizer)
    loops, jobs, ray_jobs = [], [], []
    for _ in range(args.repeats):  # alternated, best of N
        loops.append(transformers_loop(corpus, tokenizer, template))
        ray_jobs.append(raypipe_job(corpus, workdir / "out-ray", tokenizer, "ray"))
        jobs.append(raypipe_job(corpus, workdir / "out", tokenizer))
    loop, job = min(loops, key=lambda r: r["seconds"]), min(jobs, key=lambda r: r["wall"])
    on_ray = min(ray_jobs, key=lambda r: r["wall"])
    count = args.conversations
    rows = [("what", "conversations", "tokens", "seconds", "conversations/s"),
            ("transformers apply_chat_template loop, 2 processes", f"{loop['rows']:,}",
             f"{loop['tokens']:,}", f"{loop['seconds']:.2f}",
             f"{loop['rows'] / loop['seconds']:,.0f}"),
            ("raypipe tokenize --chat, end to end (no Ray here: local processes)",
             f"{job['documents']:,}", f"{job['tokens']:,}", f"{job['wall']:.2f}",
             f"{count / job['wall']:,.0f}"),
            ("raypipe tokenize --chat --executor ray, end to end (a fresh local Ray)",
             f"{on_ray['documents']:,}", f"{on_ray['tokens']:,}", f"{on_ray['wall']:.2f}",
             f"{count / on_ray['wall']:,.0f}"),
            ("raypipe units' CPU time / 2", f"{job['documents']:,}", f"{job['tokens']:,}",
             f"{job['unit_cpu'] / 2:.2f}", f"{count / (job['unit_cpu'] / 2):,.0f}")]
    print_table(rows)
    print(f"RATIO raypipe end to end / transformers loop (conversations/s) = "
          f"{loop['seconds'] / job['wall']:.2f} (local worker processes, no Ray; target "
          f">= 1: {'PASS' if loop['seconds'] >= job['wall'] else 'BELOW TARGET'})")
    print(f"RATIO raypipe --executor ray end to end / transformers loop = "
          f"{loop['seconds'] / on_ray['wall']:.2f} (Ray start-up {on_ray['ray_start']:.2f} s "
          "inside)")
    print(f"RATIO raypipe units / transformers loop (per core) = "
          f"{loop['seconds'] / (job['unit_cpu'] / 2):.2f}")
    print(f"tokens equal: {loop['tokens'] == job['tokens']} (transformers {loop['tokens']:,}, "
          f"raypipe {job['tokens']:,}); trained tokens equal: "
          f"{loop['trained'] == job['trained']} (transformers' assistant mask "
          f"{loop['trained']:,}, raypipe's loss mask {job['trained']:,})")
    print(f"shards of the local processes and of Ray byte-identical: "
          f"{same_shards(workdir / 'out', workdir / 'out-ray')}")
    ours = conversation_digests(workdir / "out")
    equal = sum(a == b for a, b in zip(loop["digests"], ours, strict=False))
    every = equal == len(loop["digests"]) == len(ours)
    print(f"conversations whose ids and mask equal transformers': {equal:,} of "
          f"{len(loop['digests']):,} ({'ALL' if every else 'NOT ALL'})")
    for seq_len in (int(value) for value in args.seq_lens.split(",")):
        result = packing(workdir / "out", seq_len)
        print(f"T={seq_len} ({result['packing']} packing): trained targets "
              f"{result['trained'] / result['positions']:.1%} of positions, padding "
              f"{result['padded'] / result['positions']:.1%}, conversations cut "
              f"{result['cut']} (longer than a row: {result['longer']})")
    cost = mask_cost(workdir / "out")
    print(f"loss mask in the loader (bestfit, B=8, T=2048, {cost['batches']} batches): "
          f"{1e6 * cost['plain'] / cost['rows']:.1f} us a row without it, "
          f"{1e6 * cost['masked'] / cost['rows']:.1f} us with it")
    print(f"RATIO loader fill with the loss mask / without = "
          f"{cost['masked'] / cost['plain']:.2f}")
    for overlong in ("split", "cut", "truncate", "drop"):
        result = packing(workdir / "out", args.overlong_seq_len, overlong)
        print(f"T={args.overlong_seq_len} overlong {overlong}: {result['longer']:,} "
              f"conversations longer than a row; trained targets / the loss mask's trained "
              f"tokens = {result['trained'] / job['trained']:.4f}; positions repeated "
              f"{result['repeated'] / result['positions']:.2%}, padding "
              f"{result['padded'] / result['positions']:.1%}")


if __name__ == "__main__":
    main()
