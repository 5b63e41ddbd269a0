"""The generation programs compiled from shapes alone: the prefill of B prompts of S tokens and
one decode step over its cache, nothing allocated. For memory and kernels without weights
(``benchmarks/gpu_compile.py``, the GPU-compile tests), on any mesh, a GPU target's included.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..config import ModelConfig
from ..families import family
from ..mesh import RING, SEQ, act_spec, axis_size
from ..models.decoder import Decoder
from ..models.param_layout import param_shardings
from .cache import cache_layout
from .decode import decode_program
from .generator import generation_config, prompt_slots
from .prefill import prefill_program
from .sampling import Sampling


def _shaped(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def compiled_programs(cfg: ModelConfig, mesh: Mesh, batch: int, prompt_len: int,
                      new_tokens: int, sampling: Sampling = Sampling(),
                      samples: int = 1) -> dict:
    """{"prefill": compiled, "decode": compiled} for ``batch`` prompts of ``prompt_len``
    tokens and ``new_tokens`` new ones, ``samples`` per prompt, as ``Generator.generate``
    builds them (weights on every device, the cache split by head over ``seq``, rows over
    ``data``).

    Text models on a ("data", "seq") mesh; ValueError otherwise."""
    if family(cfg.family).vision:
        raise ValueError(f"model.family={cfg.family}: the abstract programs take text prompts "
                         f"only")
    if axis_size(mesh, RING) > 1:
        raise ValueError("the abstract generation programs take a (data, seq) mesh")
    if batch % dict(mesh.shape).get("data", 1):
        raise ValueError(f"batch {batch} is not divisible by the mesh's data axis "
                         f"{dict(mesh.shape)['data']}")
    cfg = generation_config(cfg)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
    params = jax.tree.map(lambda a, s: _shaped(a.shape, a.dtype, s), shapes,
                          param_shardings(shapes, mesh, "replicated"))
    s = prompt_slots(prompt_len, axis_size(mesh, SEQ))
    layout = cache_layout(cfg, mesh, batch, s)
    new = cache_layout(cfg, mesh, batch * samples, new_tokens)
    tokens = _shaped((batch, s), np.int32, NamedSharding(mesh, act_spec(mesh)))
    rep = NamedSharding(mesh, P())
    rows, seed = _shaped((batch * samples,), np.int32, rep), _shaped((), np.uint32, rep)
    prefill = prefill_program(graphdef, layout, new, mesh, sampling, samples).lower(
        params, tokens, tokens, tokens, rows, seed, None)
    shapes = prefill.out_info[2:]
    prefill = prefill.compile()
    prompt, caches = (jax.tree.map(lambda a, sh: _shaped(a.shape, a.dtype, sh), part, laid)
                      for part, laid in zip(shapes, prefill.output_shardings[2:]))
    scalar = _shaped((), np.int32, rep)
    decode = decode_program(graphdef, layout, mesh, sampling,
                            prefill.output_shardings[3]).lower(
        params, prompt, caches, rows, scalar, rows, rows, rows, scalar, seed).compile()
    return {"prefill": prefill, "decode": decode}
