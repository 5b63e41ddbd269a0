"""Does the data pipeline stay flat as the corpus grows? Prepare throughput and peak RSS, and
a 3-step train.py run's wall time and peak RSS, on parquet corpora of growing size.

    python benchmarks/data_scale.py --sizes 15e6,120e6 --workers 2 [--bpe] [--workdir DIR]

Corpora are synthetic text in parquet files of 64 MB row groups, sized in bytes (with the
byte tokenizer one token per byte, plus EOS per document; ``--bpe`` tokenizes with a
4096-id byte-level BPE trained here: about 4.5x fewer tokens, and a real tokenization cost).
Each measured command runs in its own process: peak RSS is that of its largest process
(``ru_maxrss`` of the waited-for children; prepare's tokenizer workers included). "open
store" is what train.py does with the store before compiling (packing plan, segment bound,
first rows), timed inside its process. Writes a Markdown table to stdout and the rows as JSON
to WORKDIR/data_scale.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["the ", "data ", "def ", "return ", "x", " + 1\n", "sequence ", "parallel ", "é", "漢字",
         "\n", "    ", "attention ", "(", ")", ":", "token ", "shard "]


def write_corpus(path: str, tokens: int, seed: int = 0) -> int:
    """Parquet files under ``path`` with about ``tokens`` bytes of text; returns the bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = "".join(rng.choice(WORDS, 2_000_000))  # text to cut documents from
    written, part = 0, 0
    while written < tokens:
        docs, size = [], 0
        while size < min(64 << 20, tokens - written):
            n = int(rng.integers(200, 8000))
            a = int(rng.integers(0, len(pool) - n))
            docs.append(pool[a:a + n])
            size += len(docs[-1].encode())
        pq.write_table(pa.table({"text": docs}), os.path.join(path, f"part-{part:04d}.parquet"))
        written += size
        part += 1
    return written


def train_bpe(path: str, vocab_size: int = 4096) -> str:
    """A byte-level BPE tokenizer.json trained on the corpus' word pool (for a realistic
    tokenization cost: bytes cost almost nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = np.random.default_rng(1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["".join(rng.choice(WORDS, 2000)) for _ in range(500)], trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


def measured(cmd: list[str]) -> dict:
    """Runs ``cmd`` (in this process's child) and returns wall seconds and peak RSS in MB."""
    out = subprocess.run([sys.executable, __file__, "--measure", *cmd], capture_output=True,
                         text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    if len(lines) > 1:  # the command's own JSON line (--open)
        result.update(json.loads(lines[-2]))
    return result


def _measure(cmd: list[str]) -> None:
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.time() - t0
    if r.returncode:
        print(r.stderr[-3000:], file=sys.stderr)
        sys.exit(r.returncode)
    if r.stdout.strip().startswith("{"):
        print(r.stdout.strip().splitlines()[-1])
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # kB -> MB on Linux
    print(json.dumps({"seconds": round(wall, 2), "peak_rss_mb": round(rss, 1)}))


def _open(store: str) -> None:
    """Opens ``store`` as train.py does (plan, segment bound, first batch); prints seconds."""
    sys.path.insert(0, ROOT)
    from ulysses_jax.data.packing import store_rows
    t0 = time.time()
    train_rows, _, _ = store_rows(store, 512, 0.02, 0)
    train_rows.segments_per_row(0, 0).max()
    train_rows.rows(range(2))
    print(json.dumps({"open_s": round(time.time() - t0, 4)}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="15e6,120e6", help="corpus sizes in tokens, comma-separated")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/data_scale")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bpe", action="store_true", help="tokenize with a 4096-id byte-level BPE "
                   "(trained here) instead of bytes")
    args = p.parse_args(argv)
    rows = []
    tok_args = ["--tokenizer", train_bpe(os.path.join(args.workdir, "bpe"))] if args.bpe else []
    for size in (int(float(s)) for s in args.sizes.split(",")):
        corpus = os.path.join(args.workdir, f"corpus-{size}")
        store = os.path.join(args.workdir, f"store-{size}{'-bpe' if args.bpe else ''}")
        if not os.path.isdir(corpus):
            write_corpus(corpus, size)
        subprocess.run(["rm", "-rf", store], check=True)  # else: "nothing to do"
        prep = measured([sys.executable, "-m", "ulysses_jax.data", "prepare", corpus, "--out",
                         store, "--workers", str(args.workers), "--no-progress", *tok_args])
        with open(os.path.join(store, "manifest.json")) as f:
            manifest = json.load(f)
        opened = measured([sys.executable, __file__, "--open", store])
        run_dir = os.path.join(args.workdir, f"run-{size}{'-bpe' if args.bpe else ''}")
        subprocess.run(["rm", "-rf", run_dir], check=True)
        run = measured([sys.executable, "train.py", "--config", "configs/tiny.yaml",
                        "--workdir", run_dir, "--no-progress", f"data.source={store}",
                        f"steps={args.steps}", "checkpoint_every=0", "eval_batches=1",
                        "log_tensorboard=false", "mesh.seq=2", "seq_len=512", "batch_size=2",
                        *(["model.vocab_size=4096"] if args.bpe else [])])
        row = {"tokens": manifest["num_tokens"], "documents": manifest["num_docs"],
               "prepare_s": prep["seconds"], "prepare_tok_s": manifest["num_tokens"] /
               prep["seconds"], "prepare_peak_rss_mb": prep["peak_rss_mb"],
               "open_s": opened["open_s"], "open_peak_rss_mb": opened["peak_rss_mb"],
               "run_s": run["seconds"], "run_peak_rss_mb": run["peak_rss_mb"]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    with open(os.path.join(args.workdir, "data_scale.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("| tokens | documents | prepare s | prepare tok/s | prepare peak RSS MB | "
          f"open store s | open peak RSS MB | {args.steps}-step run s | run peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['documents']:,} | {r['prepare_s']:.1f} | "
              f"{r['prepare_tok_s']:,.0f} | {r['prepare_peak_rss_mb']:.0f} | "
              f"{r['open_s']:.3f} | {r['open_peak_rss_mb']:.0f} | {r['run_s']:.1f} | "
              f"{r['run_peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        _measure(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--open":
        _open(sys.argv[2])
    else:
        main()
