"""pytest's side of the suite: the garbage collector's settings, an optional shared
compilation cache, the scheduling of test files onto pytest-xdist workers, and the fixtures
that several test files share. The test devices and JAX's settings for them are
tests/utils/devices.py's, imported first: they must be in place before JAX starts."""
from tests.utils.devices import CACHE_ENV, DEVICES

import gc
import os
import shutil
import tempfile

import jax
import pytest

# Python's cyclic garbage collector, set for a process that traces thousands of programs:
# what the imports made is frozen (never scanned again), and the youngest generation is
# collected after 50,000 new objects instead of 700. Tracing makes and drops objects by the
# hundred thousand, so the default thresholds run a collection every few milliseconds, and
# each full one walks every object the worker holds. test_qwen3_next.py in one process:
# 4.85 s in the collector with the defaults, 0.97 s with these, of 70 s.
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 20, 20)

# Every CPU program a worker compiles in 0.1 s or more is kept in memory under JAX's cache
# key and handed back when a test builds the same program again (a new closure, the same
# config and mesh: the references that several tests train, the steps a test file repeats
# across its parameters): ulysses_jax.compile_cache.keep_compiled. Nothing is serialized, so
# nothing the cache fence guards against can happen. The suite's programs are mostly distinct:
# on jax 0.12.0.1 it saved about 4% (4,129 s of test time against 4,308 without, 2026-12-07;
# docs/PERF.md, "The test suite"). No persistent cache by default: on
# jaxlib 0.10 writing each executable and the fence's analysis of it cost more than the few
# programs read back saved (18 min 1 s of pytest with the shared cache, 15 min 50 s without).
# ULYSSES_TEST_COMPILE_CACHE=1 shares one between the pytest-xdist workers and the CLIs they
# start (``cli_env``), fenced as a user's is (train.py --dry-run and the planner turn it off
# while they read XLA's dump of their own compile).
from ulysses_jax.compile_cache import keep_compiled  # noqa: E402 (after the device settings)

jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
keep_compiled()
if os.environ.get("ULYSSES_TEST_COMPILE_CACHE", "0") not in ("", "0"):
    if CACHE_ENV not in os.environ:
        os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="ulysses-jax-test-cache-")
        _OWN_CACHE = True
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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
    Only the queue's order is ours: each worker's collection stays as it collected it (xdist
    sends a worker the positions of its tests in its own collection, and compares a
    restarted worker's collection with the first one). Another ``--dist`` given on the
    command line is xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _SCOPE_OF_FILE.get(path, path)

        def schedule(self) -> None:
            if self.collection is not None or not self._check_nodes_have_same_collection():
                return super().schedule()  # a worker added later; or xdist's own refusal
            self.collection = list(next(iter(self.registered_collections.values())))
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            first = lambda scope: (_LONGEST_FIRST.index(scope) if scope in _LONGEST_FIRST  # noqa: E731
                                   else len(_LONGEST_FIRST), -len(units[scope]))
            for scope in sorted(units, key=first):
                self.workqueue[scope] = units[scope]
            for node in self.nodes:
                if self.workqueue:
                    self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)

    return FileScheduling(config, log)


# The scheduling units of the most test seconds, longest first (per-file sums of
# ``--durations=0`` on the 2-core machine, jax 0.12.0.1); only the order units are handed out
# reads it.
_LONGEST_FIRST = ("tests/test_dpo.py", "tests/test_accumulate.py", "tests/test_grpo_train.py",
                  "tests/test_real_checkpoint.py", "tests/test_cacheable.py",
                  "tests/test_model.py", "tests/test_gpu_compile.py", "tests/test_lora.py",
                  "tests/test_train.py", "tests/test_generate.py", "tests/test_fit.py",
                  "tests/test_ring.py", "tests/test_faults.py", "tests/test_qwen3_next.py",
                  "tests/test_qwen2_5_vl.py", "tests/test_ulysses.py", "tests/test_offload.py")


# The compatibility set: the tests README's command also runs on Python 3.11 with jax 0.10.2
# (``-m compat``), the last jax that Python has, which requirements.txt installs there. They
# hold what differs between the two jax versions the package supports: what the
# compilation-cache fence keeps out (what XLA:CPU compiles, and how jaxlib serializes it,
# differ), host computations (``compute_on`` is a context manager on 0.10, a function wrapper
# from 0.11), the Ulysses exchange itself, and the layer order.
COMPAT = ("tests/test_compile_cache.py", "tests/test_cacheable.py", "tests/test_host_compute.py",
          "tests/test_offload.py", "tests/test_ulysses.py", "tests/test_imports.py")


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 (pytest's hook signature)
    for item in items:
        if item.nodeid.split("::", 1)[0] in COMPAT:
            item.add_marker(pytest.mark.compat)


def pytest_collection_finish(session):  # noqa: ARG001 (pytest's hook signature)
    """What the test modules imported at collection (flax, the package, transformers) is
    frozen too."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """The controller (or a run without workers) removes the cache it made."""
    if globals().get("_OWN_CACHE") and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(CACHE_ENV), ignore_errors=True)


@pytest.fixture(scope="session")
def devices():
    return DEVICES


@pytest.fixture(scope="session")
def chat_store_run(tmp_path_factory):
    """(run dir, chat token store, its tokenizer directory): a tiny model trained 2 steps
    (seq_len 128, mesh.seq=2) from a chat store prepared with a small BPE tokenizer (ChatML
    template) and data.tokenizer unset, as docs/DATA.md allows; 20% of the conversations held
    out; a checkpoint and an eval (1 batch of 2 rows) at step 2. For evaluate and export."""
    from tests.test_store_train import _cfg, _chat_store
    from ulysses_jax.training.trainer import train
    tmp = tmp_path_factory.mktemp("chat_store_run")
    store, tok_dir = _chat_store(tmp)
    cfg = _cfg(store, "seq_len=128", "steps=2", "mesh.seq=2", "mesh.data=1", "eval_every=2",
               "checkpoint_every=2", "data.heldout_fraction=0.2", "log_tensorboard=false")
    assert cfg.data.tokenizer is None
    train(cfg, str(tmp / "run"), progress=False)
    return str(tmp / "run"), store, tok_dir
