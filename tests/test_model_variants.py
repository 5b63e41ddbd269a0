"""The decoder with attention variants against itself on one device: Gemma blocks with a
local/global layer pattern, softcaps and padded heads; a sliding window on a ring mesh; the
config keys and their errors. (Against transformers, which also shows that each variant
changes the logits: tests/test_hf_variants.py.)"""
import pytest

from test_model import _batch, _loss_and_grads, _rel_close, _setup
from ulysses_jax.config import ConfigError, load_config

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
    _rel_close(loss, loss1, 1e-4)
    _rel_close(grads, grads1, 1e-4)


def _cfg(*items):
    return load_config(None, list(items))


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
            (["model.n_heads=8", "model.n_kv_heads=3"], "n_heads 8 is not divisible by model"),
            (["model.n_heads=6", "model.n_kv_heads=3", "mesh.seq=2", "ulysses.chunks=2"],
             "ulysses.chunks 2 must divide the kv heads per device, 3")):
        with pytest.raises(ConfigError, match=reason):
            _cfg(*items)
