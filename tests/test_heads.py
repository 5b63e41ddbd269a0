"""Head counts the seq axis does not divide: the padded layout (each device gets the query
heads and the kv copies they read), values and gradients against the dense reference on
Ulysses and hybrid meshes, the bytes the exchange moves, and the one error left."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.utils.attention import attention_inputs
from tests.utils.devices import need_devices
from tests.utils.numerics import tolerance
from ulysses_jax import make_mesh, reference_attention, ulysses_attention
from ulysses_jax.attention.heads import pad_heads
from ulysses_jax.head_layout import head_layout
from ulysses_jax.attention.ulysses import _pack_qkv, _unpack_qkv, seq_to_heads
from ulysses_jax.hlo import collective_bytes, collective_counts


def _brute_force_layouts(n, k, p):
    """Every (K', R, G') with K' in [K, 2P], R in [1, P], G' in [G, 2G] a multiple of R,
    and K' R a multiple of P: the layouts the module docstring allows."""
    g = n // k
    return [(kp, r, gp) for kp in range(k, 2 * p + 1) for r in range(1, p + 1)
            for gp in range(g, 2 * g + 1) if gp % r == 0 and (kp * r) % p == 0]


@pytest.mark.parametrize("n,k,p", [(3, 3, 2), (3, 1, 2), (7, 7, 4), (7, 1, 8), (12, 4, 8),
                                   (12, 12, 8), (6, 3, 2), (12, 3, 8), (3, 3, 8), (8, 2, 4),
                                   (16, 8, 8), (16, 1, 8)])
def test_layout_is_valid_and_cheapest(n, k, p):
    lay = head_layout(n, k, p)
    g = n // k
    assert lay.g_pad >= g and lay.k_pad >= k and lay.g_pad % lay.reps == 0
    assert lay.kv_sent % p == 0 and lay.n_pad % p == 0
    if n % p == 0 and (k % p == 0 or p % k == 0):   # the layouts that existed before: kept
        assert not lay.padded and lay.reps == (1 if k % p == 0 else p // k)
    cost = lambda kp, r, gp: (2 * kp * gp + 2 * kp * r, kp * gp)
    best = min(cost(*x) for x in _brute_force_layouts(n, k, p))
    assert (lay.exchanged_heads(), lay.n_pad) == best, (lay, best)


def test_layout_examples_and_error():
    assert (head_layout(3, 3, 2).n_pad, head_layout(3, 3, 2).k_pad) == (4, 4)
    lay = head_layout(12, 4, 8)                      # kv heads copied twice, 4 queries each
    assert (lay.n_pad, lay.k_pad, lay.reps, lay.g_pad) == (16, 4, 2, 4)
    assert not head_layout(6, 3, 2).padded and head_layout(6, 3, 2).reps == 2
    assert "attention compute x1.33" in lay.describe()
    with pytest.raises(ValueError, match="query heads 12 not divisible by kv heads 5"):
        head_layout(12, 5, 4)


@pytest.mark.parametrize("n,k,p", [(3, 3, 2), (7, 1, 4), (12, 4, 8), (6, 3, 2)])
def test_each_device_gets_its_queries_and_the_kv_they_read(n, k, p):
    """Head-coded inputs through the padding and the real exchange: local query head j of
    each device is a real head or padding, and the local kv copy it reads (j // G_local) is
    the real head's kv head, n // G."""
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    lay = head_layout(n, k, p)
    code = lambda heads, base: jnp.asarray((base + 1 + np.arange(heads, dtype=np.float32))[
        None, None, :, None] * np.ones((1, 2 * p, heads, 1), np.float32))
    q, kk = code(n, 0), code(k, 100)

    def body(q, kk):
        qp, kp, vp = pad_heads(q, kk, kk, lay)
        return _unpack_qkv(seq_to_heads(_pack_qkv(qp, kp, vp, p)), lay.n_local, lay.k_local)[:2]

    spec = P(None, None, "seq")
    ql, kl = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "seq"),) * 2,
                                   out_specs=(spec, spec)))(q, kk)
    ql, kl = np.asarray(ql)[0, 0, :, 0], np.asarray(kl)[0, 0, :, 0]      # [N'], [K'R]
    g_local = lay.n_local // lay.k_local
    seen = set()
    for dev in range(p):
        for j in range(lay.n_local):
            head = ql[dev * lay.n_local + j]
            kv = kl[dev * lay.k_local + j // g_local]
            if head == 0:                          # padding: reads padding or anything
                continue
            assert kv == 100 + 1 + (int(head) - 1) // (n // k), (dev, j, head, kv)
            seen.add(int(head))
    assert seen == set(range(1, n + 1))


NUMERIC = [  # (seq U, ring R, query heads, kv heads, causal, segments)
    (2, 1, 3, 3, True, False),     # MHA, one padded head
    (4, 1, 7, 1, False, True),     # MQA: 8 query heads, the kv head copied 4 times
    (8, 1, 12, 4, True, False),    # GQA: 4 query heads per kv head copy, 16 in all
    (8, 1, 3, 3, False, False),    # more devices than heads
    (2, 2, 7, 7, True, True)]      # hybrid: heads padded for the seq axis only


@pytest.mark.parametrize("u,r,n,k,causal,segments", NUMERIC)
def test_uneven_heads_match_reference(u, r, n, k, causal, segments):
    mesh = make_mesh(seq=u, ring=r, data=1, devices=need_devices(u * r))
    s, b, h = 8 * u * r, 2, 8
    q, kk, v, seg, ct = attention_inputs(n * 10 + u, b, s, n, k, h, segments=segments,
                                         boundary=False, keys=("q", "ct", "k", "v", "seg"))
    fn = lambda q, kk, v: ulysses_attention(q, kk, v, mesh=mesh, causal=causal,
                                            segment_ids=seg)
    ref = lambda q, kk, v: reference_attention(q, kk, v, causal=causal, segment_ids=seg)

    def vg(f):
        loss = lambda q, kk, v: (lambda o: (jnp.sum(o * ct), o))(f(q, kk, v))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, kk, v)
    (_, out), grads = vg(fn)
    (_, out_ref), grads_ref = vg(ref)
    assert out.shape == (b, s, n, h)
    tol = tolerance(q.dtype)
    chex.assert_trees_all_close(out, out_ref, atol=tol, rtol=tol)
    for name, g, gr in zip("qkv", grads, grads_ref):
        chex.assert_trees_all_close(g, gr, atol=tol, rtol=tol, custom_message=f"d{name}")


def test_padded_heads_with_head_chunks():
    """6 query / 3 kv heads on 2 devices: each kv head copied twice, no query padding; in 3
    head groups the exchange runs 3 times, same values."""
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))

    @jax.jit
    def inputs(seed):
        ks = jax.random.split(jax.random.key(seed), 3)
        q = jax.random.normal(ks[0], (1, 16, 6, 8))
        kk, v = (jax.random.normal(x, (1, 16, 3, 8)) for x in ks[1:])
        return q, kk, v
    q, kk, v = inputs(3)
    fn = jax.jit(lambda q, kk, v: ulysses_attention(q, kk, v, mesh=mesh, head_chunks=3))
    compiled = fn.lower(q, kk, v).compile()
    chex.assert_trees_all_close(compiled(q, kk, v), jax.jit(reference_attention)(q, kk, v),
                                atol=1e-5, rtol=1e-5)
    assert collective_counts(compiled.as_text())["all-to-all"] == 6


@pytest.mark.parametrize("n,k,p", [(12, 4, 8), (3, 3, 2), (16, 4, 8)])
def test_exchange_moves_the_padded_heads(n, k, p):
    """Forward all-to-all bytes per device = the layout's formula: [B, S, (N' + 2K'R)/P, H]
    in, [B, S/P, N', H] back (fp32), in exactly two all-to-alls."""
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    b, s, h = 1, 16 * p, 8
    q = jax.ShapeDtypeStruct((b, s, n, h), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, s, k, h), jnp.float32)
    text = jax.jit(lambda q, kk, v: ulysses_attention(q, kk, v, mesh=mesh)).lower(
        q, kv, kv).compile().as_text()
    lay = head_layout(n, k, p)
    want = 4 * b * h * (s * (lay.n_pad + 2 * lay.kv_sent) // p + s // p * lay.n_pad)
    assert collective_counts(text)["all-to-all"] == 2
    assert collective_bytes(text, "all-to-all") == want, (collective_bytes(text, "all-to-all"),
                                                          want)
