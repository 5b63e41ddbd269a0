"""Hybrid Ulysses x Ring attention against the dense reference: layout, values, gradients,
block skipping and balance, HLO, errors."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.utils.attention import attention_inputs
from tests.utils.devices import need_devices
from tests.utils.numerics import tolerance
from ulysses_jax import (act_spec, hybrid_attention, inverse_zigzag_permutation, make_mesh,
                         reference_attention, seq_axes, ulysses_attention, zigzag_permutation)
from ulysses_jax.hlo import collective_counts, collective_shapes
from ulysses_jax.attention.ring import _FLAT, _half_shard_moves, _reorder, block_counts


def _attention_fn(mesh, causal, seg, layout, s):
    """Natural order in and out; "zigzag" permutes around hybrid_attention (test-side gather)."""
    if layout == "public":
        return lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=seg)
    if layout == "contiguous":
        return lambda q, k, v: hybrid_attention(q, k, v, mesh=mesh, causal=causal,
                                                segment_ids=seg, layout="contiguous")
    ring = dict(mesh.shape)["ring"]
    perm, inv = zigzag_permutation(s, ring), inverse_zigzag_permutation(s, ring)
    zseg = None if seg is None else seg[:, perm]
    return lambda q, k, v: hybrid_attention(q[:, perm], k[:, perm], v[:, perm], mesh=mesh,
                                            causal=causal, segment_ids=zseg,
                                            layout="zigzag")[:, inv]


def _check_against_reference(mesh, q, k, v, seg, ct, causal, layout, sharded=False):
    tol = tolerance(q.dtype)
    spec = act_spec(mesh)
    if sharded:
        sh = NamedSharding(mesh, spec)
        q, k, v = (jax.device_put(x, sh) for x in (q, k, v))
        seg = None if seg is None else jax.device_put(seg, sh)

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * ct), out

    hyb = _attention_fn(mesh, causal, seg, layout, q.shape[1])
    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg)
    grad = lambda fn: jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2),
                                                 has_aux=True))
    (_, out), grads = grad(hyb)(q, k, v)
    (_, out_ref), grads_ref = grad(ref)(q, k, v)
    if layout != "zigzag":
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim), out.sharding
    chex.assert_trees_all_close(out, out_ref, atol=tol, rtol=tol)
    for name, g, gr in zip("qkv", grads, grads_ref):
        chex.assert_trees_all_close(g, gr, atol=tol, rtol=tol, custom_message=f"d{name}")
    return out


# ----------------------------------------------------------------------------- mesh and order

def test_make_mesh_with_ring(devices):
    mesh = make_mesh(seq=2, ring=2, devices=devices[:8])
    assert mesh.axis_names == ("data", "ring", "seq")
    assert dict(mesh.shape) == {"data": 2, "ring": 2, "seq": 2}
    assert seq_axes(mesh) == ("ring", "seq")
    assert act_spec(mesh, 1) == P("data", ("ring", "seq"), None)
    flat = make_mesh(seq=2, devices=devices[:8])
    assert flat.axis_names == ("data", "seq") and seq_axes(flat) == "seq"
    assert act_spec(flat) == P("data", "seq")
    with pytest.raises(ValueError, match="ring x seq = 3 x 2 = 6 does not divide the 8"):
        make_mesh(seq=2, ring=3, devices=devices[:8])
    with pytest.raises(ValueError, match="data=2 x ring=4 x seq=2 needs 16 devices"):
        make_mesh(seq=2, ring=4, data=2, devices=devices[:8])
    with pytest.raises(ValueError, match="ring axis size must be a positive integer"):
        make_mesh(seq=2, ring=0, devices=devices[:8])


def test_zigzag_permutation():
    # S=8, R=2: chunks of 2 in the order 0, 3, 1, 2; rank 0 holds chunks 0 and 3.
    np.testing.assert_array_equal(zigzag_permutation(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    for s, r in [(8, 2), (32, 4), (48, 8)]:
        perm, inv = zigzag_permutation(s, r), inverse_zigzag_permutation(s, r)
        np.testing.assert_array_equal(np.sort(perm), np.arange(s))
        np.testing.assert_array_equal(perm[inv], np.arange(s))
        # Every ring rank holds one early and one late chunk: the chunk ids sum to 2R-1.
        chunk_of = (perm // (s // (2 * r))).reshape(r, 2, -1)
        assert np.all(chunk_of[:, 0] + chunk_of[:, 1] == 2 * r - 1)
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by 2 x ring = 4"):
        zigzag_permutation(10, 2)


@pytest.mark.parametrize("u,r", [(4, 2), (2, 4), (1, 8), (3, 2)])
def test_in_shard_map_reorder_is_exact(u, r):
    """The natural <-> zigzag move inside shard_map equals x[:, perm] and round-trips exactly."""
    mesh = make_mesh(seq=u, ring=r, data=1, devices=need_devices(u * r))
    s = 4 * u * r
    x = jax.random.normal(jax.random.key(u * r), (2, s, 3))
    to_zig, back = (_half_shard_moves(u * r, r, to_zigzag=t) for t in (True, False))
    spec = P(None, _FLAT)
    fn = jax.jit(jax.shard_map(lambda x: (lambda z: (z, _reorder(z, back, u * r)))(
        _reorder(x, to_zig, u * r)), mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    z, x2 = fn(x)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(x)[:, zigzag_permutation(s, r)])
    np.testing.assert_array_equal(np.asarray(x2), np.asarray(x))


# ----------------------------------------------------------------------------- numerics

# (seq U, ring R, data D, q heads, kv heads, causal, segments, layout, seq len): P = U*R > heads
# throughout; kv heads split (K % U == 0), GQA-replicated and MQA; all three layouts.
NUMERIC_CASES = [
    (4, 2, 1, 4, 4, True, True, "public", 32),
    (4, 2, 1, 4, 1, False, True, "public", 32),
    (4, 2, 1, 4, 2, True, False, "zigzag", 32),
    (4, 2, 1, 4, 2, True, True, "public", 24),      # S % 2UR != 0: falls back to contiguous
    (2, 4, 1, 2, 1, True, True, "public", 32),
    (2, 4, 1, 4, 2, False, True, "contiguous", 32),
    (2, 4, 1, 4, 1, True, True, "zigzag", 32),
    (1, 8, 1, 2, 1, True, True, "public", 32),
    (1, 8, 1, 4, 2, False, False, "contiguous", 16),
    (2, 2, 2, 4, 2, True, True, "public", 32),
]


@pytest.mark.parametrize("u,r,d,n,kh,causal,segments,layout,s", NUMERIC_CASES)
def test_matches_reference(u, r, d, n, kh, causal, segments, layout, s):
    mesh = make_mesh(seq=u, ring=r, data=d, devices=need_devices(u * r * d))
    q, k, v, seg, ct = attention_inputs(u * 100 + r * 10 + kh, b=2 * d, s=s, n=n, kh=kh,
                                        segments=segments)
    _check_against_reference(mesh, q, k, v, seg, ct, causal, layout, sharded=d > 1)


def test_zigzag_and_contiguous_agree():
    mesh = make_mesh(seq=2, ring=4, data=1, devices=need_devices(8))
    q, k, v, seg, _ = attention_inputs(5, b=2, s=32, n=4, kh=2, segments=True)
    zig = jax.jit(_attention_fn(mesh, True, seg, "zigzag", 32))(q, k, v)
    con = jax.jit(_attention_fn(mesh, True, seg, "contiguous", 32))(q, k, v)
    chex.assert_trees_all_close(zig, con, atol=1e-5, rtol=1e-5)
    assert not np.allclose(np.asarray(zig[:, :16]), np.asarray(zig[:, 16:]))  # not degenerate


@functools.cache
def _tiled_reference(causal):
    """test_tiled_pairs_match_reference's dense output, loss and gradients (one program; the
    inputs do not depend on the layout or tiles)."""
    q, k, v, seg, ct = attention_inputs(7, b=1, s=64, n=4, kh=2, segments=True)

    def loss(q, k, v):
        out = reference_attention(q, k, v, causal=causal, segment_ids=seg)
        return jnp.sum(out * ct), out
    (val, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return out, val, grads


@pytest.mark.parametrize("layout,causal,block_q,block_k", [
    # C = 16 in ragged tiles (padded inside each pair), the diagonal pairs' tiles triangular
    ("zigzag", True, 6, 5),
    ("contiguous", False, 16, 12),     # C = 32, bidirectional
])
def test_tiled_pairs_match_reference(layout, causal, block_q, block_k):
    """Pairs cut into several score tiles give the reference's values and gradients."""
    mesh = make_mesh(seq=2, ring=2, data=1, devices=need_devices(4))
    q, k, v, seg, ct = attention_inputs(7, b=1, s=64, n=4, kh=2, segments=True)
    perm = inv = np.arange(64)
    if layout == "zigzag":
        perm, inv = zigzag_permutation(64, 2), inverse_zigzag_permutation(64, 2)
    zseg = seg[:, perm]

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * ct)

    hyb = lambda q, k, v: hybrid_attention(q[:, perm], k[:, perm], v[:, perm], mesh=mesh,
                                           causal=causal, segment_ids=zseg, layout=layout,
                                           block_q=block_q, block_k=block_k)[:, inv]
    vg = lambda fn: jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2)))
    (val, grads), (out_ref, val_ref, grads_ref) = vg(hyb)(q, k, v), _tiled_reference(causal)
    chex.assert_trees_all_close(jax.jit(hyb)(q, k, v), out_ref, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(val, val_ref, atol=1e-4, rtol=1e-5)
    for name, g, gr in zip("qkv", grads, grads_ref):
        chex.assert_trees_all_close(g, gr, atol=1e-5, rtol=1e-5, custom_message=f"d{name}")


def test_ring_memory_has_no_chunk_squared_tile():
    """Per-device temp of a compiled fwd+bwd stays far below one [B, N/U, C, C] fp32 score
    array when pairs are tiled; the same program with one tile per pair (block = C, what the
    ring did before it reused the chunked kernel) needs more than that array: the check can
    fail."""
    u, r = 2, 4
    mesh = make_mesh(seq=u, ring=r, data=1, devices=need_devices(8))
    b, s, n, h = 1, 16384, 2, 8  # small head dim: the S x H arrays stay small next to C x C
    c = s // (2 * r)                                            # zigzag chunk, 2048
    x = jax.ShapeDtypeStruct((b, s, n, h), jnp.float32)
    pair_scores = b * (n // u) * c * c * 4                      # 16 MiB

    def temp_bytes(block):
        fn = lambda q, k, v: hybrid_attention(q, k, v, mesh=mesh, causal=True,
                                              block_q=block, block_k=block)
        grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2))
        return jax.jit(grad).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    tiled, whole = temp_bytes(256), temp_bytes(c)
    assert whole > pair_scores, (whole, pair_scores)
    print(f"temp bytes: tiled {tiled}, one tile per pair {whole}, [C, C] scores {pair_scores}")
    assert tiled < pair_scores / 4, (tiled, pair_scores)


# ----------------------------------------------------------------------------- skipping, balance

def _expected_pairs(r, layout, causal):
    """Computed (q chunk, kv chunk) pairs per ring rank, by the rule, independent of the code."""
    chunks = ([[i] for i in range(r)] if layout == "contiguous"
              else [[i, 2 * r - 1 - i] for i in range(r)])
    every = [c for cs in chunks for c in cs]
    return np.array([sum(1 for cq in chunks[i] for ck in every if not causal or ck <= cq)
                     for i in range(r)])


@pytest.mark.parametrize("causal", [True, False])
def test_block_skipping_and_zigzag_balance(causal):
    """The kernels' own counters: causal pairs above the diagonal are skipped (forward and
    backward), zigzag gives every ring rank the same work, contiguous does not."""
    u, r = 2, 4
    mesh = make_mesh(seq=u, ring=r, data=1, devices=need_devices(8))
    q, k, v, seg, _ = attention_inputs(1, b=1, s=32, n=4, kh=2, segments=True)
    counts = {}
    for layout in ("zigzag", "contiguous"):
        c = block_counts(q, k, v, mesh=mesh, causal=causal, segment_ids=seg, layout=layout)
        assert c.shape == (1, r, u, 2), c.shape
        want = _expected_pairs(r, layout, causal)                          # [R]
        np.testing.assert_array_equal(c[0, :, :, 0], np.repeat(want[:, None], u, 1))  # forward
        np.testing.assert_array_equal(c[0, :, :, 1], np.repeat(want[:, None], u, 1))  # backward
        counts[layout] = want
    if causal:
        # Zigzag pairs are (S/2R)^2, contiguous ones (S/R)^2: 4 zigzag tiles each.
        zig, con = counts["zigzag"], counts["contiguous"] * 4
        np.testing.assert_array_equal(zig, [2 * r + 1] * r)                # 9 9 9 9
        np.testing.assert_array_equal(con, [4, 8, 12, 16])
        assert zig.max() / zig.min() == 1.0 and con.max() / con.min() == r
        assert zig.max() < con.max()                                       # busiest rank
    else:
        assert counts["zigzag"].tolist() == [4 * r] * r and counts["contiguous"].tolist() == [r] * r


# ----------------------------------------------------------------------------- HLO

def _compiled(fn, *args):
    fwd = jax.jit(fn).lower(*args).compile().as_text()
    bwd = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2))).lower(
        *args).compile().as_text()
    return fwd, bwd


@pytest.mark.parametrize("u,r,d,layout", [(4, 2, 1, "zigzag"), (2, 2, 2, "natural"),
                                          (1, 8, 1, "zigzag")])
def test_compiled_collectives_ring(u, r, d, layout):
    mesh = make_mesh(seq=u, ring=r, data=d, devices=need_devices(u * r * d))
    b, s, n, kh, h = 2 * d, 32, 4, 2, 8
    q, k, v, seg, _ = attention_inputs(3, b, s, n, kh, h, segments=True)
    fn = lambda q, k, v, seg: hybrid_attention(q, k, v, mesh=mesh, segment_ids=seg, layout=layout)
    fwd, bwd = _compiled(fn, q, k, v, seg)
    fc, bc = collective_counts(fwd), collective_counts(bwd)
    assert fc["all-to-all"] == (2 if u > 1 else 0), fc
    assert (3 if u > 1 else 0) <= bc["all-to-all"] <= (4 if u > 1 else 0), bc
    assert fc["collective-permute"] >= 3 and bc["collective-permute"] >= 3, (fc, bc)  # k, v, seg
    assert "conditional" in fwd and "conditional" in bwd  # causal skip is a real branch
    # The only gather allowed is the small [B, S/R] int segment-id array (over seq, U > 1).
    qkv_elems = (b // d) * (s // (u * r)) * n * h
    for text in (fwd, bwd):
        gathered = collective_shapes(text, "all-gather")
        assert all(np.prod(shape) < qkv_elems for shape in gathered), gathered
        assert len(gathered) <= (1 if u > 1 else 0), gathered


def test_ulysses_path_unchanged_without_ring():
    """ring == 1: the same mesh and HLO as before: exactly 2 all-to-alls, no permutes."""
    mesh = make_mesh(seq=4, data=2, devices=need_devices(8), ring=1)
    assert mesh.axis_names == ("data", "seq")
    q, k, v, _, _ = attention_inputs(4, b=2, s=32, n=8, kh=2)
    fwd, bwd = _compiled(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh), q, k, v)
    fc, bc = collective_counts(fwd), collective_counts(bwd)
    assert fc["all-to-all"] == 2 and fc["collective-permute"] == 0, fc
    assert sum(fc.values()) == 2, fc
    assert bc["collective-permute"] == 0 and bc["all-gather"] == 0, bc


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("u,r,shape_q,kh,layout,match", [
    (4, 2, (2, 36, 4, 8), 4, "natural",
     r"sequence length 36 is not divisible by ring x seq = 8 \(ring axis size R=2, seq axis size U=4"),
    (4, 2, (2, 24, 4, 8), 4, "zigzag",
     r"sequence length 24 is not divisible by 2 zigzag chunks x ring x seq = 16"),
    (2, 4, (2, 32, 4, 8), 3, "natural",
     r"query heads 4 not divisible by kv heads 3 .*\(ring axis size 4\)"),
    (2, 4, (2, 32, 4, 8), 2, "diagonal", r"unknown ring layout 'diagonal'"),
])
def test_bad_shapes_raise(u, r, shape_q, kh, layout, match):
    mesh = make_mesh(seq=u, ring=r, data=1, devices=need_devices(u * r))
    q = jnp.zeros(shape_q)
    k = v = jnp.zeros(shape_q[:2] + (kh, shape_q[3]))  # validation comes before any kernel
    with pytest.raises(ValueError, match=match):
        if layout == "natural":
            ulysses_attention(q, k, v, mesh=mesh)
        else:
            hybrid_attention(q, k, v, mesh=mesh, layout=layout)


def test_hybrid_needs_ring_axis():
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="mesh has no 'ring' axis"):
        hybrid_attention(q, q, q, mesh=make_mesh(seq=2, data=1, devices=need_devices(2)))
