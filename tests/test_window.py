"""Sliding windows, softmax scales and logit softcaps in the local kernels: the dense
reference against a loop, the chunked kernel (values, gradients, tiles visited, ring-pair
offsets) and XLA's kernel against the reference, cuDNN's arguments through a stand-in, and
the kernel choice."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.utils.attention import attention_inputs
from tests.utils.numerics import tolerance
from ulysses_jax import reference_attention
from ulysses_jax.attention import cudnn, kernels
from ulysses_jax.attention.chunked import (_backward, _delta, _forward, _pad_inputs, _Plan,
                                           block_backward, block_forward, block_plan,
                                           chunked_attention)
from ulysses_jax.attention.kernels import local_attention, resolve_impl


def _assert_matches(fn, ref, q, k, v, ct):
    def vg(f):
        loss = lambda q, k, v: (lambda o: (jnp.sum(o * ct), o))(f(q, k, v))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (_, out), grads = vg(fn)
    (_, out_ref), grads_ref = vg(ref)
    tol = tolerance(q.dtype)
    chex.assert_trees_all_close(out, out_ref, atol=tol, rtol=tol)
    for name, g, gr in zip("qkv", grads, grads_ref):
        chex.assert_trees_all_close(g, gr, atol=tol, rtol=tol, custom_message=f"d{name}")


def test_reference_window_and_softcap_by_loop():
    """The reference's definitions, by a loop: query i sees the W keys i-W+1..i (causal) or
    |i - j| < W; logits are c * tanh(scale * q.k / c) before masking."""
    q, k, v, _, _ = attention_inputs(0, 1, 12, 1, 1)
    w, c, scale = 4, 1.5, 0.7
    qn, kn, vn = (np.asarray(x, np.float64)[0, :, 0] for x in (q, k, v))
    ref = jax.jit(reference_attention, static_argnames=("causal", "scale", "window", "softcap"))
    checked = 0
    for causal in (True, False):
        got = np.asarray(ref(q, k, v, causal=causal, scale=scale, window=w, softcap=c))[0, :, 0]
        for i in range(12):
            keys = [j for j in range(12) if i - w < j and (j <= i if causal else j < i + w)]
            assert len(keys) == (min(i + 1, w) if causal else min(i + w, 12) - max(i - w + 1, 0))
            logits = c * np.tanh(scale * (kn[keys] @ qn[i]) / c)
            p = np.exp(logits - logits.max())
            np.testing.assert_allclose(got[i], (p / p.sum()) @ vn[keys], rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == 24


@pytest.mark.parametrize("causal,window,softcap,segments,bq,bk", [
    (True, 1, None, False, 8, 8),        # a query sees only itself
    (True, 5, None, True, 7, 13),        # window smaller than a block, ragged blocks
    (True, 17, 2.0, False, 8, 8),        # window across several blocks, softcap
    (True, 64, None, True, 16, 16),      # window longer than the sequence: plain causal
    (False, 6, None, False, 8, 16),      # both sides
    (False, 9, 3.0, True, 13, 7),
])
def test_chunked_window_matches_reference(causal, window, softcap, segments, bq, bk):
    q, k, v, seg, ct = attention_inputs(1, 2, 50, 4, 2, segments=segments, rate=0.1)
    fn = lambda q, k, v: chunked_attention(q, k, v, causal=causal, segment_ids=seg, block_q=bq,
                                           block_k=bk, window=window, softcap=softcap, scale=0.3)
    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg,
                                              window=window, softcap=softcap, scale=0.3)
    _assert_matches(fn, ref, q, k, v, ct)


@pytest.mark.parametrize("n,kh,bq,bk,causal,window,softcap,segments", [
    (8, 2, 8, 8, True, 17, 2.0, False),     # G = 4: the query-outer backward, loops both ways
    (8, 2, 13, 7, False, 9, 3.0, True),     # G = 4, both sides, ragged blocks, segments
    (4, 2, 64, 8, True, 12, 2.0, True),     # one query block: the key-outer backward, no loop
    (4, 2, 8, 64, False, 12, 2.0, False),   # one key block: the forward seeds only, no loop
    (8, 2, 8, 64, True, 12, 2.0, True),     # G = 4 and one key block: no key loop at all
    (8, 2, 64, 8, False, 12, 2.0, False),   # G = 4 and one query block
])
def test_window_and_softcap_in_every_loop_order(n, kh, bq, bk, causal, window, softcap,
                                                segments):
    """The paths the kernel takes by shape (a kv head serving more than two query heads runs
    the query-outer backward; one query or key block skips that loop) apply the window, the
    softcap's derivative and the segment mask like the many-block key-outer path."""
    q, k, v, seg, ct = attention_inputs(8, 2, 50, n, kh, segments=segments, rate=0.1)
    fn = lambda q, k, v: chunked_attention(q, k, v, causal=causal, segment_ids=seg, block_q=bq,
                                           block_k=bk, window=window, softcap=softcap, scale=0.3)
    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg,
                                              window=window, softcap=softcap, scale=0.3)
    _assert_matches(fn, ref, q, k, v, ct)


def _tiles_in_window(t, bq, bk, causal, window, offset=0):
    """Independent count: tiles with at least one (query, key) pair inside the window."""
    rel = (np.arange(t)[:, None] + offset) - np.arange(t)[None, :]
    inside = (rel < window) & ((rel >= 0) if causal else (rel > -window))
    return sum(inside[i:i + bq, j:j + bk].any() for i in range(0, t, bq)
               for j in range(0, t, bk))


def _visits(plan, q, k, v, ct, offset=0):
    padded = _pad_inputs(q, k, v, None, None, plan)
    out, lse, fwd = jax.jit(lambda *a: _forward(*a, plan, 1.0, offset=offset))(*padded)
    d_out = _pad_inputs(ct, k, v, None, None, plan)[0]
    *_, bwd = jax.jit(lambda *a: _backward(*a, plan, 1.0, offset=offset))(
        *padded, lse, _delta(out, d_out), d_out)
    return int(fwd), int(bwd)


@pytest.mark.parametrize("s,bq,bk,causal,window,offset,n", [
    (50, 7, 13, True, 9, 0, 2), (50, 8, 8, False, 9, 0, 2), (1024, 64, 64, True, 128, 0, 2),
    (48, 8, 8, True, 20, 32, 2), (48, 8, 8, False, 20, -40, 2),
    # 4 query heads per kv head: the query-outer backward visits the same tiles
    (50, 7, 13, True, 9, 0, 4), (48, 8, 8, True, 20, 32, 4), (48, 8, 8, False, 20, -40, 4)])
def test_window_visits_exactly_the_tiles_inside_it(s, bq, bk, causal, window, offset, n):
    """The loops' own counters equal a brute-force count of the tiles that hold a pair
    inside the window (forward and backward), also for a ring pair's offset."""
    q, k, v, _, ct = attention_inputs(2, 1, s, n, 1, h=4)
    plan = _Plan(s, s, bq, bk, causal, window=window)
    want = _tiles_in_window(s, bq, bk, causal, window, offset)
    assert _visits(plan, q, k, v, ct, offset) == (want, want)
    if s == 1024:
        full = _visits(_Plan(s, s, bq, bk, causal), q, k, v, ct)
        # 16 query blocks of 64: causal visits 1 + 2 + ... + 16 tiles; a window of 128 lets
        # block i (i >= 2) reach back into block i - 2 only: 1 + 2 + 3 x 14.
        assert full[0] == 16 * 17 // 2 and want == 1 + 2 + 3 * 14, (full, want)


def _pair_reference(qa, kb, vb, offset, window, cap, scale):
    """Dense attention of query rows at positions offset + i over keys at positions j
    (GQA: each kv head repeated for its query heads), causal window and softcap; a row that
    sees no key gives 0."""
    g = qa.shape[2] // kb.shape[2]
    kb, vb = jnp.repeat(kb, g, axis=2), jnp.repeat(vb, g, axis=2)
    logits = cap * jnp.tanh(jnp.einsum("btnh,bsnh->bnts", qa, kb) * scale / cap)
    rel = offset + jnp.arange(qa.shape[1])[:, None] - jnp.arange(kb.shape[1])[None, :]
    ok = (rel >= 0) & (rel < window)
    logits = jnp.where(ok, logits, -1e30)
    p = jnp.exp(logits - logits.max(-1, keepdims=True)) * ok
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bnts,bsnh->btnh", p, vb)


@pytest.mark.parametrize("n,kh,bq,bk", [
    (2, 2, 8, 8),       # several blocks each way, key-outer backward
    (8, 2, 8, 8),       # G = 4: query-outer backward
    (2, 2, 16, 8),      # one query block (no backward query loop), which sees keys
    (8, 2, 8, 16),      # G = 4, one key block: query block 1 sees none of it, yet is run
    (8, 2, 16, 16),     # one tile in all
])
def test_ring_pair_offset_uses_true_positions(n, kh, bq, bk):
    """block_forward / block_backward of a (query chunk, key chunk) pair 32 positions apart,
    window 20: rows 0..2 of the query chunk reach its last keys, the rest see nothing (output
    0, logsumexp -inf); values and gradients equal a dense pair computed directly."""
    q, k, v, _, ct = attention_inputs(3, 1, 16, n, kh)
    plan = block_plan(16, 16, True, bq, bk, window=20, softcap=2.0)
    out, lse = jax.jit(lambda q, k, v: block_forward(q, k, v, None, None, plan, 0.4,
                                                     offset=32))(q, k, v)
    ref = jax.jit(lambda q, k, v: _pair_reference(q, k, v, 32, 20, 2.0, 0.4))
    seen = np.isfinite(np.asarray(lse)[0, :, 0])
    np.testing.assert_array_equal(seen, np.arange(16) < 3)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(q, k, v)), atol=1e-6)
    grads = jax.jit(lambda q, k, v, lse, out, ct: block_backward(
        q, k, v, None, None, lse, _delta(out, ct), ct, plan, 0.4, offset=32))(q, k, v, lse, out,
                                                                             ct)
    _, vjp = jax.vjp(ref, q, k, v)
    for name, g, gr in zip("qkv", grads, vjp(ct)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(gr), atol=1e-5, err_msg=name)
    assert float(np.abs(np.asarray(grads[1])).max()) > 0


def test_xla_kernel_window_and_scale():
    causal = False  # both sides of the window (the causal side: test_cudnn_gets_...)
    q, k, v, seg, ct = attention_inputs(4, 2, 40, 4, 2, segments=True, rate=0.1)
    fn = lambda q, k, v: local_attention(q, k, v, causal=causal, segment_ids=seg, impl="xla",
                                         window=7, scale=0.3)
    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg,
                                              window=7, scale=0.3)
    _assert_matches(fn, ref, q, k, v, ct)


def test_cudnn_gets_the_window_and_scale(monkeypatch):
    """impl='cudnn' cannot lower on a CPU: a stand-in records what jax's call receives and
    answers with XLA's kernel, which must then equal the reference."""
    seen = []
    real = jax.nn.dot_product_attention

    def fake(q, k, v, **kw):
        seen.append(kw)
        return real(q, k, v, **{**kw, "implementation": "xla"})
    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    q, k, v, _, _ = attention_inputs(5, 1, 32, 4, 2)
    # a fresh function: the stand-in must see this test's trace
    local = jax.jit(lambda q, k, v, **kw: local_attention(q, k, v, **kw),
                    static_argnames=("causal", "impl", "window", "scale"))
    ref = jax.jit(reference_attention, static_argnames=("causal", "window", "scale"))
    out = local(q, k, v, causal=True, impl="cudnn", window=5, scale=0.25)
    assert seen == [dict(mask=None, is_causal=True, implementation="cudnn", scale=0.25,
                         local_window_size=(4, 0))]
    chex.assert_trees_all_close(out, ref(q, k, v, window=5, scale=0.25), atol=1e-5, rtol=1e-5)
    out = local(q, k, v, causal=False, impl="cudnn")                     # encoders: both ways
    assert seen[1] == dict(mask=None, is_causal=False, implementation="cudnn", scale=None)
    chex.assert_trees_all_close(out, ref(q, k, v, causal=False), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kernel 'cudnn' cannot apply a logit softcap"):
        local_attention(q, k, v, causal=True, impl="cudnn", softcap=5.0)


def test_packed_cudnn_gets_the_window(monkeypatch):
    """The packed layout passes the window to cuDNN; the exact fallback applies it too."""
    calls = []
    monkeypatch.setattr(cudnn, "_cudnn_packed_call",
                        lambda *a, **kw: calls.append(kw) or jnp.zeros_like(a[0]))
    q, k, v, _, _ = attention_inputs(6, 1, 32, 4, 2)
    seg = np.asarray([[1] * 20 + [2] * 12], np.int32)
    out = jax.jit(lambda q, k, v: cudnn.packed_attention(q, k, v, seg, causal=True,
                                                        max_segments=4, window=6))(q, k, v)
    assert calls == [dict(causal=True, scale=8 ** -0.5, window=6)] and bool(jnp.all(out == 0))
    over = jax.jit(lambda q, k, v: cudnn.packed_attention(q, k, v, seg, causal=True,
                                                         max_segments=1, window=6))(q, k, v)
    ref = jax.jit(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg, window=6))
    chex.assert_trees_all_close(over, ref(q, k, v), atol=1e-5, rtol=1e-5)


H100 = (9, 0)


@pytest.mark.parametrize("impl,causal,window,softcap,segments,checked,want", [
    ("auto", True, 64, None, False, False, "cudnn"),          # cuDNN's sliding window
    ("auto", True, None, 50.0, False, False, "chunked"),      # no softcap in cuDNN
    ("auto", False, 64, None, False, False, "chunked"),       # cuDNN: left windows only
    ("auto", False, None, None, False, False, "cudnn"),
    ("auto", True, 64, None, True, False, "chunked"),         # packed + window: not verified
    ("auto", True, 64, None, True, True, "cudnn_packed"),
    ("cudnn", True, 64, None, True, False, "cudnn_packed"),   # explicit: honoured
    ("xla", False, 64, None, False, False, "xla"),
    ("chunked", True, 64, 50.0, True, False, "chunked"),
])
def test_kernel_choice_for_variants(impl, causal, window, softcap, segments, checked, want,
                                    monkeypatch):
    monkeypatch.setattr(cudnn, "_jax_version", lambda: (0, 11))
    monkeypatch.setattr(cudnn, "PACKED_WINDOW_CHECKED", checked)
    assert resolve_impl(impl, jnp.bfloat16, 64, backend="gpu", segments=segments,
                        capability=H100, heads=(8, 2), causal=causal, window=window,
                        softcap=softcap) == want


def test_variant_refusals():
    kw = dict(backend="gpu", capability=H100)
    with pytest.raises(ValueError, match="impl='cudnn' cannot apply a logit softcap"):
        resolve_impl("cudnn", jnp.bfloat16, 64, softcap=30.0, **kw)
    with pytest.raises(ValueError, match="impl='xla' cannot apply a logit softcap"):
        resolve_impl("xla", jnp.float32, 64, softcap=30.0, backend="cpu")
    with pytest.raises(ValueError, match="without the causal mask"):
        resolve_impl("cudnn", jnp.bfloat16, 64, causal=False, window=8, **kw)
    q, k, v, _, _ = attention_inputs(7, 1, 16, 2, 1)
    for bad, match in ((dict(window=0), "window must be a positive int"),
                       (dict(window=2.5), "window must be a positive int"),
                       (dict(softcap=-1.0), "softcap must be positive")):
        with pytest.raises(ValueError, match=match):
            chunked_attention(q, k, v, causal=True, **bad)
    assert kernels.IMPLS == ("auto", "xla", "cudnn", "chunked")
