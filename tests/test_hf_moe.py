"""Qwen3-MoE import/export against transformers' own Qwen3MoeForCausalLM (torch, fp32, eager).

Tiny random checkpoints with mixed dense/MoE layers are written by transformers itself
(per-expert tensors, as its save_pretrained writes them), loaded by ``ulysses_jax.hf`` on 1, 2
and 4 sequence-parallel devices, and their logits, loss and router aux loss compared with
transformers'. Every weight is redrawn at random (norms around 1).
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from tests.utils.devices import need_devices
from tests.utils.numerics import rel_error
from tests.utils.torch_models import randomize
from ulysses_jax import make_mesh
from ulysses_jax.config import ModelConfig, load_config
from ulysses_jax.hf import config_from_hf, config_to_hf, from_pretrained, save_pretrained
from ulysses_jax.models.decoder import Decoder, layer_groups
from ulysses_jax.training.objectives.sft import objective

torch = pytest.importorskip("torch", reason="torch is needed to build reference checkpoints")
transformers = pytest.importorskip("transformers", reason="transformers is needed as reference")

V, S, B = 300, 32, 2
TOL = 1e-4  # max|ours - theirs| / max|theirs|, fp32 (as tests/test_hf.py)
BASE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=V, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, router_aux_loss_coef=0.05)
CHECKPOINTS = {
    # layers: MoE, dense, MoE (three scans); top-k renormalised; untied head
    "mixed": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
                  tie_word_embeddings=False),
    # decoder_sparse_step=2: dense, MoE, dense, MoE (one scan over a two-layer unit); tied
    "periodic": dict(num_hidden_layers=4, decoder_sparse_step=2, tie_word_embeddings=True),
    # use_sliding_window: every layer attends to its 8 most recent keys (MoE, dense)
    "windowed": dict(num_hidden_layers=2, mlp_only_layers=[1], use_sliding_window=True,
                     sliding_window=8),
}


def _tokens(seed):
    return np.random.default_rng(seed).integers(0, V, (B, S)).astype(np.int32)


def _hf_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()


def _hf_outputs(path, tokens):
    """transformers' logits, loss (cross-entropy + coef x aux) and aux loss on ``tokens``."""
    t = torch.from_numpy(tokens).long()
    with torch.no_grad():
        out = _hf_load(path)(t, labels=t, output_router_logits=True)
    return out.logits.numpy(), float(out.loss), float(out.aux_loss)


def _ours(model, tokens, mesh):
    """Our logits, objective and aux loss; targets pre-shifted, the last position unscored."""
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
             "loss_mask": np.concatenate([np.ones((B, S - 1)), np.zeros((B, 1))], 1),
             "segment_ids": np.ones((B, S), np.int32),
             "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))}
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, batch):
        obj, (_, metrics) = objective(graphdef, params, batch, mesh)
        return nnx.merge(graphdef, params)(batch["tokens"]), obj, metrics["moe_aux_loss"]

    return [np.asarray(x) for x in run(params, batch)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, (name, kw) in enumerate(CHECKPOINTS.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.Qwen3MoeConfig(**BASE, **kw))
        randomize(model, seed=i)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path, safe_serialization=True)
        out[name] = path
    return out


@pytest.mark.parametrize("name,p", [("mixed", 1), ("mixed", 2), ("mixed", 4), ("periodic", 2)])
def test_import_matches_transformers(checkpoints, name, p):
    path = checkpoints[name]
    tokens = _tokens(p)
    want_logits, want_loss, want_aux = _hf_outputs(path, tokens)
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    model = from_pretrained(path, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    logits, loss, aux = _ours(model, tokens, mesh)
    assert logits.shape == (B, S, V)
    assert rel_error(logits, want_logits) <= TOL, rel_error(logits, want_logits)
    np.testing.assert_allclose(aux, want_aux, rtol=TOL)
    np.testing.assert_allclose(loss, want_loss, rtol=TOL)
    assert abs(BASE["router_aux_loss_coef"] * want_aux) > 100 * TOL * want_loss  # aux counts


def test_checkpoints_are_what_they_claim(checkpoints):
    """transformers 5 writes one tensor per expert, and the expert count as num_local_experts;
    the layer patterns are the ones the tests mean."""
    path = checkpoints["mixed"]
    hf = json.load(open(os.path.join(path, "config.json")))
    assert hf["model_type"] == "qwen3_moe" and hf.get("num_local_experts") == 8
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.1.mlp.gate_proj.weight" in keys                  # dense layer
    assert not any("gate_up_proj" in k for k in keys)
    cfg = config_from_hf(hf)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_ffn_dim, cfg.mlp_only_layers,
            cfg.norm_topk_prob, cfg.ffn_dim, cfg.qk_norm) == (8, 2, 32, (1,), True, 96, True)
    assert len(layer_groups(cfg)) == 3
    periodic = config_from_hf(json.load(open(os.path.join(checkpoints["periodic"],
                                                          "config.json"))))
    assert layer_groups(periodic) == [(0, ((False, "A"), (True, "A")), 2)]


def test_export_round_trip(tmp_path):
    cfg = ModelConfig(vocab_size=V, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                      ffn_dim=96, qk_norm=True, tie_embeddings=False, attn_impl="xla",
                      init_std=0.08, num_experts=8, num_experts_per_tok=2, moe_ffn_dim=32,
                      norm_topk_prob=True, mlp_only_layers=(1,), router_aux_loss_coef=0.05)
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    model = Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(3))
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(4), 64))
    nnx.update(model, jax.tree_util.tree_map_with_path(
        lambda p, x: 1 + 0.3 * jax.random.normal(next(keys), x.shape)
        if "scale" in jax.tree_util.keystr(p) else x, state))
    save_pretrained(model, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    hf = json.load(open(tmp_path / "config.json"))
    assert (hf["model_type"], hf["num_experts"], hf["mlp_only_layers"]) == ("qwen3_moe", 8, [1])
    tokens = _tokens(11)
    want_logits, want_loss, want_aux = _hf_outputs(str(tmp_path), tokens)
    logits, loss, aux = _ours(model, tokens, mesh)
    assert rel_error(logits, want_logits) <= TOL
    np.testing.assert_allclose((loss, aux), (want_loss, want_aux), rtol=TOL)
    back = from_pretrained(str(tmp_path), mesh=mesh, attn_impl="xla")
    assert back.cfg == dataclasses.replace(cfg, init_std=back.cfg.init_std)
    ours, theirs = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (model, back))
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_moe_config_translation():
    cfg = ModelConfig(qk_norm=True, num_experts=4, num_experts_per_tok=1, moe_ffn_dim=24,
                      decoder_sparse_step=2, mlp_only_layers=(0,), norm_topk_prob=True,
                      router_aux_loss_coef=0.01, tie_embeddings=False)
    assert config_from_hf(config_to_hf(cfg)) == cfg
    # Keys a config.json may omit take Qwen3MoeConfig's defaults.
    hf = {k: v for k, v in config_to_hf(cfg).items()
          if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                       "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                       "router_aux_loss_coef", "num_key_value_heads")}
    theirs = transformers.AutoConfig.for_model(**hf)
    ours = config_from_hf(hf)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_ffn_dim, ours.norm_topk_prob,
            ours.decoder_sparse_step, ours.mlp_only_layers, ours.router_aux_loss_coef,
            ours.n_kv_heads) == (
        theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
        theirs.norm_topk_prob, theirs.decoder_sparse_step, tuple(theirs.mlp_only_layers),
        theirs.router_aux_loss_coef, theirs.num_key_value_heads)
    for bad, reason in ((dict(qk_norm=False), "exports as qwen3_moe"),
                        (dict(moe_shared_ffn_dim=8), "no shared expert")):
        with pytest.raises(ValueError, match=reason):
            config_to_hf(dataclasses.replace(cfg, **bad))
    with pytest.raises(ValueError, match="has no experts but the model has num_experts=4"):
        config_to_hf(cfg, "qwen3")
    with pytest.raises(ValueError, match="attention_bias=true"):
        config_from_hf({**config_to_hf(cfg), "attention_bias": True})
    # A window loads on every layer, as Qwen3MoeConfig applies it (only with
    # use_sliding_window), and exports back; Qwen3-MoE has no per-layer kinds to export.
    windowed = config_from_hf({**config_to_hf(cfg), "use_sliding_window": True,
                               "sliding_window": 8})
    assert (windowed.sliding_window, windowed.layer_kinds()) == (8, "LL")
    assert config_from_hf({**config_to_hf(cfg), "sliding_window": 8}).sliding_window == 0
    assert config_from_hf(config_to_hf(windowed)) == windowed
    with pytest.raises(ValueError, match="arch 'qwen3_moe' slides on every layer"):
        config_to_hf(dataclasses.replace(windowed, layer_pattern="LG"))


def test_sliding_window_import_matches_transformers(checkpoints):
    """Qwen3-MoE with use_sliding_window (transformers applies config.sliding_window in every
    layer): logits, loss and aux loss equal transformers' on a seq=2 mesh, and the same
    weights without the window differ (the window is in effect at S=32, W=8)."""
    path = checkpoints["windowed"]
    tokens = _tokens(5)
    want_logits, want_loss, want_aux = _hf_outputs(path, tokens)
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    model = from_pretrained(path, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    assert (model.cfg.sliding_window, model.cfg.layer_kinds()) == (8, "LL")
    logits, loss, aux = _ours(model, tokens, mesh)
    assert rel_error(logits, want_logits) <= TOL, rel_error(logits, want_logits)
    np.testing.assert_allclose((loss, aux), (want_loss, want_aux), rtol=TOL)
    full = nnx.eval_shape(lambda: Decoder(dataclasses.replace(model.cfg, sliding_window=0),
                                          mesh=mesh, rngs=nnx.Rngs(0)))  # every weight replaced
    nnx.update(full, nnx.state(model, nnx.Param))
    assert rel_error(_ours(full, tokens, mesh)[0], want_logits) > 100 * TOL


def test_init_from_qwen3_moe_checkpoint(checkpoints, tmp_path):
    """train.py's init_from with a Qwen3-MoE checkpoint: the model comes from it, step 1's loss
    is the imported model's loss on the first batch, and the router metrics are logged."""
    from ulysses_jax.models.loss import plain_cross_entropy
    from ulysses_jax.data import text as data_lib
    from ulysses_jax.training.trainer import train
    path = checkpoints["mixed"]
    cfg = load_config(None, ["steps=1", "seq_len=32", "batch_size=2", f"init_from={path}",
                             "mesh.seq=2", "checkpoint_every=0", "eval_batches=0", "log_every=1",
                             "optimizer.warmup_steps=0", "model.attn_impl=xla"])
    train(cfg, str(tmp_path / "run"), progress=False)
    record = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert len(record["moe_load"]) == 8 and record["moe_dropped"] == 0.0
    rows, _ = data_lib.build_rows("stdlib", data_lib.ByteTokenizer(), cfg.seq_len,
                                  cfg.data.heldout_fraction, cfg.seed)
    batch = next(data_lib.BatchIterator(rows, cfg.batch_size, cfg.seed))
    model = from_pretrained(path, mesh=make_mesh(seq=1, data=1, devices=need_devices(1)),
                            attn_impl="xla")
    loss = nnx.jit(lambda m, b: plain_cross_entropy(
        m(b["tokens"], b["positions"], b["segment_ids"]), b["targets"], b["loss_mask"]))
    expected = float(loss(model, {k: batch[k] for k in ("tokens", "positions", "segment_ids",
                                                        "targets", "loss_mask")}))
    np.testing.assert_allclose(record["loss"], expected, rtol=1e-5)
