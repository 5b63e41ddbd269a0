"""What the offloaded AdamW update costs on the host: ``optimizer.offload``'s host computation
(training/optimizer.offloaded_update, compiled by XLA:CPU, as XLA:GPU compiles a host
computation for the CPU beside the GPUs) against DeepSpeed's CPU Adam (``DeepSpeedCPUAdam``,
what ZeRO-Offload and ALST step with), on the same parameters, on this machine's CPU.

    python benchmarks/host_update.py [--params 67108864,268435456] [--repeats 5] [--no-deepspeed]

For each size: the parameters as a stack of [4096, 4096] weight matrices (the 8B presets'
shape of layer weight, decayed) and a norm scale, fp32, with their AdamW moments; the gradient
in bf16 for the matrices (as the device returns it under offload) and fp32 for the scale. Ours:
``jax.jit(offloaded_update)`` with the state donated (each buffer aliased with its own new
value, as in the train step), the clip's norm given (the step sums it
on the devices). DeepSpeed: ``DeepSpeedCPUAdam(adamw_mode=True).step()`` over torch tensors of
the same sizes with fp32 gradients (ZeRO-Offload widens them while copying them in, not in
the step). Median of ``--repeats`` after one warm-up call; ns per parameter, and the memory
traffic that implies (ours reads 14 bytes a parameter and writes 12; DeepSpeed's 16 and 12).

Then the 8B presets' shares at the measured rate: ``llama3-8b-1gpu`` updates 8.03e9 parameters
on one host per step; ``llama3-8b-4m`` (ZeRO-3 over 8 GPUs) 1.0e9 per GPU, 8.03e9 per host,
beside the step's compute: the model's FLOPs per GPU (``flops_per_device`` of their dry runs)
at an H100's 989 TFLOP/s dense bf16, a lower bound on the step (modeled, not measured).
This machine: 2 cores shared with whatever else runs; a GPU server's host has more cores and
memory bandwidth, and XLA's host runtime decides its threads there (not measured).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import _common  # noqa: F401  (repository on sys.path, before JAX starts)
from _common import command_line, ints, write_results

PARAMS_8B = 8_030_261_248
# model FLOPs per GPU and step of the presets (train.py --config PRESET --dry-run --target h100)
PRESETS = {"llama3-8b-1gpu": {"gpus": 1, "flops_per_device": 2.3978e17},
           "llama3-8b-4m": {"gpus": 8, "flops_per_device": 1.7530e18}}
H100_BF16_FLOPS = 989e12
SIDE = 4096


def _ours(n: int, repeats: int) -> list[float]:
    import jax
    import jax.numpy as jnp
    from ulysses_jax.config import load_config
    from ulysses_jax.training.optimizer import make_optimizer, offloaded_update
    cfg = load_config(os.path.join(_common.ROOT, "configs", "llama3-8b-1gpu.yaml"), [])
    layers = n // (SIDE * SIDE)
    key = jax.random.key(0)
    params = {"layers": {"w": jax.random.normal(key, (layers, SIDE, SIDE)) * 0.02},
              "final_norm": {"scale": jnp.ones((SIDE,))}}
    grads = {"layers": {"w": (jax.random.normal(jax.random.key(1), (layers, SIDE, SIDE))
                              * 1e-3).astype(jnp.bfloat16)},
             "final_norm": {"scale": jnp.full((SIDE,), 1e-3)}}
    opt_state = make_optimizer(cfg.optimizer, cfg.steps).init(params)
    host_update = offloaded_update(cfg.optimizer, cfg.steps)
    # The donated arguments in the order of the results, as the train step donates its state
    # (each buffer aliased with its own new value): jax pairs donated inputs with outputs of
    # the same shape in order, and (grads, opt_state, params) -> (params, opt_state) would
    # write the new parameters over mu, mu over nu and nu over the parameters, which costs
    # XLA four copies of every weight (2026-12-07: 4.16 ns a parameter against 2.05 aligned).
    update = jax.jit(lambda g, p, s, n: host_update(g, s, p, n), donate_argnums=(1, 2))
    norm = jnp.float32(0.5)
    times = []
    for i in range(repeats + 1):
        jax.block_until_ready((params, opt_state))
        t0 = time.perf_counter()
        params, opt_state = jax.block_until_ready(update(grads, params, opt_state, norm))
        if i:
            times.append(time.perf_counter() - t0)
    return times


def _deepspeed(n: int, repeats: int) -> list[float]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    w = torch.nn.Parameter(torch.randn(n // (SIDE * SIDE), SIDE, SIDE) * 0.02)
    s = torch.nn.Parameter(torch.ones(SIDE))
    w.grad, s.grad = torch.randn_like(w) * 1e-3, torch.full_like(s, 1e-3)
    opt = DeepSpeedCPUAdam([{"params": [w], "weight_decay": 0.1},
                            {"params": [s], "weight_decay": 0.0}], lr=1e-5, betas=(0.9, 0.95),
                           adamw_mode=True)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="67108864,268435456",
                    help="parameter counts to time (multiples of 4096 x 4096)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--out", default=os.path.join(_common.ROOT, "benchmarks", "results"))
    args = ap.parse_args(argv)
    sizes = ints(args.params)
    if any(n % (SIDE * SIDE) for n in sizes):
        ap.error(f"--params must be multiples of {SIDE * SIDE}, got {args.params}")
    rows = []
    print(f"{'params':>12} {'what':<22} {'median s':>9} {'ns/param':>9} {'GB/s':>6}")
    for n in sizes:
        runs = [("ours (XLA:CPU)", _ours(n, args.repeats), 26)]
        if not args.no_deepspeed:
            try:
                runs.append(("DeepSpeedCPUAdam", _deepspeed(n, args.repeats), 28))
            except Exception as e:  # noqa: BLE001 (not built here: say so, keep ours)
                print(f"DeepSpeed's CPU Adam did not run: {type(e).__name__}: {e}")
        for what, times, traffic in runs:
            med = statistics.median(times)
            rows.append({"params": n, "what": what, "times_s": times, "median_s": med,
                         "ns_per_param": med / n * 1e9, "bytes_per_param": traffic,
                         "gb_per_s": traffic * n / med / 1e9})
            print(f"{n:>12,} {what:<22} {med:>9.3f} {med / n * 1e9:>9.3f} "
                  f"{traffic * n / med / 1e9:>6.1f}")
    print("\nthe 8B presets' host update per step at the largest size's rate, beside the "
          "step's compute (model FLOPs at 989 TFLOP/s, a lower bound)")
    largest = [r for r in rows if r["params"] == max(sizes)]
    shares = []
    for preset, p in PRESETS.items():
        compute = p["flops_per_device"] / H100_BF16_FLOPS
        for r in largest:
            per_host = PARAMS_8B * r["ns_per_param"] / 1e9  # every GPU's share, one host
            shares.append({"preset": preset, "what": r["what"], "params_per_host": PARAMS_8B,
                           "update_s": per_host, "compute_lower_bound_s": compute,
                           "fraction": per_host / compute})
            print(f"  {preset:<16} {r['what']:<18} update {per_host:7.1f} s, compute >= "
                  f"{compute:7.1f} s ({100 * per_host / compute:.1f}%)")
    write_results(args.out, "host_update.json", {
        "command": command_line(__file__, argv), "cpus": os.cpu_count(),
        "rows": rows, "presets": shares})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
