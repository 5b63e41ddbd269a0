"""Every program train.py and the evaluate CLI compile on CPU devices can be read back from
JAX's persistent compilation cache (issue 37): no collective step that only a shared
communicator orders against a loop of collectives (``hlo.unordered_loop_collectives``), on
every mesh kind and family, with LoRA, accumulation and the memory options.

The programs: the train step, the trainer's held-out loss (``make_eval_step``) and the
loss-by-position program of the evaluate CLI and the trainer (``position_loss.token_losses``);
export compiles none. Shapes are small but keep every loop a loop: 32 tokens per device and
loss chunks of 16 (a loop of one trip is unrolled by XLA, and its collectives with it).
``test_compile_cache.py`` shows that these pairs are what a read-back executable runs out of
order, and that the same programs traced without ``ulysses_jax.ordering`` have them.

A layer stack that runs once (the tiny Qwen3-Next preset's attention layer after its three
DeltaNet layers) is a loop XLA removes; under ZeRO-3 its weights' gathers would then run
beside the loops before and after it (42 pairs at 2 data x 2 seq before the edges,
2026-12-04). ``test_edges_of_stacks_that_run_once_change_no_number`` shows the edges that
order them (``param_layout.layer_after``, ``ordering.saved_after_cotangent``) leave the
numbers as they were.
"""
import contextlib
import os

import pytest

from conftest import need_devices
from ulysses_jax.config import load_config
from ulysses_jax.hlo import unordered_loop_collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["seq_len=256", "batch_size=4", "model.loss_chunk=16"]

# name -> (preset, overrides, also the evaluation programs)
CASES = {
    "tiny": ("tiny", [], True),                                   # the main command's preset
    "hybrid": ("tiny", ["mesh.seq=4", "mesh.ring=2"], True),
    "ring_data": ("tiny", ["mesh.ring=4", "mesh.seq=1", "mesh.data=2"], False),
    "window_remat_tiled": ("tiny", ["model.family=gemma", "model.sliding_window=16",
                                    "model.layer_pattern=LG", "model.remat=full",
                                    "model.offload_checkpoints=true", "model.mlp_chunk=8"],
                           False),
    "offload_no_vocab_split": ("tiny", ["optimizer.offload=true",
                                        "model.vocab_parallel=false"], True),
    # ZeRO-3, tied and untied heads: the tied head's gradient moves from the loss's
    # vocabulary split to the embedding's split before the layers' backward loop
    "zero3": ("tiny", ["param_sharding=zero3", "mesh.data=2", "mesh.seq=4"], True),
    "zero3_untied_accum": ("tiny", ["param_sharding=zero3", "model.tie_embeddings=false",
                                    "grad_accum_steps=2"], False),
    # an untied head split over 2 data x 2 seq devices (a vocabulary the 4 divide): it moves
    # to the loss's split and its gradient back, and the optimizer's reductions wait for the
    # embedding's split gradient
    "zero3_untied_data_seq": ("tiny", ["param_sharding=zero3", "model.tie_embeddings=false",
                                       "model.vocab_size=256", "mesh.data=2", "mesh.seq=2"],
                              False),
    "moe": ("tiny-moe", [], True),
    "moe_data_accum_lora": ("tiny-moe", ["mesh.data=2", "mesh.seq=4", "grad_accum_steps=2",
                                         "model.lora.rank=4"], False),
    "qwen3_next": ("tiny-qwen3-next", [], True),
    # ZeRO-3: its attention layer's stack runs once (an untied head too)
    "qwen3_next_zero3": ("tiny-qwen3-next", ["param_sharding=zero3", "mesh.data=2",
                                             "mesh.seq=2"], True),
    "qwen3_next_data_accum_lora": ("tiny-qwen3-next", ["mesh.data=2", "mesh.seq=4",
                                                       "grad_accum_steps=2",
                                                       "model.lora.rank=4"], False),
    # the vision tower after the embedding's loop; under ZeRO-3 its outer weights gathered
    # after their inputs
    "qwen2_5_vl": ("tiny-qwen2.5-vl", [], True),
    "qwen2_5_vl_zero3": ("tiny-qwen2.5-vl", ["param_sharding=zero3", "mesh.data=2",
                                             "mesh.seq=2"], False),
}


def _programs(cfg, with_eval: bool):
    """name -> compiled HLO text of the programs ``cfg`` runs."""
    from ulysses_jax.training.dry_run import compile_step
    from ulysses_jax.training.position_loss import token_losses
    from ulysses_jax.training import objectives
    from ulysses_jax.training.train_step import (abstract_batch, make_eval_step,
                                                 params_for_compute, state_layout)
    from ulysses_jax.training.trainer import build_mesh
    out = {"train step": compile_step(cfg)[0].as_text()}
    if with_eval:
        mesh = build_mesh(cfg)
        graphdef, abstract, shardings, _ = state_layout(cfg, mesh)
        batch, params = abstract_batch(cfg, mesh), abstract["params"]
        out["eval step"] = make_eval_step(mesh, graphdef, shardings, objectives.get(cfg)).lower(
            params, batch).compile().as_text()
        out["token losses"] = token_losses(mesh, graphdef, cfg.model.loss_chunk,
                                           params_for_compute(cfg, shardings)).lower(
            params, batch).compile().as_text()
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_programs_have_no_unordered_loop_collectives(name):
    need_devices(8)
    preset, over, with_eval = CASES[name]
    cfg = load_config(os.path.join(ROOT, "configs", f"{preset}.yaml"), SMALL + over)
    programs = _programs(cfg, with_eval)
    assert "while" in programs["train step"]  # loops are there to be ordered
    for program, text in programs.items():
        assert unordered_loop_collectives(text) == [], (name, program)


def test_edges_of_stacks_that_run_once_change_no_number():
    """Qwen3-Next under ZeRO-3 with a DeltaNet layer then an attention layer: two stacks
    that run once, whose weights take edges from the layer's input and, in the backward
    pass, from its cotangent. One train step with the edges and one traced without any
    (``ordering.disabled``), from the same state and batch: the same loss, gradient norm and
    parameters (1e-6); the program without them is the one with unordered pairs."""
    import jax
    import numpy as np

    from ulysses_jax import ordering
    from ulysses_jax.data import run_data, text as data_lib
    from ulysses_jax.training.train_step import init_state, make_train_step
    from ulysses_jax.training.trainer import build_mesh, token_order
    need_devices(4)
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-qwen3-next.yaml"), [
        "seq_len=64", "batch_size=4", "model.n_layers=2", "model.mixer_pattern=DA",
        "model.d_model=32", "model.moe_ffn_dim=16", "model.moe_shared_ffn_dim=16",
        "model.loss_chunk=8", "param_sharding=zero3", "mesh.data=2", "mesh.seq=2"])
    mesh = build_mesh(cfg)
    rows, _ = run_data.load_data(cfg)
    batch = data_lib.BatchIterator(rows, cfg.batch_size, cfg.seed).next_global(
        mesh, token_order(cfg))
    graphdef, state, shardings, tx = init_state(cfg, mesh)
    again = jax.tree.map(lambda a: a.copy(), state)  # the step donates its state
    results = []
    for edges, start in ((True, state), (False, again)):
        with contextlib.nullcontext() if edges else ordering.disabled():
            step = make_train_step(cfg, mesh, graphdef, tx, shardings).lower(
                start, batch).compile()
        assert bool(unordered_loop_collectives(step.as_text())) != edges, edges
        new, metrics = step(start, batch)
        results.append((jax.device_get(new["params"]), jax.device_get(metrics)))
    (params, metrics), (plain_params, plain_metrics) = results
    for key in ("loss", "grad_norm"):
        assert abs(metrics[key] - plain_metrics[key]) <= 1e-6 * abs(plain_metrics[key]), key
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(plain_params), strict=True):
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)
