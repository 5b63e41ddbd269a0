"""Memory per device of an MoE preset from compiled memory analysis (nothing allocated).

    python benchmarks/moe_memory.py [--config configs/qwen3-235b-a22b-128k.yaml]
        [--ps 1,16,32,64] [--activation-seq-lens 2048,131072] [--set KEY=VALUE ...]
        [--target h100] [--out-dir benchmarks/results]

Two measurements, both abstract compiles on fake CPU devices (``--xla_force_host_platform_
device_count`` = the largest P), XLA's per-device memory analysis; with ``--target h100``
(h200, a100) both are compiled by XLA's GPU compiler for P GPUs of that kind instead (no GPU
needed: jax's CUDA plugin, jax >= 0.11; lowered on the fake CPU devices), device and host
bytes apart:

1. The whole train step (forward, backward, AdamW update: ``dry_run.compile_step``, as
   ``--dry-run``) at the preset's ``seq_len`` with ``batch_size=1 mesh.data=1 mesh.seq=P``:
   experts split over the P devices (expert parallelism), everything else ZeRO-3 over the same
   P devices, Ulysses over them too. Its peak is what must fit a device. The all-to-alls of
   the compiled step (static count: a scan body counts once) and their result shapes per
   device are recorded too.
2. Activation memory without sequence parallelism (P=1): the temporaries of the forward and
   backward pass through all layers with the gradient taken only for the input embedding
   table (so no weight-gradient or optimizer buffers exist; the embedding gradient is the
   program's output, not a temporary). Measured at each ``--activation-seq-lens`` length; the
   difference between two lengths is the part that grows with the tokens, i.e. the
   activations, free of the per-layer weight casts that every length has.

Results: benchmarks/results/moe_memory.json (moe_memory_<target>.json with a target; with
the command and the times).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from _common import (ROOT, add_target, command_line, ints, require_target,  # noqa: E402
                     target_name, write_results)  # (first: sets up)

GIB = 2 ** 30


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen3-235b-a22b-128k.yaml")
    ap.add_argument("--ps", default="1,16,32,64", help="devices P (mesh.seq) for the step")
    ap.add_argument("--activation-seq-lens", default="2048,131072",
                    help="lengths of the P=1 activation measurement ('' to skip)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override (repeatable)")
    add_target(ap)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    ps = ints(args.ps)
    flags = os.environ.get("XLA_FLAGS", "")  # _common asked for 8; the step needs max(P)
    os.environ["XLA_FLAGS"] = flags.replace("device_count=8", f"device_count={max(ps + [8])}")

    require_target(args.target)
    import jax
    from ulysses_jax import gpu_target
    from ulysses_jax.config import load_config
    from ulysses_jax.hlo import collective_counts, collective_shapes
    from ulysses_jax.training.flops import active_params_per_token
    from ulysses_jax.training.dry_run import (compile_step, device_and_host_bytes,
                                              peak_bytes_per_device, target_mesh)
    from ulysses_jax.training.objectives.sft import objective
    from ulysses_jax.training.train_step import abstract_batch, state_layout
    from ulysses_jax.training.trainer import build_mesh

    gpu = gpu_target.load(args.target) if args.target else None

    config = str(ROOT / args.config) if not Path(args.config).is_absolute() else args.config
    base = ["batch_size=1", "mesh.data=1", *args.set]
    t_all = time.time()

    def activations(seq_len: int) -> dict:
        cfg = load_config(config, base + ["mesh.seq=1", f"seq_len={seq_len}"])
        mesh = target_mesh(cfg, gpu) if gpu else build_mesh(cfg)
        graphdef, abstract, _, _ = state_layout(cfg, mesh)
        params = dict(abstract["params"])
        embed = params.pop("embed")

        def loss(embed, rest, batch):
            return objective(graphdef, {**rest, "embed": embed}, batch, mesh)[0]

        t0 = time.time()
        grad = jax.jit(jax.grad(loss))
        batch = abstract_batch(cfg, mesh)
        compiled = (gpu_target.compile(grad, (embed, params, batch), gpu) if gpu else
                    grad.lower(embed, params, batch).compile())
        mem = compiled.memory_analysis()
        return {"seq_len": seq_len, "temp_bytes": int(mem.temp_size_in_bytes),
                "output_bytes": int(mem.output_size_in_bytes),
                "compile_seconds": round(time.time() - t0, 1)}

    act = []
    for s in ints(args.activation_seq_lens) if args.activation_seq_lens else []:
        act.append(activations(s))
        print(f"P=1 activations seq_len={s}: temp {act[-1]['temp_bytes'] / GIB:.2f} GiB "
              f"(compile {act[-1]['compile_seconds']} s)", flush=True)
    steps = []
    for p in ps:
        cfg = load_config(config, base + [f"mesh.seq={p}"])
        t0 = time.time()
        compiled, abstract = compile_step(cfg, target_mesh(cfg, gpu) if gpu else None, gpu)
        mem = compiled.memory_analysis()
        text = compiled.as_text()
        peak, host = (device_and_host_bytes(compiled) if gpu else
                      (peak_bytes_per_device(compiled), 0))
        steps.append({"p": p, "seq_len": cfg.seq_len,
                      "peak_bytes": peak, "host_bytes": host,
                      "argument_bytes": int(mem.argument_size_in_bytes),
                      "temp_bytes": int(mem.temp_size_in_bytes),
                      "all_to_all": collective_counts(text)["all-to-all"],
                      "all_to_all_shapes": sorted({str(list(x)) for x in
                                                   collective_shapes(text, "all-to-all")}),
                      "compile_seconds": round(time.time() - t0, 1)})
        print(f"P={p} train step seq_len={cfg.seq_len}: peak {steps[-1]['peak_bytes'] / GIB:.2f} "
              f"GiB, arguments {steps[-1]['argument_bytes'] / GIB:.2f} GiB, temp "
              f"{steps[-1]['temp_bytes'] / GIB:.2f} GiB (compile {steps[-1]['compile_seconds']} s)",
              flush=True)
    cfg = load_config(config, base)
    out = {"command": command_line(__file__, argv), "config": args.config,
           "model": {k: getattr(cfg.model, k) for k in (
               "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
               "num_experts", "num_experts_per_tok", "moe_ffn_dim", "moe_capacity_factor",
               "dtype", "remat")},
           "param_sharding": cfg.param_sharding,
           "active_params_per_token": active_params_per_token(cfg.model),
           "activations_p1": act, "train_step": steps,
           "compiler": gpu.device_kind if gpu else "cpu",
           "jax": jax.__version__, "python": platform.python_version(),
           "wall_seconds": round(time.time() - t_all, 1),
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    write_results(args.out_dir, target_name("moe_memory.json", args.target), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
