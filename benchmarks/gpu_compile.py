"""Every GPU preset's train step compiled by XLA's GPU compiler for its GPUs, and by XLA's CPU
compiler for comparison, on a machine without a GPU; the generation programs of the 1B and 8B
models at P = 8.

    python benchmarks/gpu_compile.py [--target h100] [--presets a,b] [--compilers gpu,cpu]
                                     [--generation] [--validate] [--timeout 900]

Each train step is one ``train.py --config configs/<preset>.yaml --dry-run [--target T]`` in
its own process (a compile that XLA aborts ends that row, not the script), and the row keeps
what it prints: device and host bytes per device (apart), the collectives, the attention
kernels the program calls, the compile time, and for the GPU compiler's program the step's
modeled time, tokens/s and MFU (ulysses_jax/time_model.py: a model, not a measurement). ``gpu`` rows are the GPU compiler's program for
the preset's own mesh of compile-only ``--target`` GPUs (ulysses_jax/gpu_target.py); ``cpu``
rows are what ``--dry-run`` reports on the 8 fake CPU devices (bf16 compiled as fp16, offloaded
buffers moved to the host column by the live-range model: training/dry_run.py). The two
compilers place buffers differently; the GPU column is the one a GPU would allocate.

``--validate`` compiles the 1B step for one H200 at 8k and 32k tokens as the H200 itself
compiled it (../shared/H200.md, jax 0.11.2), and sets the deviceless temporaries beside that run's.

``--generation`` adds the prefill of one 32,768-token prompt and one decode step after it
(64 new tokens of cache room) for the 1B and Llama-3-8B models at P = 8, from shapes
(``generation.abstract``), GPU compiler only.

Results: benchmarks/results/gpu_compile_<target>.json (one entry per preset and compiler,
with the command that made it). Needs jax's CUDA plugin for the gpu rows
(``gpu_target.install_hint()``: ``pip install "jax[cuda13]==<jax's version>"``; README). The
two columns can come from two interpreters (README's test command makes a Python 3.12 venv
with jax 0.12 and the plugin, and a 3.11 one with jax 0.10.2): each run updates the rows it
makes in the same results file.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from _common import ROOT, command_line, target_name, write_results

GIB = 2 ** 30
# The presets sized for GPUs (configs/ minus the CPU-sized tiny ones) and the overrides that
# make the GPU compile possible where the preset's own flags cannot (said per row).
PRESETS = ("llama-1b-32k", "llama3-8b-128k", "llama3-8b-4m", "llama3-8b-1gpu",
           "llama3.1-8b-256k", "qwen3-8b-128k", "qwen3-8b-yarn-128k", "qwen3-30b-a3b-128k",
           "qwen3-235b-a22b-128k", "qwen3-235b-a22b-lora-128k", "qwen2.5-vl-7b-128k",
           "llama3-8b-dpo-lora-64k", "llama3-8b-grpo-lora-32k")
KEEP = ("peak_bytes_per_device", "host_bytes_per_device", "device_memory_bytes", "compiler",
        "compiled_dtype", "collectives", "attention_kernels", "argument_bytes", "temp_bytes",
        "memory_model", "params", "trainable_params", "mesh", "seq_len", "batch_size",
        "compile_seconds", "notes", "time_model", "step_seconds_model",
        "tokens_per_second_model", "tokens_per_second_per_gpu_model", "mfu_model",
        "time_by_kind", "time_top_other_model")
GENERATION = {"llama-1b-32k": 32768, "llama3-8b-128k": 32768}


# The deviceless compile against a real one: the 1B step on one H200 as the GPU itself
# compiled it (jax 0.11.2; XLA's temporaries, GiB; ../shared/H200.md, "CPU-compiled
# memory against the GPU": chunked kernel, save_dots, replicated parameters, batch 1).
VALIDATION_PRESET, VALIDATION_TARGET = "llama-1b-32k", "h200"
VALIDATION = {8192: 11.2, 32768: 30.6}
VALIDATION_OVERRIDES = ("batch_size=1", "mesh.data=1", "mesh.seq=1", "param_sharding=replicated",
                        "model.attn_impl=chunked")


def _dry_run(preset: str, target: str | None, timeout: int, overrides=()) -> dict:
    cmd = [sys.executable, str(ROOT / "train.py"), "--config",
           str(ROOT / "configs" / f"{preset}.yaml"), "--dry-run"]
    if target:
        cmd += ["--target", target]
    cmd += list(overrides)
    shown = ["python", "train.py", "--config", f"configs/{preset}.yaml", "--dry-run"] + (
        ["--target", target] if target else []) + list(overrides)
    # train.py asks for as many CPU devices as the mesh has (a target compile lowers there);
    # the 8 that _common asked for this process must not win in the child
    env = dict(os.environ, XLA_FLAGS=re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                            os.environ.get("XLA_FLAGS", "")).strip())
    t0 = time.time()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                             env=env)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(shown), "error": f"no answer in {timeout} s"}
    row = {"command": " ".join(shown), "wall_seconds": round(time.time() - t0, 1)}
    last = out.stdout.strip().splitlines()[-1:] if out.stdout.strip() else []
    if out.returncode != 0 or not last or not last[0].startswith("{"):
        err = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
        row["error"] = (f"exit {out.returncode}: " + " | ".join(err[-3:]))[-1500:]
        return row
    result = json.loads(last[0])
    row.update({k: result[k] for k in KEEP if k in result})
    return row


def _generation(model_preset: str, prompt: int, target: str) -> dict:
    from ulysses_jax import gpu_target, make_mesh
    from ulysses_jax.config import load_config
    from ulysses_jax.generation.abstract import compiled_programs
    cfg = load_config(str(ROOT / "configs" / f"{model_preset}.yaml"), [])
    t = gpu_target.load(target)
    mesh = make_mesh(seq=8, data=1, devices=gpu_target.devices(t, 8))
    t0 = time.time()
    with gpu_target.compiling_for(t):
        progs = compiled_programs(cfg.model, mesh, batch=1, prompt_len=prompt, new_tokens=64)
    from ulysses_jax.hlo import attention_kernels, collective_counts
    from ulysses_jax.training.dry_run import device_and_host_bytes
    row = {"model": model_preset, "prompt_len": prompt, "new_tokens": 64, "batch": 1,
           "mesh": {"data": 1, "seq": 8}, "compile_seconds": round(time.time() - t0, 1)}
    for name, prog in progs.items():
        device, host = device_and_host_bytes(prog)
        text = prog.as_text()
        row[name] = {"peak_bytes_per_device": device, "host_bytes_per_device": host,
                     "collectives": collective_counts(text),
                     "attention_kernels": attention_kernels(text)}
    return row


def _gib(b) -> str:
    return "-" if b is None else f"{b / GIB:.2f}"


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fits(row: dict) -> str:
    """Whether the device peak is within the target's memory (its target file's size)."""
    peak, size = row.get("peak_bytes_per_device"), row.get("device_memory_bytes")
    return "-" if peak is None or not size else ("yes" if peak <= size else "no")


def markdown(result: dict) -> str:
    """docs/PERF.md's table of the presets from a results file: GPU and CPU compiler side by
    side, device and host GiB per device (host only where the preset offloads)."""
    def cell(row):
        if not row:
            return "not run"
        if "error" in row:
            return "error (results file)"
        host = row.get("host_bytes_per_device") or 0
        return _gib(row["peak_bytes_per_device"]) + (f" / {_gib(host)} host" if host else "")
    lines = [f"| preset | GPUs x tokens | GPU compiler ({result['target']}), GiB | fits its memory | "
             "CPU compiler, GiB | cuDNN calls (fwd+bwd) | step s, model | tokens/s per GPU, "
             "model | MFU, model |", "|---|---|--:|:-:|--:|--:|--:|--:|--:|"]
    for preset, rows in result.get("train_steps", {}).items():
        gpu, cpu = rows.get("gpu", {}), rows.get("cpu", {})
        ref = gpu if "mesh" in gpu else cpu
        mesh = ref.get("mesh", {})
        n = mesh.get("data", 1) * mesh.get("ring", 1) * mesh.get("seq", 1)
        k = gpu.get("attention_kernels", {})
        lines.append(f"| `{preset}` | {n} x {ref.get('seq_len', 0):,} | {cell(gpu)} | "
                     f"{_fits(gpu)} | {cell(cpu)} | "
                     f"{k.get('cudnn', 0)} + {k.get('cudnn_backward', 0)} | "
                     f"{_num(gpu.get('step_seconds_model'), '.2f')} | "
                     f"{_num(gpu.get('tokens_per_second_per_gpu_model'), ',.0f')} | "
                     f"{_num(gpu.get('mfu_model'), '.1%')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--compilers", default="gpu,cpu",
                    help="gpu (XLA's GPU compiler for --target), cpu (8 fake CPU devices)")
    ap.add_argument("--generation", action="store_true",
                    help="also the 1B and 8B prefill (32k prompt) and decode programs, P = 8")
    ap.add_argument("--validate", action="store_true",
                    help="also the 1B step for one H200 at 8k and 32k, against the temporaries "
                         "the real H200 compiled")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per compile")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--markdown", action="store_true",
                    help="print the results file's table (docs/PERF.md) and compile nothing")
    args = ap.parse_args(argv)
    path = os.path.join(args.out, target_name("gpu_compile.json", args.target))
    if args.markdown:
        if not os.path.isfile(path):
            print(f"error: no results file {path}: run the benchmark first", file=sys.stderr)
            return 2
        print(markdown(json.load(open(path))))
        return 0
    presets = [p for p in args.presets.split(",") if p]
    compilers = [c for c in args.compilers.split(",") if c]
    unknown = [p for p in presets if not (ROOT / "configs" / f"{p}.yaml").is_file()]
    if unknown or not set(compilers) <= {"gpu", "cpu"}:
        print(f"error: unknown presets {unknown} or compilers {compilers} (gpu, cpu)",
              file=sys.stderr)
        return 2
    from ulysses_jax import gpu_target  # (_common let its CUDA plugin start without a GPU)
    if "gpu" in compilers and not gpu_target.cuda_plugin_installed():
        print(f"error: the gpu column needs jax's CUDA plugin: {gpu_target.install_hint()}",
              file=sys.stderr)
        return 2
    result = json.load(open(path)) if os.path.isfile(path) else {}
    result.update({"command": command_line(__file__, argv),
                   "date": time.strftime("%Y-%m-%d"), "target": args.target})
    rows = result.setdefault("train_steps", {})
    print(f"{'preset':28} {'compiler':8} {'device GiB':>10} {'host GiB':>9} {'a2a':>4} "
          f"{'cudnn':>5} {'s':>6} {'MFU (model)':>11}  note", flush=True)
    for preset in presets:
        for c in compilers:
            row = _dry_run(preset, args.target if c == "gpu" else None, args.timeout)
            row["date"] = result["date"]
            rows.setdefault(preset, {})[c] = row
            with open(path, "w") as f:  # after every row: a long run keeps what it has
                json.dump(result, f, indent=1)
            note = row.get("error", "")
            print(f"{preset:28} {c:8} {_gib(row.get('peak_bytes_per_device')):>10} "
                  f"{_gib(row.get('host_bytes_per_device')):>9} "
                  f"{row.get('collectives', {}).get('all-to-all', '-'):>4} "
                  f"{row.get('attention_kernels', {}).get('cudnn', '-'):>5} "
                  f"{row.get('wall_seconds', '-'):>6} {_num(row.get('mfu_model'), '.1%'):>11}  "
                  f"{note[:200]}", flush=True)
    if args.validate:
        val = result.setdefault("validation", {})
        for seq_len, measured in VALIDATION.items():
            row = _dry_run(VALIDATION_PRESET, VALIDATION_TARGET, args.timeout,
                           (f"seq_len={seq_len}", *VALIDATION_OVERRIDES))
            row["h200_measured_temp_gib"] = measured
            val[str(seq_len)] = row
            print(f"{VALIDATION_PRESET} on one {VALIDATION_TARGET}, {seq_len} tokens: "
                  f"temporaries deviceless {_gib(row.get('temp_bytes'))} GiB, on the H200 "
                  f"{measured} GiB {row.get('error', '')[:200]}", flush=True)
    if args.generation:
        gen = result.setdefault("generation", {})
        for preset, prompt in GENERATION.items():
            row = _generation(preset, prompt, args.target)
            gen[preset] = row
            print(f"{preset} generation P=8, {prompt}-token prompt: prefill "
                  f"{_gib(row['prefill']['peak_bytes_per_device'])} GiB (cudnn "
                  f"{row['prefill']['attention_kernels']['cudnn']}), decode "
                  f"{_gib(row['decode']['peak_bytes_per_device'])} GiB, all-to-alls "
                  f"{row['decode']['collectives'].get('all-to-all', 0)} "
                  f"({row['compile_seconds']} s)", flush=True)
    write_results(args.out, os.path.basename(path), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
