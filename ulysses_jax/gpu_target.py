"""Compiling for GPUs that are not here: XLA's GPU compiler on a deviceless topology.

``--target h100`` (also ``h200``, ``a100``) makes the dry run, the planner and the memory
benchmarks compile their programs for N GPUs of that kind on any machine where jax's CUDA
plugin is installed, GPU or not: jax builds compile-only devices from a target description
(``targets/<name>.txtpb``, XLA's ``GpuTargetConfigProto`` in text form, each file naming the
source of its numbers), and XLA's GPU compiler fuses, schedules and places buffers as it
would on the real devices. Memory comes from its compiled memory analysis (device and host
apart), the HLO shows the kernels and collectives a GPU would run.

What the deviceless compile needs, kept in this one place:
  - the plugin must start without a GPU: it checks the CUDA driver's version at start-up
    unless ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` is set (``prepare_plugin``, before JAX starts);
  - compile-only devices have no memory spaces (jaxlib lists none), so a program traced on
    them cannot place buffers in host memory (jax 0.12 refuses the optimizer-offload step's
    trace; jax 0.10 dropped the placement). ``compile`` therefore traces and lowers on this
    process's CPU devices for the "cuda" platform, whose memory kinds the program keeps, and
    hands that module to the topology's compiler for the target's devices. Generation has
    no host buffers and is compiled on the topology's devices directly;
  - jax's cuDNN attention asks the local GPU's compute capability while tracing
    (``jax._src.cudnn.fused_attention_stablehlo``), and jax offers no way to name another:
    ``compiling_for`` answers with the target's for the duration of the compile, and makes
    the kernel choice (``attention.kernels.device_facts``) see the target GPU;
  - the compile is the run's: the options are the jitted program's own (``jax.jit``'s
    ``compiler_options``, which a GPU run compiles with too: ``step_options``), XLA's stock
    pipeline with no pass turned off, and the process's ``XLA_FLAGS`` reach both alike.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import os
import re

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
           "jax_plugins.xla_cuda12")
# XLA's latency-hiding scheduler: it orders independent work so that collectives (the Ulysses
# all-to-alls, ZeRO-3's weight gathers) run under compute.
OVERLAP_OPTION = "xla_gpu_enable_latency_hiding_scheduler"
_DEVICES_PER_HOST = 8  # the topology's hosts hold 8 GPUs each, as HGX/DGX machines do


class TargetUnavailable(RuntimeError):
    """The target cannot be compiled for here (no CUDA plugin); the message says what to
    install."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    config_text: str       # GpuTargetConfigProto, text form
    device_kind: str       # "NVIDIA H100 80GB HBM3"
    memory_bytes: int      # device memory as CUDA reports it
    capability: tuple[int, int]


def step_options(overlap: bool) -> dict:
    """XLA options of a train step (``jax.jit``'s ``compiler_options``): what a GPU run and
    ``compile`` for a target both compile it with. ``overlap`` (the config's ``gpu_overlap``)
    turns the latency-hiding scheduler on, unless the process's ``XLA_FLAGS`` name it
    (the user's flags win). A CPU compile ignores the option."""
    if not overlap or OVERLAP_OPTION in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {OVERLAP_OPTION: True}


def names() -> list[str]:
    """The targets this package describes (``targets/*.txtpb``)."""
    return sorted(os.path.basename(p)[:-len(".txtpb")]
                  for p in glob.glob(os.path.join(TARGETS_DIR, "*.txtpb")))


def _field(text: str, pattern: str, what: str, name: str) -> str:
    m = re.search(pattern, text)
    if not m:
        raise ValueError(f"target file {name}.txtpb has no {what}")
    return m.group(1)


def load(name: str) -> Target:
    """The target called ``name`` (ValueError naming the known ones if there is none)."""
    path = os.path.join(TARGETS_DIR, f"{name}.txtpb")
    if not os.path.isfile(path):
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(names())}")
    text = open(path, encoding="utf-8").read()
    cap = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*(?:minor:\s*(\d+))?", text)
    if not cap:
        raise ValueError(f"target file {name}.txtpb has no cuda_compute_capability")
    return Target(name=name, config_text=text,
                  device_kind=_field(text, r'device_description_str:\s*"([^"]+)"',
                                     "device_description_str", name),
                  memory_bytes=int(_field(text, r"device_memory_size:\s*(\d+)",
                                          "device_memory_size", name)),
                  capability=(int(cap.group(1)), int(cap.group(2) or 0)))


def for_device_kind(kind: str) -> Target | None:
    """The target of a real GPU's ``device_kind`` ("NVIDIA H100 80GB HBM3" -> h100), or None
    for a kind no target file describes."""
    return next((load(n) for n in names() if n.upper() in kind.upper()), None)


def cuda_plugin_installed() -> bool:
    """Whether a jax CUDA plugin is importable (without importing it or JAX)."""
    for name in PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


def nvidia_gpu_present() -> bool:
    """Whether this machine shows an NVIDIA GPU to processes (its device files)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def prepare_plugin() -> None:
    """Lets an installed CUDA plugin start on a machine without a GPU (it refuses when it
    cannot query a driver), so that a target can be compiled for. Call before JAX starts;
    a machine with a GPU keeps the plugin's checks."""
    if cuda_plugin_installed() and not nvidia_gpu_present():
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


TESTED_JAX = "0.12.0.1"  # the jax these compiles are built and tested with (README)


def _jax_too_old() -> bool:
    import jax
    return tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11)


def install_hint() -> str:
    """The command that makes GPU targets compile in this environment."""
    import jax
    if _jax_too_old():
        return (f'python3.12 -m venv .venv && .venv/bin/pip install -r requirements.txt '
                f'"jax[cuda13]=={TESTED_JAX}" (jax 0.11 or newer, which needs Python 3.12; '
                f'this process has jax {jax.__version__})')
    return f'pip install "jax[cuda13]=={jax.__version__}"'


def devices(target: Target, n: int) -> list:
    """``n`` compile-only devices of ``target`` (hosts of 8, as one process sees them all)."""
    import jax
    from jax.experimental import topologies
    if n < 1:
        raise ValueError(f"a target needs a positive device count, got {n}")
    if not cuda_plugin_installed():
        raise TargetUnavailable(
            f"compiling for --target {target.name} needs jax's CUDA plugin, which is not "
            f"installed: {install_hint()} (no GPU needed)")
    if _jax_too_old():
        raise TargetUnavailable(
            f"compiling for --target {target.name} is built for jax 0.11 and newer (cuDNN's "
            f"packed attention with GQA, host memory kinds in the lowering): "
            f"{install_hint()}")
    hosts, per_host = ((n // _DEVICES_PER_HOST, _DEVICES_PER_HOST)
                       if n > _DEVICES_PER_HOST and n % _DEVICES_PER_HOST == 0 else (1, n))
    try:
        topology = topologies.get_topology_desc(
            target.name, "cuda", target_config=target.config_text,
            topology=f"1x{hosts}x{per_host}")
    except (NotImplementedError, RuntimeError, jax.errors.JaxRuntimeError) as e:
        raise TargetUnavailable(
            f"jax's CUDA plugin could not describe {n} x {target.device_kind} ({e}); "
            f"JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 must be set before JAX starts on a machine "
            f"without a GPU (gpu_target.prepare_plugin), and the plugin must match jax: "
            f"{install_hint()}") from None
    return list(topology.devices)


def capability_of(device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device, real or compile-only."""
    cap = getattr(device, "compute_capability", None)
    if not cap:
        return None
    major, minor = str(cap).split(".")[:2]
    return int(major), int(minor)


@contextlib.contextmanager
def compiling_for(target: Target):
    """Traces and compiles inside see ``target``: jax's cuDNN checks answer with its compute
    capability, and the attention kernels are chosen for it (module docstring)."""
    from jax._src.cudnn import fused_attention_stablehlo as fused
    from .attention import kernels

    def at_least(capability: str) -> bool:
        return target.capability >= tuple(int(x) for x in capability.split("."))

    def equal(capability: str) -> bool:
        return target.capability == tuple(int(x) for x in capability.split("."))

    saved = (fused.check_compute_capability, fused.is_cuda_compute_capability_equal,
             kernels.COMPILING_FOR)
    fused.check_compute_capability, fused.is_cuda_compute_capability_equal = at_least, equal
    kernels.COMPILING_FOR = ("gpu", target.capability)
    try:
        yield target
    finally:
        (fused.check_compute_capability, fused.is_cuda_compute_capability_equal,
         kernels.COMPILING_FOR) = saved


class Compiled:
    """A program XLA's GPU compiler built for a target, with the readings the dry run and the
    tests take from jax's own compiled objects: ``memory_analysis()`` (device and host
    apart), ``as_text()`` (the optimized HLO) and ``cost_analysis()`` (None: XLA gives no
    cost analysis without a device); ``options``: the XLA options it was compiled with."""

    def __init__(self, executable, target: Target, n: int, options: dict):
        self._executable, self.target, self.num_devices = executable, target, n
        self.options = options

    def memory_analysis(self):
        return self._executable.get_compiled_memory_stats()

    def as_text(self) -> str:
        return "\n\n".join(m.to_string() for m in self._executable.hlo_modules())

    def cost_analysis(self):
        return None


def compile(jitted, args: tuple, target: Target) -> Compiled:
    """``jitted(*args)`` (a ``jax.jit`` function and abstract arguments laid out on a mesh of
    this process's CPU devices) compiled by XLA's GPU compiler for as many ``target`` GPUs
    as the mesh has, with the options ``jitted`` carries and nothing else (a GPU run's
    compile); memory kinds (host offload) kept (module docstring)."""
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client as xc
    with compiling_for(target):
        lowering = jitted.trace(*args).lower(lowering_platforms=("cuda",))._lowering
        ca = lowering.compile_args
        gpus = devices(target, ca["num_devices"])
        client = gpus[0].client
        allow_in, allow_out = pxla.get_prop_to_input_output(
            ca["in_shardings"], ca["out_shardings"], len(ca["ordered_effects"]))
        kvs = dict(lowering._compiler_options_kvs)
        options = pxla.create_compile_options(
            lowering.stablehlo(), ca["tuple_args"], allow_in, allow_out, client,
            np.array(gpus, dtype=object), kvs)
        executable = compiler.backend_compile_and_load(
            client, lowering.stablehlo(), xc.DeviceList(tuple(gpus)), options, [])
    return Compiled(executable, target, len(gpus), kvs)
