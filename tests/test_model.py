"""The sequence-parallel decoder, loss and train step against the same model on one device."""
import functools
import re

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from tests.utils.configs import tiny_config
from tests.utils.devices import need_devices
from tests.utils.numerics import assert_rel_close
from ulysses_jax import make_mesh
from ulysses_jax.models.loss import chunked_cross_entropy, plain_cross_entropy
from ulysses_jax.models.decoder import Decoder
from ulysses_jax.training.objectives.sft import loss_fn
from ulysses_jax.training.train_step import init_state, make_train_step, state_layout

V = 257


def _cfg(seq=1, data=1, **over):
    items = {"mesh.seq": seq, "mesh.data": data, "seq_len": 64, "batch_size": 2,
             "model.loss_chunk": 8, "model.qk_norm": True, "optimizer.warmup_steps": 2, **over}
    return tiny_config(preset=None, **items)


def _batch(seed, b=2, s=64, docs=True):
    """Random tokens packed as several documents per row, with per-document positions."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, V, (b, s + 1)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    if docs:
        for r in range(b):
            for cut in sorted(rng.choice(np.arange(4, s - 4), size=2, replace=False)):
                seg[r, cut:] += 1
    starts = np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        for t in range(s):
            pos[r, t] = 0 if starts[r, t] else pos[r, t - 1] + 1
    mask = np.ones((b, s), np.float32)
    mask[:, :-1][seg[:, 1:] != seg[:, :-1]] = 0.0  # a document's last token has no target
    return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": mask,
            "segment_ids": seg, "positions": pos}


def _setup(seq, data, **over):
    cfg = _cfg(seq, data, **over)
    ring = cfg.mesh.ring
    mesh = make_mesh(seq=seq, data=data, ring=ring, devices=need_devices(seq * data * ring))
    graphdef, state, shardings, tx = init_state(cfg, mesh)
    return cfg, mesh, graphdef, state, shardings, tx


def _mesh(cfg):
    seq, data, ring = cfg.mesh.seq, cfg.mesh.data, cfg.mesh.ring
    return make_mesh(seq=seq, data=data, ring=ring, devices=need_devices(seq * data * ring))


@functools.cache
def _built(cfg):
    """(mesh, graphdef, state, shardings, optimizer, loss-and-gradients program) for ``cfg``,
    built once per module: the tests that share a config share its init program and one
    jit(value_and_grad(loss)) taking (params, batch)."""
    mesh = _mesh(cfg)
    graphdef, state, shardings, tx = init_state(cfg, mesh)
    loss_grad = jax.jit(jax.value_and_grad(lambda p, batch: loss_fn(graphdef, p, batch, mesh)[0]))
    return mesh, graphdef, state, shardings, tx, loss_grad


def _shared_setup(seq, data, **over):
    """``_setup`` from the module's one init per config; the state is a fresh copy (train
    steps donate theirs)."""
    cfg = _cfg(seq, data, **over)
    mesh, graphdef, state, shardings, tx, _ = _built(cfg)
    return cfg, mesh, graphdef, jax.device_put(state, may_alias=False), shardings, tx


def _shared_loss_and_grads(cfg, params, batch):
    """``_loss_and_grads`` of ``_shared_setup``'s model for ``cfg``, one program per config."""
    return _built(cfg)[-1](params, batch)


def _layout(seq, data, **over):
    """``_setup`` with the abstract state (shapes and shardings, no init program), for tests
    that only lower or read the tree."""
    cfg = _cfg(seq, data, **over)
    mesh = _mesh(cfg)
    graphdef, state, shardings, tx = state_layout(cfg, mesh)
    return cfg, mesh, graphdef, state, shardings, tx


def _logits(graphdef, params, batch):
    model = nnx.merge(graphdef, params)
    return model(batch["tokens"], batch["positions"], batch["segment_ids"])


def _loss_and_grads(graphdef, state, batch, mesh):
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch, mesh)[0]))(
        state["params"])


@pytest.mark.parametrize("seq,data,sharding", [(4, 1, "replicated"), (4, 2, "replicated"),
                                               (4, 2, "zero3")])
def test_sharded_model_equals_one_device(seq, data, sharding):
    batch = _batch(0)
    cfg1, _, g1, s1, _, _ = _shared_setup(1, 1)
    cfg, _, g, s, _, _ = _shared_setup(seq, data, param_sharding=sharding)
    logits1 = jax.jit(_logits, static_argnums=0)(g1, s1["params"], batch)
    logits = jax.jit(_logits, static_argnums=0)(g, s["params"], batch)
    chex.assert_trees_all_close(logits, logits1, atol=1e-5, rtol=1e-5)
    loss1, grads1 = _shared_loss_and_grads(cfg1, s1["params"], batch)
    loss, grads = _shared_loss_and_grads(cfg, s["params"], batch)
    assert_rel_close(loss, loss1, 1e-4)
    assert_rel_close(grads, grads1, 1e-4)
    assert float(loss) > 0


def test_ten_steps_same_loss_curve():
    curves = {}
    for seq in (1, 4):
        cfg, mesh, g, state, sh, tx = _shared_setup(seq, 1)
        step = make_train_step(cfg, mesh, g, tx, sh)
        curve = []
        for i in range(10):
            state, metrics = step(state, _batch(100 + i % 3))
            curve.append(float(metrics["loss"]))
        curves[seq] = np.array(curve)
    np.testing.assert_allclose(curves[4], curves[1], rtol=1e-4)
    assert curves[1][-1] < curves[1][0] - 0.05, curves[1]  # it actually learns


def test_causal_prefix_invariance():
    _, mesh, g, s, _, _ = _shared_setup(4, 1)
    batch = _batch(3, docs=False)
    longer = {k: np.concatenate([v, _batch(4, docs=False)[k]], axis=1) for k, v in batch.items()}
    longer["positions"] = np.broadcast_to(np.arange(128, dtype=np.int32), (2, 128))
    short_logits = jax.jit(_logits, static_argnums=0)(g, s["params"], batch)
    long_logits = jax.jit(_logits, static_argnums=0)(g, s["params"], longer)
    chex.assert_trees_all_close(long_logits[:, :64], short_logits, atol=1e-5, rtol=1e-5)


def test_packed_batch_equals_documents_alone():
    """A row holding three documents gives the token-weighted loss of the three run alone."""
    _, mesh, g, s, _, _ = _shared_setup(4, 1)
    packed = _batch(5, b=1)
    seg = packed["segment_ids"][0]
    total, count = 0.0, 0.0
    for doc in np.unique(seg):
        idx = np.where(seg == doc)[0]
        n = len(idx)
        pad = (-n) % 4  # each document alone, padded to a multiple of P, padding masked
        alone = {k: np.pad(v[:, idx], ((0, 0), (0, pad))) for k, v in packed.items()}
        alone["positions"] = np.arange(n + pad, dtype=np.int32)[None]
        alone["segment_ids"] = np.pad(np.ones((1, n), np.int32), ((0, 0), (0, pad)))
        loss, c = jax.jit(loss_fn, static_argnums=(0, 3))(g, s["params"], alone, mesh)
        total += float(loss) * float(c)
        count += float(c)
    assert count > 0
    packed_loss, packed_count = jax.jit(loss_fn, static_argnums=(0, 3))(g, s["params"], packed, mesh)
    assert float(packed_count) == count
    np.testing.assert_allclose(float(packed_loss), total / count, rtol=1e-5)


def test_positions_matter_and_are_global():
    """Positions reach RoPE as given, identically sharded and unsharded (no per-shard offset).

    RoPE sees only position differences, so the test uses strided positions (distances x7),
    and checks that shard-local positions (the off-by-shard bug) would give other logits."""
    batch = _batch(6, docs=False)
    shifted = dict(batch, positions=batch["positions"] * 7 + 1000)
    local = dict(batch, positions=batch["positions"] % 16)  # what a shard-local RoPE would use
    big = {"model.init_std": 0.5}  # large weights so attention scores, hence RoPE, matter
    _, _, g1, s1, _, _ = _setup(1, 1, **big)
    _, _, g4, s4, _, _ = _setup(4, 1, **big)
    f = jax.jit(_logits, static_argnums=0)
    a1, a4 = f(g1, s1["params"], shifted), f(g4, s4["params"], shifted)
    assert_rel_close(a4, a1, 1e-5)  # relative to the largest logit: these weights make logits large
    assert not np.allclose(np.asarray(a1), np.asarray(f(g1, s1["params"], batch)), atol=1e-2)
    a_local = f(g1, s1["params"], local)
    assert not np.allclose(np.asarray(a_local), np.asarray(f(g4, s4["params"], batch)), atol=1e-2)


def test_chunked_loss_equals_plain_loss():
    _, mesh, g, s, _, _ = _shared_setup(4, 2)
    batch = _batch(7, b=2)

    def plain(p):
        return plain_cross_entropy(_logits(g, p, batch), batch["targets"], batch["loss_mask"])

    def chunked(p):
        model = nnx.merge(g, p)
        h = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
        return chunked_cross_entropy(h, model.head_weight(), batch["targets"],
                                     batch["loss_mask"], mesh=mesh, chunk=4)[0]

    lp, gp = jax.jit(jax.value_and_grad(plain))(s["params"])
    lc, gc = jax.jit(jax.value_and_grad(chunked))(s["params"])
    np.testing.assert_allclose(float(lc), float(lp), rtol=1e-5)
    assert_rel_close(gc, gp, 1e-4)


def test_compiled_step_holds_no_full_logits():
    """No fp32 [B, S/P, V] logits buffer in the compiled step: per-device temp memory stays
    below that buffer's size and no f32 array in the HLO is that large; the same model with
    the plain loss exceeds it (so this test can fail). Sizes make the logits dominate."""
    vocab, b, s, seq = 32768, 1, 512, 4
    over = {"model.vocab_size": vocab, "seq_len": s, "batch_size": b, "model.loss_chunk": 16,
            "model.d_model": 16, "model.ffn_dim": 32, "model.n_layers": 1, "model.n_heads": 4,
            "model.n_kv_heads": 4, "model.head_dim": 8}
    cfg, mesh, g, state, sh, tx = _layout(seq, 1, **over)
    batch = _batch(8, b=b, s=s)
    logits_elems = b * (s // seq) * vocab
    compiled = make_train_step(cfg, mesh, g, tx, sh).lower(state, batch).compile()
    chunked_temp = compiled.memory_analysis().temp_size_in_bytes
    f32_sizes = [np.prod([int(d) for d in dims.split(",")])
                 for dims in re.findall(r"f32\[([\d,]+)\]", compiled.as_text())]
    assert f32_sizes and max(f32_sizes) < logits_elems, max(f32_sizes)

    def plain_grads(p):
        return jax.grad(lambda p: plain_cross_entropy(_logits(g, p, batch), batch["targets"],
                                                      batch["loss_mask"]))(p)

    plain_temp = jax.jit(plain_grads).lower(state["params"]).compile().memory_analysis() \
        .temp_size_in_bytes
    assert chunked_temp < logits_elems * 4 < plain_temp, (chunked_temp, logits_elems * 4,
                                                          plain_temp)


@pytest.mark.parametrize("seq,ring,data,vocab,tied", [
    (2, 1, 1, V, True),      # V=257 padded to 258
    (4, 1, 1, 256, True),
    (2, 2, 1, 250, True),    # ring x seq, padded to 252
    (2, 1, 2, 256, False),   # data axis, untied lm_head
    (4, 1, 2, 250, False),   # data axis, untied, padded
])
def test_vocab_parallel_does_not_change_numbers(seq, ring, data, vocab, tied):
    """model.vocab_parallel (the default) against the replicated embedding and head: same
    loss and gradients (fp32), with V divisible by P and not (padded shards), on seq,
    ring x seq and data x seq meshes, tied and untied."""
    batch = _batch(16)
    batch = {k: (v % vocab if k in ("tokens", "targets") else v) for k, v in batch.items()}
    base = {"mesh.ring": ring, "model.vocab_size": vocab, "param_sharding": "zero3",
            "model.tie_embeddings": tied}
    _, mesh, g, s, _, _ = _setup(seq, data, **base)
    _, _, gr, sr, _, _ = _setup(seq, data, **base, **{"model.vocab_parallel": False})
    assert nnx.merge(g, s["params"]).vocab_parallel
    assert not nnx.merge(gr, sr["params"]).vocab_parallel
    if ring > 1:  # the training model reads zigzag-ordered batches on a ring mesh
        from ulysses_jax.attention.ring import zigzag_permutation
        batch = {k: v[:, zigzag_permutation(64, ring)] for k, v in batch.items()}
    l0, g0 = _loss_and_grads(gr, sr, batch, mesh)
    l1, g1 = _loss_and_grads(g, s, batch, mesh)
    assert_rel_close(l1, l0, 1e-5)
    assert_rel_close(g1, g0, 1e-5)


@pytest.mark.parametrize("vocab", [16384, 16382])  # 16382: padded to 16384 at P=4
def test_vocab_parallel_step_holds_no_full_vocab_buffer(vocab):
    """With ZeRO-3 and the vocabulary split, no fp32 array in the compiled train step is as
    large as the [V, D] embedding, and temp memory is lower by more than one such array; with
    model.vocab_parallel=false both fail (the check can fail). Sizes make [V, D] dominate."""
    d, seq = 32, 4
    over = {"model.vocab_size": vocab, "seq_len": 256, "batch_size": 1, "model.loss_chunk": 16,
            "model.d_model": d, "model.ffn_dim": 64, "model.n_layers": 1, "model.n_heads": 4,
            "model.n_kv_heads": 4, "model.head_dim": 8, "param_sharding": "zero3"}
    batch = _batch(17, b=1, s=256)
    found = {}
    for split in (True, False):
        cfg, mesh, g, state, sh, tx = _layout(seq, 1, **over, **{"model.vocab_parallel": split})
        compiled = make_train_step(cfg, mesh, g, tx, sh).lower(state, batch).compile()
        f32_sizes = [np.prod([int(x) for x in dims.split(",")])
                     for dims in re.findall(r"f32\[([\d,]+)\]", compiled.as_text())]
        found[split] = (max(f32_sizes), compiled.memory_analysis().temp_size_in_bytes)
    table_elems = vocab * d
    assert found[True][0] < table_elems <= found[False][0], (found, table_elems)
    assert found[True][1] < found[False][1] - 4 * table_elems, (found, 4 * table_elems)


@pytest.mark.parametrize("heads,kv,seq", [(8, 2, 4), (8, 1, 4), (8, 1, 8)])
def test_gqa_and_mqa_train(heads, kv, seq):
    cfg, mesh, g, state, sh, tx = _setup(seq, 1, **{"model.n_heads": heads,
                                                    "model.n_kv_heads": kv, "optimizer.lr": 1e-2})
    step = make_train_step(cfg, mesh, g, tx, sh)
    batch = _batch(9)
    losses = []
    for _ in range(6):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses


def _assert_option_keeps_numbers(batch, option, **base):
    """Loss and gradients at seq=2 with ``option`` set equal those without it (1e-5)."""
    cfg, _, _, s, _, _ = _shared_setup(2, 1, **base)
    cfgo, _, _, so, _, _ = _shared_setup(2, 1, **base, **option)
    l0, g0 = _shared_loss_and_grads(cfg, s["params"], batch)
    l1, g1 = _shared_loss_and_grads(cfgo, so["params"], batch)
    assert_rel_close(l1, l0, 1e-5)
    assert_rel_close(g1, g0, 1e-5)


@pytest.mark.parametrize("remat,seed", [("full", 10), ("save_dots", 10), ("offload", 13)])
def test_remat_does_not_change_numbers(remat, seed):
    _assert_option_keeps_numbers(_batch(seed), {"model.remat": remat})


def test_bfloat16_compute_close_to_float32():
    batch = _batch(11)
    cfg, _, _, s, _, _ = _shared_setup(2, 1)
    cfgb, _, _, sb, _, _ = _shared_setup(2, 1, **{"model.dtype": "bfloat16"})
    l32 = _shared_loss_and_grads(cfg, s["params"], batch)[0]
    l16 = _shared_loss_and_grads(cfgb, sb["params"], batch)[0]
    np.testing.assert_allclose(float(l16), float(l32), rtol=1e-2)


def test_tiled_mlp_same_numbers_less_memory():
    """TiledMLP (model.mlp_chunk) gives the same loss and gradients, and the compiled step
    needs less temp memory than the untiled MLP at a size where [B, S/P, F] dominates."""
    over = {"model.ffn_dim": 2048, "model.d_model": 32, "model.n_layers": 1, "seq_len": 256}
    batch = _batch(12, s=256)
    _, mesh, g, s, _, _ = _setup(2, 1, **over)
    _, _, gt, st, _, _ = _setup(2, 1, **over, **{"model.mlp_chunk": 16})
    compiled = lambda g, p: jax.jit(jax.value_and_grad(
        lambda p: loss_fn(g, p, batch, mesh)[0])).lower(p).compile()
    c0, c1 = compiled(g, s["params"]), compiled(gt, st["params"])
    l0, g0 = c0(s["params"])
    l1, g1 = c1(st["params"])
    assert_rel_close(l1, l0, 1e-5)
    assert_rel_close(g1, g0, 1e-5)
    untiled, tiled = (c.memory_analysis().temp_size_in_bytes for c in (c0, c1))
    ffn_bytes = 2 * (256 // 2) * 2048 * 4  # one fp32 [B, S/P, F] buffer
    assert tiled < untiled - ffn_bytes, (tiled, untiled, ffn_bytes)


def test_weight_decay_spares_norms_and_biases():
    """Stacked layers make norm scales [L, D]; decay must still skip them (by name)."""
    from ulysses_jax.training.optimizer import _decays
    cfg, mesh, g, state, sh, tx = _layout(1, 1, **{"model.qkv_bias": True})
    flags = {"/".join(str(getattr(k, "key", k)) for k in path): _decays(path, leaf)
             for path, leaf in jax.tree_util.tree_leaves_with_path(state["params"])}
    assert flags["layers/attn/wq"] and flags["embed"] and flags["layers/mlp/w_down"]
    for name in ("layers/attn_norm/scale", "layers/mlp_norm/scale", "final_norm/scale",
                 "layers/attn/q_norm/scale", "layers/attn/bq"):
        assert flags[name] is False, name


def test_ring_mesh_model_matches_one_device():
    """On a (seq=2, ring=4) mesh: natural-order logits equal one device's, and the training
    model fed the zigzag-ordered batch gives the same loss and gradients."""
    from ulysses_jax.attention.ring import zigzag_permutation
    batch = _batch(14)
    cfg1, _, g1, s1, _, _ = _shared_setup(1, 1)
    cfg, mesh, g, s, _, _ = _shared_setup(2, 1, **{"mesh.ring": 4})
    natural = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg.model, mesh=mesh, rngs=nnx.Rngs(0))))
    logits1 = jax.jit(_logits, static_argnums=0)(g1, s1["params"], batch)
    logits = jax.jit(_logits, static_argnums=0)(natural, s["params"], batch)
    chex.assert_trees_all_close(logits, logits1, atol=1e-5, rtol=1e-5)
    order = zigzag_permutation(64, 4)
    zigzag = {k: v[:, order] for k, v in batch.items()}
    loss1, grads1 = _shared_loss_and_grads(cfg1, s1["params"], batch)
    loss, grads = _shared_loss_and_grads(cfg, s["params"], zigzag)
    assert_rel_close(loss, loss1, 1e-5)
    assert_rel_close(grads, grads1, 1e-4)


def test_ulysses_head_chunks_do_not_change_numbers():
    _assert_option_keeps_numbers(_batch(15), {"ulysses.chunks": 2}, **{"model.n_kv_heads": 4})


def _array_dims(hlo_text: str, dtype: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(dtype + r"\[([0-9,]*)\]", hlo_text)]


def test_train_step_keeps_no_per_tile_masks_or_embedding_masks():
    """Nothing the layers or the embedding keep grows with S beyond activations: no stack
    of the attention kernel's tile masks ([blocks, ..., block, block], which JAX's scan
    partial evaluation used to compute for all tiles outside the layer loop), and no
    embedding ownership mask broadcast over D ([..., tokens, D] booleans kept for the
    backward pass)."""
    s, d = 2048, 64
    cfg, mesh, g, st, sh, tx = _layout(2, 1, **{"seq_len": s, "model.d_model": d,
                                                "model.attn_impl": "chunked",
                                                "model.remat": "full"})
    batch = _batch(23, s=s)
    step = make_train_step(cfg, mesh, g, tx, sh)
    text = step.lower(st, batch).compile().as_text()
    block = 512  # chunked_attention's default tiles
    preds = _array_dims(text, "pred")
    assert preds, "no boolean arrays at all: the check would pass vacuously"
    tile_stacks = [p for p in preds if len(p) >= 3 and p[-2:] == (block, block) and
                   p[0] == s // block]
    assert not tile_stacks, tile_stacks
    local = 2 * (s // 2)  # B x S/P tokens per device
    d_masks = [p for p in preds if p and p[-1] == d and np.prod(p) >= local * d]
    assert not d_masks, d_masks
