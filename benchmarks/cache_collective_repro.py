"""Issue 29's crash outside the suite: the held-out loss-by-position program
(training/position_loss.token_losses) on a 2-device CPU mesh, read back from JAX's persistent
compilation cache, deadlocks in its collectives or segfaults while its results are read.

    python benchmarks/cache_collective_repro.py DIR x 1    # compiles, writes DIR: ok
    python benchmarks/cache_collective_repro.py DIR x 50   # reads DIR back: aborts
    python benchmarks/cache_collective_repro.py none x 50  # no cache: ok

Seen on 2026-12-02 (jax/jaxlib 0.10.2, 2-core CPU machine): the first run "ok"; of three
cache-reading runs one segfaulted and two aborted ("Termination timeout for `all gather
RendezvousKey{...op_id=1}`" on one device thread while the other waits in `reduce scatter
... op_id=1` of the same run id). Not yet fixed: see issue 29's note.
"""
# flake8: noqa: E402
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
import jax, numpy as np
if sys.argv[1] != "none":
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ulysses_jax import make_mesh
from ulysses_jax.config import load_config
from ulysses_jax.training.train_step import init_state
from ulysses_jax.training.position_loss import token_losses
from ulysses_jax.data import text as data_lib
SMALL = ["seq_len=128", "batch_size=2", "model.d_model=32", "model.n_layers=1",
         "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=8", "model.ffn_dim=64",
         "model.loss_chunk=16", "model.vocab_size=384", "mesh.seq=2", "mesh.data=1"]
cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), SMALL)
mesh = make_mesh(seq=2, data=1)
graphdef, state, sh, tx = init_state(cfg, mesh)
fn = token_losses(mesh, graphdef, cfg.model.loss_chunk)
rng = np.random.default_rng(0)
tok = rng.integers(0, 384, (2, 129)).astype(np.int32)
batch = {"tokens": tok[:, :-1], "targets": tok[:, 1:], "positions": np.tile(np.arange(128, dtype=np.int32), (2, 1)),
         "segment_ids": np.ones((2, 128), np.int32), "loss_mask": np.ones((2, 128), np.float32)}
ref = None
if sys.argv[2] == "check":
    print(fn.lower(state["params"], data_lib.shard_batch(batch, mesh)).compile().as_text().count("all-gather"), "all-gathers")
for i in range(int(sys.argv[3])):
    l, p = fn(state["params"], data_lib.shard_batch(batch, mesh))
    l = np.asarray(l); p = np.asarray(p)
    if ref is None: ref = (l, p)
    assert (ref[0] == l).all() and (ref[1] == p).all(), i
print("ok", float(ref[0].mean()), flush=True)
