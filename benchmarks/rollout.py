"""Rollout cost on CPU: G samples of each of a few long prompts, as GRPO samples its groups.

    python benchmarks/rollout.py [--prompts 4] [--prompt-len 2048] [--samples 8] [--new 128]
        [--stop-rate 0.03] [--repeats 2] [--seq 1] [--no-transformers] [--dpo]

The model: the tiny preset's shape (configs/tiny.yaml: 2 layers, d_model 128, 8 query / 2 kv
heads of 16, vocabulary 257) as a transformers Llama with random weights (seed 0, no q/k
norm: Llama has none), loaded into ours from its saved directory, so both run the same
weights. Sampling at temperature 1 with a set of stop ids (--stop-rate of the vocabulary), so
completions end at very different steps before the --new cap.

Rows, each the same request (--prompts prompts of --prompt-len tokens, --samples each, one
seed; compiled programs reused: the last of --repeats rounds is reported, compile excluded):
  repeated   each prompt written G times, every row decoded to the end (what the generator
             did before prompts had samples: G prefills per prompt, G copies of its cache)
  shared     ``num_samples=G``: one prefill per prompt, its samples reading one copy of its
             cache; every row decoded to the end
  shrinking  ``num_samples=G`` and finished rows dropped (the default): the rest continue in
             smaller compiled batches
  transformers  ``generate(num_return_sequences=G, do_sample=True)`` on the same prompts,
             the same stop ids (fp32, SDPA, its KV cache), timed the same way; its prefill
             column is one forward pass over the prompts repeated G times (generate expands
             them so before its prefill)
Columns: rollout wall seconds, prefill seconds, decode seconds, the row-steps decoded, the
decode program's peak bytes per device and its prompt-cache bytes (XLA's compiled memory
analysis and the cache layout, of the first, largest decode batch). The three rows of ours
give the same completions (checked). The fake CPU devices share the machine's cores: compare
rows of one run. Results: benchmarks/results/rollout.json.

``--dpo`` runs the other half of long-prompt preference and RL work instead: DPO's step
time and step_tokens packed against padded (``benchmarks/dpo_packing.py``).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from _common import command_line, write_results, ROOT  # noqa: E402  (fake devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _rollout import MODES, measure, request  # noqa: E402
from ulysses_jax import make_mesh  # noqa: E402
from ulysses_jax.generation import Generator  # noqa: E402
from ulysses_jax.interop.hf import load_params  # noqa: E402

SHAPE = dict(vocab_size=257, hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=16, intermediate_size=384,
             max_position_embeddings=8192, tie_word_embeddings=False)


def tiny_llama(out: str) -> str:
    """The tiny preset's shape as a transformers Llama with random weights, saved at
    ``out``."""
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    model.save_pretrained(out)
    return out


def theirs(path: str, prompts, stops, args) -> dict:
    import torch
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor(prompts)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=0,
              top_p=1.0, num_return_sequences=args.samples, max_new_tokens=args.new,
              eos_token_id=sorted(stops), pad_token_id=sorted(stops)[0])
    with torch.no_grad():
        for _ in range(args.repeats):
            torch.manual_seed(1)
            t = time.perf_counter()
            model.generate(x, **kw)
            wall = time.perf_counter() - t
        t = time.perf_counter()
        # its prefill alone: generate expands the prompts num_return_sequences times first
        model(x.repeat_interleave(args.samples, dim=0))
        prefill = time.perf_counter() - t
    return {"mode": "transformers", "wall_s": wall, "prefill_s": prefill}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--stop-rate", type=float, default=0.03)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--dpo", action="store_true",
                    help="DPO packed against padded instead (benchmarks/dpo_packing.py)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args, rest = ap.parse_known_args(argv)
    if args.dpo:
        import dpo_packing
        return dpo_packing.main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    prompts, stops = request(SHAPE["vocab_size"], args.prompts, args.prompt_len,
                             args.stop_rate)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_llama(tmp)
        mesh = make_mesh(seq=args.seq, data=1, devices=jax.devices()[:args.seq])
        cfg, params = load_params(path, mesh)
        gen = Generator(params, cfg, mesh)
        for mode in MODES:
            for _ in range(args.repeats):
                row = measure(gen, prompts, stops, args.samples, args.new, mode)
            rows.append(row)
        if not args.no_transformers:
            rows.append(theirs(path, prompts, stops, args))
    same = all(r["ids"] == rows[0]["ids"] for r in rows[1:3])
    lengths = rows[0]["lengths"]
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.samples} samples each, "
          f"at most {args.new} new (completions {min(lengths)} .. {max(lengths)}, median "
          f"{int(np.median(lengths))}); the same completions in our three rows: {same}")
    print(f"{'':14}{'wall s':>9}{'prefill s':>11}{'decode s':>10}{'row-steps':>11}"
          f"{'decode peak B':>15}{'prompt cache B':>16}")
    for r in rows:
        cells = [f"{r['wall_s']:9.2f}", f"{r['prefill_s']:11.2f}"]
        if "decode_s" in r:
            cells += [f"{r['decode_s']:10.2f}", f"{r['row_steps']:11d}",
                      f"{r['decode_peak_bytes']:15,d}", f"{r['prompt_cache_bytes']:16,d}"]
        print(f"{r['mode']:14}" + "".join(cells))
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['mode']}: rollout {base['wall_s'] / r['wall_s']:.2f}x faster than repeated, "
              f"prefill {base['prefill_s'] / r['prefill_s']:.2f}x")
    for r in rows:
        r.pop("ids", None)
    write_results(args.out, "rollout.json", {"command": command_line(__file__, argv),
                                             "same_completions": same, "rows": rows})
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
