"""The decoder with attention variants against itself on one device: Gemma blocks with a
local/global layer pattern, softcaps and padded heads; a sliding window on a ring mesh; the
config keys and their errors; Gemma's norms in the fused norm+MLP chunks, and per-layer
kinds through MoE layer groups. (Against transformers, which also shows that each variant
changes the logits: tests/test_hf_variants.py.)"""
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.test_model import _batch, _logits, _loss_and_grads, _setup
from tests.utils.configs import tiny_config
from tests.utils.numerics import assert_rel_close
from ulysses_jax.config import ConfigError
from ulysses_jax.models.decoder import layer_groups

GEMMA = {"model.family": "gemma", "model.sliding_window": 8, "model.layer_pattern": "LG",
         "model.n_layers": 2, "model.attn_softcap": 20.0, "model.final_softcap": 15.0,
         "model.attn_scale": 0.3, "model.rope_local_theta": 1000.0}


@pytest.mark.parametrize("seq,ring,over", [
    (4, 1, {**GEMMA, "model.n_heads": 6, "model.n_kv_heads": 3}),   # heads padded 6 -> 8
    (2, 2, {"model.sliding_window": 12, "model.n_heads": 3, "model.n_kv_heads": 1}),
])
def test_variant_model_sharded_equals_one_device(seq, ring, over):
    """Loss and gradients of the sharded model equal one device's (fp32, 1e-4)."""
    batch = _batch(31)
    _, mesh1, g1, s1, _, _ = _setup(1, 1, **over)
    loss1, grads1 = _loss_and_grads(g1, s1, batch, mesh1)
    _, mesh, g, s, _, _ = _setup(seq, 1, **{**over, "mesh.ring": ring})
    if ring > 1:  # the training model reads zigzag-ordered batches on a ring mesh
        from ulysses_jax.attention.ring import zigzag_permutation
        batch = {k: v[:, zigzag_permutation(64, ring)] for k, v in batch.items()}
    loss, grads = _loss_and_grads(g, s, batch, mesh)
    assert_rel_close(loss, loss1, 1e-4)
    assert_rel_close(grads, grads1, 1e-4)


_cfg = functools.partial(tiny_config, preset=None)


def test_config_keys_and_errors():
    cfg = _cfg("model.sliding_window=4", "model.layer_pattern=LLG", "model.n_layers=7")
    assert cfg.model.layer_kinds() == "LLGLLGL"
    assert _cfg("model.sliding_window=4").model.layer_kinds() == "LL"
    assert _cfg("model.layer_pattern=G").model.layer_kinds() == "GG"
    # Heads that mesh.seq does not divide are padded now; only N % K is an error.
    assert _cfg("model.n_heads=3", "model.n_kv_heads=3", "mesh.seq=2").model.n_heads == 3
    for items, reason in (
            (["model.layer_pattern=LX", "model.sliding_window=4"], "layer_pattern 'LX' has"),
            (["model.layer_pattern=LG"], "has local layers \\(L\\) but model.sliding_window"),
            (["model.sliding_window=-1"], "model.sliding_window must be 0"),
            (["model.attn_softcap=-2.0"], "model.attn_softcap must be 0"),
            (["model.family=gpt"], "model.family must be one of llama, gemma"),
            (["model.family=gemma", "model.num_experts=4"],
             "model.family=gemma has no mixture-of-experts layers"),
            (["model.n_heads=8", "model.n_kv_heads=3"], "n_heads 8 is not divisible by model"),
            (["model.n_heads=6", "model.n_kv_heads=3", "mesh.seq=2", "ulysses.chunks=2"],
             "ulysses.chunks 2 must divide the kv heads per device, 3")):
        with pytest.raises(ConfigError, match=reason):
            _cfg(*items)


def _perturb_scales(params):
    """Norm scales drawn at random (the same for every call: seeded by the parameter's
    path), so a (1 + w) scale and a post-norm differ from their zero-initialised identity."""
    def perturb(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if not name.endswith("scale"):
            return x
        noise = jax.random.normal(jax.random.key(zlib.crc32(name.encode())), x.shape)
        return x + 0.3 * noise
    return jax.tree_util.tree_map_with_path(perturb, params)


def test_gemma_norms_fuse_into_the_tiled_mlp():
    """model.mlp_chunk runs Gemma's (1 + w) pre-norm, GeGLU MLP and post-norm in the fused
    token-chunk loop (and its norms over chunks): loss and gradients equal the unfused block
    on one device, with random norm scales."""
    over = {**GEMMA, "model.n_heads": 4, "model.n_kv_heads": 2}
    batch = _batch(32)
    _, mesh1, g1, s1, _, _ = _setup(1, 1, **over)
    _, mesh, g, s, _, _ = _setup(2, 1, **{**over, "model.mlp_chunk": 8})
    assert nnx.merge(g, s["params"]).cfg.mlp_chunk == 8
    p1, p = _perturb_scales(s1["params"]), _perturb_scales(s["params"])
    loss1, grads1 = _loss_and_grads(g1, {"params": p1}, batch, mesh1)
    loss, grads = _loss_and_grads(g, {"params": p}, batch, mesh)
    assert_rel_close(loss, loss1, 1e-4)
    assert_rel_close(grads, grads1, 1e-4)
    post = grads["layers"]["mlp_post_norm"]["scale"]
    assert float(jnp.abs(post).max()) > 0


def _layer_by_layer(model, kinds, batch):
    """Logits from the model's own blocks applied one layer at a time, layer i with
    kinds[i] (no scan, no layer groups): the reference for the layer loop."""
    tokens, pos, seg = batch["tokens"], batch["positions"], batch["segment_ids"]
    x = jnp.take(model.embed[...], tokens, axis=0)                                  # [B, S, D]
    done = []
    for g, (first, unit, repeats) in enumerate(layer_groups(model.cfg)):
        for r in range(repeats):
            for u in range(len(unit)):
                i = first + r * len(unit) + u
                stack = model.layers if not isinstance(model.layers, nnx.List) else \
                    model.layers[g][u]
                graphdef, state = nnx.split(stack)
                block = nnx.merge(graphdef, jax.tree.map(lambda a: a[r], state))
                x, _ = block(x, pos, seg, kinds[i])
                done.append(i)
    assert done == list(range(model.cfg.n_layers))
    return model.final_norm(x) @ model.head_weight()                               # [B, S, V]


@pytest.mark.parametrize("over", [
    # dense, MoE, dense, MoE, ...: one scan over a two-layer unit; kinds L L G | L L G mix
    # at both unit positions (layers 0, 2, 4: L G L; layers 1, 3, 5: L L G)
    {"model.n_layers": 6, "model.decoder_sparse_step": 2, "model.layer_pattern": "LLG"},
    # MoE, MoE, dense, MoE: three groups; kinds L G | L | G (mixed in the first only)
    {"model.n_layers": 4, "model.mlp_only_layers": "[2]", "model.layer_pattern": "LG"},
])
def test_layer_kinds_follow_each_layer_through_moe_groups(over):
    """With MoE layer groups (main's layer stacking) each layer still gets its own attention
    kind: the model's logits equal its blocks applied one by one with layer i's kind, and
    differ from all-global layers (so the kinds are in effect)."""
    over = {**over, "model.num_experts": 4, "model.sliding_window": 6, "model.qk_norm": True}
    cfg, _, g, s, _, _ = _setup(1, 1, **over)
    model = nnx.merge(g, s["params"])
    batch = _batch(33)
    logits = jax.jit(_logits, static_argnums=0)(g, s["params"], batch)
    kinds = cfg.model.layer_kinds()
    assert "L" in kinds and "G" in kinds
    want = jax.jit(lambda: _layer_by_layer(model, kinds, batch))()
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=2e-5, rtol=2e-5)
    every_global = jax.jit(lambda: _layer_by_layer(model, "G" * len(kinds), batch))()
    assert float(jnp.abs(every_global - want).max()) > 1e-3
