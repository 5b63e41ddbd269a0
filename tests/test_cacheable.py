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

Not yet here: Qwen3-Next under ZeRO-3 with a layer pattern that runs once (``n_layers`` =
``len(mixer_pattern)``, as in its tiny preset): XLA hoists the gathers of the one-trip loop's
weights out of it (42 pairs at 2 data x 2 seq, 2026-12-04; none with two repeats). The fence
keeps those programs out of the cache.
"""
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
    from ulysses_jax.training.train_step import (make_eval_step, params_for_compute,
                                                 state_layout)
    from ulysses_jax.training.trainer import _abstract_batch, build_mesh
    out = {"train step": compile_step(cfg)[0].as_text()}
    if with_eval:
        mesh = build_mesh(cfg)
        graphdef, abstract, shardings, _ = state_layout(cfg, mesh)
        batch, params = _abstract_batch(cfg, mesh), abstract["params"]
        out["eval step"] = make_eval_step(mesh, graphdef, shardings, cfg).lower(
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
