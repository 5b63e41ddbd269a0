"""A GPU step's time without a GPU: a model over the program XLA's GPU compiler built.

``gpu_target.compile`` gives the optimized HLO a GPU would run (its fusions, GEMMs, cuDNN
calls, collectives and host transfers, in the order the scheduler placed them); this module
prices it, instruction by instruction, with rates that live in the target file
(``targets/<name>.txtpb``, ``# time-model`` lines, each with its source), and adds up a step:

  - GEMMs (Triton GEMM fusions, cuBLAS calls): their FLOPs from the shapes at the target's
    bf16 GEMM rate (TF32 for f32 operands), or their bytes at HBM speed if longer;
  - attention, by kernel: cuDNN's fused calls from their FLOPs (shapes and mask in the call's
    own config; packed documents priced as the whole causal row, an upper bound) at the rate
    measured for cuDNN at that head dim and length; the plain-JAX chunked kernel (a loop with
    data-dependent trip counts XLA cannot count) per call, from its queries' shape, as
    causal attention over the row (windows too: an upper bound), at its measured rate;
  - every other fusion and copy from the bytes it reads and writes at HBM speed (operands a
    fusion only slices count by the slice, an in-place update by the update), plus a launch;
  - collectives from the bytes each device sends (all-gather and all-to-all (g-1)/g of the
    result, reduce-scatter (g-1) results, all-reduce twice (g-1)/g, a permute all of it) over
    NVLink within a host of 8 and the network across hosts, plus NCCL's launch;
  - host transfers (arrays in host memory, ``S(5)``) over PCIe; host computations
    (``HostExecute``: the offloaded optimizer) from their bytes at the host's measured rate.

Loop bodies count as many times as XLA's known trip count says (a loop without one counts
once, and the result says how many). Of a conditional, the branch with cuDNN's call is taken
when the other is the chunked fallback (rows past the packed layout's bound); otherwise the
dearest. An asynchronous collective or transfer is hidden by the compute the schedule places
between its start and its done, and what is left is exposed; synchronous ones are exposed.

Every figure is a model: it is printed as ``*_model`` and labelled so, never as measured.
``benchmarks/time_model.py`` sets it beside the steps measured on an H200 (docs/PERF.md).
"""
from __future__ import annotations

import dataclasses
import math
import re

from .hlo import _BYTES, _CALL, _computations

KINDS = ("matmul", "attention_cudnn", "attention_chunked", "other_fusions",
         "copies_transposes", "collectives_exposed", "collectives_hidden", "host_transfers",
         "host_compute", "overlapped")
_RATE_LINE = re.compile(r"^#\s*time-model\s+(\w+)\s*=\s*([0-9.eE+\-]+)\s*(.*)$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<shape>.+?)\s"
                    r"(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64|s4|u4|"
                    r"f8e4m3fn|f8e5m2)\[([\d,]*)\](\{[^}]*\})?")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "iota",
         "all-gather-done", "all-reduce-done", "reduce-scatter-done", "all-to-all-done",
         "collective-permute-done", "copy-done", "async-done", "custom-call-done",
         "send-done", "recv-done", "domain"}
_COLLECTIVE = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute"}
_CHUNKED_CALL = re.compile(r'op_name="[^"]*chunked_attention\)*/(?:eval_jaxpr/)?while"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_EXTRA_BYTES = {"s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class Rates:
    """The model's constants for one target (``# time-model name = value  source`` lines of
    its target file); ``sources`` maps each name to the text after its value."""
    values: dict
    sources: dict

    def __getitem__(self, key: str) -> float:
        if key not in self.values:
            raise KeyError(f"the target file has no '# time-model {key} = ...' line")
        return self.values[key]

    def attention_tflops(self, kernel: str, head_dim: int, seq: int) -> float:
        """The measured rate of ``kernel`` (cudnn, chunked) at this head dim (the nearest
        measured one) and length (log-linear between the measured lengths, flat outside)."""
        pat = re.compile(rf"attention_{kernel}_d(\d+)_s(\d+)_tflops$")
        table = {}
        for k, v in self.values.items():
            m = pat.match(k)
            if m:
                table.setdefault(int(m.group(1)), {})[int(m.group(2))] = v
        if not table:
            raise KeyError(f"the target file has no attention_{kernel}_* rates")
        d = min(table, key=lambda x: (abs(math.log2(x) - math.log2(max(head_dim, 1))), -x))
        points = sorted(table[d].items())
        if seq <= points[0][0]:
            return points[0][1]
        for (s0, r0), (s1, r1) in zip(points, points[1:]):
            if seq <= s1:
                f = (math.log(seq) - math.log(s0)) / (math.log(s1) - math.log(s0))
                return r0 + f * (r1 - r0)
        return points[-1][1]


def rates(config_text: str) -> Rates:
    """The ``# time-model`` lines of a target file's text."""
    values, sources = {}, {}
    m = re.search(r"memory_bandwidth:\s*(\d+)", config_text)
    if m:
        values["hbm_gbps"] = int(m.group(1)) / 1e9
        sources["hbm_gbps"] = "the file's memory_bandwidth"
    for line in config_text.splitlines():
        m = _RATE_LINE.match(line.strip())
        if m:
            values[m.group(1)] = float(m.group(2))
            sources[m.group(1)] = m.group(3).strip()
    return Rates(values, sources)


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list
    attrs: str
    line: str


def _split_call(rest: str) -> tuple[str, str]:
    """``rest`` after "opcode(": (the operand list, the attributes after it)."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1:].lstrip(", ")
    return rest, ""


def _parse(body: str) -> list[_Instr]:
    out = []
    for line in body.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        args, attrs = _split_call(m.group("rest"))
        out.append(_Instr(m.group("name"), m.group("shape"), m.group("op"),
                          re.findall(r"%([\w.\-]+)", args), attrs, line))
    return out


def _arrays(shape: str):
    """(bytes, in host memory) of every array in a shape string."""
    for dtype, dims, layout in _ARRAY.findall(shape):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        yield n * _BYTES.get(dtype, _EXTRA_BYTES.get(dtype, 4)), "S(5)" in (layout or "")


def shape_bytes(shape: str, host: bool | None = None) -> int:
    """Bytes of a shape string's arrays (``host``: only those in host memory, or only those
    not; None: all)."""
    return int(sum(b for b, h in _arrays(shape) if host is None or h == host))


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


class _Program:
    def __init__(self, hlo_text: str):
        self.order, bodies, self.entry = _computations(hlo_text)
        self.instrs = {name: _parse(bodies[name]) for name in self.order}
        self.by_name = {name: {i.name: i for i in self.instrs[name]} for name in self.order}
        self._dots, self._reach = {}, {}

    def callees(self, instr: _Instr) -> list[str]:
        names = [c for _, c in _CALL.findall(instr.attrs)]
        m = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
        if m:
            names += re.findall(r"%([\w.\-]+)", m.group(1))
        m = re.search(r"called_computations=\{([^}]*)\}", instr.attrs)
        if m:
            names += re.findall(r"%([\w.\-]+)", m.group(1))
        return [n for n in names if n in self.instrs]

    def dot_flops(self, comp: str) -> tuple[float, str]:
        """(FLOPs of the dots in a fused computation and its callees, the widest operand
        dtype among them)."""
        if comp in self._dots:
            return self._dots[comp]
        flops, dtype = 0.0, ""
        table = self.by_name[comp]
        for ins in self.instrs[comp]:
            if ins.op == "dot":
                lhs = table.get(ins.operands[0]) if ins.operands else None
                lhs_dims = _dims(lhs.shape) if lhs else []
                m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
                contract = math.prod(lhs_dims[int(i)] for i in m.group(1).split(",") if i) \
                    if m and lhs_dims else 1
                flops += 2.0 * math.prod(_dims(ins.shape) or [1]) * contract
                t = _ARRAY.search(lhs.shape).group(1) if lhs and _ARRAY.search(lhs.shape) \
                    else ""
                dtype = "f32" if "f32" in (t, dtype) else (t or dtype)
            for callee in self.callees(ins):
                f, t = self.dot_flops(callee)
                flops += f
                dtype = "f32" if "f32" in (t, dtype) else (t or dtype)
        self._dots[comp] = (flops, dtype)
        return self._dots[comp]

    def contains(self, comp: str, pattern: re.Pattern) -> bool:
        key = (comp, pattern.pattern)
        if key not in self._reach:
            self._reach[key] = False
            self._reach[key] = any(
                pattern.search(ins.line) or any(self.contains(c, pattern)
                                                for c in self.callees(ins))
                for ins in self.instrs[comp])
        return self._reach[key]

    def fusion_bytes(self, ins: _Instr, comp: str) -> tuple[int, int]:
        """(device bytes, host bytes) a fusion reads and writes: an operand only sliced
        inside counts by its slices, a result updated in place by its update."""
        table = self.by_name[comp]
        callee = next(iter(self.callees(ins)), None)
        fused = self.instrs.get(callee, []) if callee else []
        params = {}
        for f in fused:
            if f.op == "parameter":
                m = re.match(r"\s*(\d+)", f.line.split("parameter(", 1)[1])
                params[f.name] = int(m.group(1)) if m else -1
        # a bitcast only renames an array: see through it to the parameter it views
        source = {}
        for f in fused:
            if f.op == "bitcast" and f.operands:
                source[f.name] = source.get(f.operands[0], f.operands[0])
        users = {}
        for f in fused:
            if f.op == "bitcast":
                continue
            for o in f.operands:
                users.setdefault(source.get(o, o), []).append((f, source.get(o, o)))
        dev = host = 0
        in_place = set()
        root = next((f for f in fused if f.line.lstrip().startswith("ROOT")), None)
        roots = ([fused_by(fused, o) for o in root.operands] if root and root.op == "tuple"
                 else [root] if root else [])
        roots = [fused_by(fused, source[r.name]) if r is not None and r.name in source else r
                 for r in roots]
        written = 0
        for r in roots:
            if r is not None and r.op == "dynamic-update-slice" and len(r.operands) > 1:
                upd = fused_by(fused, r.operands[1])
                written += shape_bytes(upd.shape) if upd else 0
                base = source.get(r.operands[0], r.operands[0])
                if base in params:
                    in_place.add(base)
            elif r is not None:
                written += shape_bytes(r.shape)
        for pname, idx in params.items():
            if pname in in_place or idx < 0 or idx >= len(ins.operands):
                continue
            operand = table.get(ins.operands[idx])
            if operand is None:
                continue
            us = [u for u, _ in users.get(pname, [])]
            if us and all(u.op in ("dynamic-slice", "slice", "gather")
                          and source.get(u.operands[0], u.operands[0]) == pname for u in us):
                b = sum(shape_bytes(u.shape) for u in us)
                on_host = shape_bytes(operand.shape, host=True) > 0
            else:
                b = shape_bytes(operand.shape)
                on_host = False
                host += shape_bytes(operand.shape, host=True)
                b -= shape_bytes(operand.shape, host=True)
            if on_host:
                host += b
            else:
                dev += b
        if not fused:  # no fused computation to read: every operand and the result
            dev += sum(shape_bytes(table[o].shape) for o in ins.operands if o in table)
        out_host = shape_bytes(ins.shape, host=True)
        if out_host:
            host += min(written, out_host)
            dev += max(written - out_host, 0)
        else:
            dev += written if fused else shape_bytes(ins.shape)
        return dev, host


def fused_by(fused: list[_Instr], name: str) -> _Instr | None:
    return next((f for f in fused if f.name == name), None)


def _group_size(attrs: str, devices: int, per_host: int) -> int:
    """Devices in each replica group of a collective; for a collective-permute, 2, or all
    the devices where a pair crosses hosts (so that it is priced on the network)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict((k.strip().strip("'"), int(v)) for k, v in
                     (p.split("=") for p in m.group(1).split(",")))
        axes = [a.strip().strip("'") for a in m.group(2).split(",") if a.strip()]
        return math.prod(sizes[a] for a in axes) if axes else 1
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    pairs = re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=", 1)[1]
                       .split("}}", 1)[0] + "}") if "source_target_pairs=" in attrs else []
    if pairs:
        return devices if any(int(a) // per_host != int(b) // per_host for a, b in pairs) else 2
    return devices


class _Pricer:
    def __init__(self, program: _Program, r: Rates, devices: int):
        self.p, self.r, self.devices = program, r, devices
        self.kinds = dict.fromkeys(KINDS, 0.0)
        self.items: dict = {}   # (kind, op_name) -> seconds in the step
        self.untripped_loops = 0

    # ----------------------------------------------------------------- unit costs
    def hbm(self, nbytes: float) -> float:
        return nbytes / (self.r["hbm_bandwidth_fraction"] * self.r["hbm_gbps"] * 1e9)

    def moved(self, ins: _Instr, comp: str, result: bool = True) -> int:
        """Bytes of the instruction's operands, and of its result with ``result``."""
        table = self.p.by_name[comp]
        return (shape_bytes(ins.shape) if result else 0) + sum(
            shape_bytes(table[o].shape) for o in ins.operands if o in table)

    def launch(self) -> float:
        return self.r["kernel_launch_us"] * 1e-6

    def matmul(self, flops: float, dtype: str) -> float:
        tflops = self.r["matmul_tf32_tflops" if dtype == "f32" else "matmul_bf16_tflops"]
        return flops / (tflops * 1e12)

    def collective(self, ins: _Instr, comp: str, op: str) -> float:
        size = shape_bytes(ins.shape)
        if ins.op.endswith("-start"):  # (operands, result[, scratch]): the result's bytes
            done = next((i for i in self.p.instrs[comp]
                         if i.operands[:1] == [ins.name] and i.op.endswith("-done")), None)
            size = shape_bytes(done.shape) if done else size
        g = _group_size(ins.attrs, self.devices, int(self.r["gpus_per_host"]))
        wire = {"all-gather": size * (g - 1) / g, "all-to-all": size * (g - 1) / g,
                "reduce-scatter": size * (g - 1), "all-reduce": 2 * size * (g - 1) / g,
                "collective-permute": size}[op]
        link = ("network_gbps" if g > self.r["gpus_per_host"] else "nvlink_gbps")
        return (wire / (self.r["collective_bandwidth_fraction"] * self.r[link] * 1e9)
                + self.r["collective_launch_us"] * 1e-6)

    # ----------------------------------------------------------------- instructions
    def price(self, ins: _Instr, comp: str) -> tuple[str, float]:
        """(kind, seconds) of one instruction run once; async starts give their own
        duration (the caller decides how much is hidden)."""
        op = ins.op
        base = op[:-len("-start")] if op.endswith("-start") else op
        if base in _COLLECTIVE:
            return "collective", self.collective(ins, comp, base)
        if op == "async-start":
            inner = next((i for c in self.p.callees(ins) for i in self.p.instrs[c]
                          if i.op in _COLLECTIVE), None)
            if inner is not None:
                return "collective", self.collective(inner, comp, inner.op)
        if op in ("custom-call", "custom-call-start"):
            return self.custom_call(ins, comp)
        if base == "fusion":
            return self.fusion(ins, comp)
        if op in ("copy", "copy-start"):
            host = shape_bytes(ins.shape, host=True) or sum(
                shape_bytes(self.p.by_name[comp][o].shape, host=True)
                for o in ins.operands if o in self.p.by_name[comp])
            if host:
                return "host_transfers", host / (self.r["pcie_gbps"] * 1e9) + self.launch()
            return "copies_transposes", self.hbm(2 * shape_bytes(ins.shape)) + self.launch()
        if op == "transpose":
            return "copies_transposes", self.hbm(2 * shape_bytes(ins.shape)) + self.launch()
        return "other_fusions", self.hbm(self.moved(ins, comp)) + self.launch()

    def custom_call(self, ins: _Instr, comp: str) -> tuple[str, float]:
        target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        target = target.group(1) if target else ""
        if target.startswith("__cudnn$fmha"):
            cfg = ins.attrs
            dims = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*'
                             r'\[([^\]]*)\]', cfg)
            b, n, sq, skv = (int(x.strip().strip('"')) for x in dims.group(1).split(","))
            q = re.search(r"operand_layout_constraints=\{([^}]*\})", ins.attrs)
            head = _dims(q.group(1))[-1] if q else 128
            mask = re.search(r'"mask_type":\s*"(\w+)"', cfg)
            causal = bool(mask) and "CAUSAL" in mask.group(1)
            window = re.search(r'"sliding_window_length":\s*"?(\d+)', cfg)
            pairs = sq * skv / 2 if causal else sq * skv
            if window and int(window.group(1)) > 0:
                pairs = min(pairs, sq * int(window.group(1)))
            fwd = 4.0 * b * n * head * pairs
            flops = fwd * (2.5 if "Backward" in target else 1.0)
            rate = self.r.attention_tflops("cudnn", head, max(sq, skv))
            return "attention_cudnn", flops / (rate * 1e12) + self.launch()
        if target.startswith("__cublas"):
            table = self.p.by_name[comp]
            lhs = table.get(ins.operands[0]) if ins.operands else None
            m = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', ins.attrs)
            lhs_dims = _dims(lhs.shape) if lhs else []
            contract = math.prod(lhs_dims[int(x.strip().strip('"'))]
                                 for x in m.group(1).split(",") if x.strip()) \
                if m and lhs_dims else 1
            out = _dims(ins.shape)
            flops = 2.0 * math.prod(out or [1]) * contract
            dtype = _ARRAY.search(lhs.shape).group(1) if lhs else "bf16"
            return "matmul", (max(self.matmul(flops, dtype), self.hbm(self.moved(ins, comp)))
                              + self.launch())
        if target == "HostExecute" or "HostExecute" in ins.attrs:
            moved = self.moved(ins, comp)
            if ins.op.endswith("-start"):  # ((args), (results), context): count once
                moved = (self.moved(ins, comp, result=False)
                         + shape_bytes(_tuple_element(ins.shape, 1)))
            return "host_compute", moved / (self.r["host_compute_gbps"] * 1e9)
        return "other_fusions", self.hbm(self.moved(ins, comp)) + self.launch()

    def fusion(self, ins: _Instr, comp: str) -> tuple[str, float]:
        callee = next(iter(self.p.callees(ins)), None)
        dev, host = self.p.fusion_bytes(ins, comp)
        flops, dtype = self.p.dot_flops(callee) if callee else (0.0, "")
        t_host = host / (self.r["pcie_gbps"] * 1e9)
        if flops:
            return "matmul", max(self.matmul(flops, dtype), self.hbm(dev)) + t_host \
                + self.launch()
        if host:
            return "host_transfers", self.hbm(dev) + t_host + self.launch()
        root = next((f for f in self.p.instrs.get(callee, [])
                     if f.line.lstrip().startswith("ROOT")), None)
        kind = ("copies_transposes" if root is not None and root.op in ("transpose", "copy")
                else "other_fusions")
        return kind, self.hbm(dev) + self.launch()

    def add(self, kind: str, seconds: float) -> None:
        self.kinds["collectives_exposed" if kind == "collective" else kind] += seconds

    def note_item(self, kind: str, ins: _Instr, seconds: float) -> None:
        m = _OP_NAME.search(ins.line)
        key = (kind, m.group(1) if m else ins.op)
        self.items[key] = self.items.get(key, 0.0) + seconds

    # ----------------------------------------------------------------- control flow
    def chunked_call(self, ins: _Instr) -> float:
        """One call of the chunked kernel: its queries are the loop's first [B, S, N, H]
        float array; priced as causal attention over the whole row at the kernel's rate."""
        name = _OP_NAME.search(ins.line).group(1)
        backward = "transpose(" in name and "rematted_computation" not in name
        q = next(d for d in (_dims(a.group(0)) for a in _ARRAY.finditer(ins.shape)
                             if a.group(1) in ("bf16", "f16", "f32")) if len(d) == 4)
        b, seq, n, head = q
        fwd = 4.0 * b * n * head * seq * seq / 2
        rate = self.r.attention_tflops("chunked", head, seq)
        return fwd * (2.5 if backward else 1.0) / (rate * 1e12)

    def branch(self, ins: _Instr) -> list[str]:
        """The branches of a conditional the model prices: cuDNN's side where the other is
        the chunked fallback of its packed layout (rows with more documents than its bound:
        ``cudnn.packed_attention``), else the dearest."""
        branches = self.p.callees(ins)
        cudnn = re.compile(r'custom_call_target="__cudnn\$fmha')
        fallback = re.compile(r'op_name="[^"]*chunked_attention')
        with_cudnn = [b for b in branches if self.p.contains(b, cudnn)]
        chunked = [b for b in branches if b not in with_cudnn and self.p.contains(b, fallback)]
        if chunked and with_cudnn:
            branches = with_cudnn
        elif chunked and len(chunked) < len(branches) and self.p.contains(self.p.entry, cudnn):
            # XLA may hoist the cuDNN side's work out of a loop, leaving its branch nearly
            # empty beside the fallback's
            branches = [b for b in branches if b not in chunked]
        costs = {b: self.walk(b, 1, record=False) for b in branches}
        return [max(costs, key=costs.get)] if costs else []

    def walk(self, comp: str, times: float, record: bool = True) -> float:
        """Seconds of ``comp`` run ``times`` times on the step's critical path; with
        ``record`` its parts are added to ``kinds``."""
        total = 0.0
        pending = {}   # async start name -> (kind, seconds, compute seconds seen since)
        for ins in self.p.instrs[comp]:
            op = ins.op
            if op in _FREE and not op.endswith("-done"):
                continue
            if op.endswith("-done"):
                start = ins.operands[0] if ins.operands else None
                if start in pending:
                    kind, t, covered = pending.pop(start)
                    hidden = min(t, covered)
                    exposed = t - hidden
                    total += exposed
                    if record:
                        if kind == "collective":
                            self.kinds["collectives_exposed"] += exposed * times
                            self.kinds["collectives_hidden"] += hidden * times
                        else:
                            self.kinds[kind] += exposed * times
                            self.kinds["overlapped"] += hidden * times
                        self.note_item(kind, ins, exposed * times)
                continue
            if op == "while":
                if _CHUNKED_CALL.search(ins.line) and re.search(r"\b(bf16|f16|f32)\[",
                                                                ins.shape):
                    # (a loop of the kernel carrying only integers is its tile plan,
                    # hoisted out of the layer loop: priced by its fusions below)
                    t = self.chunked_call(ins)
                    kind = "attention_chunked"
                else:
                    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
                    if trip is None and record:
                        self.untripped_loops += 1
                    n = int(trip.group(1)) if trip else 1
                    body = dict(_CALL.findall(ins.attrs)).get("body")
                    t = self.walk(body, times * n, record) / times if body else 0.0
                    kind = None
            elif op == "conditional":
                t = sum(self.walk(b, times, record) for b in self.branch(ins)) / times
                kind = None
            elif op in ("call", "async-call") or (op == "async-start" and not any(
                    i.op in _COLLECTIVE for c in self.p.callees(ins)
                    for i in self.p.instrs[c])):
                t = sum(self.walk(c, times, record) for c in self.p.callees(ins)) / times
                kind = None
            else:
                kind, t = self.price(ins, comp)
                if op.endswith("-start"):
                    pending[ins.name] = (kind, t, 0.0)
                    continue
            total += t
            if record and kind is not None:
                self.add(kind, t * times)
                self.note_item(kind, ins, t * times)
            for key, (k, tt, covered) in pending.items():
                pending[key] = (k, tt, covered + t)
        for kind, t, covered in pending.values():  # a start without its done here
            total += t
            if record:
                self.add(kind, t * times)
        return total * times


def _tuple_element(shape: str, index: int) -> str:
    """The ``index``-th element of a tuple shape string ("((a, b), (c), u32[])")."""
    s = shape.strip()
    if not s.startswith("("):
        return s
    depth, start, parts = 0, 1, []
    for i, ch in enumerate(s):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                parts.append(s[start:i])
        elif ch == "," and depth == 1:
            parts.append(s[start:i])
            start = i + 1
    return parts[index].strip() if index < len(parts) else ""


def step_time(hlo_text: str, config_text: str, devices: int) -> dict:
    """The modeled seconds of one run of the program in ``hlo_text`` (a GPU program:
    ``gpu_target.Compiled.as_text()``) on the target whose file is ``config_text``.

    Args:
      devices: the GPUs the program runs on (for replica groups the HLO does not spell out).

    Returns:
      {"seconds": the step, "by_kind": seconds per ``KINDS`` entry (``collectives_hidden``
      and ``overlapped``, what runs under compute, are not in the step: the second holds
      host transfers, host compute and asynchronous device work), "by_op": seconds in the
      step per (kind, jax op_name), dearest first,
      "loops_without_trip_count": loops priced once}.
    """
    r = rates(config_text)
    pricer = _Pricer(_Program(hlo_text), r, devices)
    seconds = pricer.walk(pricer.p.entry, 1.0)
    top = sorted(pricer.items.items(), key=lambda kv: -kv[1])
    return {"seconds": seconds, "by_kind": pricer.kinds,
            "by_op": [{"kind": k, "op_name": n, "seconds": v} for (k, n), v in top],
            "loops_without_trip_count": pricer.untripped_loops}


ATTENTION_OR_MATMUL = ("matmul", "attention_cudnn", "attention_chunked")


def report(hlo_text: str, target, devices: int, flops_per_device: float,
           tokens_per_step: int, peak_flops: float | None) -> dict:
    """The dry run's time fields for a program compiled for ``target`` (a
    ``gpu_target.Target``): ``step_seconds_model``, ``tokens_per_second_model`` (the whole
    mesh) and per GPU, ``mfu_model`` (the trainer's MFU: model FLOPs per device over the
    step's seconds and the GPU's dense bf16 peak), ``time_by_kind`` (seconds, ``KINDS``) and
    ``time_top_other_model``: the dearest operations that are neither a matmul nor attention,
    the place to look for waste."""
    t = step_time(hlo_text, target.config_text, devices)
    s = t["seconds"]
    sig = lambda x: float(f"{x:.5g}")  # noqa: E731 (five significant digits)
    other = [{"kind": o["kind"], "op_name": o["op_name"], "seconds": sig(o["seconds"])}
             for o in t["by_op"] if o["kind"] not in ATTENTION_OR_MATMUL][:8]
    return {
        "time_model": (f"modeled, not measured: ulysses_jax/time_model.py over this program "
                       f"with the rates of targets/{target.name}.txtpb"),
        "step_seconds_model": sig(s),
        "tokens_per_second_model": sig(tokens_per_step / s),
        "tokens_per_second_per_gpu_model": sig(tokens_per_step / s / devices),
        "mfu_model": sig(flops_per_device / (s * peak_flops)) if peak_flops else None,
        "time_by_kind": {k: sig(v) for k, v in t["by_kind"].items()},
        "time_top_other_model": other,
        "loops_without_trip_count": t["loops_without_trip_count"],
    }
