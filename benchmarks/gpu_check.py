"""Every GPU check of the open issues in one run, for a session that is lent a GPU.

    python benchmarks/gpu_check.py --out $OUT [--smoke] [--only attention_bf16,throughput,...]

Sections, each timed and written as soon as it finishes (so a timeout keeps what ran):
  1. attention_bf16: cudnn and chunked kernels against the dense reference in bf16 (P=1, and
     Ulysses over all visible GPUs when there are two or more), forward and gradients;
  2. throughput: tokens/s and MFU of the ~1B preset (configs/llama-1b-32k.yaml) on one GPU
     at 8k and 32k tokens (P=1), bf16, after warm-up;
  3. transformers: the same shape in transformers (bf16, SDPA) on the same GPU: tokens/s and
     peak memory of forward+backward, next to ours (no download: random init from a config);
  4. longest_8b: the longest sequence whose compiled 8B step fits one GPU with every memory
     option on (remat full, TiledMLP, chunked loss, zero3 is moot on one device).
Results: OUT/gpu_check.json plus the device, versions and date. ``--smoke`` shrinks every
size so the script can be checked on a CPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _attention_bf16(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from ulysses_jax import make_mesh, reference_attention, ulysses_attention

    out = {}
    s = 256 if smoke else 4096
    impls = ["chunked"] + (["cudnn"] if jax.default_backend() == "gpu" else [])
    n_dev = jax.device_count()
    ps = sorted({1, n_dev if n_dev >= 2 else 1})
    for impl in impls:
        for p in ps:
            mesh = make_mesh(seq=p, data=1, devices=jax.devices()[:p])
            ks = jax.random.split(jax.random.key(0), 4)
            q = jax.random.normal(ks[0], (1, s, 8 * p, 64), jnp.bfloat16)
            k = jax.random.normal(ks[1], (1, s, 2 * p, 64), jnp.bfloat16)
            v = jax.random.normal(ks[2], (1, s, 2 * p, 64), jnp.bfloat16)
            ct = jax.random.normal(ks[3], q.shape, jnp.bfloat16)

            def run(fn, dtype):
                args = [x.astype(dtype) for x in (q, k, v)]
                o, vjp = jax.vjp(fn, *args)
                return (o, *vjp(ct.astype(dtype)))

            got = jax.jit(lambda: run(lambda q, k, v: ulysses_attention(
                q, k, v, mesh=mesh, impl=impl), jnp.bfloat16))()
            # The truth: the same bf16 inputs, computed in fp32 by the dense reference.
            ref = jax.jit(lambda: run(reference_attention, jnp.float32))()
            errs = {}
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                a, b = a.astype(jnp.float32), b.astype(jnp.float32)
                errs[name] = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
            out[f"{impl}_p{p}"] = {"rel_err": errs, "pass": all(e <= 1e-2 for e in errs.values())}
    return out


def _throughput(smoke: bool, steps: int = 5) -> dict:
    import jax
    import numpy as np
    from ulysses_jax.config import load_config
    from ulysses_jax.training.trainer import build_mesh, peak_flops
    from ulysses_jax.training.train_step import init_state, make_train_step

    out = {}
    lens = [512, 1024] if smoke else [8192, 32768]
    for s in lens:
        over = [f"seq_len={s}", "batch_size=1", "mesh.data=1", "mesh.seq=1",
                "param_sharding=replicated"]
        if smoke:
            over += ["model.n_layers=1", "model.d_model=64", "model.ffn_dim=128",
                     "model.vocab_size=512", "model.head_dim=8", "model.dtype=float32"]
        cfg = load_config("configs/llama-1b-32k.yaml", over)
        mesh = build_mesh(cfg)
        graphdef, state, sh, tx = init_state(cfg, mesh)
        step = make_train_step(cfg, mesh, graphdef, tx, sh)
        rng = np.random.default_rng(0)
        toks = rng.integers(0, cfg.model.vocab_size, (1, s + 1)).astype(np.int32)
        batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:],
                 "loss_mask": np.ones((1, s), np.float32), "segment_ids": np.ones((1, s), np.int32),
                 "positions": np.arange(s, dtype=np.int32)[None]}
        compiled = step.lower(state, batch).compile()
        cost = compiled.cost_analysis()
        flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost).get("flops", 0))
        for _ in range(2):
            state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        t0 = time.perf_counter()
        for _ in range(steps):
            state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        dt = (time.perf_counter() - t0) / steps
        peak = peak_flops(jax.devices()[0])
        stats = jax.devices()[0].memory_stats() or {}
        out[f"seq{s}"] = {"step_s": dt, "tokens_per_sec": s / dt, "flops_per_step": flops,
                          "mfu": flops / dt / peak if peak else None,
                          "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                          "loss": float(m["loss"])}
    return out


def _transformers(smoke: bool, steps: int = 5) -> dict:
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = transformers.LlamaConfig(
        hidden_size=64 if smoke else 2048, intermediate_size=128 if smoke else 8192,
        num_hidden_layers=1 if smoke else 16, num_attention_heads=32 if not smoke else 8,
        num_key_value_heads=8 if not smoke else 2, head_dim=64 if not smoke else 8,
        vocab_size=512 if smoke else 128256, tie_word_embeddings=True,
        rope_theta=500000.0, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(dev, dtype)
    model.gradient_checkpointing_enable()
    out = {}
    for s in ([512, 1024] if smoke else [8192, 32768]):
        tokens = torch.randint(0, cfg.vocab_size, (1, s), device=dev)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for i in range(2 + steps):
            if i == 2:
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        out[f"seq{s}"] = {"step_s": dt, "tokens_per_sec": s / dt,
                          "peak_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else None,
                          "note": "forward+backward only (no optimizer), gradient checkpointing"}
    return out


def _longest_8b(smoke: bool) -> dict:
    import jax
    from ulysses_jax.config import load_config
    from ulysses_jax.plan import longest_fitting_seq_len

    stats = jax.devices()[0].memory_stats() or {}
    budget = int(stats.get("bytes_limit", 139 * 2 ** 30))
    over = ["mesh.data=1", "mesh.seq=1", "param_sharding=replicated", "model.remat=full",
            "model.mlp_chunk=2048"]
    if smoke:
        over += ["model.n_layers=1", "model.d_model=64", "model.ffn_dim=128", "model.n_heads=8",
                 "model.n_kv_heads=2", "model.head_dim=8", "model.vocab_size=512"]
        budget = 64 * 2 ** 20
    cfg = load_config("configs/llama3-8b-128k.yaml", over + ["seq_len=1024"])
    # Coarse steps keep this to about ten compiles of the 32-layer step.
    best = longest_fitting_seq_len(cfg, budget, granularity=1024 if smoke else 16384,
                                   max_seq_len=1 << 18, progress=print)
    return {"budget_bytes": budget, "longest_seq_len": best, "overrides": over}


SECTIONS = {"attention_bf16": _attention_bf16, "throughput": _throughput,
            "transformers": _transformers, "longest_8b": _longest_8b}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script on CPU")
    p.add_argument("--only", help="comma-separated sections")
    args = p.parse_args()
    import jax
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": str(jax.devices()[0].device_kind), "device_count": jax.device_count(),
              "backend": jax.default_backend(), "jax": jax.__version__,
              "python": platform.python_version(), "smoke": args.smoke, "sections": {}}
    for name in (args.only.split(",") if args.only else SECTIONS):
        t0 = time.time()
        try:
            res = {"result": SECTIONS[name](args.smoke)}
        except Exception as e:  # a failing section must not lose the others' results
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.time() - t0, 1)
        result["sections"][name] = res
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(name, json.dumps(res)[:2000], flush=True)
    print("wrote", path)


if __name__ == "__main__":
    main()
