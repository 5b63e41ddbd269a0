"""The crash the compilation-cache fence prevents, outside the suite: the held-out
loss-by-position program (training/position_loss.token_losses) of a tiny decoder on a 2-device
CPU mesh, read back from JAX's persistent compilation cache, deadlocks in its collectives or
dies while its results are read; compiled fresh it runs.

    python benchmarks/cache_collective_repro.py --cache DIR --runs 1           # writes DIR
    python benchmarks/cache_collective_repro.py --cache DIR --runs 50          # reads back
    python benchmarks/cache_collective_repro.py --runs 50                      # no cache
    python benchmarks/cache_collective_repro.py --cache DIR --runs 50 --fence
    python benchmarks/cache_collective_repro.py --ordered --cache DIR2 --runs 1; ... --runs 50

Each run executes the program ``--runs`` times on one batch and checks that every result
equals the first; "ok" and the mean loss at the end, and the programs the fence kept out.
XLA_FLAGS are the suite's CPU flags (tests/utils/devices.py: LLVM optimisations off, the older loop
emitters), with 2 devices.

The cause: the read-back executable no longer orders the program's embedding loop (the
vocabulary-split lookup: an all-gather and a reduce-scatter per chunk) against the all-gather
of the segment ids beside it (attention's, hoisted out of the layer loop by XLA)
(``hlo.unordered_loop_collectives``; docs/TRAINING.md, "Compilation cache"). Seen with
jax/jaxlib 0.10.2 on the 2-core CPU machine: the writing run "ok"; every reading run died
(9 of 9: aborts, "Termination timeout for `all gather RendezvousKey{... op_id=1}`" on one
device thread while the other waits in `reduce scatter ... op_id=1`, or "corrupted
double-linked list", and exits 139, SIGSEGV); runs without the cache "ok". With ``--fence`` (``ulysses_jax.compile_cache.fence()``) the
program is kept out of the cache: written with the fence, read back with it, or written
without it and read back with it, every run was "ok".

``--ordered``: the same decoder with two layers and the embedding a lookup of replicated rows
(``model.vocab_parallel=false``): every collective beside the layer loop (a loop of
all-to-alls) feeds it or reads its result, so the analysis finds no pair, and the program
written to and read back from the cache runs.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import ROOT  # noqa: E402
from ulysses_jax.mesh import request_cpu_devices  # noqa: E402

SMALL = ["seq_len=128", "batch_size=2", "model.d_model=32", "model.n_layers=1",
         "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=8", "model.ffn_dim=64",
         "model.loss_chunk=16", "model.vocab_size=384", "mesh.seq=2", "mesh.data=1"]
# --ordered: no loop of collectives beside a collective that data leaves unordered
ORDERED = ["model.vocab_parallel=false", "model.n_layers=2"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="persistent compilation cache directory (default: none)")
    ap.add_argument("--runs", type=int, default=50, help="executions of the program")
    ap.add_argument("--fence", action="store_true",
                    help="install ulysses_jax.compile_cache.fence() first (the guard)")
    ap.add_argument("--ordered", action="store_true",
                    help="the decoder whose collectives data dependencies order "
                         "(model.vocab_parallel=false, 2 layers): safe to read back")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")

    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    request_cpu_devices(2)
    import jax
    import numpy as np
    if args.cache:
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if args.fence:
        from ulysses_jax.compile_cache import fence
        fence()
    from ulysses_jax import make_mesh
    from ulysses_jax.config import load_config
    from ulysses_jax.data.text import shard_batch
    from ulysses_jax.training.position_loss import token_losses
    from ulysses_jax.training.train_step import init_state

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      SMALL + (ORDERED if args.ordered else []))
    mesh = make_mesh(seq=2, data=1, devices=jax.devices()[:2])
    graphdef, state, _, _ = init_state(cfg, mesh)
    fn = token_losses(mesh, graphdef, cfg.model.loss_chunk)
    b, s = cfg.batch_size, cfg.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (b, s + 1), np.int32)
    batch = shard_batch({"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
                         "positions": np.tile(np.arange(s, dtype=np.int32), (b, 1)),
                         "segment_ids": np.ones((b, s), np.int32),
                         "loss_mask": np.ones((b, s), np.float32)}, mesh)
    first = None
    for i in range(args.runs):
        losses, preds = (np.asarray(x) for x in fn(state["params"], batch))
        if first is None:
            first = losses, preds
        elif not ((losses == first[0]).all() and (preds == first[1]).all()):
            print(f"run {i}: results differ from the first run's", file=sys.stderr)
            return 1
    from ulysses_jax.compile_cache import kept_out
    print("ok", float(first[0].mean()), "kept out of the cache:", sorted(kept_out()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
