"""Sliding windows and the Gemma block against transformers' own classes: Mistral (window
shorter than the sequence), Qwen2 (use_sliding_window, full and sliding layers mixed),
Gemma 3 (local/global pattern, two RoPE bases, qk-norm, query_pre_attn_scalar, 3 query heads
over 1 kv head: padded on 2 and 4 devices) and Gemma 2 (attention and final logit softcaps),
imported on 1, 2 and 4 sequence-parallel devices, exported back, and fine-tuned from with
init_from. Tiny random configs, built offline by the installed transformers."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from tests.test_hf import TOL, _hf_logits, _our_logits
from tests.utils.devices import cli_env, need_devices
from tests.utils.numerics import rel_error
from tests.utils.torch_models import BIASES, randomize
from ulysses_jax import make_mesh
from ulysses_jax.config import ModelConfig
from ulysses_jax.hf import config_from_hf, config_to_hf, from_pretrained, save_pretrained
from ulysses_jax.interop.hf_variants import pattern_string
from ulysses_jax.models.decoder import Decoder

torch = pytest.importorskip("torch", reason="torch is needed to build reference checkpoints")
transformers = pytest.importorskip("transformers", reason="transformers is needed as reference")

V, S, B, W = 300, 32, 2, 8   # the window is a quarter of the sequence
CHECKPOINTS = {
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      sliding_window=W)),
    "qwen2_mixed": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=W, max_window_layers=1)),
    "gemma3": ("Gemma3TextConfig", dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, sliding_window=W,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma2": ("Gemma2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    query_pre_attn_scalar=20, sliding_window=W,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, (name, (cls, kw)) in enumerate(CHECKPOINTS.items()):
        torch.manual_seed(10 + i)
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, cls)(vocab_size=V, **kw))
        randomize(model, seed=10 + i, special=[BIASES])
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path, safe_serialization=True)
        out[name] = path
    return out


def _tokens(seed):
    return np.random.default_rng(seed).integers(0, V, (B, S)).astype(np.int32)


@pytest.mark.parametrize("name,p", [("mistral", 1), ("mistral", 4), ("qwen2_mixed", 2),
                                    ("gemma3", 1), ("gemma3", 2), ("gemma3", 4),
                                    ("gemma2", 1), ("gemma2", 4)])
def test_import_matches_transformers(checkpoints, name, p):
    tokens = _tokens(p)
    want = _hf_logits(checkpoints[name], tokens)
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    model = from_pretrained(checkpoints[name], mesh=mesh, attn_impl="auto")
    assert 0 < model.cfg.sliding_window < S
    assert rel_error(_our_logits(model, tokens), want) <= TOL, (name, p)


def test_configs_read_what_transformers_applies(checkpoints):
    """The variant fields land where they should, and each one matters: without the window,
    the local RoPE base or the softcaps the logits leave the tolerance."""
    cfg = {n: config_from_hf(json.load(open(os.path.join(p, "config.json"))))
           for n, p in checkpoints.items()}
    assert (cfg["mistral"].sliding_window, cfg["mistral"].layer_kinds()) == (W, "LL")
    assert cfg["qwen2_mixed"].layer_kinds() == "GL"
    g3 = cfg["gemma3"]
    assert (g3.family, g3.layer_kinds(), g3.rope_theta, g3.rope_local_theta, g3.qk_norm) == (
        "gemma", "LGL", 1e6, 1e4, True)
    assert g3.attn_scale == 24 ** -0.5 and (g3.attn_softcap, g3.final_softcap) == (0.0, 0.0)
    g2 = cfg["gemma2"]
    assert (g2.layer_kinds(), g2.attn_softcap, g2.final_softcap, g2.qk_norm) == (
        "LG", 5.0, 8.0, False)
    tokens = _tokens(5)
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    checked, want = 0, {}
    for name, field, off in (("mistral", "sliding_window", 0), ("gemma3", "rope_local_theta", 0.0),
                             ("gemma2", "attn_softcap", 0.0), ("gemma2", "final_softcap", 0.0)):
        model = _with(checkpoints[name], mesh, **{field: off})
        if name not in want:
            want[name] = _hf_logits(checkpoints[name], tokens)
        assert rel_error(_our_logits(model, tokens), want[name]) > 10 * TOL
        checked += 1
    assert checked == 4


def _with(path, mesh, **change):
    """from_pretrained, then one config field changed (same weights; built abstractly, as
    from_pretrained builds, since every parameter is then replaced)."""
    model = from_pretrained(path, mesh=mesh)
    other = nnx.eval_shape(lambda: Decoder(dataclasses.replace(model.cfg, **change), mesh=mesh,
                                           rngs=nnx.Rngs(0)))
    nnx.update(other, nnx.state(model, nnx.Param))
    return other


@pytest.mark.parametrize("family,arch,over", [
    ("gemma", "gemma3_text", dict(qk_norm=True, rope_local_theta=5000.0, layer_pattern="LLG")),
    ("gemma", "gemma2", dict(attn_softcap=6.0, final_softcap=9.0, layer_pattern="LG")),
    ("llama", "mistral", dict()),
    ("llama", "qwen3", dict(qk_norm=True, layer_pattern="GL"))])
def test_export_round_trip(tmp_path, family, arch, over):
    cfg = ModelConfig(vocab_size=V, d_model=48, n_layers=3, n_heads=3, n_kv_heads=1,
                      head_dim=16, ffn_dim=96, rope_theta=20000.0, norm_eps=1e-6,
                      tie_embeddings=family == "gemma", attn_impl="auto", init_std=0.08,
                      family=family, sliding_window=W,
                      attn_scale=20 ** -0.5 if family == "gemma" else 0.0,
                      **over)
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    model = Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(3))
    keys = iter(jax.random.split(jax.random.key(4), 64))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree_util.tree_map_with_path(
        lambda p, x: 0.3 * jax.random.normal(next(keys), x.shape)
        if "scale" in str(p) else x, state))                    # norms are zeros at init
    save_pretrained(model, str(tmp_path), arch=arch)
    hf = json.load(open(tmp_path / "config.json"))
    assert hf["model_type"] == arch
    tokens = _tokens(11)
    assert rel_error(_our_logits(model, tokens), _hf_logits(str(tmp_path), tokens)) <= TOL
    back = from_pretrained(str(tmp_path), mesh=mesh)
    assert back.cfg.layer_kinds() == cfg.layer_kinds()
    assert back.cfg == dataclasses.replace(cfg, init_std=back.cfg.init_std,
                                           layer_pattern=back.cfg.layer_pattern)


def test_gemma3_has_no_attention_softcap_as_in_transformers(checkpoints, tmp_path):
    """transformers' Gemma3 attention ignores attn_logit_softcapping: a gemma3_text config
    that sets it (here 1.0, which would change these logits a lot) imports without it, with
    transformers' logits; a gemma-family model with q/k norms and a softcap cannot export."""
    import shutil
    shutil.copytree(checkpoints["gemma3"], tmp_path / "g3", dirs_exist_ok=True)
    hf = json.load(open(tmp_path / "g3" / "config.json"))
    (tmp_path / "g3" / "config.json").write_text(json.dumps({**hf, "attn_logit_softcapping": 1.0}))
    model = from_pretrained(str(tmp_path / "g3"), mesh=make_mesh(
        seq=1, data=1, devices=need_devices(1)))
    assert model.cfg.attn_softcap == 0.0
    tokens = _tokens(6)
    assert rel_error(_our_logits(model, tokens), _hf_logits(str(tmp_path / "g3"), tokens)) <= TOL
    with pytest.raises(ValueError, match=r"gemma3_text applies no attention logit softcap .* "
                                         r"attn_softcap=50.0"):
        config_to_hf(ModelConfig(family="gemma", qk_norm=True, attn_softcap=50.0))


def test_export_refusals():
    with pytest.raises(ValueError, match="arch 'mistral' slides on every layer"):
        config_to_hf(ModelConfig(sliding_window=8, layer_pattern="LG"), "mistral")
    with pytest.raises(ValueError, match="arch 'llama' has no sliding window"):
        config_to_hf(ModelConfig(sliding_window=8), "llama")
    with pytest.raises(ValueError, match="gemma2 has one RoPE base"):
        config_to_hf(ModelConfig(family="gemma", rope_local_theta=10.0, rope_theta=20.0))
    with pytest.raises(ValueError, match="not query_pre_attn_scalar"):
        config_to_hf(ModelConfig(family="gemma", attn_scale=0.3))
    with pytest.raises(ValueError, match="use arch='gemma3_text'"):
        config_to_hf(ModelConfig(family="gemma", qk_norm=True), "gemma2")
    base = dict(model_type="gemma3_text", hidden_size=48, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=3, vocab_size=V)
    for over, reason in ((dict(hidden_activation="silu"), "hidden_activation 'silu'"),
                         (dict(use_bidirectional_attention=True), "bidirectional"),
                         (dict(rope_parameters={"full_attention": {"rope_type": "dynamic",
                                                                   "factor": 8.0}}),
                          "RoPE scaling 'dynamic' on full_attention layers")):
        with pytest.raises(ValueError, match=reason):
            config_from_hf({**base, **over})
    assert pattern_string("LLLLLGLLLLLGLL") == "LLLLLG" and pattern_string("GGL") == "GGL"


def test_init_from_gemma_dry_run(checkpoints):
    """train.py --dry-run with init_from a Gemma 3 checkpoint on a seq=2 mesh: the model
    shape comes from it (3 heads over 2 devices, padded), and the step compiles."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "train.py", "--dry-run", f"init_from={checkpoints['gemma3']}",
                          "mesh.seq=2", "seq_len=64", "batch_size=2", "model.loss_chunk=16"],
                         capture_output=True, text=True, cwd=root, env=cli_env(), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["peak_bytes_per_device"] > 0 and out["collectives"]["all-to-all"] >= 2
