"""Start-up shared by the benchmark scripts; import it before anything imports JAX.

Puts the repository on ``sys.path`` (the scripts run from anywhere), asks for 8 fake CPU
devices before JAX starts, lets an installed CUDA plugin start without a GPU (``--target``),
and spells the command line recorded in each results file.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ulysses_jax import gpu_target  # noqa: E402
from ulysses_jax.mesh import request_cpu_devices  # noqa: E402

request_cpu_devices(8)
gpu_target.prepare_plugin()  # (a no-op without jax's CUDA plugin, or with a GPU present)


def ints(text: str) -> list[int]:
    """'8192,1024,8192' -> [1024, 8192]: a comma-separated command-line list, sorted, unique."""
    return sorted({int(x) for x in text.split(",") if x.strip()})


def command_line(script: str, argv=None) -> str:
    """The command as typed from the repository root, for the results file."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", f"benchmarks/{Path(script).name}", *args])


def write_results(out_dir: str, name: str, result: dict) -> str:
    """Writes ``result`` as ``out_dir/name`` (JSON, made if missing), says so; the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return path


def add_target(ap) -> None:
    """The ``--target`` option of the benchmarks that report memory."""
    ap.add_argument("--target", choices=gpu_target.names(), default=None,
                    help="compile with XLA's GPU compiler for that many GPUs of this kind, "
                         "without one (jax >= 0.11 and its CUDA plugin); results go to "
                         "NAME_<target>.json beside the CPU compiler's")


def require_target(target: str | None) -> None:
    """Exits 2 with the install command where ``target`` cannot be compiled for here."""
    if target is None:
        return
    try:
        gpu_target.devices(gpu_target.load(target), 1)
    except gpu_target.TargetUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def target_name(name: str, target: str | None) -> str:
    """'x.json' -> 'x_h100.json' with a target: the two compilers' results side by side."""
    if not target:
        return name
    stem, ext = os.path.splitext(name)
    return f"{stem}_{target}{ext}"


def compiled_on(target: str | None) -> str:
    """What compiled the results, for their files: this machine's fake CPU devices or XLA's
    GPU compiler for ``target``."""
    what = f"XLA's GPU compiler for {target}, no GPU" if target else "fake devices"
    return f"{platform.machine()}, {os.cpu_count()} CPUs ({what})"
