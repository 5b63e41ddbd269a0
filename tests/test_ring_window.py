"""Windows, scales and softcaps through the exchange: Ulysses and hybrid Ulysses x Ring
against the dense reference, the ring offsets a window needs, the pairs each rank computes,
and the K/V a window no longer sends (collective-permutes as executed)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.utils.attention import attention_inputs
from tests.utils.devices import need_devices
from tests.utils.numerics import tolerance
from ulysses_jax import (hybrid_attention, inverse_zigzag_permutation, make_mesh,
                         reference_attention, ulysses_attention, zigzag_permutation)
from ulysses_jax.attention.ring import block_counts, ring_steps
from ulysses_jax.hlo import executed_collectives


def _check(fn, q, k, v, seg, ct, causal, **variant):
    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg, **variant)

    def vg(f):
        loss = lambda q, k, v: (lambda o: (jnp.sum(o * ct), o))(f(q, k, v))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (_, out), grads = vg(fn)
    (_, out_ref), grads_ref = vg(ref)
    tol = tolerance(q.dtype)
    chex.assert_trees_all_close(out, out_ref, atol=tol, rtol=tol)
    for name, g, gr in zip("qkv", grads, grads_ref):
        chex.assert_trees_all_close(g, gr, atol=tol, rtol=tol, custom_message=f"d{name}")


@pytest.mark.parametrize("p,causal,window,softcap,segments", [
    (4, True, 9, None, True), (2, False, 5, 3.0, False)])
def test_ulysses_variants_match_reference(p, causal, window, softcap, segments):
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    q, k, v, seg, ct = attention_inputs(p, 2, 16 * p, 4, 2, segments=segments, rate=0.1,
                                        boundary=False)
    variant = dict(window=window, softcap=softcap, scale=0.3)
    fn = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=seg,
                                           **variant)
    _check(fn, q, k, v, seg, ct, causal, **variant)


@pytest.mark.parametrize("u,r,layout,causal,window,softcap,segments", [
    (2, 4, "zigzag", True, 9, None, False),      # chunks of 8: one ring step each way round
    (2, 4, "natural", True, 9, 3.0, True),       # runs contiguous: no reorder with a window
    (2, 4, "zigzag", False, 13, None, True),      # both sides, each way round
])
def test_ring_window_matches_reference(u, r, layout, causal, window, softcap, segments):
    mesh = make_mesh(seq=u, ring=r, data=1, devices=need_devices(u * r))
    s = 64
    q, k, v, seg, ct = attention_inputs(u + r, 1, s, 4, 2, segments=segments, rate=0.1,
                                        boundary=False)
    perm = inv = np.arange(s)
    if layout == "zigzag":
        perm, inv = zigzag_permutation(s, r), inverse_zigzag_permutation(s, r)
    zseg = None if seg is None else seg[:, perm]
    variant = dict(window=window, softcap=softcap, scale=0.4)
    fn = lambda q, k, v: hybrid_attention(q[:, perm], k[:, perm], v[:, perm], mesh=mesh,
                                          causal=causal, segment_ids=zseg, layout=layout,
                                          block_q=4, block_k=4, **variant)[:, inv]
    _check(fn, q, k, v, seg, ct, causal, **variant)


def _meeting_pairs(r, nc, c, causal, window):
    """Independent count per ring rank: (query chunk, key chunk) pairs of the whole sequence
    that hold a (query, key) pair inside the window, by positions."""
    chunks = [[i] if nc == 1 else [i, 2 * r - 1 - i] for i in range(r)]
    every = [x for cs in chunks for x in cs]
    pos = lambda ch: np.arange(ch * c, (ch + 1) * c)

    def meets(cq, ck):
        rel = pos(cq)[:, None] - pos(ck)[None, :]
        return ((rel < window) & ((rel >= 0) if causal else (rel > -window))).any()
    return np.array([sum(meets(cq, ck) for cq in chunks[i] for ck in every) for i in range(r)])


@pytest.mark.parametrize("layout,causal,window", [("contiguous", True, 9), ("zigzag", True, 5),
                                                  ("contiguous", False, 3)])
def test_window_pairs_and_ring_steps(layout, causal, window):
    """The kernels' counters equal the pairs that meet inside the window, forward and
    backward, on every rank; the ring runs only the offsets those pairs need."""
    u, r, s = 1, 8, 64
    mesh = make_mesh(seq=u, ring=r, data=1, devices=need_devices(u * r))
    q, k, v, _, _ = attention_inputs(9, 1, s, 2, 1)
    nc = 2 if layout == "zigzag" else 1
    counts = block_counts(q, k, v, mesh=mesh, causal=causal, layout=layout, window=window)
    want = _meeting_pairs(r, nc, s // (r * nc), causal, window)
    np.testing.assert_array_equal(counts[0, :, 0, 0], want)
    np.testing.assert_array_equal(counts[0, :, 0, 1], want)
    c = s // (r * nc)
    reach = -(-(window - 1) // c)
    steps = ring_steps(r, nc, c, causal, window)
    assert steps == {("contiguous", True): (reach, 0), ("zigzag", True): (reach, reach),
                     ("contiguous", False): (reach, reach)}[layout, causal], steps
    assert ring_steps(r, nc, c, causal, None) == (r - 1, 0)


def test_short_window_sends_less():
    """Contiguous ring of 8, chunks of 512, window 300: K/V move one step instead of 7
    (forward: 2 permutes of [B, C, K, H] each step); the backward also returns dK/dV from one
    step away instead of going all the way round. Counted as executed (loop trip counts)."""
    r, s, h = 8, 4096, 8
    mesh = make_mesh(seq=1, ring=r, data=1, devices=need_devices(r))
    x = jax.ShapeDtypeStruct((1, s, 2, h), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, s, 1, h), jnp.float32)
    sent = {}
    for window in (None, 300):
        fn = lambda q, k, v: hybrid_attention(q, k, v, mesh=mesh, layout="contiguous",
                                              window=window)
        fwd = jax.jit(fn).lower(x, kv, kv).compile().as_text()
        bwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))).lower(
            x, kv, kv).compile().as_text()
        sent[window] = [executed_collectives(t)["bytes"]["collective-permute"]
                        for t in (fwd, bwd)]
    block = 4 * (s // r) * h                     # one [1, C, 1, H] fp32 K or V block
    assert sent[None][0] == 2 * (r - 1) * block and sent[300][0] == 2 * block, sent
    assert sent[300][1] < sent[None][1] / 3, sent
