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
# compile 0.80 CPU s instead of 0.84 (benchmarks/program_cost.py mesh.seq=4, two runs each).
# The op names stay (the dry run's memory categories and the HLO checks read
# them): JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS=0 would drop them with the stacks.
# Subprocesses inherit it (``cli_env``).
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# The directory of the compilation cache the pytest workers and their CLIs share, when the
# suite runs with one (conftest.py).
CACHE_ENV = "ULYSSES_TEST_COMPILE_CACHE_DIR"


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
    if CACHE_ENV in os.environ:
        env.update(JAX_COMPILATION_CACHE_DIR=os.environ[CACHE_ENV],
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.3")
    env.update(extra)
    if DEVICES[0].platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    return env
