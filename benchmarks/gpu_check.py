"""Every GPU check in one run, for a session that is lent a GPU.

    python benchmarks/gpu_check.py --out $OUT [--smoke] [--only env,attention_bf16,...]
        [--pytest-timeout 420]

Sections run in this order, each timed and written to OUT/gpu_check.json as soon as it
finishes (a timeout keeps what ran); a failing section records its error and the next runs:
  env              device, compute capability, cuDNN and package versions; the kernel that
                   impl="auto" picks with and without segment ids on this GPU.
  attention_bf16   correctness: cuDNN (plain causal), cuDNN's packed layout (segment ids,
                   what training runs) and the chunked kernel, bf16 forward and gradients,
                   against the dense fp32 reference on the same inputs (P=1, and Ulysses over
                   all GPUs when there are two or more); max |err| / max |ref| <= 1e-2.
  packed_attention time of one attention forward+backward on packed rows (4 documents, random
                   boundaries), causal, bf16, 32 query / 8 kv heads: ours with impl=auto (the
                   packed cuDNN layout), the chunked kernel with and without segment skipping,
                   cuDNN on the same length without documents (a bound), torch SDPA (causal,
                   no documents: torch has no packed path there); 8k and 32k, head dims 128, 64.
  window_attention sliding window W=1024: cuDNN's window (plain; packed layout,
                   which decides cudnn.PACKED_WINDOW_CHECKED) and the chunked kernel, bf16,
                   against the fp32 reference with the window; forward+backward times at 8k
                   and 32k, 32 query / 8 kv heads of 128, cuDNN and chunked, with and
                   without the window.
  throughput       the 1B preset (configs/llama-1b-32k.yaml) on one GPU: rows packed with 4
                   documents, batch 1, bf16, AdamW step included, 8k and 32k tokens, each
                   remat policy in --remat; tokens/s, step time, MFU from the model's FLOPs
                   (training/flops.py), XLA's FLOPs beside it, peak bytes in use; beside
                   each step the time model's figure for this GPU's own compiled program
                   (ulysses_jax/time_model.py, the target file of this GPU's kind), and a
                   bf16 GEMM's measured TFLOP/s (the model's matmul_bf16_tflops).
  accumulation     the same preset at 8k: one optimizer step over 4 micro-batches of one row
                   (grad_accum_steps=4) beside the plain step on one row and on all four at
                   once: time per step, tokens/s, peak bytes; loss and gradient norm against
                   the all-at-once step's (rows with different supervised counts; 1e-2).
  lora             the same preset at 8k with LoRA (rank 16 on every projection, frozen layer
                   matrices in bf16) beside the full step: time, tokens/s, peak bytes, trained
                   parameters; the first step's losses are equal (B starts at 0).
  transformers     transformers' LlamaForCausalLM of the same shape (bf16, SDPA, gradient
                   checkpointing, forward+backward, no optimizer): tokens/s and peak memory.
  generate         generation: the same preset's model (random weights, bf16) and
                   transformers' of its shape (bf16, SDPA): prefill tokens/s of one 32k-token
                   prompt and decode ms per token over 32 greedy tokens, ours and theirs.
  rollout          GRPO's sampling on one GPU: the 1B preset's model (random weights, bf16),
                   4 prompts of 8,192 tokens x 8 samples of up to 256 tokens at temperature 1,
                   stop ids (3% of the vocabulary) hit at different steps; wall, prefill and
                   decode seconds and the decode program's peak bytes for each prompt
                   written 8 times, num_samples=8, and num_samples=8 with finished rows
                   dropped (benchmarks/_rollout.py); whether the three give the same tokens.
  grpo             GRPO end to end with train.py's loop: the 1B preset's model
                   (random weights, bf16, the byte tokenizer) on one GPU, 2 prompts of 8,192
                   tokens x 4 completions of up to 512, 3 steps (no warm-up): per step the
                   sampling seconds, the step's seconds, completion lengths (metrics.jsonl).
  longest_8b       the longest sequence whose compiled 8B step fits this GPU (planner search;
                   returns at once with "none" when the shortest probe does not fit).
  offload_8b       the one-GPU 8B preset (host offload of checkpoints and optimizer): the GPU
                   compiler's memory analysis at the preset's length against the CPU
                   planner's, and one executed step at 131,072 tokens (time, peak bytes).
  qwen3_next       Gated DeltaNet: the chunked delta rule with the convolution in
                   bf16 against the fp32 step-by-step recurrence (forward and gradients, packed
                   documents; max |err| / max |ref| <= 1e-2); forward+backward time of one
                   Qwen3-Next-80B-shaped DeltaNet core (32 value heads of 128) against cuDNN
                   attention (16 / 2 heads of 256) at 8k and 32k; the GPU compiler's peak of
                   the one-layer train steps of benchmarks/deltanet_memory.py (DeltaNet vs
                   attention layer, target ratio <= 1.2).
  pytest           the test suite on this host (one GPU: the GPU tests on the GPU, the rest on
                   8 CPU devices as in CI), in a subprocess with --pytest-timeout; pass and
                   fail counts and the failures' names.
``--smoke`` shrinks every size so the script can be checked on a CPU (the GPU-only parts
report themselves skipped). Targets: at least 45,000 tokens/s at 8k and 28,000 at
32k, MFU at least 45% at 32k.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# ----------------------------------------------------------------------------- helpers

# --smoke: the 1B preset shrunk to a model that compiles and steps in seconds on a CPU.
SMOKE_1B = ["model.n_layers=1", "model.d_model=64", "model.ffn_dim=128", "model.vocab_size=512",
            "model.head_dim=8", "model.dtype=float32"]


def _packed_row(rng, s: int, vocab: int, seed: int) -> dict:
    """One training row [1, S] of random tokens (``rng``) packed with 4 documents (boundaries
    from ``seed``); no target across a document boundary."""
    import numpy as np
    toks = rng.integers(0, vocab, (1, s + 1)).astype(np.int32)
    seg, pos = _packed_segments(s, 4, seed=seed)
    mask = np.ones((1, s), np.float32)
    mask[0, :-1][seg[0, 1:] != seg[0, :-1]] = 0
    return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": mask,
            "segment_ids": seg, "positions": pos}


def _packed_segments(s: int, docs: int, seed: int):
    """[1, S] ids 1..docs with random boundaries, and per-document positions [1, S]."""
    import numpy as np
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, s), docs - 1, replace=False))
    seg = 1 + np.searchsorted(cuts, np.arange(s), side="right")
    starts = np.concatenate([[0], cuts])
    pos = np.arange(s) - starts[seg - 1]
    return seg[None].astype(np.int32), pos[None].astype(np.int32)


def _timed(fn, args, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` after warm-up (results blocked on)."""
    import statistics
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _on_gpu() -> bool:
    import jax
    return jax.default_backend() == "gpu"


def _fwd_bwd(attn):
    import jax

    def run(q, k, v, ct):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out, *vjp(ct))
    return jax.jit(run)


# ----------------------------------------------------------------------------- sections

def _env(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from ulysses_jax.attention import cudnn
    from ulysses_jax.attention.kernels import resolve_impl
    dev = jax.devices()[0]
    cap = cudnn.compute_capability(dev)
    out = {"device": dev.device_kind, "platform": dev.platform, "compute_capability": cap,
           "jax": jax.__version__, "devices": jax.device_count()}
    try:
        from jax._src.lib import cuda_versions
        out["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception as e:  # noqa: BLE001 - informational only
        out["cudnn"] = f"unknown ({e})"
    for name in ("flax", "optax", "orbax.checkpoint", "chex", "torch", "transformers"):
        try:
            out[name] = __import__(name, fromlist=["__version__"]).__version__
        except Exception as e:  # noqa: BLE001
            out[name] = f"missing ({type(e).__name__})"
    for h in (64, 128):
        out[f"auto_kernel_h{h}"] = {
            seg: resolve_impl("auto", jnp.bfloat16, h, backend=dev.platform, segments=seg,
                              capability=cap, heads=(32, 8))
            for seg in (False, True)}
    return out


def _attention_bf16(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from ulysses_jax import make_mesh, reference_attention, ulysses_attention
    from ulysses_jax.attention.ulysses import mesh_kernel

    out = {}
    s = 256 if smoke else 4096
    n_dev = jax.device_count()
    ps = sorted({1, n_dev if n_dev >= 2 else 1})
    impls = ["chunked"] + (["cudnn"] if _on_gpu() else [])
    for p in ps:
        mesh = make_mesh(seq=p, data=1, devices=jax.devices()[:p])
        ks = jax.random.split(jax.random.key(p), 4)
        q = jax.random.normal(ks[0], (1, s, 8 * p, 128), jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, s, 2 * p, 128), jnp.bfloat16)
        v = jax.random.normal(ks[2], (1, s, 2 * p, 128), jnp.bfloat16)
        ct = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
        seg_np, _ = _packed_segments(s, 4, seed=p)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
        for segments in (False, True):
            seg = jnp.asarray(seg_np) if segments else None
            ref = _fwd_bwd(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg))(*f32)
            for impl in impls:
                try:
                    kernel = mesh_kernel(impl, q, mesh, segments, (8, 2))
                    got = _fwd_bwd(lambda q, k, v: ulysses_attention(
                        q, k, v, mesh=mesh, segment_ids=seg, impl=impl))(q, k, v, ct)
                except ValueError as e:  # e.g. packed layout refused on this GPU
                    out[f"{impl}_p{p}_seg{int(segments)}"] = {"refused": str(e)}
                    continue
                errs = {name: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) /
                                    jnp.max(jnp.abs(b)))
                        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
                out[f"{impl}_p{p}_seg{int(segments)}"] = {
                    "kernel": kernel, "rel_err": errs,
                    "pass": all(e <= 1e-2 for e in errs.values())}
    return out


def _packed_attention(smoke: bool, repeats: int = 5) -> dict:
    import jax
    import jax.numpy as jnp
    from ulysses_jax import make_mesh, ulysses_attention
    from ulysses_jax.attention import chunked
    from ulysses_jax.attention.ulysses import mesh_kernel

    out = {}
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    lens = [512] if smoke else [8192, 32768]
    dims = [32] if smoke else [128, 64]
    heads = (8, 2) if smoke else (32, 8)
    for s in lens:
        for h in dims:
            ks = jax.random.split(jax.random.key(s + h), 4)
            q = jax.random.normal(ks[0], (1, s, heads[0], h), jnp.bfloat16)
            k = jax.random.normal(ks[1], (1, s, heads[1], h), jnp.bfloat16)
            v = jax.random.normal(ks[2], (1, s, heads[1], h), jnp.bfloat16)
            ct = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
            seg = jnp.asarray(_packed_segments(s, 4, seed=s)[0])
            flops = 3.5 * 2 * heads[0] * s * s * h  # causal fwd+bwd, as in shared/H200.md
            row = {"auto_kernel": mesh_kernel("auto", q, mesh, True, heads)}
            variants = {
                "ours_auto_packed": lambda q, k, v: ulysses_attention(
                    q, k, v, mesh=mesh, segment_ids=seg, max_segments=8),
                "chunked_segment_skip": lambda q, k, v: chunked.chunked_attention(
                    q, k, v, causal=True, segment_ids=seg),
            }
            if s <= 8192 or smoke:  # the kernel as it was: 0.6 s at 32k, not worth the time
                plan = chunked._Plan(s, s, min(512, s), min(512, s), True, skip_segments=False)
                variants["chunked_causal_only"] = lambda q, k, v: chunked._attention(
                    q, k, v, seg, plan, h ** -0.5)
            if _on_gpu():
                variants["cudnn_no_documents"] = lambda q, k, v: ulysses_attention(
                    q, k, v, mesh=mesh, impl="cudnn")
            for name, fn in variants.items():
                try:
                    dt = _timed(_fwd_bwd(fn), (q, k, v, ct), 2, repeats)
                    row[name] = {"ms": dt * 1e3, "causal_tflops": flops / dt / 1e12}
                except Exception as e:  # noqa: BLE001 - keep the other variants
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            row["torch_sdpa_causal"] = _torch_sdpa(s, heads, h, repeats, flops)
            out[f"s{s}_h{h}"] = row
    return out


def _window_attention(smoke: bool, repeats: int = 5) -> dict:
    """Sliding window: cuDNN's window (plain and packed layout) and the chunked
    kernel, bf16, against the fp32 reference (forward and gradients); then times of one
    forward + backward with and without the window. What "auto" picks is recorded too."""
    import jax
    import jax.numpy as jnp
    from ulysses_jax import make_mesh, reference_attention, ulysses_attention
    from ulysses_jax.attention import cudnn
    from ulysses_jax.attention.ulysses import mesh_kernel

    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    out = {"packed_window_checked_flag": cudnn.PACKED_WINDOW_CHECKED}
    s, w = (256, 64) if smoke else (4096, 1024)
    ks = jax.random.split(jax.random.key(15), 4)
    q = jax.random.normal(ks[0], (1, s, 8, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, s, 2, 128), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, s, 2, 128), jnp.bfloat16)
    ct = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
    seg = jnp.asarray(_packed_segments(s, 4, seed=15)[0])
    f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
    for segments in (False, True):
        sg = seg if segments else None
        ref = _fwd_bwd(lambda q, k, v: reference_attention(q, k, v, segment_ids=sg,
                                                           window=w))(*f32)
        for impl in ("auto", "cudnn", "chunked"):
            name = f"{impl}_seg{int(segments)}"
            try:
                kernel = mesh_kernel(impl, q, mesh, segments, (8, 2), causal=True, window=w)
                got = _fwd_bwd(lambda q, k, v: ulysses_attention(
                    q, k, v, mesh=mesh, segment_ids=sg, impl=impl, window=w,
                    max_segments=8))(q, k, v, ct)
            except Exception as e:  # noqa: BLE001 - refused off GPU, or cuDNN says no
                out[name] = {"refused": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            errs = {n: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
                    for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
            out[name] = {"kernel": kernel, "rel_err": errs,
                         "pass": all(e <= 1e-2 for e in errs.values())}
    for s in ([512] if smoke else [8192, 32768]):
        ks = jax.random.split(jax.random.key(s), 4)
        q = jax.random.normal(ks[0], (1, s, 32 if not smoke else 8, 128), jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, s, 8 if not smoke else 2, 128), jnp.bfloat16)
        v = jax.random.normal(ks[2], k.shape, jnp.bfloat16)
        ct = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
        row = {}
        for impl in ("cudnn", "chunked"):
            for window in (None, w):
                try:
                    fn = _fwd_bwd(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh,
                                                                    impl=impl, window=window))
                    row[f"{impl}_w{window or 'none'}_ms"] = 1e3 * _timed(fn, (q, k, v, ct), 2,
                                                                         repeats)
                except Exception as e:  # noqa: BLE001
                    row[f"{impl}_w{window or 'none'}"] = f"{type(e).__name__}: {str(e)[:200]}"
        out[f"time_s{s}_w{w}"] = row
    return out


def _torch_sdpa(s, heads, h, repeats, flops) -> dict:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        return {"skipped": str(e)}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA for torch"}
    q = torch.randn(1, heads[0], s, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, heads[1], s, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, heads[1], s, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ct = torch.randn_like(q)

    def step():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(ct)
    times = []
    for i in range(2 + repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    times.sort()
    dt = times[len(times) // 2]
    return {"ms": dt * 1e3, "causal_tflops": flops / dt / 1e12}


def _throughput(smoke: bool, remat: list[str], steps: int = 5) -> dict:
    import jax
    import numpy as np
    from ulysses_jax.config import load_config
    from ulysses_jax.training.train_step import init_state, make_train_step
    from ulysses_jax.training.loop import peak_flops, xla_flops_of
    from ulysses_jax.training.trainer import build_mesh, model_flops_per_device

    from ulysses_jax import gpu_target, time_model
    import jax.numpy as jnp
    out = {}
    # the time model's GEMM rate (targets/*.txtpb, matmul_bf16_tflops) measured here
    n = 1024 if smoke else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    dt = _timed(jax.jit(lambda x, y: x @ y), (a, a), warmup=2, repeats=10)
    out["matmul_bf16"] = {"n": n, "seconds": dt, "tflops": 2 * n ** 3 / dt / 1e12}
    print("matmul_bf16", json.dumps(out["matmul_bf16"]), flush=True)
    target = gpu_target.for_device_kind(jax.devices()[0].device_kind)
    lens = [512, 1024] if smoke else [8192, 32768]
    for s in lens:
        for policy in remat:
            over = [f"seq_len={s}", "batch_size=1", "mesh.data=1", "mesh.seq=1",
                    "param_sharding=replicated", f"model.remat={policy}", "model.max_segments=8"]
            if smoke:
                over += SMOKE_1B
            key = f"seq{s}_{policy}"
            try:
                cfg = load_config(os.path.join(ROOT, "configs", "llama-1b-32k.yaml"), over)
                mesh = build_mesh(cfg)
                graphdef, state, sh, tx = init_state(cfg, mesh)
                step = make_train_step(cfg, mesh, graphdef, tx, sh)
                batch = _packed_row(np.random.default_rng(0), s, cfg.model.vocab_size, s)
                t0 = time.perf_counter()
                compiled = step.lower(state, batch).compile()
                compile_s = time.perf_counter() - t0
                for _ in range(2):
                    state, m = compiled(state, batch)
                jax.block_until_ready(m["loss"])
                t0 = time.perf_counter()
                for _ in range(steps):
                    state, m = compiled(state, batch)
                jax.block_until_ready(m["loss"])
                dt = (time.perf_counter() - t0) / steps
                peak = peak_flops(jax.devices()[0])
                flops = model_flops_per_device(cfg)
                stats = jax.devices()[0].memory_stats() or {}
                out[key] = {"step_s": dt, "tokens_per_sec": s / dt, "model_flops": flops,
                            "xla_flops": xla_flops_of(compiled),
                            "mfu": flops / dt / peak if peak else None,
                            "compile_s": compile_s,
                            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                            "loss": float(m["loss"])}
                if target is not None:  # the model on this GPU's own program, beside it
                    modeled = time_model.step_time(compiled.as_text(), target.config_text, 1)
                    out[key].update(step_s_model=modeled["seconds"],
                                    model_over_measured=modeled["seconds"] / dt,
                                    time_by_kind_model=modeled["by_kind"])
                del state, compiled, step
            except Exception as e:  # noqa: BLE001 - out of memory at one size, say
                out[key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(key, json.dumps(out[key])[:300], flush=True)
    return out


def _accumulation(smoke: bool, steps: int = 3, k: int = 4) -> dict:
    """One optimizer step of the 1B preset at 8k over k micro-batches of one row
    (grad_accum_steps=k, batch_size=k) beside the plain step on one of those rows and the
    plain step on all k rows at once: time per optimizer step, tokens/s, peak bytes in use,
    and the accumulated step's loss and gradient norm against the all-at-once step's on the
    same global batch (bf16: within 1e-2)."""
    import jax
    import numpy as np
    from ulysses_jax.config import load_config
    from ulysses_jax.training.train_step import init_state, make_train_step
    from ulysses_jax.training.trainer import build_mesh

    s = 512 if smoke else 8192
    rng = np.random.default_rng(0)
    rows = []
    for r in range(k):
        row = _packed_row(rng, s, 512 if smoke else 128256, s + r)
        row["loss_mask"][0, : (r * s) // (2 * k)] = 0  # rows with different supervised counts
        rows.append(row)
    batches = {n: np.concatenate([r[n] for r in rows]) for n in rows[0]}
    out = {}
    for key, b, accum in (("plain_micro", 1, 1), ("accumulated", k, k), ("plain_global", k, 1)):
        over = [f"seq_len={s}", f"batch_size={b}", f"grad_accum_steps={accum}", "mesh.data=1",
                "mesh.seq=1", "param_sharding=replicated", "model.remat=save_dots",
                "model.max_segments=8"]
        if smoke:
            over += SMOKE_1B
        try:
            cfg = load_config(os.path.join(ROOT, "configs", "llama-1b-32k.yaml"), over)
            mesh = build_mesh(cfg)
            graphdef, state, sh, tx = init_state(cfg, mesh)
            batch = {n: v[:b] for n, v in batches.items()}
            compiled = make_train_step(cfg, mesh, graphdef, tx, sh).lower(state, batch).compile()
            first, m = compiled(state, batch)  # the first step from the same initial state
            first_metrics = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}
            state = first
            t0 = time.perf_counter()
            for _ in range(steps):
                state, m = compiled(state, batch)
            jax.block_until_ready(m["loss"])
            dt = (time.perf_counter() - t0) / steps
            stats = jax.devices()[0].memory_stats() or {}
            out[key] = {"step_s": dt, "tokens_per_sec": b * s / dt, **first_metrics,
                        "peak_bytes_in_use": stats.get("peak_bytes_in_use")}
            del state, first, compiled
        except Exception as e:  # noqa: BLE001 - out of memory, say
            out[key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(key, json.dumps(out[key])[:300], flush=True)
    acc, glob = out.get("accumulated", {}), out.get("plain_global", {})
    if "loss" in acc and "loss" in glob:
        out["rel_err"] = {m: abs(acc[m] - glob[m]) / abs(glob[m]) for m in ("loss", "grad_norm")}
        out["ok"] = all(v <= 1e-2 for v in out["rel_err"].values())
    return out


def _lora(smoke: bool, steps: int = 5, rank: int = 16) -> dict:
    """The 1B preset's step at 8k with LoRA (rank 16 on every projection, the frozen layer
    matrices in bf16) beside the full fine-tuning step on the same packed row: time per step,
    tokens/s, peak bytes in use, trained parameters and the first step's loss (equal: LoRA's
    B starts at 0, so the first forward is the base model's). Also LoRA with
    optimizer.offload (the frozen base in pinned host memory, streamed layer by layer, the
    adapters updated on the host): on a CPU only the program runs; the GPU is where its
    host transfers and its time mean something."""
    import jax
    import numpy as np
    from ulysses_jax.config import load_config
    from ulysses_jax.models import lora
    from ulysses_jax.training.train_step import init_state, make_train_step, param_count
    from ulysses_jax.training.trainer import build_mesh

    s = 512 if smoke else 8192
    batch = _packed_row(np.random.default_rng(0), s, 512 if smoke else 128256, s)
    out = {}
    lora_keys = [f"model.lora.rank={rank}", "model.lora.base_dtype=bfloat16"]
    for key, extra in (("full", []), ("lora", lora_keys),
                       ("lora_offload", lora_keys + ["optimizer.offload=true"])):
        over = [f"seq_len={s}", "batch_size=1", "mesh.data=1", "mesh.seq=1",
                "param_sharding=replicated", "model.remat=save_dots", "model.max_segments=8",
                *extra]
        if smoke:
            over += SMOKE_1B
        try:
            cfg = load_config(os.path.join(ROOT, "configs", "llama-1b-32k.yaml"), over)
            mesh = build_mesh(cfg)
            graphdef, state, sh, tx = init_state(cfg, mesh)
            trained = param_count(lora.trainable_params(state["params"], cfg.model.lora))
            compiled = make_train_step(cfg, mesh, graphdef, tx, sh).lower(state, batch).compile()
            state, m = compiled(state, batch)
            first_loss = float(m["loss"])
            t0 = time.perf_counter()
            for _ in range(steps):
                state, m = compiled(state, batch)
            jax.block_until_ready(m["loss"])
            dt = (time.perf_counter() - t0) / steps
            stats = jax.devices()[0].memory_stats() or {}
            out[key] = {"step_s": dt, "tokens_per_sec": s / dt, "first_loss": first_loss,
                        "trained_params": trained, "params": param_count(state["params"]),
                        "peak_bytes_in_use": stats.get("peak_bytes_in_use")}
            del state, compiled
        except Exception as e:  # noqa: BLE001 - out of memory, say
            out[key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(key, json.dumps(out[key])[:300], flush=True)
    if "step_s" in out.get("full", {}) and "step_s" in out.get("lora", {}):
        out["lora_over_full_time"] = out["lora"]["step_s"] / out["full"]["step_s"]
    if "step_s" in out.get("lora", {}) and "step_s" in out.get("lora_offload", {}):
        out["lora_offload_over_lora_time"] = (out["lora_offload"]["step_s"]
                                              / out["lora"]["step_s"])
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
                          "note": "forward+backward only (no optimizer), gradient checkpointing,"
                                  " one unpacked row"}
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def _generate(smoke: bool, new: int = 32) -> dict:
    """Generation on one GPU: the 1B preset's model (random weights, bf16) and
    transformers' LlamaForCausalLM of the same shape (bf16, SDPA): prefill tokens/s of one
    32k prompt, decode ms per token over ``new`` greedy tokens (no stop id)."""
    import jax
    import numpy as np
    import torch
    import transformers
    from flax import nnx
    from ulysses_jax import make_mesh
    from ulysses_jax.config import load_config
    from ulysses_jax.generation import Generator
    from ulysses_jax.models.decoder import Decoder
    s = 256 if smoke else 32768
    over = ["model.dtype=bfloat16"] + (SMOKE_1B if smoke else [])
    cfg = load_config(os.path.join(ROOT, "configs", "llama-1b-32k.yaml"), over).model
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    params = nnx.to_pure_dict(nnx.state(Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0))))
    gen = Generator(params, cfg, mesh)
    prompt = list(np.random.default_rng(0).integers(0, cfg.vocab_size, s))
    gen.generate([prompt], max_new_tokens=new)  # compile
    before = dict(gen.timings)
    gen.generate([prompt], max_new_tokens=new)
    t = {k: gen.timings[k] - before[k] for k in ("prefill_s", "decode_s", "decode_tokens")}
    out = {"prompt_tokens": s, "new_tokens": new,
           "ours": {"prefill_s": t["prefill_s"], "prefill_tokens_per_s": s / t["prefill_s"],
                    "decode_ms_per_token": 1e3 * t["decode_s"] / t["decode_tokens"]}}
    del gen, params
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = transformers.LlamaConfig(
        hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, tie_word_embeddings=True,
        rope_theta=cfg.rope_theta, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(hf).to(dev, torch.bfloat16).eval()
    x = torch.tensor([prompt], device=dev)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None,
              pad_token_id=0)

    def timed(n):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(2)
    first, whole = timed(1), timed(new)
    out["transformers"] = {"prefill_s": first, "prefill_tokens_per_s": s / first,
                           "decode_ms_per_token": 1e3 * (whole - first) / (new - 1)}
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def _rollout(smoke: bool) -> dict:
    """benchmarks/_rollout.py's three modes on one GPU (a compiling round, then a timed one
    each), the 1B preset's model with random weights in bf16."""
    import jax
    from flax import nnx
    from _rollout import MODES, measure, request
    from ulysses_jax import make_mesh
    from ulysses_jax.config import load_config
    from ulysses_jax.generation import Generator
    from ulysses_jax.models.decoder import Decoder
    n, length, g, new = (2, 256, 4, 16) if smoke else (4, 8192, 8, 256)
    over = ["model.dtype=bfloat16"] + (SMOKE_1B if smoke else [])
    cfg = load_config(os.path.join(ROOT, "configs", "llama-1b-32k.yaml"), over).model
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    params = nnx.to_pure_dict(nnx.state(Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0))))
    gen = Generator(params, cfg, mesh)
    prompts, stops = request(cfg.vocab_size, n, length, 0.03)
    rows = {}
    for mode in MODES:
        for _ in range(2):
            rows[mode] = measure(gen, prompts, stops, g, new, mode)
    same = all(rows[m]["ids"] == rows["repeated"]["ids"] for m in MODES)
    for r in rows.values():
        r.pop("ids")
    return {"prompts": n, "prompt_tokens": length, "samples": g, "max_new_tokens": new,
            "same_tokens": same, "rows": rows}


def _grpo(smoke: bool, steps: int = 3) -> dict:
    """GRPO through train() on one GPU: sampling with the generator, the rewards, the train
    step; the times each step logs."""
    import tempfile
    import numpy as np
    from ulysses_jax.config import load_config
    from ulysses_jax.training.trainer import train
    prompt_len, new = (200, 8) if smoke else (8192, 512)
    tmp = tempfile.mkdtemp(prefix="gpu_check_grpo_")
    rng = np.random.default_rng(0)
    with open(os.path.join(tmp, "prompts.jsonl"), "w") as f:
        for key in (3, 7):
            words = " ".join(rng.choice(["red", "sea", "old", "map"], prompt_len // 4))
            f.write(json.dumps({"prompt": f"{words[:prompt_len - 20]} the key is {key}.\nkey:",
                                "answer": str(key)}) + "\n")
    over = ["objective=grpo", f"data.source={tmp}/prompts.jsonl", "data.heldout_fraction=0",
            f"seq_len={prompt_len + new}", "batch_size=2", "grpo.num_generations=4",
            f"grpo.max_completion_length={new}", f"steps={steps}", "log_every=1",
            "eval_batches=0", "checkpoint_every=0", "mesh.data=1", "mesh.seq=1",
            "param_sharding=replicated", "grad_accum_steps=1", "log_tensorboard=false",
            "model.max_segments=0"] + (SMOKE_1B if smoke else ["model.dtype=bfloat16"])
    cfg = load_config(os.path.join(ROOT, "configs", "llama-1b-32k.yaml"), over)
    summary = train(cfg, os.path.join(tmp, "run"), progress=False)
    with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    keep = ("step", "loss", "grad_norm", "step_time", "sampling_s", "batch_s", "reward",
            "completions/mean_length", "completions/clipped_ratio", "memory_peak_bytes")
    return {"prompt_tokens": prompt_len, "max_new_tokens": new, "status": summary["status"],
            "steps": [{k: r.get(k) for k in keep} for r in records]}


def _longest_8b(smoke: bool) -> dict:
    import jax
    from ulysses_jax.config import load_config
    from ulysses_jax.plan import longest_fitting_seq_len

    stats = jax.devices()[0].memory_stats() or {}
    budget = int(stats.get("bytes_limit", 139 * 2 ** 30))
    over = ["mesh.data=1", "mesh.seq=1", "param_sharding=replicated", "model.remat=full",
            "model.mlp_chunk=2048", "batch_size=1", "grad_accum_steps=1"]  # one sequence
    if smoke:
        over += ["model.n_layers=1", "model.d_model=64", "model.ffn_dim=128", "model.n_heads=8",
                 "model.n_kv_heads=2", "model.head_dim=8", "model.vocab_size=512"]
        budget = 64 * 2 ** 20
    cfg = load_config(os.path.join(ROOT, "configs", "llama3-8b-128k.yaml"),
                      over + ["seq_len=1024"])
    # Coarse steps keep this to a few compiles; the first probe failing ends it at once.
    best = longest_fitting_seq_len(cfg, budget, granularity=1024 if smoke else 16384,
                                   max_seq_len=1 << 18, progress=print)
    return {"budget_bytes": budget, "longest_seq_len": best, "overrides": over}


def _offload_8b(smoke: bool, seq_len: int | None) -> dict:
    """The one-GPU 8B preset on a GPU: (a) the GPU compiler's memory analysis of it
    (configs/llama3-8b-1gpu.yaml, at its seq_len or --offload-seq-len), next to the CPU
    planner's numbers recorded in the preset; (b) one executed 8B step at 131,072 tokens with
    the offload options on: time, peak device bytes in use, loss."""
    import jax
    import numpy as np
    from ulysses_jax.config import load_config
    from ulysses_jax.training.dry_run import dry_run
    from ulysses_jax.training.train_step import init_state, make_train_step

    path = os.path.join(ROOT, "configs", "llama3-8b-1gpu.yaml")
    small = ["model.n_layers=1", "model.d_model=64", "model.ffn_dim=128", "model.n_heads=8",
             "model.n_kv_heads=2", "model.head_dim=8", "model.vocab_size=512"] if smoke else []
    out = {}
    plan_cfg = load_config(path, small + ([f"seq_len={seq_len}"] if seq_len else []))
    t0 = time.perf_counter()
    compiled = dry_run(plan_cfg)
    out["compile_at_preset"] = {k: compiled[k] for k in (
        "seq_len", "peak_bytes_per_device", "host_bytes_per_device", "memory_model",
        "compiled_dtype", "argument_bytes", "temp_bytes")}
    out["compile_at_preset"]["seconds"] = time.perf_counter() - t0
    run_len = 1024 if smoke else 131072
    cfg = load_config(path, small + [f"seq_len={run_len}"])
    try:
        from ulysses_jax.training.trainer import build_mesh
        mesh = build_mesh(cfg)
        t0 = time.perf_counter()
        graphdef, state, sh, tx = init_state(cfg, mesh)
        step = make_train_step(cfg, mesh, graphdef, tx, sh)
        rng = np.random.default_rng(0)
        toks = rng.integers(0, cfg.model.vocab_size, (1, run_len + 1)).astype(np.int32)
        seg, pos = _packed_segments(run_len, 4, seed=1)
        mask = np.ones((1, run_len), np.float32)
        mask[0, :-1][seg[0, 1:] != seg[0, :-1]] = 0
        batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": mask,
                 "segment_ids": seg, "positions": pos}
        compiled_step = step.lower(state, batch).compile()
        setup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, m = compiled_step(state, batch)
        loss = float(m["loss"])
        step_s = time.perf_counter() - t0
        stats = jax.devices()[0].memory_stats() or {}
        out["step_131k"] = {"seq_len": run_len, "setup_s": setup_s, "step_s": step_s,
                            "tokens_per_sec": run_len / step_s, "loss": loss,
                            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                            "bytes_limit": stats.get("bytes_limit")}
    except Exception as e:  # noqa: BLE001 - out of memory, say: keep the compile numbers
        out["step_131k"] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
    return out


def _pytest(smoke: bool, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rfE"]
    if smoke:
        cmd += ["tests/test_flops.py"]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    t0 = time.time()
    try:
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
        text, rc = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    return {"returncode": rc, "counts": counts, "failed": failed[:50],
            "seconds": round(time.time() - t0, 1), "tail": text[-3000:]}

def _qwen3_next(smoke: bool, repeats: int = 5) -> dict:
    """Gated DeltaNet on the GPU: bf16 correctness against the fp32 recurrence, time against
    attention, and the GPU compiler's memory of a DeltaNet layer against an attention layer."""
    import jax
    import jax.numpy as jnp
    from ulysses_jax import make_mesh, ulysses_attention
    from ulysses_jax.attention import deltanet, linear
    from ulysses_jax.config import load_config
    from ulysses_jax.training.dry_run import dry_run

    out = {}
    s = 256 if smoke else 4096
    ks = jax.random.split(jax.random.key(21), 8)
    q = jax.random.normal(ks[0], (1, s, 2, 64), jnp.float32)
    k = jax.random.normal(ks[1], (1, s, 2, 64), jnp.float32)
    v = jax.random.normal(ks[2], (1, s, 4, 64), jnp.float32)
    g = -0.2 * jnp.abs(jax.random.normal(ks[3], (1, s, 4)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, s, 4)))
    seg = jnp.asarray(_packed_segments(s, 4, seed=21)[0])
    ct = jax.random.normal(ks[5], v.shape, jnp.float32)

    def vjp(fn, *args):
        o, pull = jax.vjp(fn, *args)
        return (o, *pull(ct.astype(o.dtype)))

    ref = jax.jit(lambda *a: vjp(lambda q, k, v: deltanet.recurrent_reference(
        q, k, v, g, beta, seg), *a))(q, k, v)
    got = jax.jit(lambda *a: vjp(lambda q, k, v: deltanet.chunked_delta_rule(
        q, k, v, g, beta, seg), *a))(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    errs = {n: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
            for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
    out["bf16_vs_fp32_recurrence"] = {"rel_err": errs, "pass": all(e <= 1e-2 for e in
                                                                     errs.values())}
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    for s in ([512] if smoke else [8192, 32768]):
        ks = jax.random.split(jax.random.key(s), 12)
        bf = lambda i, shape: jax.random.normal(ks[i], shape, jnp.bfloat16)
        core = (bf(0, (1, s, 16, 128)), bf(1, (1, s, 16, 128)), bf(2, (1, s, 32, 128)),
                bf(3, (1, s, 32)), bf(4, (1, s, 32)), 0.3 * bf(5, (16, 128, 4)),
                0.3 * bf(6, (16, 128, 4)), 0.3 * bf(7, (32, 128, 4)), bf(8, (32,)),
                bf(9, (32,)))
        dct = bf(10, (1, s, 32, 128))
        row = {}

        def timed(fn, args, cotangent):
            run = jax.jit(lambda *a: jax.vjp(fn, *a)[1](cotangent))
            return 1e3 * _timed(run, args, 2, repeats)

        row["deltanet_ms"] = timed(lambda *a: linear.gated_deltanet(*a, mesh=mesh), core, dct)
        qa, ka, va = bf(0, (1, s, 16, 256)), bf(1, (1, s, 2, 256)), bf(2, (1, s, 2, 256))
        try:
            row["cudnn_attention_ms"] = timed(lambda q, k, v: ulysses_attention(
                q, k, v, mesh=mesh, impl="cudnn"), (qa, ka, va), bf(11, qa.shape))
        except Exception as e:  # noqa: BLE001 - no cuDNN off GPU
            row["cudnn_attention"] = f"{type(e).__name__}: {str(e)[:200]}"
        out[f"time_s{s}"] = row
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from deltanet_memory import LAYER
    preset = os.path.join(ROOT, "configs", "tiny-qwen3-next.yaml")
    for s in ([1024] if smoke else [32768, 131072]):
        peaks = {}
        for mixer in ("A", "D"):
            cfg = load_config(preset, LAYER + [f"model.mixer_pattern={mixer}", f"seq_len={s}",
                                               "mesh.seq=1"])
            peaks[mixer] = dry_run(cfg)["peak_bytes_per_device"]
        out[f"compiled_peak_s{s}"] = {"attention": peaks["A"], "deltanet": peaks["D"],
                                      "ratio": peaks["D"] / peaks["A"]}
    return out


def _qwen2_5_vl(smoke: bool, repeats: int = 3) -> dict:
    """Qwen2.5-VL on the GPU: the tiny preset's model in bf16 against float32 with images
    (logits), the time of Qwen2.5-VL-7B's vision tower forward + backward on one GPU, and the
    GPU compiler's memory of the 7B preset's train step at 131,072 tokens (its dry run)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from ulysses_jax import make_mesh
    from ulysses_jax.config import load_config
    from ulysses_jax.models import multimodal
    from ulysses_jax.models.decoder import Decoder
    from ulysses_jax.training.dry_run import dry_run

    out = {}
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    tiny = os.path.join(ROOT, "configs", "tiny-qwen2.5-vl.yaml")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 280, (1, 256)).astype(np.int32)
    tokens[0, 10:58] = 290                                   # an image of 6 x 8 units
    grid = np.array([[1, 12, 16]])
    pixels = rng.standard_normal((192, 1176)).astype(np.float32)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(tiny, [f"model.dtype={dtype}", "mesh.seq=1"]).model
        model = Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0))
        logits[dtype] = np.asarray(model(jnp.asarray(tokens), pixel_values=pixels,
                                         image_grid_thw=grid), np.float32)
    err = float(np.max(np.abs(logits["bfloat16"] - logits["float32"]))
                / np.max(np.abs(logits["float32"])))
    out["tiny_bf16_vs_fp32"] = {"rel_err": err, "pass": err <= 3e-2}
    preset = os.path.join(ROOT, "configs", "qwen2.5-vl-7b-128k.yaml")
    small = ["model.n_layers=1", "model.vision.depth=2", "model.vision.fullatt_block_indexes=[1]",
             "model.vocab_size=4096"] if smoke else ["model.n_layers=1", "model.vocab_size=4096"]
    cfg = load_config(preset, small + ["mesh.seq=1", "seq_len=8192"]).model
    model = Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0))
    n = 1024 if smoke else 16384
    side = int(np.sqrt(n // 4)) * 2
    grid = np.array([[1, side, n // side]])
    vision = multimodal.vision_layout(grid, cfg.vision)
    vision["pixels"] = rng.standard_normal((len(vision.pop("order")), 1176)).astype(np.float32)
    graphdef, params = nnx.split(model.visual)
    run = jax.jit(jax.grad(lambda p, v: jnp.sum(
        nnx.merge(graphdef, p)(v).astype(jnp.float32) ** 2)))
    vision = {k: jnp.asarray(v) for k, v in vision.items()}
    out[f"vision_tower_fwd_bwd_ms_{int(grid.prod())}_patches"] = 1e3 * _timed(
        run, (params, vision), 1, repeats)
    if not smoke:
        compiled = dry_run(load_config(preset, []))
        out["preset_7b_128k_compile"] = {k: compiled[k] for k in (
            "peak_bytes_per_device", "memory_model", "compiled_dtype", "argument_bytes",
            "temp_bytes", "params")}
    return out


SECTIONS = ("env", "attention_bf16", "packed_attention", "window_attention", "throughput",
            "accumulation", "lora", "transformers", "generate", "rollout", "grpo", "longest_8b",
            "offload_8b",
            "qwen3_next", "qwen2_5_vl", "pytest")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "benchmarks",
                                                                        "results")))
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script on CPU")
    p.add_argument("--only", help=f"comma-separated sections of {','.join(SECTIONS)}")
    p.add_argument("--remat", default="save_dots,full",
                   help="remat policies the throughput section tries (default save_dots,full)")
    p.add_argument("--pytest-timeout", type=int, default=420)
    p.add_argument("--offload-seq-len", type=int,
                   help="offload_8b: compile the one-GPU 8B preset at this length instead of "
                        "its own")
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    import jax
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": str(jax.devices()[0].device_kind), "device_count": jax.device_count(),
              "backend": jax.default_backend(), "jax": jax.__version__,
              "python": platform.python_version(), "smoke": args.smoke,
              "command": " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]),
              "sections": {}}
    runners = {
        "env": lambda: _env(args.smoke),
        "attention_bf16": lambda: _attention_bf16(args.smoke),
        "qwen2_5_vl": lambda: _qwen2_5_vl(args.smoke),
        "packed_attention": lambda: _packed_attention(args.smoke),
        "window_attention": lambda: _window_attention(args.smoke),
        "throughput": lambda: _throughput(args.smoke, args.remat.split(",")),
        "accumulation": lambda: _accumulation(args.smoke),
        "lora": lambda: _lora(args.smoke),
        "transformers": lambda: _transformers(args.smoke),
        "generate": lambda: _generate(args.smoke),
        "rollout": lambda: _rollout(args.smoke),
        "grpo": lambda: _grpo(args.smoke),
        "longest_8b": lambda: _longest_8b(args.smoke),
        "offload_8b": lambda: _offload_8b(args.smoke, args.offload_seq_len),
        "qwen3_next": lambda: _qwen3_next(args.smoke),
        "pytest": lambda: _pytest(args.smoke, args.pytest_timeout),
    }
    for name in names:
        t0 = time.time()
        try:
            res = {"result": runners[name]()}
        except Exception as e:  # a failing section must not lose the others' results
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.time() - t0, 1)
        result["sections"][name] = res
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(name, json.dumps(res, default=str)[:2000], flush=True)
    print("wrote", path)


if __name__ == "__main__":
    main()
