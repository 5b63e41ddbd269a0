"""The step-time model (ulysses_jax/time_model.py) against every GPU time measured so far.

    python benchmarks/time_model.py [--only steps,attention] [--out benchmarks/results]

The measurements are one H200's, 2026-11-30 (../shared/H200.md, jax 0.11.2, main at 88ebeb9):
  steps      the 1B preset's train step on one H200 (``configs/llama-1b-32k.yaml`` with one
             device, batch 1, replicated parameters, remat save_dots as it was then, AdamW):
             8,192 tokens with the chunked kernel (0.895 s) and with cuDNN over a dense
             [S, S] document mask (0.246 s), 32,768 with the chunked kernel (11.57 s).
             Each is compiled here
             by XLA's GPU compiler for one H200 (``train.py --dry-run --target h200``) and
             modeled. The dense-mask cuDNN kernel is gone (``impl=cudnn`` now takes cuDNN's
             packed layout): that row models today's program and, beside it, the same with
             its cuDNN attention time scaled by what the dense mask cost per call on the H200
             (8.95 ms against 4.17 plain causal, head dim 128).
  attention  one attention forward + backward, bf16, causal, batch 1, 32 query / 8 kv heads,
             compiled alone for one H200: cuDNN and the chunked kernel at 8k and 32k, head
             dims 128 and 64, and XLA's dense attention at 8k. The cuDNN and chunked rates of
             the model are these measurements (targets/h200.txtpb), so their rows check the
             reading of the program, not the rates; XLA's dense attention is priced from its
             fusions and GEMMs, an independent check.

Prints a table (modeled, measured, model / measured) and writes
benchmarks/results/time_model.json. No GPU is used: every modeled figure is a model.
"""
from __future__ import annotations

import argparse
import time

from _common import command_line, write_results

# ../shared/H200.md, seconds
STEPS = (
    ("1B, 8,192 tokens, chunked kernel", 8192, ("model.attn_impl=chunked",), 0.895, None),
    ("1B, 8,192 tokens, cuDNN (measured: dense mask; modeled: packed layout)", 8192, (),
     0.246, 8.95 / 4.17),
    ("1B, 32,768 tokens, chunked kernel", 32768, ("model.attn_impl=chunked",), 11.57, None),
)
ONE_H200 = ("batch_size=1", "mesh.data=1", "mesh.seq=1", "param_sharding=replicated")
# ms per forward + backward call (../shared/H200.md): (kernel, seq, head_dim) -> ms
ATTENTION = {("cudnn", 8192, 128): 4.17, ("cudnn", 32768, 128): 53.8,
             ("cudnn", 8192, 64): 2.90, ("cudnn", 32768, 64): 35.3,
             ("chunked", 8192, 128): 38.5, ("chunked", 32768, 128): 585,
             ("chunked", 8192, 64): 36.6, ("chunked", 32768, 64): 534,
             ("xla", 8192, 128): 23.8, ("xla", 8192, 64): 23.5}


def model_step(seq_len: int, overrides) -> dict:
    """The 1B step as the H200 ran it: save_dots as it was then (the weight matmuls' outputs
    only; it now keeps the fused attention's forward too, which the H200's run recomputed)."""
    import jax
    from ulysses_jax.config import load_config
    from ulysses_jax.models import decoder
    from ulysses_jax.training.dry_run import dry_run
    from _common import ROOT
    cfg = load_config(str(ROOT / "configs" / "llama-1b-32k.yaml"),
                      [*ONE_H200, f"seq_len={seq_len}", *overrides])
    now = decoder._REMAT_POLICIES["save_dots"]
    decoder._REMAT_POLICIES["save_dots"] = \
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    try:
        return dry_run(cfg, target="h200")
    finally:
        decoder._REMAT_POLICIES["save_dots"] = now


def model_attention(kernel: str, seq: int, head_dim: int) -> float:
    """Modeled seconds of one attention forward + backward compiled alone for one H200."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding
    from ulysses_jax import gpu_target, time_model
    from ulysses_jax.attention.kernels import local_attention
    target = gpu_target.load("h200")

    def loss(q, k, v):
        return local_attention(q, k, v, causal=True, impl=kernel).astype(jnp.float32).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    q = jax.ShapeDtypeStruct((1, seq, 32, head_dim), jnp.bfloat16, sharding=cpu)
    kv = jax.ShapeDtypeStruct((1, seq, 8, head_dim), jnp.bfloat16, sharding=cpu)
    compiled = gpu_target.compile(step, (q, kv, kv), target)
    return time_model.step_time(compiled.as_text(), target.config_text, 1)["seconds"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="steps,attention")
    ap.add_argument("--out", default=None, help="results directory (default "
                                               "benchmarks/results)")
    args = ap.parse_args(argv)
    from _common import ROOT, require_target
    require_target("h200")
    only = set(args.only.split(","))
    result = {"command": command_line(__file__, argv), "date": time.strftime("%Y-%m-%d"),
              "measured": "one H200, 2026-11-30, jax 0.11.2 (../shared/H200.md)",
              "modeled": "XLA's GPU compiler for one H200 here (jax 0.12.0.1), priced by "
                         "ulysses_jax/time_model.py with targets/h200.txtpb's rates",
              "steps": [], "attention": []}
    print(f"{'what':74} {'modeled':>9} {'measured':>9} {'ratio':>6}")
    if "steps" in only:
        for name, seq, over, measured, dense_ratio in STEPS:
            r = model_step(seq, over)
            modeled = r["step_seconds_model"]
            row = {"name": name, "seq_len": seq, "overrides": list(over),
                   "modeled_seconds": modeled, "measured_seconds": measured,
                   "ratio": round(modeled / measured, 3), "mfu_model": r["mfu_model"],
                   "time_by_kind": r["time_by_kind"],
                   "time_top_other_model": r["time_top_other_model"]}
            print(f"{name[:74]:74} {modeled:9.3f} {measured:9.3f} {modeled / measured:6.2f}",
                  flush=True)
            if dense_ratio:  # the same program with the dense-mask kernel's measured cost
                adjusted = modeled + r["time_by_kind"]["attention_cudnn"] * (dense_ratio - 1)
                row["modeled_with_dense_mask_seconds"] = round(adjusted, 4)
                row["dense_mask_over_causal"] = round(dense_ratio, 3)
                print(f"{'  the same, cuDNN attention x %.2f (the dense mask, measured)' % dense_ratio:74}"
                      f" {adjusted:9.3f} {measured:9.3f} {adjusted / measured:6.2f}", flush=True)
            result["steps"].append(row)
    if "attention" in only:
        for (kernel, seq, head), ms in ATTENTION.items():
            modeled = model_attention(kernel, seq, head) * 1e3
            result["attention"].append({"kernel": kernel, "seq_len": seq, "head_dim": head,
                                        "modeled_ms": round(modeled, 2), "measured_ms": ms,
                                        "ratio": round(modeled / ms, 3)})
            print(f"{f'attention fwd+bwd, {kernel}, {seq} tokens, head dim {head} (ms)':74} "
                  f"{modeled:9.2f} {ms:9.2f} {modeled / ms:6.2f}", flush=True)
    write_results(args.out or str(ROOT / "benchmarks" / "results"), "time_model.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
