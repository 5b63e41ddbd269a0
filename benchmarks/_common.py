"""Start-up shared by the benchmark scripts; import it before anything imports JAX.

Puts the repository on ``sys.path`` (the scripts run from anywhere), asks for 8 fake CPU
devices before JAX starts, and spells the command line recorded in each results file.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ulysses_jax.mesh import request_cpu_devices  # noqa: E402

request_cpu_devices(8)


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
