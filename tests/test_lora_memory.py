"""LoRA (model.lora) with each memory option: the option changes where things live or when
they are computed, not what a LoRA step does.

Each case trains the tiny LoRA model three steps on one batch at mesh.seq 2 with a memory
option on, and the same model without it (the reference, shared by the cases), both from the
same parameters with nonzero B (so the first step's gradient reaches every A as well).
Asserted: the losses and gradient norms of the three steps equal the reference's within 1e-5
relative; AdamW's moments after the first step, (1 - b1) g and (1 - b2) g^2 of its gradient
g, equal the reference's within 1e-5 of their largest value for every trained tensor; every
trained tensor moves and every frozen one comes out bitwise as it went in; the optimizer
state holds moments for the trained leaves only; with optimizer.offload all of the state is
in host memory, the update is computed there, and the frozen layer matrices stream to the
device one layer at a time in the dtype they are stored in.

The parameters themselves are not compared: AdamW's first update is g / (|g| + eps) per
element, and where the gradient is zero up to fp32 rounding (~1e-9 here, next to eps =
1e-8) that is rounding noise scaled to the size of the learning rate. Measured: remat=full
alone, with gradients equal within 2e-7, moves lora_k_b 1.4e-3 (of its largest value)
away from the plain step's after one step.
"""
import os

import jax
import numpy as np
import pytest

from tests.test_model import _batch
from tests.utils.devices import DEVICES, need_devices
from ulysses_jax import make_mesh
from ulysses_jax.config import load_config
from ulysses_jax.models import lora
from ulysses_jax.training.train_step import batch_shardings, init_state, make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# test_lora's tiny LoRA model (each run compiles and trains in seconds on 2 cores).
SMALL = ["seq_len=64", "batch_size=2", "model.d_model=32", "model.n_layers=2",
         "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=8", "model.ffn_dim=64",
         "model.loss_chunk=16", "model.attn_impl=xla", "optimizer.warmup_steps=0",
         "optimizer.lr=0.01", "mesh.seq=2", "model.lora.rank=4", "model.lora.alpha=8"]
STEPS = 3
TOL = 1e-5
# bf16 moments: each stored value is rounded to bf16's 8 significant bits, by at most 2^-8 of
# itself;
# the steps after the first one see updates that differ by about as much.
BF16 = 2.0 ** -8
BF16_BASE = "model.lora.base_dtype=bfloat16"
OFFLOAD = "optimizer.offload=true"

# id -> (the memory option's keys, keys the case shares with its reference, tolerance)
CASES = {
    "offload": ([OFFLOAD], [], TOL),
    "offload-zero3-accum-bf16-base": (
        [OFFLOAD, "param_sharding=zero3", "grad_accum_steps=2"],
        [BF16_BASE, "model.lora.trainable=[norms]"], TOL),
    "offload-checkpoints": (["model.remat=full", "model.offload_checkpoints=true"], [], TOL),
    "remat-full": (["model.remat=full"], [], TOL),
    "remat-save-dots": (["model.remat=save_dots"], [], TOL),
    "remat-offload": (["model.remat=offload"], [], TOL),
    "mlp-chunk": (["model.mlp_chunk=8"], [], TOL),
    "loss-chunk": (["model.loss_chunk=8"], [], TOL),
    "grad-accum": (["grad_accum_steps=2"], [], TOL),
    "zero3": (["param_sharding=zero3"], [], TOL),
    "bf16-moments": (["optimizer.moment_dtype=bfloat16"], [], BF16),
}
_RUNS = {}  # keys -> _run's result: the references are shared by the cases


def _host(tree):
    return jax.tree.map(np.array, tree)


def _paths(tree) -> list[tuple]:
    return [tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in p)
            for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _moments(opt_state) -> dict:
    """("mu" or "nu", *parameter path) -> AdamW's moment as fp32, whatever chain holds it."""
    out = {}
    for path, x in zip(_paths(opt_state), jax.tree.leaves(opt_state)):
        at = [i for i, k in enumerate(path) if k in ("mu", "nu")]
        if at:
            out[path[at[0]:]] = np.asarray(x, np.float32)
    return out


def _start(mesh) -> dict:
    """The tiny model's parameters (seed 0) with every B drawn nonzero, std 0.05."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), SMALL)
    params = _host(init_state(cfg, mesh)[1]["params"])
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: (0.05 * rng.standard_normal(x.shape)).astype(x.dtype)
        if str(p[-1].key).endswith("_b") else x, params)


def _run(keys: tuple) -> dict:
    """STEPS train steps of the tiny LoRA model with ``keys`` from ``_start`` on one batch:
    the parameters before and after, the losses and gradient norms, AdamW's moments after the
    first step, the state's memory kinds, and (offload) the step lowered for a GPU."""
    if keys in _RUNS:
        return _RUNS[keys]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), SMALL + list(keys))
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    if "start" not in _RUNS:
        _RUNS["start"] = _start(mesh)
    graphdef, state, shardings, tx = init_state(cfg, mesh, _RUNS["start"])
    before = _host(state["params"])
    step = make_train_step(cfg, mesh, graphdef, tx, shardings)
    batch = {k: jax.device_put(v, batch_shardings(mesh)[k]) for k, v in _batch(3).items()}
    lowered = (step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
               if cfg.optimizer.offload else None)
    losses, norms, moments = [], [], None
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        moments = moments or _moments(state["opt_state"])
    out = {"cfg": cfg, "before": before, "after": _host(state["params"]), "losses": losses,
           "norms": norms, "moments": moments, "lowered": lowered,
           "kinds": {x.sharding.memory_kind
                     for x in jax.tree.leaves((state["params"], state["opt_state"]))}}
    _RUNS[keys] = out
    return out


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="trainer tests run on fake CPU devices")
@pytest.mark.parametrize("case", list(CASES))
def test_lora_step_is_the_plain_lora_step(case):
    option, common, tol = CASES[case]
    got, want = _run(tuple(common + option)), _run(tuple(common))
    lo = got["cfg"].model.lora
    trained = set(_paths(lora.trainable_params(got["before"], lo)))
    assert trained and all(lora.is_adapter(p) or "norm" in str(p) for p in trained)

    # The same start ...
    assert _paths(got["before"]) == _paths(want["before"])
    for path, x, y in zip(_paths(got["before"]), jax.tree.leaves(got["before"]),
                          jax.tree.leaves(want["before"])):
        assert x.dtype == y.dtype and np.array_equal(x, y), path
    # ... the same steps (module docstring: why the moments and not the parameters).
    assert got["losses"][-1] < got["losses"][0] - 0.01, got["losses"]
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=tol)
    np.testing.assert_allclose(got["norms"], want["norms"], rtol=tol)
    assert set(got["moments"]) == set(want["moments"]) == {
        (m, *p) for m in ("mu", "nu") for p in trained}   # moments for trained leaves only
    for key, x in got["moments"].items():
        y = want["moments"][key]
        assert np.any(y != 0) and _rel(x, y) <= tol, (key, _rel(x, y))
    # Every trained tensor moved; every frozen one is bitwise what it was.
    checked = 0
    for path, x0, x in zip(_paths(got["before"]), jax.tree.leaves(got["before"]),
                           jax.tree.leaves(got["after"])):
        assert x.dtype == x0.dtype and x.shape == x0.shape, path
        if path in trained:
            assert not np.array_equal(x, x0), f"trained {path} did not move"
            checked += 1
        else:
            assert np.array_equal(x, x0), f"frozen {path} changed"
    assert checked == len(trained)
    if OFFLOAD in option:
        assert got["kinds"] == {"pinned_host"}, got["kinds"]
        # The update runs on the host; the frozen layer matrices stream to the device inside
        # the layer loop (one layer's [D, N, H] of the [L, D, N, H] stack) in their storage
        # dtype (the bf16 base: half the bytes of an fp32 copy).
        text = got["lowered"]
        assert text.count('_xla_compute_type = "host"') > 0
        to_device = [line for line in text.splitlines()
                     if '_xla_buffer_placement = "device"' in line]
        wq = got["before"]["layers"]["attn"]["wq"]
        dt = {np.dtype(np.float32): "f32"}.get(wq.dtype, "bf16")
        one = "x".join(map(str, wq.shape[1:]))
        assert any(f"tensor<{one}x{dt}>" in line for line in to_device), to_device[:5]
        assert not any(f"tensor<{wq.shape[0]}x{one}x" in line for line in to_device)
