"""Host memory a run on CPU devices will hold, compared with what the machine has before
anything is allocated.

On CPU devices every device's arrays live in the same RAM, so a replicated parameter costs
one copy per device there: a few-hundred-million-parameter checkpoint replicated on 4 fake
devices is killed by the OS (exit -9, nothing printed) where ``param_sharding=zero3``
trained. The trainer calls ``check`` before it builds the train state; a run that cannot fit
raises ``ConfigError`` naming the numbers and the settings that help.

What is counted, summed over this process's devices from the train state's abstract layout
(``train_step.state_layout``: each array's shard shape on each device, nothing allocated;
processes that share a machine each compare their own share with all of its memory):

  - parameters and optimizer state (AdamW's moments in ``optimizer.moment_dtype``), as
    their shardings lay them out: replicated = one copy per device, zero3 = one in all;
  - gradients: float32, laid out like the parameters; with ``grad_accum_steps`` > 1 also the
    float32 accumulator;
  - activations, a lower bound: the input of every layer, ``n_layers x B x S x D`` values in
    ``model.dtype`` per optimizer micro-batch (what ``model.remat=full`` keeps); the rest of a
    layer's activations, the loss's chunk, zero3's gathered weights, the optimizer's
    temporaries and XLA's workspace are not counted (``benchmarks/host_memory.py`` measures
    what a run adds: 1.7x the estimate replicated, 3.1x with zero3, on a 31M model);
  - a checkpoint save: Orbax copies one replica of the state off the devices and writes it
    in the background, while the next steps run;
  - at start-up with ``init_from``: the imported parameters (laid out like the state's, alive
    while the state is built from them: ``jit`` copies them) and the largest checkpoint tensor
    in numpy.

The estimate is the largest of three phases: start-up, a training step, the final save.
Each sum is what the run holds at least, so a refusal is a run that cannot fit; one that
passes may still run out (the uncounted activations). Available memory is ``MemAvailable``
of ``/proc/meminfo`` (else ``os.sysconf``), lowered to a cgroup v2 limit's headroom when one
is set; ``ULYSSES_MEMORY_BUDGET`` (a size) replaces it. ``ULYSSES_SKIP_HOST_MEMORY_CHECK=1``
skips the check. After it, the trainer holds the compiled step against the same memory
(``fit.py``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

import jax
import numpy as np

from ..config import Config, ConfigError, rows_per_batch
from ..models import lora
from .train_step import state_layout

SKIP_ENV = "ULYSSES_SKIP_HOST_MEMORY_CHECK"
# Replaces the memory the checks read (the host's here and in fit.py; each GPU's there).
BUDGET_ENV = "ULYSSES_MEMORY_BUDGET"
GiB = 2**30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"3GiB"``, ``"500 MB"``, ``"123456"`` -> bytes; ValueError for anything else."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not found or found.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (bytes, or a number with KB, MB, GB, KiB, "
                         f"MiB or GiB)")
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])


def budget_override() -> int | None:
    """``ULYSSES_MEMORY_BUDGET`` in bytes, or None when unset; ConfigError when it is not a
    size."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ConfigError(f"{BUDGET_ENV}: {e}") from None


@dataclasses.dataclass(frozen=True)
class HostEstimate:
    """Bytes a run holds in host memory (this process's devices), by phase and part."""
    phases: dict[str, dict[str, int]]  # "start-up" / "training" / "final save" -> part -> bytes
    params: int                         # parameter count
    devices: int                        # this process's devices in the mesh

    @property
    def peak(self) -> tuple[str, int]:
        """(the phase that holds the most, its bytes)."""
        name = max(self.phases, key=lambda k: sum(self.phases[k].values()))
        return name, sum(self.phases[name].values())


def _bytes(tree) -> int:
    """Bytes of ``tree``'s abstract arrays over the devices of this process that hold them."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = x.sharding
        shard = math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        total += shard * len(sharding.addressable_devices)
    return total


def shard_bytes(tree) -> int:
    """Bytes of ``tree``'s abstract arrays on one device (the first shard's shape)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def global_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def estimate(cfg: Config, mesh, reads_init_from: bool = False) -> HostEstimate:
    """What the run of ``cfg`` on ``mesh`` holds in host memory if its devices are CPUs.

    Args:
      cfg: the run's config (init_from already resolved: the model is the checkpoint's).
      mesh: the run's mesh.
      reads_init_from: the state is built from ``cfg.init_from`` (not resumed).
    Returns:
      A HostEstimate; module docstring for what each part counts.
    """
    _, abstract, _, _ = state_layout(cfg, mesh)
    params, opt = abstract["params"], abstract["opt_state"]
    local = len(mesh.local_devices)
    fraction = local / mesh.devices.size  # this process's share of what exists once
    state = {"parameters": _bytes(params), "optimizer state": _bytes(opt)}
    # float32 gradients of the trained parameters (all of them, or LoRA's: model.lora)
    grads = _bytes(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32,
                                                               sharding=x.sharding),
                                lora.trainable_params(params, cfg.model.lora)))
    save = {"checkpoint save": int(global_bytes([params, opt]) * fraction)}
    m = cfg.model
    # of a micro-batch, all devices (DPO: two sequences per pair)
    tokens = rows_per_batch(cfg) // cfg.grad_accum_steps * cfg.seq_len
    training = dict(state, gradients=grads)
    if cfg.grad_accum_steps > 1:
        training["gradient accumulator"] = grads
    training["activations"] = int(m.n_layers * tokens * m.d_model
                                  * np.dtype(m.dtype).itemsize * fraction)
    if 0 < cfg.checkpoint_every < cfg.steps:  # the write of one overlaps the next steps
        training.update(save)
    start = dict(state)
    if reads_init_from:
        start["init_from copy"] = _bytes(params)
        start["init_from tensor"] = max((global_bytes(x) for x in jax.tree.leaves(params)),
                                        default=0)
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    return HostEstimate({"start-up": start, "training": training, "final save": state | save},
                        params=n, devices=local)


def available_bytes(meminfo: str = "/proc/meminfo",
                    cgroup: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """(bytes this process can still allocate, where the number comes from), or None if
    unknown: ``MemAvailable`` of ``meminfo`` (else ``os.sysconf``'s available pages), lowered
    to ``memory.max - memory.current`` of a cgroup v2 directory that sets a limit."""
    found = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = (int(line.split()[1]) * 1024, f"MemAvailable in {meminfo}")
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            found = (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                     "os.sysconf's available pages")
        except (ValueError, OSError, AttributeError):
            pass
    try:
        with open(os.path.join(cgroup, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(cgroup, "memory.current")) as f:
            used = int(f.read().strip())
        if limit != "max" and (found is None or int(limit) - used < found[0]):
            found = (max(int(limit) - used, 0), f"the cgroup limit {cgroup}/memory.max less "
                                                f"memory.current")
    except (OSError, ValueError):
        pass
    return found


def _gib(n: int) -> str:
    """Bytes as GiB, or MiB below a tenth of one."""
    return f"{n / GiB:.1f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


def check(cfg: Config, mesh, reads_init_from: bool = False,
          available: tuple[int, str] | None = None) -> HostEstimate | None:
    """Raises ConfigError when the run on CPU devices cannot fit in host memory.

    Args:
      cfg, mesh, reads_init_from: as for ``estimate``.
      available: (bytes, source) to compare with; default ``available_bytes()``.
    Returns:
      The estimate, or None when not checked (devices that are not CPUs, available memory
      unknown, or ``ULYSSES_SKIP_HOST_MEMORY_CHECK=1``).
    Raises:
      ConfigError: the estimate is larger than the available memory; the message names
        both, the parts, and what each helpful setting would need.
    """
    if (os.environ.get(SKIP_ENV, "0") not in ("", "0")
            or mesh.devices.flat[0].platform != "cpu"):
        return None
    if available is None and budget_override() is not None:
        available = (budget_override(), f"{BUDGET_ENV}={os.environ[BUDGET_ENV].strip()}")
    available = available or available_bytes()
    if available is None:
        return None
    est = estimate(cfg, mesh, reads_init_from)
    phase, need = est.peak
    if need <= available[0]:
        return est
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in est.phases[phase].items() if v)
    raise ConfigError(
        f"not enough host memory: on its {est.devices} CPU devices (whose arrays all live in "
        f"this machine's RAM) this run of {est.params / 1e6:,.1f}M parameters would hold at "
        f"least {_gib(need)} ({phase}: {parts}), but {_gib(available[0])} is available "
        f"({available[1]}). {_remedies(cfg, mesh, est, reads_init_from, available[0])}; "
        f"docs/MEMORY.md says what is counted. To start anyway, set {SKIP_ENV}=1")


def _remedies(cfg: Config, mesh, est: HostEstimate, reads_init_from: bool,
              available: int) -> str:
    """What each setting that cuts the fixed part would need (the same lower bound), and
    whether that is under ``available``."""
    n = est.devices
    options = []
    if cfg.param_sharding == "replicated" and mesh.devices.size > 1:
        options.append((f"param_sharding=zero3 (one copy of the parameters, gradients and "
                        f"optimizer state over the {mesh.devices.size} devices instead of one "
                        f"on each)", {"param_sharding": "zero3"}))
    if cfg.optimizer.moment_dtype == "float32":
        options.append(("optimizer.moment_dtype=bfloat16 (AdamW's moments in half the bytes)",
                        {"moment_dtype": "bfloat16"}))
    if len(options) == 2:
        options.append(("both", {"param_sharding": "zero3", "moment_dtype": "bfloat16"}))
    lines = []
    for text, change in options:
        other = dataclasses.replace(
            cfg, param_sharding=change.get("param_sharding", cfg.param_sharding),
            optimizer=dataclasses.replace(cfg.optimizer, moment_dtype=change.get(
                "moment_dtype", cfg.optimizer.moment_dtype)))
        need = estimate(other, mesh, reads_init_from).peak[1]
        lines.append(f"{text}: at least {_gib(need)}"
                     f"{' (under what is available)' if need <= available else ' (still over)'}")
    if cfg.param_sharding == "replicated" and n > 1:
        state = est.phases["training"]
        per = (state["parameters"] + state["optimizer state"] + state["gradients"]) // n
        lines.append(f"fewer devices (mesh.data x mesh.ring x mesh.seq = {mesh.devices.size} "
                     f"now): each holds its own {_gib(per)} of parameters, gradients and "
                     f"optimizer state")
    acts = est.phases["training"]["activations"]
    if acts * 4 >= est.peak[1]:  # a quarter or more: the batch is what to cut
        seqs = rows_per_batch(cfg) // cfg.grad_accum_steps
        lines.append(f"activations ({_gib(acts)} for {seqs} "
                     f"sequences of {cfg.seq_len} tokens at a time): a larger grad_accum_steps "
                     f"or a smaller batch_size or seq_len")
    return "What helps: " + "; ".join(lines) if lines else (
        "Nothing in the config cuts this: use a machine with more memory or a smaller model")
