"""The host-memory check's estimate (training/host_memory.py) against the resident memory a
short run on 4 CPU devices really adds, phase by phase: the train state built, the step
compiled, three steps, a checkpoint save started, one step while it is written.

    python benchmarks/host_memory.py --param-sharding replicated
    python benchmarks/host_memory.py --param-sharding zero3

A ~31M-parameter model (d_model 512, 8 layers) at seq_len 256, batch 2: under 4 GiB
replicated, small enough for a 24 GB machine. RSS is read from /proc/self/status (a thread
samples it every 2 ms for the peaks) and reported above its value before the state is built,
against what the estimate holds live by the end of each phase. The estimate is meant to be a
lower bound: each phase's peak should be at least its estimate.

Seen on the 2-core, 24 GB CPU machine (jax 0.10.2, orbax-checkpoint 0.12.8),
each phase's peak RSS above the start in GiB, the estimate in brackets:

    phase                               replicated       zero3
    train state built                   2.229 (1.366)    0.632 (0.341)
    step compiled                       1.820 (1.366)    0.779 (0.341)
    3 steps                             3.032 (1.829)    1.820 (0.463)
    checkpoint save started             2.958 (1.707)    1.737 (0.683)
    a step while the save is written    3.738 (2.170)    2.484 (0.804)

The whole run's peak is 1.7x the estimate replicated, 3.1x with zero3: what the estimate
leaves out (the rest of the activations, zero3's gathered weights, the optimizer's and XLA's
temporaries, memory the allocator keeps) is a larger share of a small model, and with zero3
the counted parameters, gradients and moments are a quarter of the replicated ones.
Phase-by-phase growth is not a fair comparison: the allocator returns memory to the system
at unpredictable points.
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time

from _common import ROOT  # first: the repository on sys.path, 8 CPU devices asked for

GiB = 2**30
MODEL = ["mesh.seq=4", "model.d_model=512", "model.n_layers=8", "model.n_heads=8",
         "model.n_kv_heads=2", "model.head_dim=64", "model.ffn_dim=2048", "seq_len=256",
         "batch_size=2"]


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


class Peak:
    """The highest RSS since ``reset``, sampled by a daemon thread."""

    def __init__(self):
        self.value = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            self.value = max(self.value, rss())
            time.sleep(0.002)

    def reset(self) -> int:
        self.value = now = rss()
        return now


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--param-sharding", choices=("replicated", "zero3"), default="replicated")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from ulysses_jax import make_mesh
    from ulysses_jax.config import load_config
    from ulysses_jax.data.text import shard_batch
    from ulysses_jax.training import host_memory
    from ulysses_jax.training.checkpoint import Checkpointer
    from ulysses_jax.training.train_step import init_state, make_train_step
    from ulysses_jax.training.loop import _abstract
    from ulysses_jax.training.train_step import abstract_batch

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"),
                      MODEL + [f"param_sharding={args.param_sharding}"])
    mesh = make_mesh(seq=4, data=1, devices=jax.devices()[:4])
    est = host_memory.estimate(cfg, mesh)
    part = {k: v / GiB for k, v in est.phases["training"].items()}
    print(f"param_sharding={args.param_sharding}, {est.params / 1e6:.1f}M parameters, "
          f"4 devices; estimate (GiB): " + ", ".join(f"{k} {v:.3f}" for k, v in part.items()))
    b, s = cfg.batch_size, cfg.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (b, s + 1), np.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
             "positions": np.tile(np.arange(s, dtype=np.int32), (b, 1)),
             "segment_ids": np.ones((b, s), np.int32), "loss_mask": np.ones((b, s), np.float32)}
    peak = Peak()
    start = peak.reset()  # everything below is measured above this

    def report(what, estimated):
        """The phase's peak RSS above ``start`` (then resets the peak) against what the
        estimate holds live by the end of the phase."""
        print(f"{what}: peak +{(peak.value - start) / GiB:.3f} GiB, now +"
              f"{(rss() - start) / GiB:.3f} GiB (estimate {estimated:.3f})")
        peak.reset()

    graphdef, state, shardings, tx = init_state(cfg, mesh)
    jax.block_until_ready(state)
    held = part["parameters"] + part["optimizer state"]
    report("train state built", held)
    step = make_train_step(cfg, mesh, graphdef, tx, shardings).lower(
        _abstract(state), abstract_batch(cfg, mesh)).compile()
    report("step compiled", held)
    for _ in range(3):
        state, metrics = step(state, shard_batch(batch, mesh))
        float(np.asarray(metrics["loss"]))
    stepping = held + part["gradients"] + part["activations"]
    report("3 steps", stepping)
    ckpt = Checkpointer(tempfile.mkdtemp(), keep=1, save_every=1)
    ckpt.save(3, state, {}, force=True)
    report("checkpoint save started", held + part["checkpoint save"])
    state, metrics = step(state, shard_batch(batch, mesh))
    float(np.asarray(metrics["loss"]))
    report("a step while the save is written", stepping + part["checkpoint save"])
    ckpt.wait()
    ckpt.close()

if __name__ == "__main__":
    main()
