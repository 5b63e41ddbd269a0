"""RoPE's fp32 angle and output error at positions up to 4,194,304, against float64.

    python benchmarks/rope_precision.py [--max-position 4194304] [--samples 4096] [--logits]

For RoPE settings of published models (head_dim 128: Llama-3.1 theta 5e5 with llama3 x8,
Qwen3 theta 1e6 with YaRN x4 from 32,768, unscaled theta 1e4), and for positions drawn at
random from [P/2, P) for P = 4,096 ... --max-position, three ways of forming the angles
(models/rope.py ``angles``):
  fp32     transformers': fp32(position x inv_freq);
  exact    reduced modulo a turn before rounding (model.rope_exact_from=0);
  default  the model's default: fp32 below 2^17 = 131,072, exact from there.
Errors are the largest over positions and frequencies, against two float64 references:
  "same freqs": position x float64(the fp32 inv_freq the model uses), in float64 - the error
    of forming the angle, which is what ``exact`` removes;
  "formula": the whole formula (inv_freq too, ``inv_freq(dtype=float64)``) in float64 - adds
    the fp32 rounding of inv_freq itself, which every implementation that keeps fp32
    frequencies (transformers, and us for parity with it) shares.
Output error: max |RoPE(x) - RoPE64(x)| / max |RoPE64(x)| for random x [1, S, 1, 128]
(attention factor included), against the "same freqs" reference.
--logits (needs torch and transformers) also compares the logits of tiny random transformers
models (Llama-3.1 RoPE, Qwen3 with YaRN, unscaled Llama; 32 tokens from offsets 60,000 to
1,000,000) with ours for each method: how far exact angles move from transformers' own.
Results: benchmarks/results/rope_precision.json.
"""
from __future__ import annotations

import argparse
import json

from _common import ROOT, command_line

import jax
import jax.numpy as jnp
import numpy as np

from ulysses_jax.config import ROPE_EXACT_FROM, RopeScalingConfig
from ulysses_jax.models.rope import angles, apply_rope, attention_factor, inv_freq

H = 128
SETTINGS = {
    "llama3.1 (5e5, llama3 x8)": (5e5, RopeScalingConfig(
        type="llama3", factor=8.0, original_max_position_embeddings=8192)),
    "qwen3 (1e6, yarn x4)": (1e6, RopeScalingConfig(
        type="yarn", factor=4.0, original_max_position_embeddings=32768)),
    "unscaled (1e4)": (1e4, RopeScalingConfig()),
}
METHODS = {"fp32": None, "exact": 0, "default": ROPE_EXACT_FROM}


def _wrap(a: np.ndarray) -> np.ndarray:
    """Angles (float64) to (-pi, pi]."""
    return np.angle(np.exp(1j * a))


def _rope64(x: np.ndarray, a: np.ndarray, scale: float) -> np.ndarray:
    """Half-split RoPE in float64; x [1, S, 1, H], a [1, S, H/2]."""
    cos = np.concatenate([np.cos(a)] * 2, -1)[:, :, None] * scale
    sin = np.concatenate([np.sin(a)] * 2, -1)[:, :, None] * scale
    x1, x2 = x[..., :H // 2], x[..., H // 2:]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


def measure(theta: float, scaling: RopeScalingConfig, top: int, samples: int,
            rng: np.random.Generator) -> list[dict]:
    f32 = inv_freq(H, theta, scaling)                                   # [H/2] the model's
    f64 = inv_freq(H, theta, scaling, dtype=np.float64)                 # [H/2] the formula
    scale = attention_factor(scaling)
    rows, p = [], 4096
    while p <= top:
        pos = rng.integers(p // 2, p, samples).astype(np.int32)[None]   # [1, S]
        pos[0, -1] = p - 1
        same = pos[..., None].astype(np.float64) * f32.astype(np.float64)     # [1, S, H/2]
        formula = pos[..., None].astype(np.float64) * f64
        x = rng.standard_normal((1, samples, 1, H))
        want = _rope64(x, same, scale)
        row = {"position": p}
        for name, exact_from in METHODS.items():
            got = np.asarray(angles(jnp.asarray(pos), f32, exact_from), np.float64)
            out = np.asarray(apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), theta,
                                        scaling, exact_from=exact_from), np.float64)
            row[name] = {
                "angle_err_same_freqs": float(np.max(np.abs(_wrap(got - same)))),
                "angle_err_formula": float(np.max(np.abs(_wrap(got - formula)))),
                "output_err": float(np.max(np.abs(out - want)) / np.max(np.abs(want)))}
        rows.append(row)
        p *= 2
    return rows


def logits_vs_transformers(offsets=(60_000, 120_000, 1_000_000)) -> list[dict]:
    """Relative logit error (max |ours - theirs| / max |theirs|) per model, offset, method."""
    import tempfile

    import torch
    import transformers
    from flax import nnx

    from ulysses_jax import make_mesh
    from ulysses_jax.hf import from_pretrained

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300,
                 max_position_embeddings=131072)
    models = {"llama3.1": transformers.LlamaConfig(**shape, rope_parameters=dict(
                  rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=8192)),
              "qwen3 yarn": transformers.Qwen3Config(**shape, rope_parameters=dict(
                  rope_type="yarn", rope_theta=1e6, factor=4.0,
                  original_max_position_embeddings=32768)),
              "unscaled": transformers.LlamaConfig(**shape, rope_theta=1e4)}
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    rows = []
    for name, config in models.items():
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager").eval()
        with torch.no_grad():  # weights away from their init (norms at 1, ...)
            for w in hf.parameters():
                noise = torch.randn_like(w)
                w.copy_(1 + 0.3 * noise if w.ndim == 1 else 0.08 * noise)
        path = tempfile.mkdtemp()
        hf.save_pretrained(path)
        tokens = rng.integers(0, 300, (2, 32)).astype(np.int32)
        for offset in offsets:
            pos = np.broadcast_to(np.arange(32, dtype=np.int32) + offset, (2, 32))
            with torch.no_grad():
                want = hf(torch.from_numpy(tokens).long(),
                          position_ids=torch.from_numpy(pos.copy()).long()).logits.numpy()
            row = {"model": name, "offset": offset}
            for method, exact_from in (("fp32", 2**31 - 1), ("exact", 0)):
                ours = from_pretrained(path, mesh=mesh, attn_impl="xla",
                                       rope_exact_from=exact_from)
                got = np.asarray(nnx.jit(lambda m, t, p: m(t, p))(ours, jnp.asarray(tokens),
                                                                  jnp.asarray(pos)))
                row[method] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            rows.append(row)
            print(f"{name:>12} offset {offset:>9,}: fp32 angles {row['fp32']:.1e}, "
                  f"exact angles {row['exact']:.1e}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-position", type=int, default=4_194_304)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--logits", action="store_true",
                    help="also compare logits with transformers' models (torch needed)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    results = {"command": command_line(__file__, argv), "head_dim": H,
               "device": jax.devices()[0].device_kind, "exact_from_default": ROPE_EXACT_FROM,
               "settings": {}}
    for label, (theta, scaling) in SETTINGS.items():
        rows = measure(theta, scaling, args.max_position, args.samples, rng)
        results["settings"][label] = rows
        print(f"\n{label}: max angle error (rad) vs float64 [same freqs | formula]; output "
              f"error (relative)")
        print(f"{'positions <':>12} " + " ".join(f"{m + ' angle':>22} {m + ' out':>9}"
                                                  for m in METHODS))
        for r in rows:
            cells = " ".join(f"{r[m]['angle_err_same_freqs']:9.1e} | "
                             f"{r[m]['angle_err_formula']:8.1e} {r[m]['output_err']:9.1e}"
                             for m in METHODS)
            print(f"{r['position']:>12,} {cells}")
    if args.logits:
        print("\nlogits against transformers (relative error), tiny random models:")
        results["logits_vs_transformers"] = logits_vs_transformers()
    out = ROOT / "benchmarks" / "results" / "rope_precision.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
