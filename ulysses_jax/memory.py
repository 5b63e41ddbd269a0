"""Where a compiled program's bytes go: XLA's buffer live ranges, by category and memory.

``compiled.memory_analysis()`` gives one peak. To say what that peak is made of, and what it
would be with some buffers in host memory, this module reads two files XLA writes when a
process runs with ``--xla_dump_to=DIR``: the optimized HLO (each value's shape, op and the
JAX name stack in its metadata) and the buffer live ranges (each buffer's first and last
step in the program's schedule, plus the buffers live at the peak). From them:

  - ``usage``: bytes in use at every step of the schedule, and its peak (checked against
    the peak XLA reports, so a parsing slip shows);
  - ``categories``: every buffer named by what it holds, from its name stack (the model's
    ``jax.named_scope`` labels: embed, layers, attention, mlp, loss, optimizer) or, for
    arguments, from the train state path (parameters, optimizer state, batch);
  - peaks with some buffers moved to host memory (``host_peaks``): what an offload option
    does to the device's peak, on a compiler (the CPU one) that ignores memory kinds.

The CPU compiler's schedule and fusion are not the GPU's; numbers here are the CPU
program's. See docs/PERF.md for how they compare with a GPU compile.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
          "f8e4m3fn": 1, "f8e5m2": 1, "token": 0}
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)"
                    r" ([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_VISION = re.compile(r"(^|[/(])vision([/)]|$)")  # the decoder's "vision" named scope
_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")


def _arrays(shape: str) -> list[int]:
    """Bytes of each array in an HLO shape string (a tuple gives several)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(n * _BYTES.get(dtype, 4))
    return out


@dataclasses.dataclass
class Buffer:
    name: str              # "while.410{3}"
    size: int              # bytes
    start: int             # first schedule step
    end: int               # last schedule step
    shape: str             # e.g. "f32[32,1,16384,4096]"
    op_name: str           # JAX name stack (or the train-state path of an argument)
    category: str = ""
    slot: tuple[int, int] | None = None   # (allocation, offset): aliases share one


def _parse_hlo(text: str):
    """name -> (shape string, op, op_name); op_names from the value itself, else from its
    fused computation, its operands, or (a loop body's parameter) the loop that runs it."""
    raw, comp_root, caller, comp = {}, {}, {}, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        op_m = _OP_NAME.search(line)
        op_name = op_m.group(1) if op_m else ""
        args = line[m.end():].split(")", 1)[0]
        operands = re.findall(r"%([\w.\-]+)", args)
        called = re.findall(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)", line)
        raw[name] = [shape, op, op_name, called, operands, comp]
        if op_name and comp is not None and (comp not in comp_root or "ROOT" in line):
            comp_root[comp] = op_name
        for c in called:
            caller.setdefault(c, name)

    def resolve(name, depth=0):
        shape, op, op_name, called, operands, comp = raw[name]
        if op_name or depth > 6:
            return op_name
        for c in called:
            if comp_root.get(c):
                return comp_root[c]
        if op == "parameter" and comp in caller:
            return resolve(caller[comp], depth + 1)
        for o in operands:
            if o in raw:
                got = resolve(o, depth + 1)
                if got:
                    return got
        return ""

    return {n: (v[0], v[1], resolve(n)) for n, v in raw.items()}


def _element_shape(shape: str, index: str) -> str:
    """The array of ``shape`` at tuple index ``index`` ("" = the whole, non-tuple shape)."""
    arrays = [f"{d}[{s}]" for d, s in _ARRAY.findall(shape)]
    if not index:
        return arrays[0] if arrays else shape
    i = int(index.split(",")[0])
    return arrays[i] if i < len(arrays) else ""


def _slots(assignment_text: str) -> dict[str, tuple[int, int]]:
    """Buffer name ("param.106{}", "while.4{3}") -> (allocation, offset) from XLA's buffer
    assignment: values that alias (a loop's carry and its body parameter) share a slot."""
    slots, alloc = {}, -1
    for line in assignment_text.splitlines():
        m = re.match(r"allocation (\d+):", line)
        if m:
            alloc = int(m.group(1))
            continue
        m = re.match(r"\s*value: <\d+ ([\w.\-]+)(\{[0-9,]*\})?(?: \(phi\))? @\d+> "
                     r"\(size=\d+,offset=(\d+)\)", line)
        if m:
            slots[m.group(1) + (m.group(2) or "{}")] = (alloc, int(m.group(3)))
    return slots


def parse(hlo_text: str, live_range_text: str,
          assignment_text: str | None = None) -> tuple[list[Buffer], int]:
    """Buffers with sizes, live ranges and name stacks; and the peak XLA's report names.

    With XLA's buffer assignment, each buffer also gets its (allocation, offset) slot, so
    ``usage`` counts aliased buffers once."""
    instrs = _parse_hlo(hlo_text)
    slots = _slots(assignment_text) if assignment_text else {}
    buffers = []
    section = None
    peak = 0
    for line in live_range_text.splitlines():
        if line.strip().startswith("BufferLiveRange"):
            section = "ranges"
            continue
        if line.strip().startswith("Live ranges at"):
            section = "peak"
            continue
        if section == "ranges":
            m = re.match(r"\s*([\w.\-]+)\{([0-9,]*)\}:(\d+)-(\d+)", line)
            if not m:
                continue
            name, index, start, end = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
            shape, op, op_name = instrs.get(name, ("", "", ""))
            elem = _element_shape(shape, index)
            sizes = _arrays(elem)
            key = f"{name}{{{index}}}"
            buffers.append(Buffer(key, sizes[0] if sizes else 0, start, end, elem, op_name,
                                  slot=slots.get(key)))
        elif section == "peak":
            m = re.search(r"cumulative: (\d+) bytes", line)
            if m:
                peak = max(peak, int(m.group(1)))
    return buffers, peak


def _groups(buffers: list[Buffer]):
    """Physical buffers: (start, end, size, members), aliased buffers (one slot, overlapping
    live ranges) merged into one group, so their bytes count once."""
    by_slot: dict = {}
    for b in buffers:
        if b.size:
            by_slot.setdefault((b.slot or b.name, b.size), []).append(b)
    out = []
    for (_, size), members in by_slot.items():
        members.sort(key=lambda b: b.start)
        group = [members[0]]
        hi = members[0].end
        for b in members[1:]:
            if b.start <= hi + 1:
                group.append(b)
                hi = max(hi, b.end)
            else:
                out.append((group[0].start, hi, size, group))
                group, hi = [b], b.end
        out.append((group[0].start, hi, size, group))
    return out


def usage(buffers: list[Buffer], exclude=lambda b: False,
          only=None) -> tuple[int, int]:
    """(peak bytes, step of the peak) of the physical buffers: without those of which
    ``exclude`` takes out any member, or (``only`` given) just those of which ``only`` takes
    any member."""
    events: dict[int, int] = {}
    for start, end, size, members in _groups(buffers):
        keep = any(only(b) for b in members) if only else not any(exclude(b) for b in members)
        if keep:
            events[start] = events.get(start, 0) + size
            events[end + 1] = events.get(end + 1, 0) - size
    level, peak, at = 0, 0, 0
    for t in sorted(events):
        level += events[t]
        if level > peak:
            peak, at = level, t
    return peak, at


# Categories, from the name stack (the model's named scopes) and the state path of arguments.
CATEGORIES = ("parameters", "optimizer state", "batch", "layer checkpoints", "attention",
              "mlp", "loss / vocabulary", "embedding", "vision tower", "layer gradients",
              "gradients", "gradient accumulator", "optimizer update", "other")


def categorize(b: Buffer, n_layers: int) -> str:
    """What a buffer holds; see CATEGORIES."""
    n = b.op_name
    if n.startswith("state['params']") or n.startswith("state[\\'params\\']"):
        return "parameters"
    if "opt_state" in n and not n.startswith("jit("):
        return "optimizer state"
    if n.startswith("batch"):
        return "batch"
    if "optimizer" in n:
        return "optimizer update"
    if "grad_accum" in n:
        return "gradient accumulator"  # training/accumulate.py's named scope
    if _VISION.search(n):
        return "vision tower"        # the multimodal families' tower (models/vision.py)
    backward = "transpose(" in n
    dims = _ARRAY.findall(b.shape)
    lead = int(dims[0][1].split(",")[0]) if dims and dims[0][1] else 0
    in_layers = "layers" in n
    stacked = n.rstrip("/").endswith("while") or "dynamic_update_slice" in n
    if in_layers and stacked and not backward and "attention" not in n and "mlp" not in n:
        return "layer checkpoints"   # the layer loop's stacked residuals (one stack per group)
    if backward and in_layers and (stacked or lead == n_layers) and \
            not ("attention" in n or "mlp" in n):
        return "layer gradients"     # stacked per-layer weight gradients
    if "attention" in n:
        return "attention"
    if "mlp" in n:
        return "mlp"
    if "loss" in n:
        return "loss / vocabulary"
    if "embed" in n:
        return "embedding"
    if backward and "layers" not in n:
        return "gradients"
    return "other"


def assign_categories(buffers: list[Buffer], n_layers: int) -> list[Buffer]:
    """Sets each buffer's ``category`` (``categorize``); returns the list."""
    for b in buffers:
        b.category = categorize(b, n_layers)
    return buffers


def breakdown(buffers: list[Buffer], at: int) -> dict[str, int]:
    """Bytes per category live at schedule step ``at``; a physical buffer counts once, in
    the category of its most specific member (any category before "other")."""
    out = {c: 0 for c in CATEGORIES}
    for start, end, size, members in _groups(buffers):
        if start <= at <= end:
            cats = [b.category for b in members if b.category != "other"] or ["other"]
            out[cats[0]] += size
    return out


# ----------------------------------------------------------------------------- dumps

def dump_flags(directory: str) -> str:
    """XLA flags that make every compile of the train step write what ``parse`` reads."""
    return (f"--xla_dump_to={directory} --xla_dump_hlo_module_re=.*jit_step.* "
            f"--xla_dump_hlo_pass_re=^$")


def dump_dir() -> str | None:
    """The dump directory this process's XLA_FLAGS name (set before JAX started), or None."""
    m = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return m.group(1) if m else None


def clear_dump(directory: str) -> None:
    """Deletes the files a compile dumped (each probe of the planner dumps anew)."""
    for path in glob.glob(os.path.join(directory, "*")):
        if os.path.isfile(path):
            os.remove(path)


def latest_dump(directory: str, module: str = "jit_step") -> tuple[str, str, str]:
    """Texts of the newest optimized HLO, live-range and buffer-assignment dumps of ``module``
    in ``directory``
    (a process run with ``--xla_dump_to=directory``)."""
    ranges = sorted(glob.glob(os.path.join(directory, f"*{module}*after_optimizations-live-range.txt")),
                    key=os.path.getmtime)
    if not ranges:
        raise FileNotFoundError(f"no live-range dump of {module} in {directory}; run with "
                                f"XLA_FLAGS=--xla_dump_to={directory}")
    live = ranges[-1]
    texts = []
    for path in (live.replace("-live-range.txt", ".txt"), live,
                 live.replace("-live-range.txt", "-buffer-assignment.txt")):
        with open(path) as f:
            texts.append(f.read())
    return tuple(texts)
