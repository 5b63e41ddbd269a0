"""Memory options for long sequences: layer checkpoints and the optimizer in host memory,
bfloat16 moments; the same numbers as without, the placement in a GPU lowering, and the
planner's device/host accounting."""
import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.test_model import _batch, _built, _cfg, _layout
from tests.utils.devices import DEVICES, LOOP_EMITTERS, cli_env
from ulysses_jax.training.optimizer import scale_by_adam_stored
from ulysses_jax.training.train_step import make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _grads(seed, shapes=((3, 5), (7,))):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {f"w{i}": jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes))}


def test_stored_adam_in_float32_is_optax_adam():
    ours, ref = scale_by_adam_stored(0.9, 0.95, 1e-8, jnp.float32), optax.scale_by_adam(0.9, 0.95)
    params = _grads(0)
    s_ours, s_ref = ours.init(params), ref.init(params)
    for step in range(4):
        g = _grads(10 + step)
        u_ours, s_ours = ours.update(g, s_ours)
        u_ref, s_ref = ref.update(g, s_ref)
        chex.assert_trees_all_close(u_ours, u_ref, rtol=1e-6, atol=1e-7)


def test_bfloat16_moments_are_stored_in_bfloat16_and_update_alike():
    ours, ref = scale_by_adam_stored(0.9, 0.95, 1e-8, jnp.bfloat16), optax.scale_by_adam(0.9, 0.95)
    params = _grads(1)
    s_ours, s_ref = ours.init(params), ref.init(params)
    assert {x.dtype for x in jax.tree.leaves((s_ours.mu, s_ours.nu))} == {jnp.dtype(jnp.bfloat16)}
    for step in range(4):
        g = _grads(20 + step)
        u_ours, s_ours = ours.update(g, s_ours)
        u_ref, s_ref = ref.update(g, s_ref)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(u_ours),
                                                              jax.tree.leaves(u_ref)))
    assert 0 < err < 2e-2, err  # different storage, same update up to bf16 rounding


def _train(over, steps=3, compiler_options=None, state_of=None):
    """``steps`` steps of ``over``'s config on one batch from a copy of its seeded initial
    state, or of ``state_of``'s config's (the same parameters and layout: ``over`` adds an
    option of the forward pass only)."""
    cfg, mesh, g, _, sh, tx = _layout(2, 1, **over)
    _, _, state, shardings, _, _ = _built(_cfg(2, 1, **(over if state_of is None else state_of)))
    assert shardings == sh
    st = jax.device_put(state, may_alias=False)  # the step donates its state
    step = make_train_step(cfg, mesh, g, tx, sh)
    batch = _batch(3)
    if compiler_options:
        step = step.lower(st, batch).compile(compiler_options=compiler_options)
    losses, norms = [], []
    for _ in range(steps):
        st, m = step(st, batch)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return losses, norms, st, step, batch


@pytest.mark.parametrize("option", [{"optimizer.offload": True},
                                    {"model.remat": "full", "model.offload_checkpoints": True}])
def test_offload_options_keep_the_numbers(option):
    """fp32: the offloaded program is the same arithmetic, so the same losses, gradient
    norms and parameters after three AdamW steps.

    On jaxlib 0.10 both programs are compiled with XLA:CPU's default code generation, which
    the suite otherwise turns off for speed (LOOP_EMITTERS, tests/utils/devices.py): with the
    older loop emitters the two programs round the embedding gradient differently (by 2e-7 of
    its largest value), and AdamW, which divides each moment by its own root, turns that rounding
    on elements whose gradient is nearly zero into parameter differences of up to 1.2e-5
    (0.2% of the value) in three steps. jaxlib 0.11 and later have only the default."""
    default = {"xla_cpu_use_fusion_emitters": True} if LOOP_EMITTERS else None
    base = {"model.remat": "full"} if "model.remat" in option else {}
    l0, n0, s0, _, _ = _train(base, compiler_options=default)
    l1, n1, s1, step, batch = _train(option, compiler_options=default,
                                     state_of=base if "model.remat" in option else None)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    np.testing.assert_allclose(n1, n0, rtol=1e-6)
    chex.assert_trees_all_close(s1["params"], s0["params"], rtol=1e-6, atol=1e-7)


def test_optimizer_offload_keeps_the_state_in_host_memory_and_updates_there():
    """The state's arrays are placed in pinned_host, and a GPU lowering of the step (no GPU
    needed to lower) moves each layer's weights to the device inside the layer loop and
    computes the update on the host."""
    _, _, st, step, batch = _train({"optimizer.offload": True}, steps=1)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((st["params"], st["opt_state"]))}
    assert kinds == {"pinned_host"}, kinds
    text = step.trace(st, batch).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('_xla_buffer_placement = "pinned_host"') > 0
    assert text.count('_xla_compute_type = "host"') > 0
    # The layer weights stream in one layer at a time: wq moves as [D, N, H] (one layer of
    # the [L, D, N, H] stack), inside the layer loop.
    to_device = [line for line in text.splitlines()
                 if '_xla_buffer_placement = "device"' in line]
    assert any("tensor<128x8x16xf32>" in line for line in to_device), to_device[:5]
    assert not any("tensor<2x128x8x16xf32>" in line for line in to_device)


def test_checkpoint_offload_moves_the_layer_input_to_the_host():
    """GPU lowering: each layer's [B, S, D] input (global shape) goes to pinned_host in the
    forward pass and comes back for the backward pass; without the option nothing moves.
    (Lowered from the state's layout: nothing needs initialising.)"""
    lowered = {}
    for offload in (False, True):
        cfg, mesh, g, abstract, sh, tx = _layout(2, 1, **{"model.remat": "full",
                                                         "model.offload_checkpoints": offload})
        step = make_train_step(cfg, mesh, g, tx, sh)
        lowered[offload] = step.trace(abstract, _batch(3)).lower(
            lowering_platforms=("cuda",)).as_text()
    b, s, d = 2, 64, 128  # the test batch and model; the lowering has global shapes
    to_host = [line for line in lowered[True].splitlines()
               if '_xla_buffer_placement = "pinned_host"' in line]
    assert any(f"tensor<{b}x{s}x{d}x" in line for line in to_host), to_host[:3]
    assert '"pinned_host"' not in lowered[False]


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="models the CPU compiler's numbers")
def test_dry_run_puts_offloaded_bytes_in_the_host_column():
    """--dry-run with the checkpoints offloaded: the host column holds at least the layer
    checkpoints (L x B x S/P x D values), the device peak drops by most of that, and the
    live-range model agrees with XLA's own peak when nothing is moved."""
    common = ["--config", "configs/tiny.yaml", "--dry-run", "mesh.seq=2", "mesh.data=1",
              "batch_size=1", "seq_len=8192", "model.remat=full", "model.n_layers=4"]
    runs = {}
    for offload in ("false", "true"):
        out = subprocess.run([sys.executable, "train.py", *common,
                              f"model.offload_checkpoints={offload}"], cwd=ROOT, env=cli_env(),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[offload] = json.loads(out.stdout.strip().splitlines()[-1])
    stack = 4 * 1 * (8192 // 2) * 128 * 4   # L x B x S/P x D fp32 (tiny is fp32)
    off, on = runs["false"], runs["true"]
    assert off["host_bytes_per_device"] == 0
    assert on["host_bytes_per_device"] >= stack
    assert off["peak_bytes_per_device"] - on["peak_bytes_per_device"] >= 0.75 * stack, (off, on)
    assert abs(off["live_range_peak_bytes"] / off["peak_bytes_per_device"] - 1) < 0.02, off
    assert off["memory_by_category"].get("layer checkpoints", 0) > 0, off["memory_by_category"]


# Each memory option, and whether it keeps the plain run's numbers exactly (bf16 moments
# store AdamW's moments rounded, so only their own straight run is the reference).
# The options that change what the evaluation, checkpoint, resume and export paths hold (the
# other remat policies change the train step alone: test_model.py's numbers tests).
MEMORY_OPTIONS = [
    (["optimizer.offload=true"], True),
    (["model.remat=full", "model.offload_checkpoints=true"], True),
    (["optimizer.moment_dtype=bfloat16"], False),
]


SMALL_RUN = ["seq_len=64", "batch_size=2", "model.d_model=32", "model.head_dim=8",
             "model.ffn_dim=64", "model.loss_chunk=16", "log_every=1", "eval_every=2",
             "eval_batches=1", "checkpoint_every=2", "mesh.seq=2", "model.attn_impl=xla",
             "optimizer.schedule_steps=3"]


def _run_records(workdir, extra, steps):
    """train.py's run of the shrunk tiny preset with ``extra`` for ``steps`` in ``workdir``
    (resumed when it holds a checkpoint): its metrics.jsonl records."""
    from ulysses_jax.config import load_config
    from ulysses_jax.training.trainer import train
    train(load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      SMALL_RUN + extra + [f"steps={steps}"]), str(workdir), progress=False)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The plain run's records (no memory option), the reference of every option that keeps
    the numbers: made once per module, not once per option."""
    return _run_records(tmp_path_factory.mktemp("plain"), [], 3)


@pytest.mark.parametrize("over,same_numbers", MEMORY_OPTIONS)
def test_every_path_works_with_each_memory_option(tmp_path, over, same_numbers, request):
    """The tiny preset (shrunk) with each memory option through every path of the trainer:
    train steps, held-out evaluation, a checkpoint and a resume (equal to the straight run,
    and to the plain run where the option keeps the numbers), the dry run and the export
    (the held-out step once read the host-resident embedding directly and crashed)."""
    from ulysses_jax import export
    from ulysses_jax.config import load_config
    from ulysses_jax.training.dry_run import dry_run
    preset = os.path.join(ROOT, "configs", "tiny.yaml")
    reference = (request.getfixturevalue("plain_run") if same_numbers
                 else _run_records(tmp_path / "reference", over, 3))
    _run_records(tmp_path / "opt", over, 2)
    resumed = _run_records(tmp_path / "opt", over, 3)   # same workdir: resumes from step 2
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("loss", "eval_loss"):
        got = [r.get(key) for r in resumed]
        want = [r.get(key) for r in reference]
        assert any(w is not None for w in want) and [g is None for g in got] == [
            w is None for w in want], key
        np.testing.assert_allclose([g for g in got if g is not None],
                                   [w for w in want if w is not None], rtol=1e-5)
    assert dry_run(load_config(preset, SMALL_RUN + over))["peak_bytes_per_device"] > 0
    assert export.main([str(tmp_path / "opt"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").exists()
