"""The persistent-cache fence (ulysses_jax/compile_cache.py): which compiled programs lose the
order of their collectives when read back from JAX's persistent compilation cache
(hlo.unordered_loop_collectives), and that the fenced cache neither writes nor runs them.

The crash itself: ``benchmarks/cache_collective_repro.py --cache DIR`` (a 2-device CPU
program, the held-out loss-by-position program of a tiny decoder) aborts or segfaults on every
run that reads DIR back without the fence; the subprocess tests below run it with the fence,
and read back without it only the program whose collectives data orders (``--ordered``).
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.utils.devices import DEVICES, cli_env, need_devices
from ulysses_jax.compile_cache import unsafe_pairs
from ulysses_jax.hlo import unordered_loop_collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPRO = os.path.join(ROOT, "benchmarks", "cache_collective_repro.py")


def _compiled(body, n_out: int):
    """``body(a, b)`` under shard_map on 2 devices, compiled; a, b: [8, 16] split by rows."""
    mesh = jax.make_mesh((2,), ("x",), devices=need_devices(2))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=(P("x"),) * n_out))
    rng = np.random.default_rng(0)
    a, b = (jax.device_put(rng.standard_normal((8, 16), np.float32), NamedSharding(mesh, P("x")))
            for _ in range(2))
    return f.lower(a, b).compile()


def _loop(a):
    """A loop whose body all-gathers: a: [4, 16] -> [1, 16]."""
    def step(i, c):
        g = jax.lax.all_gather(a * (i + 1).astype(a.dtype), "x", tiled=True)  # [8, 16]
        return c + jnp.tanh(g).sum(0)
    start = jax.lax.pcast(jnp.zeros(a.shape[1:], a.dtype), ("x",), to="varying")
    return jax.lax.fori_loop(0, 3, step, start)[None]


def test_a_loop_collective_beside_an_independent_collective_is_found():
    compiled = _compiled(lambda a, b: (_loop(a), jax.lax.psum_scatter(b, "x", tiled=True)), 2)
    pairs = unordered_loop_collectives(compiled.as_text())
    assert len(pairs) == 1, pairs
    _, one, other = pairs[0]
    assert sorted(x.split(".")[0] for x in (one, other)) == ["reduce_scatter", "while"], pairs
    assert unsafe_pairs(compiled.runtime_executable()) == pairs


def test_collectives_ordered_by_data_are_safe():
    # the reduce-scatter reads the loop's result, so every device runs the loop first
    def ordered(a, b):
        r = _loop(a)                                                   # [1, 16]
        return r, jax.lax.psum_scatter(b + r, "x", tiled=True)
    assert unordered_loop_collectives(_compiled(ordered, 2).as_text()) == []
    # collectives without a loop keep their shared order when read back
    plain = _compiled(lambda a, b: (jax.lax.psum_scatter(a, "x", tiled=True),
                                    jax.lax.psum_scatter(jnp.sin(b), "x", tiled=True)), 2)
    assert "while" not in plain.as_text()
    assert unordered_loop_collectives(plain.as_text()) == []


def _repro_program(extra=()):
    """The compiled loss-by-position program of ``cache_collective_repro.py``."""
    need_devices(2)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from cache_collective_repro import SMALL
    from ulysses_jax import make_mesh
    from ulysses_jax.config import load_config
    from ulysses_jax.training.position_loss import token_losses
    from ulysses_jax.training.train_step import init_state
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), SMALL + list(extra))
    mesh = make_mesh(seq=2, data=1, devices=DEVICES[:2])
    graphdef, state, _, _ = init_state(cfg, mesh)
    b, s = cfg.batch_size, cfg.seq_len
    batch = {k: jax.ShapeDtypeStruct((b, s), np.float32 if k == "loss_mask" else np.int32,
                                     sharding=NamedSharding(mesh, P("data", "seq")))
             for k in ("tokens", "targets", "positions", "segment_ids", "loss_mask")}
    fn = token_losses(mesh, graphdef, cfg.model.loss_chunk)
    return fn.lower(state["params"], batch).compile()


def test_the_loss_by_position_program_is_found_and_the_ordered_one_is_not():
    """The program of the crash: its embedding loop (all-gather, reduce-scatter per chunk)
    and the all-gather of the segment ids beside it, found in the HLO text and in the
    executable the fence reads. The ``--ordered`` program (the embedding a lookup, two
    layers) has a loop of all-to-alls and no pair."""
    compiled = _repro_program()
    pairs = unordered_loop_collectives(compiled.as_text())
    assert any("while" in a or "while" in b for _, a, b in pairs), pairs
    assert any(x.startswith("all") and "gather" in x for _, a, b in pairs for x in (a, b)), pairs
    assert unsafe_pairs(compiled.runtime_executable()) == pairs
    from cache_collective_repro import ORDERED
    ordered = _repro_program(ORDERED).as_text()
    assert ordered.count(" while(") >= 2 and "all-to-all" in ordered  # the layer loop's
    assert unordered_loop_collectives(ordered) == []


def _repro(cache, *extra):
    return subprocess.run([sys.executable, REPRO, "--cache", str(cache), *extra],
                          capture_output=True, text=True, timeout=300,
                          env=cli_env(JAX_PLATFORMS="cpu"))


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="the CPU runtime's cache")
def test_fenced_cache_keeps_the_program_out_and_reads_back_without_crashing(tmp_path):
    """A fenced process does not write the loss-by-position program; an unfenced one does; a
    fenced process reading that cache drops it, compiles it fresh and runs it 30 times with
    equal results (an unfenced reading process aborts or segfaults there)."""
    fenced_write = _repro(tmp_path, "--fence", "--runs", "1")
    assert fenced_write.returncode == 0, fenced_write.stderr[-2000:]
    assert "kept out of the cache: ['jit_run']" in fenced_write.stdout
    cached = os.listdir(tmp_path)
    assert any(f.startswith("jit_init") for f in cached), cached  # the cache is in use
    assert not any(f.startswith("jit_run") for f in cached), cached
    unfenced_write = _repro(tmp_path, "--runs", "1")
    assert unfenced_write.returncode == 0, unfenced_write.stderr[-2000:]
    assert any(f.startswith("jit_run") for f in os.listdir(tmp_path))
    fenced_read = _repro(tmp_path, "--fence", "--runs", "30")
    assert fenced_read.returncode == 0, fenced_read.stderr[-2000:]
    assert "kept out of the cache: ['jit_run']" in fenced_read.stdout
    assert fenced_read.stdout.split()[:2] == fenced_write.stdout.split()[:2]  # "ok", the loss


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="the CPU runtime's cache")
def test_a_program_without_pairs_reads_back_from_the_cache_and_runs(tmp_path):
    """The ``--ordered`` program (no pair: a loop of collectives that data orders against
    the collectives beside it): written to the cache without the fence, then read back
    without it and run 30 times with equal results and the loss of a fresh compile (the
    program with a pair aborts or segfaults there)."""
    write = _repro(tmp_path, "--ordered", "--runs", "1")
    assert write.returncode == 0, write.stderr[-2000:]
    assert any(f.startswith("jit_run") for f in os.listdir(tmp_path))
    read = _repro(tmp_path, "--ordered", "--runs", "30")
    assert read.returncode == 0, read.stderr[-2000:]
    assert read.stdout.split()[:2] == write.stdout.split()[:2]  # "ok", the same loss
    fresh = subprocess.run([sys.executable, REPRO, "--ordered", "--runs", "1"],
                           capture_output=True, text=True, timeout=300,
                           env=cli_env(JAX_PLATFORMS="cpu"))
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.split()[:2] == read.stdout.split()[:2]


def _env_without_cache(**extra):
    env = cli_env(JAX_PLATFORMS="cpu", **extra)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="the CPU runtime's cache")
def test_fence_without_a_cache_directory_neither_analyses_nor_warns():
    """JAX calls its cache hooks with or without a cache directory; without one the fence
    passes them through: the unordered program is not analysed (nothing kept out) and
    nothing is said about a cache nobody asked for."""
    out = subprocess.run([sys.executable, REPRO, "--fence", "--runs", "1"],
                         capture_output=True, text=True, timeout=300, env=_env_without_cache())
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kept out of the cache: []" in out.stdout, out.stdout
    assert "CacheFenceWarning" not in out.stderr and "compilation cache" not in out.stderr


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="the CPU runtime's cache")
def test_main_command_says_nothing_of_a_cache(tmp_path):
    """The README's main command (the tiny preset, here 2 short steps and an evaluation),
    with no compilation cache configured: no cache warning on stderr."""
    out = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml",
                          "--workdir", str(tmp_path), "--no-progress", "steps=2",
                          "seq_len=128", "eval_every=2", "eval_batches=1",
                          "checkpoint_every=2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=_env_without_cache())
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CacheFenceWarning" not in out.stderr and "compilation cache" not in out.stderr, \
        out.stderr[-2000:]


@pytest.fixture
def keep_every_program(monkeypatch):
    """``keep_compiled`` on, for programs of any compile time, with this test's own store."""
    from collections import OrderedDict
    from ulysses_jax import compile_cache
    assert compile_cache.keep_compiled()
    monkeypatch.setattr(compile_cache, "_live", OrderedDict())
    least = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # tiny programs too
    try:
        yield compile_cache
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", least)


def test_kept_programs_compile_once_and_a_callback_stays_its_own(keep_every_program):
    """``keep_compiled`` (conftest installs it in every worker): a program built anew (a new
    closure, the same program, options and devices) is handed back from memory with the same
    results; a program with a host callback is compiled for each closure (the executable
    binds the callback it was compiled with), so each closure's own callback runs."""
    compile_cache = keep_every_program
    x = jnp.asarray(np.random.default_rng(3).standard_normal((24, 40)), jnp.float32)

    def build():
        return jax.jit(lambda v: jnp.tanh(v) @ v.T * 0.625 + 0.375)

    hits = compile_cache.kept_hits()
    first = build()(x)
    assert compile_cache.kept_hits() == hits
    again = build()(x)
    assert compile_cache.kept_hits() == hits + 1
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))

    def with_callback(scale):
        host = lambda v: np.asarray(v) * scale  # noqa: E731
        return jax.jit(lambda v: jax.pure_callback(
            host, jax.ShapeDtypeStruct(v.shape, v.dtype), v) + 1.0)

    hits = compile_cache.kept_hits()
    np.testing.assert_allclose(np.asarray(with_callback(2.0)(x)), np.asarray(x) * 2 + 1)
    np.testing.assert_allclose(np.asarray(with_callback(3.0)(x)), np.asarray(x) * 3 + 1)
    assert compile_cache.kept_hits() == hits


def test_kept_programs_give_way_before_the_process_runs_out_of_memory_maps(keep_every_program,
                                                                          monkeypatch):
    """Each XLA:CPU executable holds memory maps of its own; past Linux's limit a compile
    aborts. With the limit set just above the maps in use, a second program kept pushes out
    the first: built again, the first compiles anew and the second is handed back."""
    compile_cache = keep_every_program
    x = jnp.asarray(np.arange(48.0, dtype=np.float32).reshape(6, 8))
    compile_cache._live.clear()  # what making x compiled
    builds = (lambda: jax.jit(lambda v: jnp.cos(v) * 1.25 - v),
              lambda: jax.jit(lambda v: jnp.sin(v).T @ v * 0.75))
    builds[0]()(x)
    assert len(compile_cache._live) == 1
    limit = 2 * compile_cache._maps_in_use()  # the second program's maps go past half
    monkeypatch.setattr(compile_cache, "_map_limit", lambda: limit)
    builds[1]()(x)
    assert len(compile_cache._live) == 1
    hits = compile_cache.kept_hits()
    builds[1]()(x)
    assert compile_cache.kept_hits() == hits + 1
    builds[0]()(x)
    assert compile_cache.kept_hits() == hits + 1
