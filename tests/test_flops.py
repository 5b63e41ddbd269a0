"""Model FLOPs for MFU: the formula against a hand count, and against the model's own
weights."""
import math

import jax
from flax import nnx

from ulysses_jax.config import ModelConfig
from ulysses_jax.mesh import make_mesh
from ulysses_jax.models.decoder import Decoder
from ulysses_jax.training.flops import (attention_flops_per_token, matmul_params_per_token,
                                        train_step_flops)

SMALL = ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=8, ffn_dim=64)


def test_hand_count():
    # per layer: q 32*4*8 = 1024, k and v 32*2*8 = 512 each, o 4*8*32 = 1024: attention 3072;
    # MLP 3 * 32*64 = 6144; two layers 18432; head 32*100 = 3200 -> 21632 weights per token.
    assert matmul_params_per_token(SMALL) == 21632
    # causal attention, S = 128: 6 * L * N * H * S = 6 * 2 * 4 * 8 * 128 = 49152 per token.
    assert attention_flops_per_token(SMALL, 128) == 49152
    assert attention_flops_per_token(SMALL, 128, causal=False) == 2 * 49152
    # step: (6 * 21632 + 49152) per token, B = 2 rows of 128 tokens.
    assert train_step_flops(SMALL, 2, 128) == (6 * 21632 + 49152) * 256


def _matmul_weights(params, tied: bool) -> int:
    """Sizes of the projection, MLP and head weights of a real Decoder, by name."""
    names = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"} | (
        {"embed"} if tied else set())
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if str(getattr(path[-1], "key", path[-1])) in names:
            total += math.prod(leaf.shape)
    return total


def test_counts_the_weights_the_model_has():
    """Untied: the input table is a gather (not counted), the head is; tied: the table is
    counted once, as the head."""
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    for tied in (True, False):
        cfg = ModelConfig(**{**SMALL.__dict__, "tie_embeddings": tied})
        params = nnx.to_pure_dict(nnx.state(Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0))))
        assert matmul_params_per_token(cfg) == _matmul_weights(params, tied), tied
