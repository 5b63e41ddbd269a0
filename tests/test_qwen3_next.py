"""Qwen3-Next against transformers' own Qwen3NextForCausalLM (torch, fp32, eager), and its
Gated DeltaNet kernels against the definition.

Kernels: the chunked delta rule against the token-by-token recurrence (values and gradients,
document resets) and against transformers' ``torch_chunk_gated_delta_rule``; the Ulysses
DeltaNet (one packed all-to-all) on 2 and 4 devices against the one-device core, forward and
backward, with key heads copied where P does not divide them, and its collectives in HLO.
Model: a tiny random checkpoint (three DeltaNet layers then one attention layer, MoE with a
shared expert, a dense layer) written by transformers, imported on 1, 2 and 4 devices (logits
and loss); packed documents against each document alone; export round trip; refusals.
"""
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.utils.devices import need_devices
from tests.utils.numerics import rel_error
from tests.utils.torch_models import randomize
from ulysses_jax import make_mesh
from ulysses_jax.attention import deltanet, linear
from ulysses_jax.config import ConfigError, load_config
from ulysses_jax.hf import config_from_hf, from_pretrained, save_pretrained
from ulysses_jax.hlo import collective_counts
from ulysses_jax.models.decoder import layer_groups
from ulysses_jax.training.objectives.sft import objective

torch = pytest.importorskip("torch", reason="torch is needed to build reference checkpoints")
transformers = pytest.importorskip("transformers", reason="transformers is needed as reference")
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next  # noqa: E402

V, S, B = 300, 96, 2   # 96 tokens: two chunks of the delta rule, the second one padded
TOL = 1e-4
HF_CONFIG = dict(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True,
    router_aux_loss_coef=0.05, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25})


def _rng_inputs(seed, b, s, h, dq, dv):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, s, h, dq)).astype(np.float32)
    k = rng.normal(size=(b, s, h, dq)).astype(np.float32)
    v = rng.normal(size=(b, s, h, dv)).astype(np.float32)
    g = (-0.3 * np.abs(rng.normal(size=(b, s, h)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, s, h))))).astype(np.float32)
    return q, k, v, g, beta


def _packed_segments(b, s):
    seg = np.ones((b, s), np.int32)
    seg[:, 70:] = 2
    seg[0, 150:] = 3
    seg[-1, 33:40] = 5     # a short document in the middle of a chunk
    return jnp.asarray(seg)


# ----------------------------------------------------------------------------- kernels

def test_chunked_delta_rule_matches_the_recurrence_and_transformers():
    q, k, v, g, beta = _rng_inputs(0, 2, 200, 6, 16, 8)
    q, k = q[:, :, :3], k[:, :, :3]          # 3 key heads, 6 value heads: 2 per key head
    want = jax.jit(deltanet.recurrent_reference)(q, k, v, g, beta)
    got = jax.jit(lambda *a: deltanet.chunked_delta_rule(*a, chunk=16))(q, k, v, g, beta)
    assert float(np.max(np.abs(want))) > 0.1
    np.testing.assert_allclose(got, want, atol=1e-5)
    t = lambda x: torch.tensor(np.asarray(x), dtype=torch.float64)
    theirs, _ = hf_next.torch_chunk_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta),
                                                     chunk_size=64, use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(got, theirs.numpy(), atol=1e-5)


def test_document_resets_values_and_gradients():
    """Packed rows: every document's outputs equal the document run alone (the state and
    nothing else restarts), and gradients of the chunked form equal the recurrence's."""
    q, k, v, g, beta = _rng_inputs(1, 2, 200, 2, 16, 8)
    args = (q, k, v, g, beta)
    seg = _packed_segments(2, 200)
    chunked = lambda *a: deltanet.chunked_delta_rule(*a, chunk=16)
    reference = jax.jit(deltanet.recurrent_reference)
    got = np.asarray(jax.jit(chunked)(*args, seg))
    np.testing.assert_allclose(got, reference(*args, seg), atol=1e-5)
    checked = 0
    for row, (lo, hi) in [(0, (70, 150)), (0, (150, 200)), (1, (33, 40)), (1, (40, 70))]:
        alone = np.asarray(reference(*(x[row:row + 1, lo:hi] for x in args)))
        np.testing.assert_allclose(got[row, lo:hi], alone[0], atol=1e-5)
        checked += 1
    assert checked == 4

    def grad(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a, seg))), argnums=range(5)))

    grads = grad(chunked)(*args)
    want = grad(deltanet.recurrent_reference)(*args)
    for a, b in zip(grads, want, strict=True):
        assert float(np.max(np.abs(b))) > 0
        np.testing.assert_allclose(a, b, atol=2e-5 * float(np.max(np.abs(b))))


def test_conv_restarts_at_document_starts():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1, 12, 3)).astype(np.float32)
    w = rng.normal(size=(3, 4)).astype(np.float32)
    seg = jnp.asarray([[1] * 5 + [2] * 7])
    got = np.asarray(jax.jit(lambda x, w: deltanet.causal_conv(x, w, deltanet.run_ids(seg, 12)))(
        x, w))
    for lo, hi in ((0, 5), (5, 12)):
        part = x[:, lo:hi]
        alone = torch.nn.functional.conv1d(
            torch.tensor(part).transpose(1, 2), torch.tensor(w)[:, None],
            padding=3, groups=3)[:, :, :hi - lo].transpose(1, 2).numpy()
        np.testing.assert_allclose(got[:, lo:hi], alone, atol=1e-6)


def _core_args(seed, hk, hv, s=96):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.normal(size=shape).astype(np.float32)
    return (f(B, s, hk, 16), f(B, s, hk, 16), f(B, s, hv, 8), f(B, s, hv), f(B, s, hv),
            f(hk, 16, 4), f(hk, 16, 4), f(hv, 8, 4), 0.5 * f(hv), f(hv))


def _sum_sin_grad(fn):
    return jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=range(10))


# The one-device core on _packed_segments(B, 96) (the reference of every mesh below; one
# program each for all cases of one shape).
_core_ref = jax.jit(lambda *a: linear.gated_delta_core(*a, _packed_segments(B, 96), chunk=16))
_core_ref_grads = jax.jit(_sum_sin_grad(
    lambda *a: linear.gated_delta_core(*a, _packed_segments(B, 96), chunk=16)))


@pytest.mark.parametrize("p,hk", [(2, 2), (4, 2)])
def test_ulysses_deltanet_matches_one_device(p, hk):
    """The exchange is exact: outputs and all ten gradients equal the one-device core (P=4
    with 2 key heads copies each key head twice before the exchange)."""
    args = _core_args(p + hk, hk, 4)
    seg = _packed_segments(B, 96)
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    ours = lambda *a: linear.gated_deltanet(*a, mesh=mesh, segment_ids=seg, chunk=16)
    np.testing.assert_allclose(jax.jit(ours)(*args), _core_ref(*args), atol=1e-5)
    for a, b in zip(jax.jit(_sum_sin_grad(ours))(*args), _core_ref_grads(*args), strict=True):
        scale = float(np.max(np.abs(b)))
        assert scale > 0
        np.testing.assert_allclose(a, b, atol=1e-5 * scale)
    assert linear.key_copies(hk, 4, p) == (2 if hk % p else 1)


def test_ulysses_deltanet_hlo_has_two_all_to_alls_and_gathers_no_activation():
    args = _core_args(5, 2, 4)
    mesh = make_mesh(seq=4, data=1, devices=need_devices(4))
    text = jax.jit(lambda *a: linear.gated_deltanet(*a, mesh=mesh)).lower(*args).compile().as_text()
    counts = collective_counts(text)
    assert counts.get("all-to-all", 0) == 2, counts
    assert counts.get("all-gather", 0) == 0, counts


def test_deltanet_head_rules():
    with pytest.raises(ValueError, match="linear value heads 6 are not divisible by the seq "
                                         "axis size 4"):
        linear.key_copies(2, 6, 4)
    with pytest.raises(ValueError, match="linear value heads 5 are not divisible by linear key "
                                         "heads 2"):
        linear.key_copies(2, 5, 1)
    assert linear.key_copies(16, 32, 8) == 1 and linear.key_copies(16, 32, 32) == 2


# ----------------------------------------------------------------------------- the model

# The reference model's random weights: vectors around 0, A_log with std 0.5 (decays
# exp(-exp(A) softplus(.)) of all speeds).
A_LOG = (r"A_log$", 0.0, 0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3NextConfig(**HF_CONFIG))
    randomize(model, 0, vector_mean=0.0, special=[A_LOG])
    path = str(tmp_path_factory.mktemp("qwen3_next"))
    model.save_pretrained(path, safe_serialization=True)
    return path


def _hf_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()


def _tokens(seed, s=S):
    return np.random.default_rng(seed).integers(0, V, (B, s)).astype(np.int32)


def _ours(model, tokens, mesh, segment_ids=None, positions=None):
    """Our logits and objective; targets pre-shifted, the last position unscored."""
    b, s = tokens.shape
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
             "loss_mask": np.concatenate([np.ones((b, s - 1)), np.zeros((b, 1))], 1),
             "segment_ids": np.ones((b, s), np.int32) if segment_ids is None else segment_ids,
             "positions": (np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
                           if positions is None else positions)}
    graphdef, params = nnx.split(model)
    return [np.asarray(x) for x in _logits_and_objective(graphdef, params, batch, mesh)]


# One program per model and mesh (test_import_matches_transformers[4] and
# test_packed_documents_equal_each_document_alone run the same one).
@functools.partial(jax.jit, static_argnums=(0, 3))
def _logits_and_objective(graphdef, params, batch, mesh):
    obj, _ = objective(graphdef, params, batch, mesh)
    logits = nnx.merge(graphdef, params)(batch["tokens"], batch["positions"],
                                         batch["segment_ids"])
    return logits, obj


def test_checkpoint_is_what_it_claims(checkpoint):
    cfg = config_from_hf(json.load(open(os.path.join(checkpoint, "config.json"))))
    assert cfg.family == "qwen3_next" and cfg.layer_mixers() == "DDDA"
    assert cfg.num_experts == 8 and cfg.moe_shared_ffn_dim == 48 and cfg.mlp_only_layers == (1,)
    assert cfg.partial_rotary_factor == 0.25
    assert [kind for _, unit, _ in layer_groups(cfg) for kind in unit] == [
        (True, "D"), (False, "D"), (True, "D"), (True, "A")]


@pytest.mark.parametrize("p", [1, 2, 4])
def test_import_matches_transformers(checkpoint, p):
    tokens = _tokens(p)
    t = torch.from_numpy(tokens).long()
    with torch.no_grad():
        out = _hf_load(checkpoint)(t, labels=t, output_router_logits=True)
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    logits, loss = _ours(model, tokens, mesh)
    assert logits.shape == (B, S, V)
    assert rel_error(logits, out.logits.numpy()) <= TOL, rel_error(logits, out.logits.numpy())
    np.testing.assert_allclose(loss, float(out.loss), rtol=TOL)


def test_packed_documents_equal_each_document_alone(checkpoint):
    """Two documents packed in a row (positions restart, segment ids differ) give, token for
    token, transformers' logits of each document run on its own: DeltaNet's state and
    convolution and the attention all restart at the boundary."""
    cut = 40
    tokens = _tokens(7)
    seg = np.where(np.arange(S) < cut, 1, 2).astype(np.int32)[None].repeat(B, 0)
    pos = np.where(np.arange(S) < cut, np.arange(S), np.arange(S) - cut).astype(np.int32)
    pos = pos[None].repeat(B, 0)
    mesh = make_mesh(seq=4, data=1, devices=need_devices(4))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    logits, _ = _ours(model, tokens, mesh, seg, pos)
    hf = _hf_load(checkpoint)
    with torch.no_grad():
        first = hf(torch.from_numpy(tokens[:, :cut]).long()).logits.numpy()
        second = hf(torch.from_numpy(tokens[:, cut:]).long()).logits.numpy()
    assert rel_error(logits[:, :cut], first) <= TOL
    assert rel_error(logits[:, cut:], second) <= TOL


def test_export_round_trip(checkpoint, tmp_path):
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    save_pretrained(model, str(tmp_path))
    written = json.load(open(tmp_path / "config.json"))
    source = json.load(open(os.path.join(checkpoint, "config.json")))
    for key in ("layer_types", "linear_num_key_heads", "linear_num_value_heads",
                "shared_expert_intermediate_size", "mlp_only_layers", "num_experts"):
        assert written[key] == source[key], key
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.25
    tokens = _tokens(11)
    with torch.no_grad():
        want = _hf_load(checkpoint)(torch.from_numpy(tokens).long()).logits.numpy()
        again = _hf_load(str(tmp_path))(torch.from_numpy(tokens).long()).logits.numpy()
    assert rel_error(again, want) <= 1e-6
    reloaded = from_pretrained(str(tmp_path), mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    assert dataclasses.replace(reloaded.cfg) == model.cfg


@pytest.mark.parametrize("over,match", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "RoPE scaling 'dynamic'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention",
                      "full_attention"]}, "layer_types must list 4"),
])
def test_unsupported_configs_are_refused(over, match):
    hf = {**HF_CONFIG, "model_type": "qwen3_next", **over}
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("over,match", [
    (["model.linear_value_heads=12"], "model.linear_value_heads 12 is not divisible by "
                                      "mesh.seq 8"),
    (["model.mixer_pattern=DX"], "model.mixer_pattern 'DX' must be a non-empty string"),
    (["model.linear_value_heads=6"], "model.linear_value_heads 6 is not divisible by "
                                     "model.linear_key_heads 4"),
    (["model.partial_rotary_factor=0.1"], "model.partial_rotary_factor 0.1 must be in"),
    (["mesh.ring=2", "mesh.seq=2"], "Gated DeltaNet layers .* need mesh.ring 1, got 2"),
])
def test_bad_qwen3_next_configs_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(os.path.join(ROOT, "configs", "tiny-qwen3-next.yaml"), over)


def test_flops_count_the_weights_and_the_delta_rule():
    """MFU's matmul weights are the weights a real Qwen3-Next Decoder has (gated q_proj,
    DeltaNet projections, routed + shared experts counted by moe.mlp_matmul_params); the
    DeltaNet layers add the chunked delta rule's FLOPs, by hand count, and no attention."""
    import math
    from ulysses_jax.models.decoder import Decoder
    from ulysses_jax.training.flops import attention_flops_per_token, matmul_params_per_token
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-qwen3-next.yaml"),
                      ["model.num_experts=0"]).model
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda: Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0)))))
    names = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "in_proj_qkvz",
             "in_proj_ba", "out_proj"}
    weights = sum(math.prod(leaf.shape) for path, leaf in
                  jax.tree_util.tree_leaves_with_path(params)
                  if str(getattr(path[-1], "key", path[-1])) in names)
    assert matmul_params_per_token(cfg) == weights
    c, dq, dv, hv = 64, cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_value_heads
    per_chunk = 2 * c * c * dq + 2 * 5 * c ** 3 + 2 * c * c * dv + 3 * c * dq * dv
    delta_rule = 6 * hv * per_chunk / c
    attention = 6 * cfg.n_heads * cfg.head_dim * 512     # one causal attention layer at 512
    assert attention_flops_per_token(cfg, 512) == pytest.approx(3 * delta_rule + attention)


def test_conv_silu_gradients_match_autodiff():
    """The hand-written backward of SiLU(convolution) equals autodiff of the plain form."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 20, 3, 4)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(3, 4, 4)).astype(np.float32))
    seg = jnp.asarray(np.repeat([[1] * 7 + [2] * 3 + [4] * 10], 2, 0))
    plain = lambda x, w: jax.nn.silu(deltanet.causal_conv(x, w, deltanet.run_ids(seg, 20)))
    custom = lambda x, w: deltanet.conv_silu(x, w, deltanet.run_ids(seg, 20))
    np.testing.assert_allclose(*jax.jit(lambda x, w: (custom(x, w), plain(x, w)))(x, w),
                               atol=1e-6)
    ct = jnp.asarray(rng.normal(size=x.shape).astype(np.float32))
    got, want = jax.jit(lambda x, w, ct: [jax.vjp(fn, x, w)[1](ct) for fn in (custom, plain)])(
        x, w, ct)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_convolution_inside_the_chunks_equals_convolving_first():
    """conv= runs SiLU(convolution) chunk by chunk with each chunk's W - 1 halo tokens:
    the same outputs and gradients as convolving the whole sequence first (packed rows,
    chunk edges inside documents and at their starts, 2 value heads per key head)."""
    rng = np.random.default_rng(6)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))
    q, k, v = f(B, 90, 2, 16), f(B, 90, 2, 16), f(B, 90, 4, 8)
    g, beta = -0.3 * jnp.abs(f(B, 90, 4)), jax.nn.sigmoid(f(B, 90, 4))
    conv = (f(2, 16, 4), f(2, 16, 4), f(4, 8, 4))
    seg = _packed_segments(B, 90)

    def first(q, k, v, *conv):
        runs = deltanet.run_ids(seg, 90, B)
        q, k, v = (deltanet.conv_silu(x, w, runs) for x, w in zip((q, k, v), conv))
        return deltanet.chunked_delta_rule(q, k, v, g, beta, seg, chunk=16)

    def fused(q, k, v, *conv):
        return deltanet.chunked_delta_rule(q, k, v, g, beta, seg, chunk=16, conv=conv)

    np.testing.assert_allclose(
        *jax.jit(lambda *a: (fused(*a), first(*a)))(q, k, v, *conv), atol=1e-5)
    grad = lambda fn: jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=range(6))
    got, want = jax.jit(lambda *a: (grad(fused)(*a), grad(first)(*a)))(q, k, v, *conv)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.max(np.abs(b))))


def test_yarn_scaled_checkpoint_matches_transformers_at_long_positions(tmp_path):
    """A Qwen3-Next config with YaRN (factor 4 from 4096) on its partial RoPE: logits equal
    transformers' at positions 60,000 on, where the scaling matters, on 2 devices."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.5}
    torch.manual_seed(1)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3NextConfig(
        **{**HF_CONFIG, "rope_parameters": rope, "max_position_embeddings": 16384,
           "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
           "mlp_only_layers": []}))
    randomize(hf_model, 1, vector_mean=0.0, special=[A_LOG])
    hf_model.save_pretrained(str(tmp_path), safe_serialization=True)
    tokens = _tokens(3, 32)
    pos = np.broadcast_to(60_000 + np.arange(32, dtype=np.int32), (B, 32))
    with torch.no_grad():
        want = _hf_load(str(tmp_path))(torch.from_numpy(tokens).long(),
                                       position_ids=torch.from_numpy(pos.copy()).long()).logits
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    model = from_pretrained(str(tmp_path), mesh=mesh, dtype=jnp.float32, attn_impl="xla",
                            rope_exact_from=2**31 - 1)   # transformers' fp32 angles
    assert model.cfg.rope_scaling.type == "yarn" and model.cfg.partial_rotary_factor == 0.5
    logits, _ = _ours(model, tokens, mesh, positions=pos)
    assert rel_error(logits, want.numpy()) <= 3e-4, rel_error(logits, want.numpy())


def test_tiny_preset_trains_with_the_seq1_loss_curve(tmp_path):
    """train.py's tiny Qwen3-Next preset (shrunk; DeltaNet, attention and MoE layers,
    packed documents): the seq=4 loss curve equals seq=1's, and it learns."""
    from ulysses_jax.training.trainer import train
    small = ["seq_len=64", "batch_size=2", "model.d_model=32", "model.head_dim=8",
             "model.ffn_dim=64", "model.moe_ffn_dim=32", "model.moe_shared_ffn_dim=32",
             "model.linear_key_dim=8", "model.linear_value_dim=8", "model.loss_chunk=32",
             "log_every=1", "steps=4", "checkpoint_every=0", "eval_batches=0",
             "optimizer.warmup_steps=2", "model.attn_impl=xla"]
    runs = {}
    for seq in (1, 4):
        cfg = load_config(os.path.join(ROOT, "configs", "tiny-qwen3-next.yaml"),
                          small + [f"mesh.seq={seq}"])
        train(cfg, str(tmp_path / str(seq)), progress=False)
        with open(tmp_path / str(seq) / "metrics.jsonl") as f:
            runs[seq] = [json.loads(line) for line in f]
    assert [r["step"] for r in runs[1]] == [r["step"] for r in runs[4]] == list(range(1, 5))
    np.testing.assert_allclose([r["loss"] for r in runs[4]], [r["loss"] for r in runs[1]],
                               rtol=1e-4)
    assert runs[1][-1]["loss"] < runs[1][0]["loss"] - 0.05
