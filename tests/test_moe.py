"""Mixture of experts: expert parallelism against the dense reference, dropping, the aux loss,
the sharded MoE model against one device, the all-to-alls in the compiled step, config rules.

The truth is ``moe.reference_moe`` (every expert on every token, masked) on one device, and
transformers' own load-balancing loss and Qwen3-Next MoE block.
"""
import math
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from tests.utils.configs import tiny_config
from tests.utils.devices import need_devices
from tests.utils.numerics import assert_rel_close
from ulysses_jax import make_mesh
from ulysses_jax.config import ConfigError, ModelConfig, load_config
from ulysses_jax.hlo import collective_counts, collective_shapes
from ulysses_jax.mesh import act_spec
from ulysses_jax.models import moe
from ulysses_jax.models.decoder import layer_groups
from ulysses_jax.models.expert_parallel import expert_spec, moe_experts
from ulysses_jax.models.param_layout import param_shardings
from ulysses_jax.training.objectives.sft import objective
from ulysses_jax.training.train_step import build_model, make_train_step, state_layout

E, A, D, F = 8, 2, 16, 8


@partial(jax.jit, static_argnums=(1, 2, 3))
def _weights(seed, e=E, d=D, f=F):
    k = jax.random.split(jax.random.key(seed), 4)
    return (0.5 * jax.random.normal(k[0], (d, e)), 0.3 * jax.random.normal(k[1], (e, d, f)),
            0.3 * jax.random.normal(k[2], (e, d, f)), 0.3 * jax.random.normal(k[3], (e, f, d)))


@partial(jax.jit, static_argnums=(1, 2, 3))
def _inputs(seed, b, s, d=D):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (b, s, d))
    valid = (jax.random.uniform(k2, (b, s)) > 0.2).astype(jnp.float32)   # some padding
    return x, valid, jax.random.normal(k3, (b, s, d))


def _place(mesh, x, valid, weights):
    x = jax.device_put(x, NamedSharding(mesh, act_spec(mesh, 1)))
    valid = jax.device_put(valid, NamedSharding(mesh, act_spec(mesh)))
    router, *experts = weights
    experts = [jax.device_put(w, NamedSharding(mesh, expert_spec(3, mesh))) for w in experts]
    return x, valid, [router, *experts]


def _reference_stats(x, valid, weights, norm, keep=None):
    b, s, d = x.shape
    y, probs, top_i = moe.reference_moe(x.reshape(b * s, d), *weights, top_k=A,
                                        norm_topk_prob=norm, keep=keep)
    return y.reshape(b, s, d), moe.router_stats(probs, top_i, valid.reshape(-1))


_jit_reference_stats = jax.jit(_reference_stats, static_argnums=3)


def _scalar(out, ct, ct_prob):
    """Nonlinear in y (so the forward combine is needed) and through the router sums."""
    y, stats = out
    return jnp.sum(jnp.tanh(y) * ct) + jnp.sum(stats["prob"] * ct_prob)


@partial(jax.jit, static_argnums=0)
def _reference_and_grads(norm, x, valid, weights, ct, ct_prob):
    out = _reference_stats(x, valid, weights, norm)
    grads = jax.grad(lambda x, w: _scalar(_reference_stats(x, valid, w, norm), ct, ct_prob),
                     argnums=(0, 1))(x, weights)
    return out, grads


@pytest.mark.parametrize("data,ring,seq,norm", [
    (1, 1, 1, True), (2, 1, 1, False), (1, 1, 2, True), (4, 1, 1, True), (2, 1, 2, False),
    (8, 1, 1, False), (2, 1, 4, True), (1, 2, 2, True)])
def test_expert_parallel_equals_dense_reference(data, ring, seq, norm):
    """Outputs, router sums and gradients (x, router, experts) of the all-to-all MoE on 1-8
    devices, with and without sequence (and ring) axes, equal every-expert-on-every-token."""
    mesh = make_mesh(seq=seq, data=data, ring=ring, devices=need_devices(data * ring * seq))
    b, s = 8, 16  # one shape for all meshes: the reference compiles once per norm
    x, valid, ct = _inputs(data * 10 + seq, b, s)
    weights = list(_weights(seq))
    ct_prob = jax.random.normal(jax.random.key(5), (E,))
    (y_ref, stats_ref), g_ref = _reference_and_grads(norm, x, valid, weights, ct, ct_prob)
    xs, valid_s, ws = _place(mesh, x, valid, weights)
    ours = lambda x, w: moe_experts(x, valid_s, *w, mesh=mesh, top_k=A, norm_topk_prob=norm)

    @jax.jit
    def run(x, w):
        return ours(x, w), jax.grad(lambda x, w: _scalar(ours(x, w), ct, ct_prob),
                                    argnums=(0, 1))(x, w)

    (y, stats), g = run(xs, ws)
    chex.assert_trees_all_close(y, y_ref, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(stats, {**stats_ref, "dropped": 0.0}, atol=1e-5, rtol=1e-5)
    assert float(stats["tokens"]) == float(np.asarray(valid).sum()) < b * s  # padding left out
    assert_rel_close(g, g_ref, 1e-4)


def _numpy_keep(top_i, mesh_shape, b, s, slots):
    """Which assignments survive: per device, in choice-major order, at most ``slots`` per
    expert (the rule of expert_parallel.assign_slots, written out independently)."""
    data, seq = mesh_shape
    keep = np.zeros(top_i.shape, bool)                                    # [B, S, A]
    bl, sl = b // data, s // seq
    for i in range(data):
        for j in range(seq):
            rows, cols = slice(i * bl, (i + 1) * bl), slice(j * sl, (j + 1) * sl)
            local = top_i[rows, cols].reshape(bl * sl, A)
            used = np.zeros(E, int)
            k = np.zeros((bl * sl, A), bool)
            for a in range(A):
                for t in range(bl * sl):
                    e = local[t, a]
                    k[t, a] = used[e] < slots
                    used[e] += 1
            keep[rows, cols] = k.reshape(bl, sl, A)
    return keep


def test_capacity_drops_exactly_the_counted_assignments():
    """With a capacity factor, assignments past each (device, expert)'s slots are dropped:
    the output is the reference with exactly those left out, and the count is reported."""
    data, seq, b, s, cf = 2, 2, 4, 8, 1.0
    mesh = make_mesh(seq=seq, data=data, devices=need_devices(data * seq))
    x, _, _ = _inputs(21, b, s)
    valid = jnp.ones((b, s))
    weights = _weights(22)
    slots = moe.capacity((b // data) * (s // seq), cf, A, E)
    assert slots == math.ceil(cf * 8 * A / E) == 2  # 8 tokens per device
    _, top_w, top_i = jax.jit(moe.route, static_argnums=(2, 3))(x.reshape(b * s, D),
                                                                 weights[0], A, True)
    keep = _numpy_keep(np.asarray(top_i).reshape(b, s, A), (data, seq), b, s, slots)
    assert 0 < (~keep).sum() < keep.size / 2
    xs, valid_s, ws = _place(mesh, x, valid, weights)
    y, stats = jax.jit(lambda x, w: moe_experts(x, valid_s, *w, mesh=mesh, top_k=A,
                                                norm_topk_prob=True, capacity_factor=cf))(xs, ws)
    y_ref, _ = _jit_reference_stats(x, valid, weights, True, keep.reshape(-1, A))
    chex.assert_trees_all_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert float(stats["dropped"]) == (~keep).sum()
    y_all, _ = _jit_reference_stats(x, valid, weights, True)
    assert not np.allclose(np.asarray(y), np.asarray(y_all), atol=1e-3)  # drops do matter


def test_aux_loss_equals_transformers_and_is_not_a_mean_of_shards():
    """Router sums pooled over layers and tokens give transformers' load_balancing_loss_func
    (with a padding mask); averaging per-shard losses instead would give another number."""
    torch = pytest.importorskip("torch")
    mod = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    rng = np.random.default_rng(0)
    layers, b, s = 3, 2, 16
    logits = [rng.normal(size=(b * s, E)).astype(np.float32) * 2 for _ in range(layers)]
    mask = (rng.uniform(size=(b, s)) > 0.25).astype(np.float32)
    theirs = float(mod.load_balancing_loss_func(
        tuple(torch.from_numpy(g) for g in logits), E, A, torch.from_numpy(mask)))

    @jax.jit
    def layer_stats(g, mask):
        probs = jax.nn.softmax(g, axis=-1)
        return moe.router_stats(probs, jax.lax.top_k(probs, A)[1], mask)

    @jax.jit
    def aux_loss(per_layer):
        return moe.aux_loss(jax.tree.map(lambda *x: sum(x), *per_layer), E)

    def stats(rows):
        return [layer_stats(g[rows], mask.reshape(-1)[rows]) for g in logits]

    ours = float(aux_loss(stats(np.arange(b * s))))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    halves = [np.arange(b * s)[: b * s // 2], np.arange(b * s)[b * s // 2:]]
    shard_mean = np.mean([float(aux_loss(stats(h))) for h in halves])
    assert abs(shard_mean - theirs) > 1e-3 * theirs


def test_shared_expert_equals_transformers_qwen3_next_block():
    """The MoE block with a shared expert (model.moe_shared_ffn_dim) equals transformers'
    Qwen3NextSparseMoeBlock with the same weights, on a data x seq mesh."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
    shared = 12
    hf_cfg = transformers.Qwen3NextConfig(hidden_size=D, num_experts=E, num_experts_per_tok=A,
                                          moe_intermediate_size=F, norm_topk_prob=True,
                                          shared_expert_intermediate_size=shared)
    block = Qwen3NextSparseMoeBlock(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    w = {n: p.detach().numpy() for n, p in block.named_parameters()}
    cfg = ModelConfig(d_model=D, num_experts=E, num_experts_per_tok=A, moe_ffn_dim=F,
                      norm_topk_prob=True, moe_shared_ffn_dim=shared)
    mesh = make_mesh(seq=2, data=2, devices=need_devices(4))

    @nnx.jit
    def build(w):
        ours = moe.MoE(cfg, mesh, rngs=nnx.Rngs(0))
        gate_up = w["experts.gate_up_proj"]                                # [E, 2F, D]
        ours.router[...] = w["gate.weight"].T
        ours.w_gate[...] = gate_up[:, :F].transpose(0, 2, 1)
        ours.w_up[...] = gate_up[:, F:].transpose(0, 2, 1)
        ours.w_down[...] = w["experts.down_proj"].transpose(0, 2, 1)       # [E, F, D]
        ours.shared_gate[...] = w["shared_expert.gate_proj.weight"].T
        ours.shared_up[...] = w["shared_expert.up_proj.weight"].T
        ours.shared_down[...] = w["shared_expert.down_proj.weight"].T
        ours.shared_expert_gate[...] = w["shared_expert_gate.weight"].T   # [D, 1]
        return ours

    ours = build(w)
    forward = nnx.jit(lambda m, x: m(x, jnp.ones(x.shape[:2])))
    x = np.random.default_rng(1).normal(size=(2, 8, D)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()
    xs = jax.device_put(x, NamedSharding(mesh, act_spec(mesh, 1)))
    got, _ = forward(ours, xs)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    without = np.asarray(forward(nnx.merge(*nnx.split(ours)), xs)[0])
    assert np.allclose(without, want, atol=1e-5)  # same module twice: deterministic
    ours.shared_expert_gate[...] = -50.0 * np.ones((D, 1), np.float32)    # gate shut
    shut = np.asarray(forward(ours, xs)[0])
    assert not np.allclose(shut, want, atol=1e-3)  # the shared expert contributes


# ----------------------------------------------------------------------------- model

def _cfg(seq=1, data=1, **over):
    items = {"mesh.seq": seq, "mesh.data": data, "seq_len": 32, "batch_size": 4,
             "model.loss_chunk": 8, "model.qk_norm": True, "model.d_model": 32,
             "model.n_heads": 4, "model.n_kv_heads": 2, "model.head_dim": 8, "model.ffn_dim": 48,
             "model.n_layers": 2, "model.num_experts": E, "model.num_experts_per_tok": A,
             "model.moe_ffn_dim": 16, "model.router_aux_loss_coef": 0.1,
             "model.attn_impl": "xla", "optimizer.warmup_steps": 2, **over}
    return tiny_config(preset=None, **items)


def _batch(seed, b=4, s=32):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 257, (b, s + 1)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[:, s // 2:] = 2
    seg[1, -5:] = 0                                                       # padding
    pos = np.concatenate([np.arange(s // 2), np.arange(s - s // 2)]).astype(np.int32)
    mask = (seg > 0).astype(np.float32)
    return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": mask,
            "segment_ids": seg, "positions": np.broadcast_to(pos, (b, s)).copy()}


def _model(cfg, params=None):
    """(mesh, graphdef, params): params built by one jitted init or moved onto the mesh in
    the config's layout."""
    mesh = make_mesh(seq=cfg.mesh.seq, data=cfg.mesh.data,
                     devices=need_devices(cfg.mesh.seq * cfg.mesh.data))
    graphdef = state_layout(cfg, mesh)[0]
    if params is None:
        params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(cfg, mesh),
                                                             nnx.Param)))()
    return mesh, graphdef, jax.device_put(params, param_shardings(params, mesh,
                                                                  cfg.param_sharding))


def _objective(graphdef, params, batch, mesh):
    f = lambda p: objective(graphdef, p, batch, mesh)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)


def test_sharded_moe_model_equals_one_device():
    """The objective (cross-entropy + coef x aux), its parts and its gradients on a data x seq
    mesh with ZeRO-3 and full remat equal one device's, for a mixed MoE, dense, MoE pattern
    (three scans). All-MoE stacks: the tiny preset's loss curve below; the periodic pattern
    of decoder_sparse_step=2: against transformers in test_hf_moe.py."""
    seq, data = 4, 2
    over = {"param_sharding": "zero3", "model.n_layers": 3, "model.mlp_only_layers": "[1]",
            "model.remat": "full"}
    batch = _batch(6)
    mesh1, g1, p1 = _model(_cfg(1, 1, **over))
    mesh, g, p = _model(_cfg(seq, data, **over), p1)
    (obj1, (ce1, m1)), grads1 = _objective(g1, p1, batch, mesh1)
    (obj, (ce, m)), grads = _objective(g, p, batch, mesh)
    assert_rel_close((obj, ce, m["moe_aux_loss"], m["moe_load"]),
                     (obj1, ce1, m1["moe_aux_loss"], m1["moe_load"]), 1e-5)
    np.testing.assert_allclose(float(obj), float(ce) + 0.1 * float(m["moe_aux_loss"]),
                               rtol=1e-6)
    np.testing.assert_allclose(float(np.sum(np.asarray(m["moe_load"]))), 1.0, rtol=1e-6)
    assert float(m["moe_dropped"]) == 0.0
    assert_rel_close(grads, grads1, 1e-4)
    router = [x for path, x in jax.tree_util.tree_leaves_with_path(grads)
              if "router" in jax.tree_util.keystr(path)]
    assert router and all(float(np.abs(np.asarray(x)).max()) > 0 for x in router)


def test_layer_groups():
    def groups(**kw):  # layer types as (sparse, mixer); every layer here is attention ("A")
        return [(first, tuple(sparse for sparse, _ in unit), r)
                for first, unit, r in layer_groups(ModelConfig(num_experts=4, **kw))]
    assert groups(n_layers=3) == [(0, (True,), 3)]
    assert layer_groups(ModelConfig(n_layers=3)) == [(0, ((False, "A"),), 3)]  # dense: as always
    assert groups(n_layers=4, decoder_sparse_step=2) == [(0, (False, True), 2)]
    assert groups(n_layers=3, mlp_only_layers=(1,)) == [(0, (True,), 1), (1, (False,), 1),
                                                         (2, (True,), 1)]
    assert groups(n_layers=4, mlp_only_layers=(0, 1)) == [(0, (False,), 2), (2, (True,), 2)]
    # Qwen3-Next: the mixer splits groups too; DDDA repeated is one scan over a 4-layer unit
    next_cfg = ModelConfig(family="qwen3_next", n_layers=8, mixer_pattern="DDDA")
    assert layer_groups(next_cfg) == [(0, ((False, "D"),) * 3 + ((False, "A"),), 2)]


def test_train_step_all_to_alls_per_moe_layer():
    """On a data-only mesh (no Ulysses exchange) the compiled train step holds 4 all-to-alls
    per MoE layer body (dispatch and combine, forward and backward) and no all-gather as large
    as a layer's expert weights: experts stay put, tokens move."""
    cfg = _cfg(1, 8, **{"model.n_layers": 3, "model.mlp_only_layers": "[1]",  # MoE, dense, MoE
                        "batch_size": 8})
    mesh = make_mesh(seq=1, data=8, devices=need_devices(8))
    g, abstract, sh, tx = state_layout(cfg, mesh)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _batch(3, b=8).items()}
    text = make_train_step(cfg, mesh, g, tx, sh).lower(abstract, batch).compile().as_text()
    assert len(layer_groups(cfg.model)) == 3
    assert collective_counts(text)["all-to-all"] == 2 * 4
    expert_elems = E * 32 * 16
    gathered = collective_shapes(text, "all-gather")
    assert all(math.prod(shape) < expert_elems for shape in gathered), gathered


@pytest.mark.parametrize("over,match", [
    ({"model.num_experts": 6}, "model.num_experts 6 is not divisible by the mesh's 4 devices"),
    ({"model.num_experts_per_tok": 9}, r"model.num_experts_per_tok must be in \[1, "
                                       r"model.num_experts 8\], got 9"),
    ({"model.mlp_only_layers": "[5]"}, r"model.mlp_only_layers \[5\] lie outside layers 0..1"),
    ({"model.moe_capacity_factor": -1.0}, "model.moe_capacity_factor must be >= 0"),
    ({"model.decoder_sparse_step": 0}, "model.decoder_sparse_step must be positive, got 0"),
])
def test_bad_moe_configs_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(2, 2, **over)


def test_active_params_count():
    cfg = ModelConfig(vocab_size=100, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1,
                      head_dim=4, ffn_dim=12, qk_norm=True, num_experts=4,
                      num_experts_per_tok=2, moe_ffn_dim=6, mlp_only_layers=(1,))
    attn = 8 * 4 * (2 * 2 + 2 * 1) + 2 * 4
    moe_layer = attn + 2 * 8 + 8 * 4 + 2 * 3 * 8 * 6
    dense_layer = attn + 2 * 8 + 3 * 8 * 12
    from ulysses_jax.training.flops import active_params_per_token, matmul_params_per_token
    assert active_params_per_token(cfg) == moe_layer + dense_layer + 8 + 8 * 100
    matmuls = 2 * 8 * 4 * (2 * 2 + 2 * 1) + (8 * 4 + 2 * 3 * 8 * 6) + 3 * 8 * 12 + 8 * 100
    assert matmul_params_per_token(cfg) == matmuls  # MFU counts routed experts only


def test_tiny_moe_preset_trains_with_the_seq1_loss_curve(tmp_path):
    """train.py's tiny MoE preset (shrunk): the seq=4 loss curve equals seq=1's, and every
    logged step carries the aux loss, the per-expert load and the dropped fraction."""
    import json
    import os
    from ulysses_jax.training.trainer import train
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    small = ["seq_len=64", "batch_size=2", "model.d_model=32", "model.n_layers=1",
             "model.head_dim=8", "model.ffn_dim=64", "model.moe_ffn_dim=32",
             "model.loss_chunk=16", "log_every=1", "steps=6", "checkpoint_every=0",
             "eval_batches=0", "optimizer.warmup_steps=2", "model.attn_impl=xla"]
    runs = {}
    for seq in (1, 4):
        cfg = load_config(os.path.join(root, "configs", "tiny-moe.yaml"),
                          small + [f"mesh.seq={seq}"])
        train(cfg, str(tmp_path / str(seq)), progress=False)
        with open(tmp_path / str(seq) / "metrics.jsonl") as f:
            runs[seq] = [json.loads(line) for line in f]
    assert [r["step"] for r in runs[1]] == [r["step"] for r in runs[4]] == list(range(1, 7))
    for key in ("loss", "moe_aux_loss"):
        np.testing.assert_allclose([r[key] for r in runs[4]], [r[key] for r in runs[1]],
                                   rtol=1e-4)
    for r in runs[4]:
        assert len(r["moe_load"]) == 8 and abs(sum(r["moe_load"]) - 1) < 1e-5
        assert r["moe_dropped"] == 0.0 and r["moe_aux_loss"] > 0
    assert runs[1][-1]["loss"] < runs[1][0]["loss"] - 0.05  # it learns


def test_planner_checks_each_p_against_the_experts(capsys):
    """python -m ulysses_jax.plan on an MoE preset: a P that does not divide the experts is
    refused before any compile, naming the numbers; the others are accepted."""
    import os
    from ulysses_jax import plan
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    preset = os.path.join(root, "configs", "tiny-moe.yaml")
    assert plan.main(["--config", preset, "--memory-gb", "1", "--p", "2,3"]) == 2
    err = capsys.readouterr().err
    assert "P=3" in err and "model.num_experts 8 is not divisible by the mesh's 3 devices" in err
    args = plan.build_parser().parse_args(["--config", preset, "--memory-gb", "1", "--p", "1,8"])
    _, per_p = plan._plan_configs(args)
    assert sorted(per_p) == [1, 8]
    assert "experts=8 top-2" in plan._moe_note(per_p[8].model)
