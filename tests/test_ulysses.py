"""Ulysses attention against the dense one-device reference: layout, values, gradients, HLO."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.utils.attention import attention_inputs
from tests.utils.devices import gpu_devices, need_devices
from tests.utils.numerics import tolerance
from ulysses_jax import (make_mesh, reference_attention, ulysses_attention, seq_to_heads,
                         heads_to_seq)
from ulysses_jax.hlo import collective_counts, collective_shapes
from ulysses_jax.attention.ulysses import _pack_qkv, _unpack_qkv


def _check_against_reference(mesh, q, k, v, seg, ct, causal, sharded=False):
    tol = tolerance(q.dtype)
    if sharded:
        sh = NamedSharding(mesh, P("data", "seq"))
        q, k, v = (jax.device_put(x, sh) for x in (q, k, v))
        seg = None if seg is None else jax.device_put(seg, sh)

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

    uly = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=seg)
    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg)
    (_, out), grads = jax.jit(jax.value_and_grad(lambda *a: loss(uly, *a), argnums=(0, 1, 2),
                                                 has_aux=True))(q, k, v)
    (_, out_ref), grads_ref = jax.jit(jax.value_and_grad(lambda *a: loss(ref, *a),
                                                         argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "seq")), out.ndim), out.sharding
    chex.assert_trees_all_close(out, out_ref, atol=tol, rtol=tol)
    for name, g, gr in zip("qkv", grads, grads_ref):
        chex.assert_trees_all_close(g, gr, atol=tol, rtol=tol, custom_message=f"d{name}")


# ----------------------------------------------------------------------------- layout

@pytest.mark.parametrize("p", [2, 4, 8])
def test_round_trip_is_exact(p):
    devs = need_devices(p)
    mesh = make_mesh(seq=p, data=1, devices=devs)
    x = jax.random.normal(jax.random.key(p), (2, 4 * p, 2 * p, 8))
    fn = jax.shard_map(lambda x: heads_to_seq(seq_to_heads(x)), mesh=mesh,
                       in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x)), np.asarray(x))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_rank_coded_exchange(p):
    """Device i must receive every position, in order, for heads [i*N/P, (i+1)*N/P)."""
    devs = need_devices(p)
    mesh = make_mesh(seq=p, data=1, devices=devs)
    b, s, n, h = 1, 2 * p, 2 * p, 1
    pos = np.arange(s)[None, :, None, None]
    head = np.arange(n)[None, None, :, None]
    x = (pos * 1000 + head).astype(np.float32) * np.ones((b, s, n, h), np.float32)  # 1000*pos+head

    def body(x):  # x: [B, S/P, N, H]
        y = seq_to_heads(x)  # [B, S, N/P, H]
        i = jax.lax.axis_index("seq")
        want = (jnp.arange(s)[None, :, None, None] * 1000
                + (i * (n // p) + jnp.arange(n // p))[None, None, :, None])
        return y, jnp.all(y == want)[None]

    y, ok = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "seq"),
                                  out_specs=(P(None, None, "seq"), P("seq"))))(x)
    assert bool(np.all(np.asarray(ok))), np.asarray(ok)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("p,kh,reps", [(4, 8, 1), (4, 4, 1), (4, 2, 2), (4, 1, 4), (8, 2, 4)])
def test_packed_qkv_exchange_gives_each_device_its_heads(p, kh, reps):
    """One all-to-all carries q, k and v; each device gets its q heads and the kv heads they use."""
    devs = need_devices(p)
    mesh = make_mesh(seq=p, data=1, devices=devs)
    s, n = 2 * p, 8
    code = lambda heads, base: (base + np.arange(s)[None, :, None, None] * 1000
                                + np.arange(heads)[None, None, :, None]).astype(np.float32)
    q, k, v = code(n, 0), code(kh, 100), code(kh, 200)

    def body(q, k, v):  # [B, S/P, heads, H]
        k, v = jnp.repeat(k, reps, axis=2), jnp.repeat(v, reps, axis=2)
        qkv = seq_to_heads(_pack_qkv(q, k, v, p))
        return _unpack_qkv(qkv, n // p, kh * reps // p)

    spec = P(None, None, "seq")
    ql, kl, vl = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                                       out_specs=(spec,) * 3))(q, k, v)
    np.testing.assert_array_equal(np.asarray(ql), np.asarray(q))
    kl = np.asarray(kl)
    np.testing.assert_array_equal(kl, np.repeat(k, reps, axis=2))
    np.testing.assert_array_equal(np.asarray(vl), np.repeat(v, reps, axis=2))
    # Query head j on a device reads local kv head j // (N / K_local_total); check the pairing.
    group = n // (kh * reps)
    for j in range(n):
        assert int(kl[0, 0, j // group, 0]) - 100 == j // (n // kh)


# ----------------------------------------------------------------------------- numerics

def _kv_cases(n, p):
    cases = sorted({n, p, 2 * p, max(p // 2, 1), 1})
    return [kh for kh in cases if n % kh == 0 and (kh % p == 0 or p % kh == 0)]


NUMERIC_CASES = [(p, kh, causal) for p in (1, 2, 4, 8) for kh in _kv_cases(16, p)
                 for causal in (True, False)]


@pytest.mark.parametrize("p,kh,causal", NUMERIC_CASES)
def test_matches_reference_1d(p, kh, causal):
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    q, k, v, seg, ct = attention_inputs(p * 31 + kh, b=2, s=8 * p, n=16, kh=kh, h=8)
    _check_against_reference(mesh, q, k, v, seg, ct, causal)


@pytest.mark.parametrize("data,p,segments,sharded,causal", [
    (1, 1, True, False, True), (1, 4, True, True, False), (1, 8, True, False, True),
    (2, 1, True, True, True), (2, 2, False, True, True), (2, 2, True, False, False),
    (2, 4, True, True, True), (2, 4, True, False, False), (2, 4, False, False, True),
])
def test_matches_reference_2d_segments(data, p, segments, sharded, causal):
    mesh = make_mesh(seq=p, data=data, devices=need_devices(data * p))
    q, k, v, seg, ct = attention_inputs(data * 10 + p, b=2 * data, s=8 * p, n=8,
                                        kh=max(p // 2, 1), h=8, segments=segments)
    _check_against_reference(mesh, q, k, v, seg, ct, causal, sharded=sharded)


def test_segments_are_isolated():
    """Changing one document's tokens must not change another document's outputs."""
    mesh = make_mesh(seq=4, data=1, devices=need_devices(4))
    q, k, v, _, _ = attention_inputs(7, b=1, s=32, n=4, kh=4, h=8)
    seg = np.where(np.arange(32) < 12, 0, 1)[None].astype(np.int32)
    attn = jax.jit(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=False,
                                                     segment_ids=seg))
    out = attn(q, k, v)
    k2 = np.array(k)
    k2[:, :12] = np.asarray(jax.random.normal(jax.random.key(9), (1, 12, 4, 8)))
    out2 = attn(q, k2, v)
    np.testing.assert_array_equal(np.asarray(out[:, 12:]), np.asarray(out2[:, 12:]))
    assert not np.allclose(np.asarray(out[:, :12]), np.asarray(out2[:, :12]))


# ----------------------------------------------------------------------------- HLO

@pytest.mark.parametrize("data,p,kh,segments", [(1, 1, 2, False), (1, 4, 2, True),
                                                (2, 4, 8, False), (1, 8, 2, True)])
def test_compiled_collectives(data, p, kh, segments):
    mesh = make_mesh(seq=p, data=data, devices=need_devices(data * p))
    b, s, n, h = 2 * data, 8 * p, 8, 8
    q, k, v, seg, ct = attention_inputs(3, b, s, n, kh, h, segments=segments)
    fwd = jax.jit(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, segment_ids=seg))
    fwd_bwd = jax.jit(jax.grad(
        lambda q, k, v: jnp.sum(ulysses_attention(q, k, v, mesh=mesh, segment_ids=seg) * ct),
        argnums=(0, 1, 2)))
    fwd_text = fwd.lower(q, k, v).compile().as_text()
    bwd_text = fwd_bwd.lower(q, k, v).compile().as_text()
    fwd_counts, bwd_counts = collective_counts(fwd_text), collective_counts(bwd_text)
    if p == 1:
        assert sum(fwd_counts.values()) == 0, fwd_counts
        assert sum(bwd_counts.values()) == 0, bwd_counts
        return
    assert fwd_counts["all-to-all"] == 2, fwd_counts
    # Forward and backward exchange each way; XLA may drop the forward output exchange when
    # only gradients are returned, never more than 4.
    assert 3 <= bwd_counts["all-to-all"] <= 4, bwd_counts
    # The only gather allowed is the small [B, S] int segment-id array.
    qkv_elems = (b // data) * (s // p) * n * h
    for text in (fwd_text, bwd_text):
        gathered = collective_shapes(text, "all-gather")
        assert all(np.prod(shape) < qkv_elems for shape in gathered), gathered
        assert len(gathered) == (1 if segments else 0), gathered


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("shape_q,shape_kv,seq,match", [
    ((2, 100, 8, 8), (2, 100, 8, 8), 8, "sequence length 100 is not divisible by the seq axis size 8"),
    ((2, 32, 8, 8), (2, 32, 3, 8), 4, "query heads 8 not divisible by kv heads 3"),
    ((2, 32, 12, 8), (2, 32, 8, 8), 8, "query heads 12 not divisible by kv heads 8"),
    ((2, 32, 8, 8), (2, 32, 8, 4), 4, "must agree on batch, sequence and head_dim"),
    ((3, 32, 8, 8), (3, 32, 8, 8), 4, "batch size 3 is not divisible by the data axis size 2"),
])
def test_bad_shapes_raise(shape_q, shape_kv, seq, match):
    mesh = make_mesh(seq=seq, data=8 // seq, devices=need_devices(8))
    q = jnp.zeros(shape_q)
    k = v = jnp.zeros(shape_kv)  # values never reach a kernel: validation comes first
    with pytest.raises(ValueError, match=match):
        ulysses_attention(q, k, v, mesh=mesh)


def test_bad_impl_and_mesh_raise():
    devs = need_devices(2)
    q, k, v, _, _ = attention_inputs(0, 1, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        ulysses_attention(q, k, v, mesh=make_mesh(seq=2, data=1, devices=devs), impl="flash")
    no_seq = jax.make_mesh((2,), ("data",), devices=devs)
    with pytest.raises(ValueError, match="mesh has no 'seq' axis"):
        ulysses_attention(q, k, v, mesh=no_seq)
    with pytest.raises(ValueError, match="segment_ids must be"):
        ulysses_attention(q, k, v, mesh=make_mesh(seq=2, data=1, devices=devs),
                          segment_ids=jnp.zeros((1, 4), jnp.int32))


def test_cudnn_on_cpu_raises():
    devs = need_devices(2)
    q, k, v, _, _ = attention_inputs(0, 1, 8, 2, 2, 8, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="impl='cudnn' needs a GPU backend"):
        ulysses_attention(q, k, v, mesh=make_mesh(seq=2, data=1, devices=devs), impl="cudnn")


def test_make_mesh_errors(devices):
    with pytest.raises(ValueError, match="seq axis size 3 does not divide the 8 available devices"):
        make_mesh(seq=3, devices=devices[:8])
    with pytest.raises(ValueError, match="needs 16 devices but only 8 are available"):
        make_mesh(seq=8, data=2, devices=devices[:8])
    mesh = make_mesh(seq=2, devices=devices[:8])
    assert dict(mesh.shape) == {"data": 4, "seq": 2}


# ----------------------------------------------------------------------------- GPU kernels

def _max_rel_errors(got, want):
    """max |a - b| / max |b| per array: bf16 kernels against an fp32 reference."""
    return [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                  float(jnp.max(jnp.abs(b.astype(jnp.float32))))) for a, b in zip(got, want)]


def _gpu_fwd_bwd(fn, q, k, v, ct):
    out, vjp = jax.vjp(jax.jit(fn), q, k, v)
    return (out, *vjp(ct))


@pytest.mark.parametrize("p,kh", [(1, 8), (2, 2)])
def test_cudnn_bf16_matches_reference(p, kh):
    devs = gpu_devices(p)
    mesh = make_mesh(seq=p, data=1, devices=devs)
    with jax.default_device(devs[0]):
        q, k, v, _, ct = attention_inputs(11, b=2, s=256 * p, n=8, kh=kh, h=64, dtype=jnp.bfloat16)
        got = _gpu_fwd_bwd(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, impl="cudnn"),
                           q, k, v, ct)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
        want = _gpu_fwd_bwd(lambda q, k, v: reference_attention(q, k, v, causal=True), *f32)
    errors = _max_rel_errors(got, want)
    assert max(errors) <= 1e-2, errors


@pytest.mark.parametrize("p,kh", [(1, 2), (2, 8)])
def test_cudnn_packed_bf16_matches_reference(p, kh):
    """Packed documents through cuDNN's packed layout ('auto' with segment ids on Hopper)."""
    from ulysses_jax.attention import cudnn, ulysses
    devs = gpu_devices(p)
    why = cudnn.packed_supported(cudnn.compute_capability(devs[0]), 8 // p, max(kh, p) // p)
    if why:
        pytest.skip(why)
    mesh = make_mesh(seq=p, data=1, devices=devs)
    with jax.default_device(devs[0]):
        q, k, v, seg, ct = attention_inputs(12, b=2, s=512 * p, n=8, kh=kh, h=64,
                                            dtype=jnp.bfloat16, segments=True)
        assert ulysses.mesh_kernel("auto", q, mesh, True, (8 // p, max(kh, p) // p)) == \
            "cudnn_packed"
        got = _gpu_fwd_bwd(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh,
                                                             segment_ids=seg), q, k, v, ct)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
        want = _gpu_fwd_bwd(lambda q, k, v: reference_attention(q, k, v, causal=True,
                                                                segment_ids=seg), *f32)
    errors = _max_rel_errors(got, want)
    assert max(errors) <= 1e-2, errors


@pytest.mark.parametrize("p,n,kh,chunks", [(4, 16, 8, 2), (2, 8, 8, 4), (2, 8, 4, 2)])
def test_head_chunks_same_results_more_smaller_exchanges(p, n, kh, chunks):
    """head_chunks=C: same outputs and gradients as the reference; 2C all-to-alls forward."""
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    q, k, v, seg, ct = attention_inputs(40 + chunks, b=2, s=8 * p, n=n, kh=kh, h=8, segments=True)
    tol = tolerance(q.dtype)
    fn = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, segment_ids=seg,
                                           head_chunks=chunks)
    out, vjp = jax.vjp(jax.jit(fn), q, k, v)
    ref, ref_vjp = jax.vjp(jax.jit(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg)),
                           q, k, v)
    chex.assert_trees_all_close(out, ref, atol=tol, rtol=tol)
    chex.assert_trees_all_close(vjp(ct), ref_vjp(ct), atol=tol, rtol=tol)
    counts = collective_counts(jax.jit(fn).lower(q, k, v).compile().as_text())
    assert counts["all-to-all"] == 2 * chunks, counts


def test_head_chunks_must_divide_local_kv_heads():
    mesh = make_mesh(seq=4, data=1, devices=need_devices(4))
    q, k, v, _, _ = attention_inputs(0, 1, 16, 8, 2, 8)
    with pytest.raises(ValueError, match="head_chunks 2 must be a positive divisor of the kv "
                                         "heads per device, 1"):
        ulysses_attention(q, k, v, mesh=mesh, head_chunks=2)
