"""RoPE scaling (models/rope.py, model.rope_scaling) against transformers' own code.

(a) Frequencies and attention factors equal transformers' rotary embedding classes for every
    supported type, from config.json dicts shaped like published checkpoints (both the
    transformers 5 ``rope_parameters`` and the older ``rope_scaling`` key), for llama,
    mistral, qwen2, qwen3, qwen3_moe and gemma3_text; partial RoPE (``rotary_dim``) equals
    Qwen3-Next's; exact angles are exact.
(b) Logits equal transformers' models at positions 60,000-117,000 on 1, 2 and 4 devices.
(c) Export: transformers reloads the same scaling and logits; import gives the config back.
(d) dynamic, longrope and unknown types are refused with the type named.
Tiny random models; every checkpoint is written by transformers itself (or, for the older
key, its config.json rewritten the way older releases wrote it).
"""
import dataclasses
import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.utils.devices import need_devices
from tests.utils.numerics import rel_error
from tests.utils.torch_models import BIASES, randomize
from ulysses_jax import make_mesh
from ulysses_jax.config import ConfigError, ModelConfig, RopeScalingConfig, load_config
from ulysses_jax.hf import config_from_hf, from_pretrained, save_pretrained
from ulysses_jax.models.decoder import Decoder
from ulysses_jax.models.rope import angles, apply_rope, attention_factor, inv_freq

torch = pytest.importorskip("torch", reason="torch is needed to build reference checkpoints")
transformers = pytest.importorskip("transformers", reason="transformers is needed as reference")

V, S, B = 300, 32, 2
TOL = 1e-4  # max|ours - theirs| / max|theirs|, fp32 (the issue allows 3e-4)
OFFSET = {1: 60_000, 2: 90_000, 4: 117_000}  # first position per device count
LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA32 = dict(LLAMA31, factor=32.0)
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
QWEN25_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
GEMMA3_LINEAR = {"factor": 8.0, "rope_type": "linear"}
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=V)
GEMMA3_SHAPE = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                    query_pre_attn_scalar=24, sliding_window=8, vocab_size=V,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _old(rope: dict, theta: float) -> dict:
    """config.json RoPE keys as transformers 4 wrote them."""
    return {"rope_scaling": rope, "rope_theta": theta}


def _new(rope: dict, theta: float) -> dict:
    """config.json RoPE keys as transformers 5 writes them."""
    return {"rope_parameters": {**rope, "rope_theta": theta}}


# name: (model_type, shape, RoPE keys, max_position_embeddings), shaped like published files.
CONFIGS = {
    "llama31_old": ("llama", SHAPE, _old(LLAMA31, 500000.0), 131072),
    "llama32_new": ("llama", SHAPE, _new(LLAMA32, 500000.0), 131072),
    "mistral_linear": ("mistral", SHAPE, _new({"rope_type": "linear", "factor": 4.0}, 1e6), 32768),
    "qwen2_yarn_old_type": ("qwen2", SHAPE, _old(QWEN25_YARN, 1e6), 32768),
    "qwen3_yarn_new": ("qwen3", SHAPE, _new(QWEN3_YARN, 1e6), 131072),
    "qwen3_yarn_old": ("qwen3", SHAPE, _old(QWEN3_YARN, 1e6), 40960),
    "qwen3_yarn_mscale": ("qwen3", SHAPE, _new(dict(QWEN3_YARN, factor=40.0, mscale=1.0,
                                                    mscale_all_dim=0.8, beta_fast=16,
                                                    beta_slow=2, truncate=False), 1e4), 32768),
    "qwen3_yarn_null_factor": ("qwen3", SHAPE, _new(dict(QWEN3_YARN, factor=None), 1e6), 131072),
    "qwen3_yarn_attention_factor": ("qwen3", SHAPE, _new(dict(
        QWEN3_YARN, attention_factor=1.25, original_max_position_embeddings=4096), 1e4), 16384),
    "qwen3_moe_yarn": ("qwen3_moe", dict(SHAPE, num_experts=4, moe_intermediate_size=32),
                       _old(QWEN3_YARN, 1e6), 32768),
    "gemma3_linear_old": ("gemma3_text", GEMMA3_SHAPE,
                          {"rope_scaling": GEMMA3_LINEAR, "rope_theta": 1e6,
                           "rope_local_base_freq": 10000.0}, 131072),
    "gemma3_yarn_new": ("gemma3_text", GEMMA3_SHAPE, {"rope_parameters": {
        "full_attention": dict(QWEN3_YARN, rope_theta=1e6),
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "truncate": False}}, 131072),                 # yarn reads truncate from the top level
}
_ROTARY = {"llama": "llama.modeling_llama.LlamaRotaryEmbedding",
           "mistral": "mistral.modeling_mistral.MistralRotaryEmbedding",
           "qwen2": "qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
           "qwen3": "qwen3.modeling_qwen3.Qwen3RotaryEmbedding",
           "qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding",
           "gemma3_text": "gemma3.modeling_gemma3.Gemma3RotaryEmbedding"}


def _config_json(name: str) -> dict:
    mt, shape, rope, max_pos = CONFIGS[name]
    return {"model_type": mt, **shape, **rope, "max_position_embeddings": max_pos}


def _rotary(hf: dict):
    """transformers' rotary embedding module of the model type, built from config.json."""
    module, cls = _ROTARY[hf["model_type"]].rsplit(".", 1)
    config = transformers.AutoConfig.for_model(**json.loads(json.dumps(hf)))
    return getattr(importlib.import_module(f"transformers.models.{module}"), cls)(config)


def _theirs(rotary, kind: str):
    """(inv_freq [H/2], attention scaling) of a layer kind (L local, G global)."""
    if hasattr(rotary, "layer_types"):  # Gemma 3: one set per layer type
        t = "sliding_attention" if kind == "L" else "full_attention"
        return (getattr(rotary, f"{t}_inv_freq").numpy(),
                getattr(rotary, f"{t}_attention_scaling"))
    return rotary.inv_freq.numpy(), rotary.attention_scaling


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frequencies_match_transformers(name):
    """inv_freq within 2 fp32 ulps (torch's pow is not always correctly rounded) and the
    cos/sin factor to 1e-12, for global and local layers, from the same config.json."""
    hf = _config_json(name)
    cfg = config_from_hf(hf)
    rotary = _rotary(hf)
    kinds = "GL" if hf["model_type"] == "gemma3_text" else "G"
    for kind in kinds:
        want, want_scale = _theirs(rotary, kind)
        theta, scaling = cfg.rope(kind)
        got = inv_freq(cfg.head_dim, theta, scaling)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=0, err_msg=f"{name} {kind}")
        assert attention_factor(scaling) == pytest.approx(want_scale, rel=1e-12)
    assert cfg.rope_scaling.type != "default"  # every case is a scaled one


def test_scalings_change_the_frequencies():
    """Each type moves inv_freq away from unscaled RoPE (no case above is vacuous)."""
    base = inv_freq(32, 1e6)
    checked = 0
    for name in ("llama31_old", "mistral_linear", "qwen3_yarn_new", "qwen3_yarn_mscale"):
        cfg = config_from_hf(_config_json(name))
        assert np.max(np.abs(inv_freq(32, 1e6, cfg.rope_scaling) / base - 1)) > 0.5, name
        checked += 1
    assert checked == 4


def test_partial_rotary_matches_qwen3_next():
    """rotary_dim: the first R dims rotate as transformers' partial RoPE, the rest pass."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qn
    config = transformers.Qwen3NextConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                          partial_rotary_factor=0.25, rope_theta=10000.0)
    rotary = qn.Qwen3NextRotaryEmbedding(config)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, S, 2, 32)).astype(np.float32)                    # [B, S, N, H]
    pos = (rng.integers(0, 100_000, (B, S))).astype(np.int32)
    cos, sin = rotary(torch.from_numpy(q), torch.from_numpy(pos).long())
    qt = torch.from_numpy(q).transpose(1, 2)                                      # [B, N, S, H]
    want, _ = qn.apply_rotary_pos_emb(qt, qt, cos, sin)
    got = jax.jit(lambda q, pos: apply_rope(q, pos, 10000.0, rotary_dim=8))(q, pos)
    np.testing.assert_allclose(np.asarray(got), want.transpose(1, 2).numpy(), rtol=0, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got)[..., 8:], q[..., 8:])
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        apply_rope(jnp.asarray(q), jnp.asarray(pos), rotary_dim=7)


def test_angles_exact_from_the_threshold():
    """From rope_exact_from up, angles equal position x inv_freq (float64) modulo 2 pi within
    2e-6 rad, where fp32 products are off by up to 0.3 rad; below it they are transformers'
    fp32 products bit for bit."""
    freqs = inv_freq(128, 5e5, RopeScalingConfig(**{k: v for k, v in LLAMA31.items()
                                                     if k != "rope_type"}, type="llama3"))
    pos = np.concatenate([np.arange(2**17 - 64, 2**17 + 64),
                          np.random.default_rng(1).integers(2**17, 2**31 - 1, 4096)])
    pos = pos.astype(np.int32)[None]                                              # [1, S]
    got = np.asarray(jax.jit(lambda p: angles(p, freqs, exact_from=2**17))(pos), np.float64)
    exact = pos[..., None].astype(np.float64) * freqs.astype(np.float64)          # [1, S, R/2]
    err = np.abs(np.angle(np.exp(1j * (got - exact))))
    high = pos[0] >= 2**17
    assert np.max(err[:, high]) < 2e-6
    fp32 = np.asarray(jax.jit(lambda p: angles(p, freqs, exact_from=None))(pos), np.float64)
    assert np.max(np.abs(np.angle(np.exp(1j * (fp32 - exact))))[:, high]) > 0.05
    want_low = torch.from_numpy(pos[0, ~high]).float()[:, None] * torch.from_numpy(freqs)
    np.testing.assert_array_equal(got[0, ~high], want_low.numpy())


# --- (b) logits of transformers' models, (c) export round trip ---------------------------

# name: (config class, RoPE keys as kwargs, rewrite config.json to the older keys)
MODELS = {
    "llama31": ("LlamaConfig", dict(rope_parameters=dict(LLAMA31, rope_theta=500000.0),
                                    tie_word_embeddings=True), True),
    # Llama-3.2-1B's published RoPE (llama3, factor 32 from 8192), tied, older keys
    "llama32": ("LlamaConfig", dict(rope_parameters=dict(LLAMA32, rope_theta=500000.0),
                                    tie_word_embeddings=True), True),
    "qwen3_yarn": ("Qwen3Config", dict(rope_parameters=dict(QWEN3_YARN, rope_theta=1e6)), False),
    "qwen2_yarn": ("Qwen2Config", dict(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "rope_theta": 1e6}), True),
    "gemma3_linear": ("Gemma3TextConfig", dict(rope_parameters={
        "full_attention": dict(GEMMA3_LINEAR, rope_theta=1e6),
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), True),
}


def _to_older_keys(path: str) -> None:
    """Rewrites config.json's RoPE keys as transformers 4 wrote them (rope_scaling, with
    type instead of rope_type for Qwen2.5; Gemma 3: rope_local_base_freq)."""
    file = os.path.join(path, "config.json")
    hf = json.load(open(file))
    rope = hf.pop("rope_parameters")
    if hf["model_type"] == "gemma3_text":
        full = dict(rope["full_attention"])
        hf.update(rope_theta=full.pop("rope_theta"),
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling=full)
    else:
        rope = dict(rope)
        hf["rope_theta"] = rope.pop("rope_theta")
        if hf["model_type"] == "qwen2":
            rope["type"] = rope.pop("rope_type")
        hf["rope_scaling"] = rope
    json.dump(hf, open(file, "w"), indent=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, (name, (cls, rope, older)) in enumerate(MODELS.items()):
        shape = GEMMA3_SHAPE if cls == "Gemma3TextConfig" else SHAPE
        torch.manual_seed(20 + i)
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, cls)(**shape, max_position_embeddings=131072, **rope))
        randomize(model, seed=20 + i, special=[BIASES])
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path, safe_serialization=True)
        if older:
            _to_older_keys(path)
        out[name] = path
    return out


def _inputs(p: int, seed: int):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (B, S)).astype(np.int32)
    positions = np.broadcast_to(np.arange(S, dtype=np.int32) + OFFSET[p], (B, S)).copy()
    return tokens, positions


def _hf_logits(path: str, tokens, positions) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long(),
                     position_ids=torch.from_numpy(positions).long()).logits.numpy()


_forward = nnx.jit(lambda m, t, p: m(t, p))  # one program per model config, mesh and shape


def _our_logits(model, tokens, positions) -> np.ndarray:
    return np.asarray(_forward(model, tokens, positions))


def _with_config(model, **changes):
    """``model``'s parameters in a Decoder with changed config fields (built abstractly: every
    parameter is replaced, so no initialisation runs)."""
    other = nnx.eval_shape(lambda: Decoder(dataclasses.replace(model.cfg, **changes),
                                           mesh=model.mesh, rngs=nnx.Rngs(0)))
    nnx.update(other, nnx.state(model, nnx.Param))
    return other


@pytest.mark.parametrize("name,p", [(n, p) for n in MODELS for p in (1, 2, 4)])
def test_logits_match_transformers(checkpoints, name, p):
    tokens, positions = _inputs(p, seed=p)
    want = _hf_logits(checkpoints[name], tokens, positions)
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    model = from_pretrained(checkpoints[name], mesh=mesh, attn_impl="xla")
    assert model.cfg.rope_scaling.type in ("llama3", "yarn", "linear")
    assert rel_error(_our_logits(model, tokens, positions), want) <= TOL, (name, p)


@pytest.mark.parametrize("name", list(MODELS))
def test_without_the_scaling_logits_differ(checkpoints, name):
    """The same weights with unscaled RoPE leave the tolerance: the parity above tests the
    scaling, not only the weights."""
    tokens, positions = _inputs(1, seed=1)
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    model = from_pretrained(checkpoints[name], mesh=mesh, attn_impl="xla")
    other = _with_config(model, rope_scaling=RopeScalingConfig())
    want = _hf_logits(checkpoints[name], tokens, positions)
    assert rel_error(_our_logits(other, tokens, positions), want) > 10 * TOL


def test_exact_angles_from_the_threshold_in_the_model(checkpoints):
    """model.rope_exact_from reaches the attention: below it the angles are transformers'
    (same logits as with exact angles switched off), from it on they are the exact ones
    (same logits as exact everywhere, and measurably not fp32's)."""
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    model = from_pretrained(checkpoints["qwen3_yarn"], mesh=mesh, attn_impl="xla")
    assert model.cfg.rope_exact_from == 2**17
    tokens, low = _inputs(1, seed=3)
    high = low + 2**20

    def logits(exact_from, positions):
        return _our_logits(_with_config(model, rope_exact_from=exact_from), tokens, positions)

    fp32, exact = 2**31 - 1, 0
    threshold_high = logits(2**17, high)
    assert rel_error(logits(2**17, low), logits(fp32, low)) <= 1e-7
    assert rel_error(threshold_high, logits(exact, high)) <= 1e-7
    assert rel_error(threshold_high, logits(fp32, high)) > TOL


EXPORTS = {
    # name: (arch, ModelConfig changes)
    "llama3": ("llama", dict(rope_theta=5e5, rope_scaling=RopeScalingConfig(
        type="llama3", factor=8.0, original_max_position_embeddings=8192))),
    "yarn_mscale": ("qwen3", dict(qk_norm=True, rope_theta=1e4, rope_scaling=RopeScalingConfig(
        type="yarn", factor=16.0, original_max_position_embeddings=4096, beta_fast=24.0,
        beta_slow=2.0, mscale=1.0, mscale_all_dim=0.5, truncate=False))),
    "yarn_attention_factor": ("qwen2", dict(qkv_bias=True, rope_theta=1e6,
                                            rope_scaling=RopeScalingConfig(
        type="yarn", factor=4.0, original_max_position_embeddings=32768,
        attention_factor=1.3))),
    "gemma3": ("gemma3_text", dict(family="gemma", qk_norm=True, tie_embeddings=True,
                                   rope_theta=1e6, rope_local_theta=1e4, sliding_window=8,
                                   layer_pattern="LGL", attn_scale=24 ** -0.5,
                                   rope_scaling=RopeScalingConfig(type="linear", factor=8.0),
                                   rope_local_scaling=RopeScalingConfig())),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(tmp_path, name):
    arch, over = EXPORTS[name]
    cfg = ModelConfig(vocab_size=V, d_model=48, n_layers=3, n_heads=3, n_kv_heads=1,
                      head_dim=32, ffn_dim=96, norm_eps=1e-6, attn_impl="xla",
                      init_std=0.08, **{"tie_embeddings": False, **over})
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    model = Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(5))
    keys = iter(jax.random.split(jax.random.key(6), 64))
    zeros = ("scale", "'bq'", "'bk'", "'bv'")                    # norms and biases start at 0
    nnx.update(model, jax.tree_util.tree_map_with_path(
        lambda path, x: 0.3 * jax.random.normal(next(keys), x.shape)
        if any(z in str(path) for z in zeros) else x, nnx.state(model, nnx.Param)))
    save_pretrained(model, str(tmp_path), arch=arch)
    hf = json.load(open(tmp_path / "config.json"))
    written = hf["rope_parameters"]
    loaded = transformers.AutoConfig.from_pretrained(str(tmp_path)).rope_parameters
    assert {k: loaded[k] for k in written} == written and "rope_type" in json.dumps(written)
    s = cfg.rope_scaling
    assert hf["max_position_embeddings"] >= s.original_max_position_embeddings * s.factor
    tokens, positions = _inputs(2, seed=7)
    want = _hf_logits(str(tmp_path), tokens, positions)
    assert rel_error(_our_logits(model, tokens, positions), want) <= TOL
    back = from_pretrained(str(tmp_path), mesh=mesh, attn_impl="xla")
    assert back.cfg == dataclasses.replace(cfg, init_std=back.cfg.init_std,
                                           layer_pattern=back.cfg.layer_pattern)


# --- (d) refusals ----------------------------------------------------------------------

@pytest.mark.parametrize("keys,reason", [
    (_old({"type": "dynamic", "factor": 2.0}, 1e4), "RoPE scaling 'dynamic' is not implemented"),
    (_new({"rope_type": "dynamic", "factor": 2.0}, 1e4), "RoPE scaling 'dynamic'"),
    (_new({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
           "original_max_position_embeddings": 4096}, 1e4), "RoPE scaling 'longrope'"),
    (_old({"rope_type": "su", "factor": 2.0}, 1e4), "RoPE scaling 'su'"),
    (_new({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096}, 1e4),
     "factor must be >= 1 for type 'yarn', got 0.5"),
    (_new({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}, 1e4), "lacks 'low_freq_factor'"),
])
def test_refusals(keys, reason):
    hf = {"model_type": "llama", **SHAPE, **keys}
    with pytest.raises(ValueError, match=reason):
        config_from_hf(hf)
    gemma = {"model_type": "gemma3_text", **GEMMA3_SHAPE, "rope_parameters": {
        "full_attention": {"rope_type": "longrope", "factor": 2.0}}}
    with pytest.raises(ValueError, match="RoPE scaling 'longrope' on full_attention layers"):
        config_from_hf(gemma)


@pytest.mark.parametrize("overrides,reason", [
    (["model.rope_scaling.type=dynamic"], "model.rope_scaling.type must be one of"),
    (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=0.5",
      "model.rope_scaling.original_max_position_embeddings=4096"],
     "model.rope_scaling.factor must be >= 1 for type 'yarn', got 0.5"),
    (["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8"],
     "original_max_position_embeddings .* must be set for type 'llama3', got 0"),
    (["model.rope_local_scaling.type=yarn", "model.rope_local_scaling.factor=2",
      "model.rope_local_scaling.original_max_position_embeddings=8",
      "model.rope_local_scaling.beta_slow=40"], "needs 0 < beta_slow < beta_fast"),
    (["model.rope_scaling.factor=2"], "has no effect with model.rope_scaling.type 'default'"),
    (["model.rope_scaling.typo=1"], "model.rope_scaling.typo"),
    (["model.rope_scaling=3"], "must hold keys such as model.rope_scaling.<key>"),
    (["model.rope_exact_from=-1"], "model.rope_exact_from must be 0"),
])
def test_config_validation(overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        load_config(None, overrides)


def test_config_setting_reaches_the_model():
    """model.rope_scaling from key=value overrides is what the attention uses."""
    cfg = load_config(None, ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
                             "model.rope_scaling.original_max_position_embeddings=32768",
                             "model.sliding_window=8", "model.layer_pattern=LG",
                             "model.rope_local_scaling.type=default"]).model
    assert cfg.rope("G")[1].type == "yarn" and cfg.rope("L")[1].type == "default"
    assert dataclasses.replace(cfg, rope_local_scaling=RopeScalingConfig(type="")).rope("L") == \
        cfg.rope("G")
