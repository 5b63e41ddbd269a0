"""Hugging Face import/export against transformers' own models (torch, fp32, eager attention).

Tiny random Llama / Qwen2 / Qwen3 / Mistral checkpoints are written by transformers itself
(single file, sharded index, bf16), loaded by ``ulysses_jax.hf`` on 1, 2 and 4 sequence-parallel
devices, and their logits compared with transformers' on the same tokens. Every weight, norms
and biases included, is redrawn at random so a swapped or mis-transposed tensor cannot hide
behind an init of ones or zeros.
"""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.utils.devices import need_devices
from tests.utils.numerics import rel_error
from tests.utils.torch_models import BIASES, randomize
from ulysses_jax import make_mesh
from ulysses_jax.config import ModelConfig
from ulysses_jax.hf import (ARCHS, config_from_hf, config_to_hf, from_pretrained, load_params,
                            save_pretrained)
from ulysses_jax.models.decoder import Decoder

torch = pytest.importorskip("torch", reason="torch is needed to build reference checkpoints")
transformers = pytest.importorskip("transformers", reason="transformers is needed as reference")

V, S, B = 300, 32, 2
TOL = 1e-4  # max|ours - theirs| / max|theirs|, fp32
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=V)
CHECKPOINTS = {
    # name: (config class, config kwargs, save kwargs, from_pretrained kwargs)
    "llama_tied": ("LlamaConfig", dict(head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-5),
                   {}, {}),
    "qwen3_untied": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=False,
                                         rope_theta=500000.0), {}, {}),
    "qwen2_untied": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=100000.0), {}, {}),
    "qwen3_sharded": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True),
                      dict(max_shard_size="40KB"), {}),
    "llama_bf16": ("LlamaConfig", dict(head_dim=16, tie_word_embeddings=False), {"bf16": True}, {}),
    "mistral_window": ("MistralConfig", dict(head_dim=16, sliding_window=64), {},
                       dict(max_seq_len=S)),
}


def _hf_load(path):
    kind = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", **{kind: torch.float32}).eval()


def _hf_logits(path, tokens) -> np.ndarray:
    with torch.no_grad():
        return _hf_load(path)(torch.from_numpy(tokens).long()).logits.numpy()


def _our_logits(model, tokens) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))


def _tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (B, S)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> directory of a transformers-written checkpoint (see CHECKPOINTS)."""
    out = {}
    for i, (name, (cls, kw, save, _)) in enumerate(CHECKPOINTS.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, cls)(**SMALL, **kw))
        randomize(model, seed=i, special=[BIASES])
        save = dict(save)
        if save.pop("bf16", False):
            model = model.to(torch.bfloat16)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path, safe_serialization=True, **save)
        out[name] = path
    return out


# Every P for the two main shapes (P=4 > 2 kv heads: kv repeated); the file-format and window
# variants only at the largest P.
IMPORT_CASES = [(n, p) for n in ("llama_tied", "qwen3_untied", "qwen2_untied")
                for p in (1, 2, 4)] + [
    (n, 4) for n in ("qwen3_sharded", "llama_bf16", "mistral_window")]


@pytest.mark.parametrize("name,p", IMPORT_CASES)
def test_import_matches_transformers(checkpoints, name, p):
    path = checkpoints[name]
    tokens = _tokens(p)
    want = _hf_logits(path, tokens)
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    model = from_pretrained(path, mesh=mesh, dtype=jnp.float32, attn_impl="xla",
                            **CHECKPOINTS[name][3])
    got = _our_logits(model, tokens)
    assert got.shape == (B, S, V) and got.dtype == np.float32
    assert rel_error(got, want) <= TOL, (name, p, rel_error(got, want))
    assert model.embed.sharding.mesh.shape == mesh.shape


def test_checkpoint_kinds_are_what_they_claim(checkpoints):
    """The sharded and bf16 cases really exercise the index and bf16 paths."""
    from safetensors import safe_open
    with open(os.path.join(checkpoints["qwen3_sharded"], "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    with safe_open(os.path.join(checkpoints["llama_bf16"], "model.safetensors"), "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    cfg = config_from_hf(json.load(open(os.path.join(checkpoints["qwen3_untied"], "config.json"))))
    assert (cfg.qk_norm, cfg.head_dim, cfg.tie_embeddings, cfg.rope_theta) == (True, 24, False, 5e5)
    # Qwen2: random (not zero) q/k/v biases, none on o_proj, and they land in bq / bk / bv.
    path = checkpoints["qwen2_untied"]
    cfg = config_from_hf(json.load(open(os.path.join(path, "config.json"))))
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.head_dim, cfg.rope_theta) == (True, False, 16, 1e5)
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        biases = {k: f.get_tensor(k) for k in f.keys() if k.endswith(".bias")}
    assert sorted(k.split(".")[-2] for k in biases) == ["k_proj", "k_proj", "q_proj", "q_proj",
                                                        "v_proj", "v_proj"]
    assert min(float(np.std(b)) for b in biases.values()) > 0.1
    _, params = load_params(path, make_mesh(seq=1, data=1, devices=need_devices(1)))
    attn = params["layers"]["attn"]
    assert (attn["bq"].shape, attn["bk"].shape, attn["bv"].shape) == ((2, 4, 16), (2, 2, 16),
                                                                      (2, 2, 16))
    np.testing.assert_array_equal(np.asarray(attn["bk"][1]).reshape(-1),
                                  biases["model.layers.1.self_attn.k_proj.bias"])


def test_zero3_load_params_lands_sharded(checkpoints):
    path = checkpoints["qwen3_untied"]
    mesh = make_mesh(seq=4, data=1, devices=need_devices(4))
    cfg, params = load_params(path, mesh, "zero3", attn_impl="xla")
    wq = params["layers"]["attn"]["wq"]                                          # [L, D, N, H]
    assert wq.shape == (2, 64, 4, 24) and wq.dtype == jnp.float32
    assert wq.sharding.spec != jax.sharding.PartitionSpec() and len(wq.sharding.device_set) == 4
    model = from_pretrained(path, mesh=mesh, param_sharding="zero3", attn_impl="xla")
    assert model.cfg == cfg
    tokens = _tokens(7)
    assert rel_error(_our_logits(model, tokens), _hf_logits(path, tokens)) <= TOL


def _redraw(p, x, keys):
    """Norm scales start at ones and biases at zeros; redraw them so their export is checked."""
    names = [str(getattr(k, "key", k)) for k in p]
    if "scale" in names:
        return 1 + 0.3 * jax.random.normal(next(keys), x.shape)
    if {"bq", "bk", "bv"} & set(names):
        return 0.3 * jax.random.normal(next(keys), x.shape)
    return x


@pytest.mark.parametrize("arch,qk_norm,qkv_bias,tie", [
    ("llama", False, False, True), ("qwen3", True, False, False), ("mistral", False, False, False),
    ("qwen2", False, True, False)])
def test_export_round_trip(tmp_path, arch, qk_norm, qkv_bias, tie):
    cfg = ModelConfig(vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24,
                      ffn_dim=128, rope_theta=20000.0, norm_eps=1e-5, qk_norm=qk_norm,
                      qkv_bias=qkv_bias, tie_embeddings=tie, attn_impl="xla", init_std=0.08)
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    model = Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(3))
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(4), 16))
    nnx.update(model, jax.tree_util.tree_map_with_path(lambda p, x: _redraw(p, x, keys), state))
    save_pretrained(model, str(tmp_path), arch=arch)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    hf = json.load(open(tmp_path / "config.json"))
    assert (hf["model_type"], hf["architectures"]) == (arch, [ARCHS[arch]])
    if qkv_bias:  # the exported biases are the redrawn ones, and transformers holds them
        bq = np.asarray(model.layers.attn.bq[...])                               # [L, N, H]
        assert float(np.std(bq)) > 0.1
        loaded = _hf_load(str(tmp_path)).model.layers[1].self_attn
        np.testing.assert_array_equal(loaded.q_proj.bias.detach().numpy(), bq[1].reshape(-1))
        assert loaded.o_proj.bias is None
    tokens = _tokens(11)
    ours = _our_logits(model, tokens)
    assert rel_error(ours, _hf_logits(str(tmp_path), tokens)) <= TOL
    back = from_pretrained(str(tmp_path), mesh=mesh, attn_impl="xla")
    assert back.cfg == dataclasses.replace(cfg, init_std=back.cfg.init_std)
    checked = 0
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                    jax.tree.leaves(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        checked += 1
    assert checked == len(jax.tree.leaves(nnx.state(model, nnx.Param))) > 0


def _hf_config(**over):
    base = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=V, hidden_act="silu")
    return {**base, **over}


@pytest.mark.parametrize("over,kw,reason", [
    (dict(model_type="gemma"), {}, "model_type 'gemma' is not supported"),
    (dict(attention_bias=True), {}, "attention_bias=true"),
    (dict(mlp_bias=True), {}, "mlp_bias=true"),
    (dict(hidden_act="gelu"), {}, "hidden_act 'gelu'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 8.0}), {}, "RoPE scaling 'dynamic'"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), {},
     "RoPE scaling 'longrope'"),
    (dict(rope_scaling={"type": "linear"}), {}, "RoPE scaling 'linear' lacks 'factor'"),
    (dict(partial_rotary_factor=0.5), {}, "partial_rotary_factor"),
    (dict(model_type="qwen3", attention_bias=True), {}, "attention_bias=true"),
])
def test_unsupported_configs_are_refused(over, kw, reason):
    with pytest.raises(ValueError, match=reason):
        config_from_hf(_hf_config(**over), **kw)


def test_config_translation():
    cfg = config_from_hf(_hf_config(model_type="mistral", sliding_window=None, rope_theta=1e6))
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.qk_norm) == (2, 16, 1e6, False)
    # A Qwen3 window that transformers would not apply (use_sliding_window false) is accepted.
    assert config_from_hf(_hf_config(model_type="qwen3", sliding_window=8)).qk_norm
    # Qwen2 likewise; a window only on layers >= max_window_layers (none of 2 here) is no window;
    # Qwen2's modeling reads no attention_bias key (its q/k/v biases are always there).
    for over in (dict(sliding_window=8), dict(use_sliding_window=True, sliding_window=8),
                 dict(attention_bias=True)):
        cfg = config_from_hf(_hf_config(model_type="qwen2", **over))
        assert (cfg.qkv_bias, cfg.qk_norm) == (True, False), over
    assert not config_from_hf(_hf_config()).qkv_bias
    assert config_from_hf(_hf_config(model_type="mistral", sliding_window=64),
                          max_seq_len=64).vocab_size == V
    # Sliding windows load (tests/test_hf_variants.py checks them against transformers).
    assert config_from_hf(_hf_config(model_type="mistral")).sliding_window == 4096
    cfg = config_from_hf(_hf_config(model_type="qwen3", use_sliding_window=True, sliding_window=8,
                                    max_window_layers=1))
    assert (cfg.sliding_window, cfg.layer_kinds()) == (8, "GL")
    assert config_from_hf(_hf_config(), dtype=jnp.bfloat16).dtype == "bfloat16"
    for qk, bias, arch in ((True, False, "qwen3"), (False, False, "llama"),
                           (False, False, "mistral"), (False, True, "qwen2")):
        cfg = ModelConfig(qk_norm=qk, qkv_bias=bias, tie_embeddings=not qk, rope_theta=123.0,
                          norm_eps=1e-5)
        assert config_from_hf(config_to_hf(cfg, arch)) == cfg
        assert config_to_hf(cfg)["model_type"] == {"mistral": "llama"}.get(arch, arch)
    with pytest.raises(ValueError, match="qk_norm=True; use arch='qwen3'"):
        config_to_hf(ModelConfig(qk_norm=True), "llama")
    with pytest.raises(ValueError, match="qkv_bias=True; use arch='qwen2'"):
        config_to_hf(ModelConfig(qkv_bias=True), "llama")
    with pytest.raises(ValueError, match="qkv_bias=False; use arch='llama'"):
        config_to_hf(ModelConfig(), "qwen2")
    with pytest.raises(ValueError, match="both q/k RMSNorm and q/k/v biases"):
        config_to_hf(ModelConfig(qk_norm=True, qkv_bias=True))
    with pytest.raises(ValueError, match="arch must be one of"):
        config_to_hf(ModelConfig(), "gpt2")
    for other in ("qwen3_next", "qwen2_5_vl", "gemma2"):  # another family's model type
        with pytest.raises(ValueError, match="arch must be one of"):
            config_to_hf(ModelConfig(), other)


def test_bad_tensors_are_refused(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file
    src = checkpoints["llama_tied"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    config = open(os.path.join(src, "config.json")).read()
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    cases = {
        "no place for": {**tensors, "model.layers.0.self_attn.q_proj.bias":
                         np.ones(64, np.float32)},
        r"lacks tensors \['model.layers.1.mlp.up_proj.weight'\]":
            {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
        r"has shape \(300, 32\), expected \(300, 64\)":
            {**tensors, "model.embed_tokens.weight": np.ones((300, 32), np.float32)},
    }
    for i, (reason, case) in enumerate(cases.items()):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(config)
        save_file(case, str(d / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=reason):
            load_params(str(d), mesh)
    with pytest.raises(ValueError, match="has no config.json"):
        load_params(str(tmp_path), mesh)
    with pytest.raises(ValueError, match="param_sharding must be one of"):
        load_params(src, mesh, "fsdp")


def test_qwen2_biases_must_match(checkpoints, tmp_path):
    """An o_proj bias (which we cannot add) or a missing q/k/v bias is refused by name."""
    from safetensors.numpy import load_file, save_file
    src = checkpoints["qwen2_untied"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    cases = {
        r"no place for.*o_proj.bias": {**tensors, "model.layers.0.self_attn.o_proj.bias":
                                       np.full(64, 0.5, np.float32)},
        r"lacks tensors \['model.layers.1.self_attn.v_proj.bias'\]":
            {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.v_proj.bias"},
        r"has shape \(32,\), expected \(64,\)":
            {**tensors, "model.layers.0.self_attn.q_proj.bias": np.ones(32, np.float32)},
    }
    for i, (reason, case) in enumerate(cases.items()):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(open(os.path.join(src, "config.json")).read())
        save_file(case, str(d / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=reason):
            load_params(str(d), mesh)


def test_import_does_not_need_torch(checkpoints):
    """Loading runs in a process where torch cannot be imported at all."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from ulysses_jax.hf import from_pretrained\n"
            f"m = from_pretrained({checkpoints['llama_bf16']!r})\n"
            "assert m.embed.shape == (300, 64)\nprint('ok')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_compare_hf_cli(checkpoints, tmp_path, monkeypatch, capsys):
    from ulysses_jax.interop import compare
    lines, passed = compare.compare_hf(checkpoints["qwen3_untied"], seqs=(1, 2), seq_len=S,
                                       batch=2, attn="sdpa", impl="xla")
    rows = [l.split() for l in lines if l.startswith(("transformers ", "ulysses_jax seq="))]
    assert passed and len(rows) == 3 and lines[-1].startswith("PASS")
    losses = [float(r[-1]) for r in rows]
    assert max(losses) - min(losses) <= 1e-4 * losses[0], losses
    monkeypatch.setattr(compare, "HF_TOLERANCE", 0.0)
    _, passed = compare.compare_hf(checkpoints["llama_tied"], seqs=(1,), seq_len=S)
    assert not passed
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(attention_bias=True)))
    assert compare.main(["hf", "--model-path", str(tmp_path)]) == compare.EXIT_BAD_ARGS
    assert "attention_bias=true" in capsys.readouterr().err


def test_config_defaults_follow_transformers():
    """Keys a config.json may omit take the value transformers' config class gives them."""
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        hf = {k: v for k, v in _hf_config(model_type=model_type, sliding_window=None).items()
              if k != "num_key_value_heads"}
        theirs = transformers.AutoConfig.for_model(**hf)
        # Qwen2Config has no head_dim field; its attention then uses hidden_size // heads.
        head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // 4
        ours = config_from_hf(hf)
        assert (ours.n_kv_heads, ours.head_dim, ours.norm_eps, ours.rope_theta,
                ours.tie_embeddings) == (theirs.num_key_value_heads, head_dim,
                                         theirs.rms_norm_eps, 10000.0,
                                         theirs.tie_word_embeddings), model_type
    with pytest.raises(ValueError, match="lacks"):
        config_from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        config_from_hf(_hf_config(), dtype="float16")
