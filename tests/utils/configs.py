"""Tiny configs for the tests: the repository's presets under ``key=value`` overrides."""
import os

from ulysses_jax.config import Config, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")

# The trainer tests' run (as train.py arguments or ``tiny_config``'s overrides): a model small
# enough that each run compiles and trains in seconds on 2 cores (one layer, d_model 32, 8
# query and 2 kv heads of 8) on 2 rows of 64 tokens, logging every step.
SMALL = ["seq_len=64", "batch_size=2", "model.d_model=32", "model.n_layers=1",
         "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=8", "model.ffn_dim=64",
         "model.loss_chunk=16", "log_every=1", "eval_batches=1", "optimizer.warmup_steps=2"]


def preset_path(name: str) -> str:
    """configs/<name>.yaml."""
    return os.path.join(ROOT, "configs", f"{name}.yaml")


def tiny_config(*over: str, preset: str | None = "tiny", **items) -> Config:
    """``load_config`` of configs/<preset>.yaml (None: the defaults alone) with the overrides
    ``over``, then ``items`` as ``key=value`` in their order (dotted keys as
    ``**{"mesh.seq": 2}``)."""
    return load_config(None if preset is None else preset_path(preset),
                       [*over, *(f"{k}={v}" for k, v in items.items())])
