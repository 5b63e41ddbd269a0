"""What the compilation-cache fence does with every program train.py and the evaluate CLI
compile on CPU devices: on every mesh kind and family, with LoRA, accumulation and the memory
options, a program is written to JAX's persistent compilation cache exactly when
``hlo.unordered_loop_collectives`` finds no collective step that only a shared communicator
orders against a loop of collectives, the others are kept out, and the one line the fence
prints names exactly those (``compile_cache.summary``). ``test_compile_cache.py`` shows that
such pairs are what a read-back executable runs out of order.

The programs: the train step, the trainer's held-out loss (``make_eval_step``) and the
loss-by-position program of the evaluate CLI and the trainer (``position_loss.token_losses``);
export compiles none. Shapes are small but keep every loop a loop: 32 tokens per device and
loss chunks of 16 (a loop of one trip is unrolled by XLA, and its collectives with it).
The models add no data edges to order their collectives, so every case's train step has pairs
(attention's gather of the segment ids beside the embedding's loop, a parameter gradient's
reduction beside a backward loop, ...); the programs recorded as safe in ``CASES`` are those
whose collectives data orders.
"""
import os
import re
import subprocess
import sys
from collections import OrderedDict

import jax
import pytest

from tests.utils.devices import DEVICES, cli_env, need_devices
from ulysses_jax import compile_cache
from ulysses_jax.config import load_config
from ulysses_jax.hlo import unordered_loop_collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["seq_len=256", "batch_size=4", "model.loss_chunk=16"]

# name -> (preset, overrides, also the evaluation programs[, the programs safe to cache])
CASES = {
    "tiny": ("tiny", [], True),                                   # the main command's preset
    "hybrid": ("tiny", ["mesh.seq=4", "mesh.ring=2"], True),
    "ring_data": ("tiny", ["mesh.ring=4", "mesh.seq=1", "mesh.data=2"], False),
    "window_remat_tiled": ("tiny", ["model.family=gemma", "model.sliding_window=16",
                                    "model.layer_pattern=LG", "model.remat=full",
                                    "model.offload_checkpoints=true", "model.mlp_chunk=8"],
                           False),
    # the embedding a lookup of replicated rows (no loop): the evaluation programs' gathers
    # feed the layer loop or read its result
    "offload_no_vocab_split": ("tiny", ["optimizer.offload=true",
                                        "model.vocab_parallel=false"], True,
                               {"eval step", "token losses"}),
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


@pytest.fixture
def fenced_cache(tmp_path, monkeypatch):
    """A persistent cache in ``tmp_path`` for this test's compiles, every program cached that
    the fence lets in, and the fence's records fresh (restored after)."""
    from jax._src import compilation_cache
    if DEVICES[0].platform != "cpu":
        pytest.skip("the CPU runtime's cache")
    compile_cache.fence(warn=False)
    monkeypatch.setattr(compile_cache, "_kept_out", {})
    monkeypatch.setattr(compile_cache, "_live", OrderedDict())
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = [getattr(jax.config, n) for n in names]
    for n, v in zip(names, (str(tmp_path), 0.0, 0)):
        jax.config.update(n, v)
    compilation_cache.reset_cache()
    try:
        yield tmp_path
    finally:
        for n, v in zip(names, before):
            jax.config.update(n, v)
        compilation_cache.reset_cache()


def _module(text: str) -> str:
    """The program's module name, which names its cache entry and the fence's record."""
    return re.match(r"HloModule ([\w.\-]+)", text).group(1)


@pytest.mark.parametrize("name", list(CASES))
def test_the_fence_keeps_out_exactly_the_programs_with_unordered_pairs(name, fenced_cache):
    need_devices(8)
    preset, over, with_eval, *safe = CASES[name]
    safe = safe[0] if safe else set()
    cfg = load_config(os.path.join(ROOT, "configs", f"{preset}.yaml"), SMALL + over)
    programs = _programs(cfg, with_eval)
    assert "while" in programs["train step"]  # loops are there to be ordered
    modules = {program: _module(text) for program, text in programs.items()}
    assert len(set(modules.values())) == len(modules), modules
    unsafe = {program for program, text in programs.items() if unordered_loop_collectives(text)}
    assert unsafe == set(programs) - safe, (name, unsafe)
    entries = os.listdir(fenced_cache)
    written = {program for program, module in modules.items()
               if any(e.startswith(module + "-") for e in entries)}
    assert written == set(programs) - unsafe, (name, written, entries)
    assert set(compile_cache.kept_out()) == {modules[p] for p in unsafe}
    line = compile_cache.summary()
    assert line is not None and "\n" not in line
    listed = set(re.search(r": ([\w.\-]+(?:, [\w.\-]+)*) \(docs/", line).group(1).split(", "))
    assert listed == {modules[p] for p in unsafe}, line


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="the CPU runtime's cache")
def test_a_run_with_a_cache_names_what_it_kept_out_in_one_line(tmp_path):
    """The README's main command (the tiny preset, here 2 short steps and an evaluation) with
    a persistent cache on CPU devices, twice: each run prints one line about the cache, at
    exit, naming the train step and the held-out loss (their pairs: attention's gather of
    the segment ids beside the embedding's loop); none of the named programs is in the
    cache, the others are, and the second run reads those back and ends with the same
    losses."""
    cache = tmp_path / "cache"
    runs = []
    for i in range(2):
        out = subprocess.run(
            [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--workdir",
             str(tmp_path / f"run{i}"), "--no-progress", "steps=2", "seq_len=128",
             "eval_every=2", "eval_batches=1", "checkpoint_every=2"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
            env=cli_env(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
                        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"))
        assert out.returncode == 0, out.stderr[-2000:]
        said = [line for line in out.stderr.splitlines() if "cache" in line]
        assert len(said) == 1 and said[0].startswith("compilation cache: "), said
        assert out.stderr.rstrip().endswith(said[0])  # at exit
        runs.append((said[0], [line for line in out.stdout.splitlines()
                               if line.startswith("done:")]))
        listed = re.search(r": ([\w.\-]+(?:, [\w.\-]+)*) \(docs/", said[0]).group(1)
        listed = listed.split(", ")
        assert {"jit_step", "jit_evaluate"} <= set(listed), said
        entries = os.listdir(cache)
        assert not any(e.startswith(name + "-") for name in listed for e in entries), entries
        assert any(e.startswith("jit_init") for e in entries), entries  # the others are in
    assert runs[0] == runs[1] and runs[0][1], runs
