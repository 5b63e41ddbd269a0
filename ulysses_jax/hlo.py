"""Reading compiled programs: collective counts and the bytes they move.

Tests and ``--dry-run`` use this to check communication in the compiled HLO rather than
trusting the numbers alone.
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
