"""Where the test suite's time goes: tracing, lowering and XLA compiles against the rest.

    python benchmarks/suite_profile.py [--out DIR] [PYTEST ARGS ...]

Runs pytest (default: ``-n 2 tests``) with this file loaded as a plugin in every worker. The
plugin listens to JAX's monitoring events for each test (in the test's own process: the
CLIs a test starts as subprocesses are not seen) and records its wall time, CPU time, the
seconds spent tracing to jaxprs, lowering to MLIR and compiling with XLA (in all, and per
jitted function name), the counts of compiles and of persistent compilation-cache hits and
misses, and the CPU time of the subprocesses it waited for (their own compiles and runs, not
broken down). At the end it prints the totals, a table per test file, the tests that compile
longest and the jitted functions (by name, over every test) whose programs cost most to
build, and writes every test's record and the per-name totals to
``DIR/suite_profile.json`` (default: benchmarks/results/).

Compare figures of one run only: the 2-core machine is shared and noisy.
"""
from __future__ import annotations

import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"
HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"
_DIR_ENV = "SUITE_PROFILE_DIR"

# ---- the plugin (loaded by pytest in each worker with -p suite_profile) --------------------

_now: collections.Counter = collections.Counter()
_now_by_name: collections.Counter = collections.Counter()  # this test's seconds per name
_records: list[dict] = []
_by_name: dict = {}  # the jitted function's name -> {event: seconds, "n": compiles}


def _on_duration(event, duration, fun_name=None, **_):
    _now[event] += duration
    _now["n " + event] += 1
    if fun_name is not None and event in (TRACE, LOWER, COMPILE):
        name = str(fun_name)  # lowering and compiling name it jit(NAME), tracing NAME
        name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
        per = _by_name.setdefault(name, dict.fromkeys((TRACE, LOWER, COMPILE, "n"), 0))
        per[event] += duration
        per["n"] += event == COMPILE
        _now_by_name[name] += duration


def _on_event(event, **_):
    _now[event] += 1


def pytest_configure(config):
    if os.environ.get(_DIR_ENV):
        import jax.monitoring
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's hook signature)
    _now.clear()
    _now_by_name.clear()
    wall, cpu, children = time.perf_counter(), time.process_time(), _children_cpu()
    yield
    _records.append({"test": item.nodeid, "wall_s": time.perf_counter() - wall,
                     "cpu_s": time.process_time() - cpu,
                     "subprocess_cpu_s": _children_cpu() - children, "trace_s": _now[TRACE],
                     "lower_s": _now[LOWER], "compile_s": _now[COMPILE],
                     "compiles": _now["n " + COMPILE], "cache_hits": _now[HITS],
                     "cache_misses": _now[MISSES],
                     # seconds building each jitted function's programs in this test
                     "by_name": {k: round(v, 3) for k, v in _now_by_name.items()
                                 if v >= 0.05}})


def _children_cpu() -> float:
    """CPU seconds of the subprocesses this worker started and waited for (the CLIs)."""
    t = os.times()
    return t.children_user + t.children_system


def pytest_sessionfinish(session):  # noqa: ARG001
    out = os.environ.get(_DIR_ENV)
    if out:
        with open(os.path.join(out, f"part-{os.getpid()}.json"), "w") as f:
            json.dump(_records, f)
        with open(os.path.join(out, f"names-{os.getpid()}.json"), "w") as f:
            json.dump(_by_name, f)

# ---- the runner --------------------------------------------------------------------------

FIELDS = ("wall_s", "cpu_s", "subprocess_cpu_s", "trace_s", "lower_s", "compile_s", "compiles",
          "cache_hits", "cache_misses")


def summarize_names(by_name: dict, top: int = 25) -> str:
    """The jitted functions whose programs cost most to build, summed over every test."""
    lines = [f"the {top} jitted functions that cost most to build (trace + lower + compile):",
             f"  {'seconds':>7s} {'trace':>6s} {'lower':>6s} {'compile':>7s} {'#comp':>5s}  name"]
    for name, per in sorted(by_name.items(),
                            key=lambda kv: -(kv[1][TRACE] + kv[1][LOWER] + kv[1][COMPILE]))[:top]:
        lines.append(f"  {per[TRACE] + per[LOWER] + per[COMPILE]:7.1f} {per[TRACE]:6.1f} "
                     f"{per[LOWER]:6.1f} {per[COMPILE]:7.1f} {per['n']:5d}  {name}")
    return "\n".join(lines)


def summarize(records: list[dict], top: int = 20) -> str:
    total = {k: sum(r.get(k, 0) for r in records) for k in FIELDS}
    jax_s = total["trace_s"] + total["lower_s"] + total["compile_s"]
    lines = [f"{len(records)} tests: {total['wall_s']:.0f} s of test wall time; tracing "
             f"{total['trace_s']:.0f} s, lowering {total['lower_s']:.0f} s, XLA compiles "
             f"{total['compile_s']:.0f} s ({total['compiles']:.0f} compiles; cache hits "
             f"{total['cache_hits']:.0f}, misses {total['cache_misses']:.0f}): "
             f"{jax_s / max(total['wall_s'], 1e-9):.0%} of the wall time building programs; "
             f"CPU {total['cpu_s']:.0f} s in the workers and {total['subprocess_cpu_s']:.0f} s "
             "in the subprocesses they waited for", ""]
    by_file: dict[str, dict] = {}
    for r in records:
        f = by_file.setdefault(r["test"].split("::")[0], dict.fromkeys(FIELDS, 0.0) | {"n": 0})
        f["n"] += 1
        for k in FIELDS:
            f[k] += r.get(k, 0)
    head = f"{'file':40s} {'tests':>5s} {'wall s':>7s} {'trace':>6s} {'lower':>6s} " \
           f"{'compile':>7s} {'#comp':>5s} {'hits':>4s} {'sub cpu':>7s}"
    lines += [head, "-" * len(head)]
    for name, f in sorted(by_file.items(), key=lambda kv: -kv[1]["wall_s"]):
        lines.append(f"{name[-40:]:40s} {f['n']:5d} {f['wall_s']:7.1f} {f['trace_s']:6.1f} "
                     f"{f['lower_s']:6.1f} {f['compile_s']:7.1f} {f['compiles']:5.0f} "
                     f"{f['cache_hits']:4.0f} {f['subprocess_cpu_s']:7.1f}")
    lines += ["", f"the {top} tests that compile longest:"]
    for r in sorted(records, key=lambda r: -r["compile_s"])[:top]:
        lines.append(f"  compile {r['compile_s']:6.1f} s in {r['compiles']:3.0f} compiles, wall "
                     f"{r['wall_s']:6.1f} s  {r['test']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(root, "benchmarks", "results")
    if argv[:1] == ["--out"]:
        out, argv = argv[1], argv[2:]
    parts = tempfile.mkdtemp(prefix="suite-profile-")
    env = dict(os.environ, **{_DIR_ENV: parts},
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                           os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "pytest", "-p", "suite_profile", *(argv or ["-n", "2", "tests"])]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=root, env=env)
    records = [r for p in sorted(glob.glob(os.path.join(parts, "part-*.json")))
               for r in json.load(open(p))]
    if not records:
        print("no test records (did pytest run any test?)", file=sys.stderr)
        return rc or 1
    by_name: dict = {}
    for p in sorted(glob.glob(os.path.join(parts, "names-*.json"))):
        for name, per in json.load(open(p)).items():
            into = by_name.setdefault(name, dict.fromkeys(per, 0))
            for k, v in per.items():
                into[k] += v
    print()
    print(summarize(records))
    print()
    print(summarize_names(by_name))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "suite_profile.json"), "w") as f:
        json.dump({"pytest_args": argv, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                               time.gmtime()),
                   "records": records, "by_name": by_name}, f, indent=1)
    print(f"\nwrote {os.path.join(out, 'suite_profile.json')}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
