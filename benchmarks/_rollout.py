"""One rollout request measured three ways (``benchmarks/rollout.py`` on CPU,
``benchmarks/gpu_check.py --only rollout`` on a GPU): G samples of each of a few long prompts
with stop ids the sampling hits at different steps, as GRPO samples its groups.

Modes: ``repeated`` (each prompt written G times, every row decoded to the end: the
generator before prompts had samples), ``shared`` (``num_samples=G``: one prefill per prompt,
one copy of its cache; every row to the end), ``shrinking`` (``num_samples=G`` with finished
rows dropped, the default). Imports nothing that picks devices.
"""
from __future__ import annotations

import time

import numpy as np

from ulysses_jax.generation import Generator, Sampling
from ulysses_jax.training.dry_run import peak_bytes_per_device

MODES = ("repeated", "shared", "shrinking")


def request(vocab: int, prompts: int, length: int, stop_rate: float):
    """(``prompts`` random prompts of ``length`` tokens, the stop ids: ``stop_rate`` of the
    vocabulary, none of them in a prompt), seed 0."""
    rng = np.random.default_rng(0)
    stops = frozenset(rng.choice(vocab, max(1, round(stop_rate * vocab)),
                                 replace=False).tolist())
    allowed = np.array(sorted(set(range(vocab)) - stops))
    return [rng.choice(allowed, length).tolist() for _ in range(prompts)], stops


def measure(gen: Generator, prompts, stops, samples: int, new: int, mode: str) -> dict:
    """One round of ``mode`` at temperature 1, seed 1 (compile excluded from the times: run
    a round before to compile): wall, prefill and decode seconds, the row-steps decoded,
    the first decode program's peak bytes per device (XLA's memory analysis) and its
    prompt-cache bytes, each completion's length and ids."""
    gen.shrink = mode == "shrinking"
    rows = [p for p in prompts for _ in range(samples)] if mode == "repeated" else prompts
    before = dict(gen.timings)
    t = time.perf_counter()
    done = gen.generate(rows, max_new_tokens=new, eos_ids=stops, seed=1,
                        sampling=Sampling(temperature=1.0),
                        num_samples=1 if mode == "repeated" else samples)
    wall = time.perf_counter() - t
    after = gen.timings
    key = next(k for k in gen._programs if k[0] == "decode"
               and k[1:3] == (len(prompts) * samples, len(rows)))
    prompt_part = gen.cache_layouts[key][0]
    attention = [k for k, mixer in zip(gen.cfg.layer_kinds(), gen.cfg.layer_mixers())
                 if mixer == "A"]
    return {"mode": mode,
            "wall_s": wall - (after["compile_s"] - before["compile_s"]),
            "prefill_s": after["prefill_s"] - before["prefill_s"],
            "decode_s": after["decode_s"] - before["decode_s"],
            "row_steps": after["decode_rows"] - before["decode_rows"],
            "decode_peak_bytes": peak_bytes_per_device(gen._programs[key]),
            "prompt_cache_bytes": prompt_part.bytes_per_device(gen.mesh, attention),
            "lengths": [len(c.ids) for c in done], "ids": [c.ids for c in done]}
