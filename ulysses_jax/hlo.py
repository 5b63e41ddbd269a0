"""Reading compiled programs: collective counts and the bytes they move.

Tests and ``--dry-run`` use this to check communication in the compiled HLO rather than
trusting the numbers alone. ``executed_collectives`` counts ops inside while loops as many
times as they run (benchmarks/hybrid_comm.py, the ring tests).
"""
from __future__ import annotations

import math
import re
from collections import Counter

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
# An HLO instruction line: "%name = <shape> opcode(operands), ...". Async pairs
# (op-start / op-done) count once, at the start.
_OP = re.compile(r"=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Number of each collective op in an HLO module's text (every op listed, 0 if absent)."""
    counts = Counter({op: 0 for op in COLLECTIVES})
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m:
            counts[m.group("op")] += 1
    return dict(counts)


_FUSED_ATTENTION = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
_CHUNKED_LOOP = re.compile(r'\swhile\(.*op_name="[^"]*chunked_attention/while"')


def attention_kernels(hlo_text: str) -> dict[str, int]:
    """The attention calls in a compiled program by kind: ``cudnn`` and ``cudnn_backward``
    (cuDNN's fused attention custom calls, forward and backward) and ``chunked`` (the loops
    over blocks of the plain-JAX chunked kernel, forward and backward; XLA removes a loop of
    one trip, so tiny sequences show none). A call inside a loop body counts once."""
    counts = Counter({"cudnn": 0, "cudnn_backward": 0, "chunked": 0})
    for line in hlo_text.splitlines():
        m = _FUSED_ATTENTION.search(line)
        if m:
            counts["cudnn_backward" if "Backward" in m.group(1) else "cudnn"] += 1
        elif _CHUNKED_LOOP.search(line):
            counts["chunked"] += 1
    return dict(counts)


_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _collective_arrays(hlo_text: str, op: str):
    """(dtype, shape) of every array one kind of collective produces (tuples flattened)."""
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m and m.group("op") == op:
            for dtype, dims in _ARRAY.findall(m.group("shape")):
                yield dtype, tuple(int(d) for d in dims.split(",") if d)


def collective_shapes(hlo_text: str, op: str) -> list[tuple[int, ...]]:
    """Shapes of the arrays one kind of collective produces (tuples flattened)."""
    return [shape for _, shape in _collective_arrays(hlo_text, op)]


def collective_bytes(hlo_text: str, op: str) -> int:
    """Bytes of all results of one kind of collective, per device."""
    return sum(math.prod(shape) * _BYTES[dtype]
               for dtype, shape in _collective_arrays(hlo_text, op))


# ----------------------------------------------------------------------------- loops counted

_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s")
_CALL = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)"
                   r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _computations(hlo_text: str) -> tuple[list[str], dict[str, str], str]:
    """HLO module text -> (names in text order, name -> body text, entry name)."""
    order, bodies, entry, name, lines = [], {}, None, None, []
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m and line.rstrip().endswith("{"):
            name, lines = m.group("name"), []
            entry = name if line.startswith("ENTRY") else entry
        elif name is not None and line.startswith("}"):
            order.append(name)
            bodies[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return order, bodies, entry


def executed_collectives(hlo_text: str) -> dict:
    """Collectives as executed: each computation's ops times how often the computation runs.

    A callee is defined before its callers in HLO text, so walking the computations from the
    last (ENTRY) to the first visits every caller before its callees. A while loop without a
    known trip count is allowed only if no collective runs inside it (the chunked attention
    kernel's data-dependent loops).

    Returns:
      {"bytes": {op: bytes}, "counts": {op: executions}, "loops": [{"trip_count",
      "collective_permutes_in_body", "op_name"}], "in_conditional": ops found in a branch}.
    """
    order, bodies, entry = _computations(hlo_text)
    own = {name: collective_counts(bodies[name]) for name in order}
    reaches = set()                              # computations that run a collective
    for name in order:                           # callees first
        callees = {c for _, c in _CALL.findall(bodies[name])}
        for group in _BRANCHES.findall(bodies[name]):
            callees |= set(re.findall(r"%([\w.\-]+)", group))
        if any(own[name].values()) or callees & reaches:
            reaches.add(name)
    runs = {name: 0 for name in order}
    runs[entry] = 1
    loops, branch_comps = [], set()
    for name in reversed(order):
        m = runs[name]
        for line in bodies[name].splitlines():
            calls = _CALL.findall(line)
            if " while(" in line:
                body, cond = dict(calls)["body"], dict(calls)["condition"]
                trip = _TRIP.search(line)
                if trip is None:
                    if {body, cond} & reaches:
                        raise ValueError(f"collectives in a while loop without "
                                         f"known_trip_count: {line[:200]}")
                    continue
                n = int(trip.group(1))
                op = re.search(r'op_name="([^"]*)"', line)
                loops.append({"trip_count": n, "op_name": op.group(1) if op else None,
                              "collective_permutes_in_body": own[body]["collective-permute"]})
                runs[body] += m * n
                runs[cond] += m * (n + 1)
                continue
            for kind, callee in calls:
                runs[callee] += m
                if kind in ("true_computation", "false_computation"):
                    branch_comps.add(callee)
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    runs[callee] += m   # an upper bound: one branch runs
                    branch_comps.add(callee)
    out = {"bytes": {op: 0 for op in COLLECTIVES}, "counts": {op: 0 for op in COLLECTIVES},
           "loops": loops, "in_conditional": []}
    for name in order:
        for op in COLLECTIVES:
            out["bytes"][op] += runs[name] * collective_bytes(bodies[name], op)
            out["counts"][op] += runs[name] * own[name][op]
            if own[name][op] and name in branch_comps:
                out["in_conditional"].append(op)
    return out


# ------------------------------------------------------- collective order across loop bodies

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_CALLEE_ATTRS = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|"
                           r"false_computation)=%[\w.\-]+|branch_computations=\{[^}]*\}")


def unordered_loop_collectives(hlo_text: str) -> list[tuple[str, str, str]]:
    """Pairs of collective steps in one computation that only a shared communicator orders.

    A "collective step" is a collective op, or a while / conditional / call whose callees run
    one. XLA:CPU runs the steps of a computation concurrently where no data dependency orders
    them, and keeps the collectives of all devices in one order by making every collective
    step use one communicator resource. An executable deserialized from the persistent
    compilation cache (jaxlib 0.10) gives each loop body a resource of its own, so a loop
    holding collectives and a collective beside it lose that order: devices then enter
    different collectives (a deadlock) or two collectives with one rendezvous key (a crash).
    Only pairs in which a loop (or branch, or call) is one side lose their order; pairs that
    data dependencies order are safe either way.

    Returns:
      (computation, step, step) for every unordered pair with a nested side; [] when the
      program is safe to read back.
    """
    order, bodies, _ = _computations(hlo_text)
    reaches = set()                              # computations that run a collective
    pairs = []
    for name in order:                           # callees first
        deps, steps = {}, []
        for line in bodies[name].splitlines():
            m = _INSTR.match(line)
            if not m:
                continue
            rest = m.group("rest")
            callees = {c for _, c in _CALL.findall(rest)}
            for group in _BRANCHES.findall(rest):
                callees |= set(re.findall(r"%([\w.\-]+)", group))
            operands = set(re.findall(r"%([\w.\-]+)", _CALLEE_ATTRS.sub("", rest)))
            deps[m.group("name")] = operands
            if _OP.search(line):
                steps.append((m.group("name"), False))
            elif callees & reaches:
                steps.append((m.group("name"), True))
        if steps:
            reaches.add(name)
        if not any(nested for _, nested in steps) or len(steps) < 2:
            continue
        ancestors = {step: _ancestors(step, deps) for step, _ in steps}
        for i, (a, nested_a) in enumerate(steps):
            for b, nested_b in steps[i + 1:]:
                if (nested_a or nested_b) and a not in ancestors[b] and b not in ancestors[a]:
                    pairs.append((name, a, b))
    return pairs


def _ancestors(name: str, deps: dict[str, set[str]]) -> set[str]:
    """Every instruction ``name`` depends on through its operands (in its computation)."""
    seen, todo = set(), [name]
    while todo:
        for d in deps.get(todo.pop(), ()):
            if d in deps and d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


_HOST_EXECUTE = re.compile(r'custom_call_target="HostExecute".*?called_computations=\{([^}]*)\}')


def host_computations(hlo_text: str) -> set[str]:
    """The computations of a compiled GPU program that run on the host: those XLA:GPU's
    ``HostExecute`` calls run (``optimizer.offload``'s host computations), and their callees."""
    _, bodies, _ = _computations(hlo_text)
    todo = [n for group in _HOST_EXECUTE.findall(hlo_text)
            for n in re.findall(r"%([\w.\-]+)", group)]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        todo += [c for _, c in _CALL.findall(bodies[name])]
        for group in _BRANCHES.findall(bodies[name]):
            todo += re.findall(r"%([\w.\-]+)", group)
    return seen


def host_collectives(hlo_text: str) -> dict[str, int]:
    """Collectives inside host computations (``host_computations``), by op: host code runs
    beside each GPU, where a collective has no place (training/host_compute.py)."""
    _, bodies, _ = _computations(hlo_text)
    counts = Counter({op: 0 for op in COLLECTIVES})
    for name in host_computations(hlo_text):
        counts.update(collective_counts(bodies[name]))
    return dict(counts)
