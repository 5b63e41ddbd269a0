"""The decode step's memory on CPU devices, from XLA's compiled memory analysis (exact and
repeatable): its argument bytes (weights, caches, tokens) and temporary bytes per device,
against the cache's own bytes, as the cache grows.

    python benchmarks/decode_memory.py [--new 40,240] [--seq 2]

Models (tiny sizes, tests/test_generate.py's): a dense 4-layer model (every layer global),
the same with a window of 16 on alternating layers (a stack of local and global layers: one
cache pool per kind), and Qwen3-Next (DeltaNet states and one attention layer). For each,
3 prompts of up to 9 tokens and --new new tokens (cache slots C = 16 + new), on --seq
devices. ``temp_growth`` is the growth of the temporary bytes between the first and last
--new divided by the growth of the cache's bytes: what the step holds beside the cache per
cache byte (transients of one layer at a time do not grow with the layers).
Results: benchmarks/results/decode_memory.json.
"""
from __future__ import annotations

import argparse
import os

from _common import command_line, ints, write_results, ROOT  # noqa: E402  (fake devices)

from flax import nnx  # noqa: E402

from ulysses_jax import make_mesh  # noqa: E402
from ulysses_jax.config import load_config  # noqa: E402
from ulysses_jax.generation import Generator  # noqa: E402
from ulysses_jax.models.decoder import Decoder  # noqa: E402
import jax  # noqa: E402

SMALL = ["model.d_model=32", "model.ffn_dim=64", "model.head_dim=8", "model.vocab_size=97",
         "model.n_layers=4"]
PROMPTS = [[5, 17, 3, 44, 9, 12, 60, 2, 31], [7, 8], [90, 1, 4, 4, 4, 15]]
MODELS = {
    "dense": ("tiny.yaml", []),
    "window16_LG": ("tiny.yaml", ["model.sliding_window=16", "model.layer_pattern=LG"]),
    "qwen3_next": ("tiny-qwen3-next.yaml", ["model.moe_ffn_dim=16",
                                            "model.moe_shared_ffn_dim=16"]),
}


def measure(preset: str, over: list[str], p: int, new: int) -> dict:
    cfg = load_config(os.path.join(ROOT, "configs", preset), SMALL + over).model
    mesh = make_mesh(seq=p, data=1, devices=jax.devices()[:p])
    params = nnx.to_pure_dict(nnx.state(Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0))))
    gen = Generator(params, cfg, mesh)
    gen.generate(PROMPTS, max_new_tokens=new)
    key, decode = next((k, v) for k, v in gen._programs.items() if k[0] == "decode")
    m = decode.memory_analysis()
    parts = gen.cache_layouts[key]  # the prompts' part and the new tokens'
    kinds = [k for k, mixer in zip(cfg.layer_kinds(), cfg.layer_mixers()) if mixer == "A"]
    return {"slots": sum(part.slots for part in parts),
            "argument_bytes": int(m.argument_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "kv_cache_bytes": sum(part.bytes_per_device(mesh, kinds) for part in parts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", type=ints, default=[40, 240])
    ap.add_argument("--seq", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args(argv)
    rows = []
    print(f"{'model':<14}{'new':>5}{'slots':>7}{'args B':>10}{'temp B':>10}{'kv cache B':>12}")
    for name, (preset, over) in MODELS.items():
        got = [measure(preset, over, args.seq, n) for n in args.new]
        for n, r in zip(args.new, got):
            print(f"{name:<14}{n:>5}{r['slots']:>7}{r['argument_bytes']:>10}"
                  f"{r['temp_bytes']:>10}{r['kv_cache_bytes']:>12}")
            rows.append({"model": name, "new": n, **r})
        grow = got[-1]["kv_cache_bytes"] - got[0]["kv_cache_bytes"]
        if grow > 0:
            ratio = (got[-1]["temp_bytes"] - got[0]["temp_bytes"]) / grow
            print(f"{name:<14} temp_growth {ratio:.2f} per cache byte")
            rows.append({"model": name, "temp_growth": ratio})
    write_results(args.out, "decode_memory.json",
                  {"command": command_line(__file__, argv), "seq": args.seq, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
