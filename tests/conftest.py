"""Test devices: 8 fake CPU devices, or the real GPUs when at least two are visible.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time.

With exactly one GPU the suite runs on the 8 CPU devices, exactly as on a machine without a
GPU (same devices, same tolerances): the CPU becomes JAX's default device, so arrays made
without a sharding (the references) stay on the CPU, and the trainer picks its devices from
there too. Only the GPU tests (``gpu_devices``) use the GPU. Subprocesses that must see the
same devices get ``cli_env()``.
"""
import glob
import importlib.metadata
import os

# Without a GPU the tests are CPU programs at tiny sizes, where compiling costs far more than
# running. LLVM's optimisations are off (JAX_DISABLE_MOST_OPTIMIZATIONS, which JAX applies to
# each compile as XLA's backend optimisation level 0, so that the tests running the real 135M
# model can turn it back on for theirs: test_real_checkpoint.py); XLA's HLO passes still run,
# so the programs keep their collectives and their memory. Each program's machine code stays
# in one LLVM module instead of being split for parallel codegen threads, which on two cores
# that the two pytest workers already keep busy only add work; the HLO is untouched.
# On jaxlib 0.10 a second setting halves what is left: XLA:CPU's older loop emitters in place
# of its MLIR fusion emitters (the tiny preset's dry run: the same collectives, a peak 192
# bytes apart in 34.6 MB). jaxlib 0.11 removed that choice and compiles the tiny train step in
# 3.0-4.7 CPU s where 0.10.2 took 0.8-0.95 (benchmarks/program_cost.py), which is why the
# CPU suite runs on Python 3.11 and jax 0.10.2 (README) and the GPU-compile tests on 0.12.
# A GPU is there when its device files are (ulysses_jax.gpu_target.nvidia_gpu_present; that
# package imports JAX, which must come after these settings). Without one, jax's CUDA plugin,
# installed for the GPU-compile tests, must be told not to look for a driver
# (gpu_target.prepare_plugin).
_GPU_HERE = bool(glob.glob("/dev/nvidia[0-9]*"))
LOOP_EMITTERS = (not _GPU_HERE and tuple(
    int(v) for v in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11))
_CPU_TEST_FLAGS = "--xla_force_host_platform_device_count=8"
if not _GPU_HERE:
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    _CPU_TEST_FLAGS += " --xla_cpu_parallel_codegen_split_count=1"
    if LOOP_EMITTERS:
        _CPU_TEST_FLAGS += " --xla_cpu_use_fusion_emitters=false"
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # subprocesses inherit it
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _CPU_TEST_FLAGS).strip()
# No Python call stacks in the programs' locations: JAX 0.10 writes up to 100 frames of each
# operation's traceback into its MLIR location, which XLA carries through every pass. With
# none, the tiny train step's compiled HLO is 797,276 characters instead of 926,418 and its
# compile 0.80 CPU s instead of 0.84 (benchmarks/program_cost.py mesh.seq=4, two runs each,
# 2026-12-04). The op names stay (the dry run's memory categories and the HLO checks read
# them): JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS=0 would drop them with the stacks.
# Subprocesses inherit it (``cli_env``).
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

# Python's cyclic garbage collector, set for a process that traces thousands of programs:
# what the imports made is frozen (never scanned again), and the youngest generation is
# collected after 50,000 new objects instead of 700. Tracing makes and drops objects by the
# hundred thousand, so the default thresholds run a collection every few milliseconds, and
# each full one walks every object the worker holds. test_qwen3_next.py in one process
# (2026-12-04): 4.85 s in the collector with the defaults, 0.97 s with these, of 70 s.
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 20, 20)

# No persistent compilation cache by default. The tests build distinct programs (of the 459
# train, evaluation and init programs a full run builds, 50 repeat a config and mesh already
# built in their worker), so a cache mostly writes: serialising each executable and the
# fence's analysis of it cost more than the few programs read back save (the full suite on
# the 2-core machine, 2026-12-03: 18 min 1 s of pytest with the shared cache, 15 min 50 s
# without; docs/PERF.md, "The test suite"). ULYSSES_TEST_COMPILE_CACHE=1 shares one cache between
# the pytest-xdist workers and the CLIs they start (``cli_env``), fenced as a user's is
# (train.py --dry-run and the planner turn it off while they read XLA's dump of their own
# compile).
_CACHE_ENV = "ULYSSES_TEST_COMPILE_CACHE_DIR"
if os.environ.get("ULYSSES_TEST_COMPILE_CACHE", "0") not in ("", "0"):
    if _CACHE_ENV not in os.environ:
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="ulysses-jax-test-cache-")
        _OWN_CACHE = True
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # Programs whose loop collectives a read-back executable would not order (deadlocks and
    # crashes, ulysses_jax/compile_cache.py; every train step) are compiled fresh instead,
    # once per worker (the fence keeps each in memory), and not named at exit.
    from ulysses_jax.compile_cache import fence
    fence(warn=False)


# Test files whose tests share a session fixture with another file's: one scheduling unit.
_SCOPE_OF_FILE = {"tests/test_real_dpo.py": "tests/test_real_checkpoint.py",
                  "tests/test_real_grpo.py": "tests/test_real_checkpoint.py"}


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist hands out whole test files (``--dist loadfile``), the three files of the
    real checkpoint as one, so each module- or session-scoped fixture is built once in one
    worker, and a file's tests reuse the programs it compiled. With xdist's default
    distribution a file's tests land on both workers and both build its fixtures
    (test_lora's trained runs, 15 s, twice), or one waits on the other's lock (the real
    checkpoint's conversion). The longest units go first (``_LONGEST_FIRST``), then the rest
    by their number of tests, so that no long file starts last and leaves a worker idle.
    Another ``--dist`` given on the command line is xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _SCOPE_OF_FILE.get(path, path)

        def schedule(self) -> None:
            if self.collection is None and self.registered_collections:
                counts: dict[str, int] = {}
                for nodeid in next(iter(self.registered_collections.values())):
                    scope = self._split_scope(nodeid)
                    counts[scope] = counts.get(scope, 0) + 1
                rank = {scope: (_LONGEST_FIRST.index(scope) if scope in _LONGEST_FIRST
                                else len(_LONGEST_FIRST), -n) for scope, n in counts.items()}
                for node, collection in self.registered_collections.items():
                    self.registered_collections[node] = sorted(
                        collection, key=lambda nodeid: rank[self._split_scope(nodeid)])
                self.config.option.loadscopereorder = False  # the order above stands
            super().schedule()

    return FileScheduling(config, log)


# The scheduling units of the most test seconds, longest first (per-file sums of
# ``--durations=0`` on the 2-core machine); only the order units are handed out reads it.
_LONGEST_FIRST = ("tests/test_real_checkpoint.py", "tests/test_cacheable.py",
                  "tests/test_grpo_train.py", "tests/test_accumulate.py", "tests/test_model.py",
                  "tests/test_train.py", "tests/test_lora.py", "tests/test_dpo.py",
                  "tests/test_offload.py", "tests/test_ring.py", "tests/test_faults.py",
                  "tests/test_qwen3_next.py")


def pytest_collection_finish(session):  # noqa: ARG001 (pytest's hook signature)
    """What the test modules imported at collection (flax, the package, transformers) is
    frozen too."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """The controller (or a run without workers) removes the cache it made."""
    if globals().get("_OWN_CACHE") and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpus()


def _test_devices():
    if GPUS:
        # fp32 comparisons need true fp32 matmuls, not TF32 (the GPU default).
        jax.config.update("jax_default_matmul_precision", "highest")
    if len(GPUS) >= 2:
        return GPUS
    cpus = jax.devices("cpu")
    if GPUS:
        jax.config.update("jax_default_device", cpus[0])
    return cpus


DEVICES = _test_devices()


@pytest.fixture(scope="session")
def devices():
    return DEVICES


def need_devices(n: int):
    """Skips the calling test when fewer than ``n`` test devices exist."""
    if len(DEVICES) < n:
        pytest.skip(f"needs {n} devices, only {len(DEVICES)} {DEVICES[0].platform} devices visible")
    return DEVICES[:n]


def gpu_devices(n: int = 1):
    """The first ``n`` GPUs, for the tests of GPU-only kernels; skips without them."""
    if len(GPUS) < n:
        pytest.skip(f"needs {n} GPU(s), {len(GPUS)} visible")
    return GPUS[:n]


def cli_env(devices: int = 8, **extra) -> dict:
    """Environment for a subprocess (train.py, ...) that must use the test devices: ``devices``
    CPU devices (8, or fewer for each process of a multi-process run) with the suite's
    code-generation settings, and on a one-GPU host no GPU (JAX_PLATFORMS=cpu)."""
    env = dict(os.environ, XLA_FLAGS=_CPU_TEST_FLAGS.replace(
        "device_count=8", f"device_count={devices}"))
    if _CACHE_ENV in os.environ:
        env.update(JAX_COMPILATION_CACHE_DIR=os.environ[_CACHE_ENV],
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.3")
    env.update(extra)
    if DEVICES[0].platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    return env


def tolerance(dtype) -> float:
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2


def small_corpus(path, n=16, chars=3000):
    """n text files cut from stdlib modules: a corpus that loads and tokenizes in a moment
    (the whole stdlib takes seconds per tokenizer and sequence length)."""
    import glob
    os.makedirs(path, exist_ok=True)
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:n]
    for f in files:
        with open(f, encoding="utf-8") as src, open(os.path.join(
                path, os.path.basename(f)[:-3] + ".txt"), "w", encoding="utf-8") as dst:
            dst.write(src.read(chars))
    return str(path)


@pytest.fixture(scope="session")
def chat_store_run(tmp_path_factory):
    """(run dir, chat token store, its tokenizer directory): a tiny model trained 2 steps
    (seq_len 128, mesh.seq=2) from a chat store prepared with a small BPE tokenizer (ChatML
    template) and data.tokenizer unset, as docs/DATA.md allows; 20% of the conversations held
    out; a checkpoint and an eval (1 batch of 2 rows) at step 2. For evaluate and export."""
    from test_store_train import _cfg, _chat_store
    from ulysses_jax.training.trainer import train
    tmp = tmp_path_factory.mktemp("chat_store_run")
    store, tok_dir = _chat_store(tmp)
    cfg = _cfg(store, "seq_len=128", "steps=2", "mesh.seq=2", "mesh.data=1", "eval_every=2",
               "checkpoint_every=2", "data.heldout_fraction=0.2", "log_tensorboard=false")
    assert cfg.data.tokenizer is None
    train(cfg, str(tmp / "run"), progress=False)
    return str(tmp / "run"), store, tok_dir


def relocated_store_run(run, store, tok_dir, dest):
    """A copy under ``dest`` of a store run (``chat_store_run``) whose config.yaml names a
    copy of its store, whose manifest records a copy of the tokenizer directory: tests change
    or remove the copied tokenizer files. The checkpoints are a link to the run's.

    Returns:
      (run copy, store copy, tokenizer directory copy), paths.
    """
    import json
    dest = str(dest)
    new_tok, new_store, new_run = (os.path.join(dest, d) for d in ("tok", "store", "run"))
    shutil.copytree(tok_dir, new_tok)
    shutil.copytree(store, new_store)
    with open(os.path.join(new_store, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["tokenizer"]["path"] == os.path.abspath(tok_dir)
    manifest["tokenizer"]["path"] = new_tok
    with open(os.path.join(new_store, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    os.makedirs(new_run)
    os.symlink(os.path.join(run, "checkpoints"), os.path.join(new_run, "checkpoints"))
    with open(os.path.join(run, "config.yaml")) as f:
        text = f.read()
    assert f"source: {store}\n" in text
    with open(os.path.join(new_run, "config.yaml"), "w") as f:
        f.write(text.replace(f"source: {store}\n", f"source: {new_store}\n"))
    return new_run, new_store, new_tok
