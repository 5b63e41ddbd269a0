"""Chunked (flash-style) attention: values and gradients against the dense reference, the
Ulysses path, compiled memory, and causal block skipping."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.utils.attention import attention_inputs
from tests.utils.devices import need_devices
from tests.utils.numerics import tolerance
from ulysses_jax import make_mesh, reference_attention, ulysses_attention
from ulysses_jax.attention.chunked import _backward, _delta, _forward, _pad_inputs, _Plan, chunked_attention
from ulysses_jax.attention.kernels import local_attention, resolve_impl


def _value_and_grads(fn, q, k, v, ct):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _assert_matches(fn, ref, q, k, v, ct):
    tol = tolerance(q.dtype)
    out, grads = _value_and_grads(fn, q, k, v, ct)
    out_ref, grads_ref = _value_and_grads(ref, q, k, v, ct)
    chex.assert_trees_all_close(out, out_ref, atol=tol, rtol=tol)
    for name, g, gr in zip("qkv", grads, grads_ref):
        chex.assert_trees_all_close(g, gr, atol=tol, rtol=tol, custom_message=f"d{name}")


@pytest.mark.parametrize("causal,n,kh,segments,t,s,bq,bk", [
    (True, 4, 4, False, 64, 64, 16, 16),    # MHA, blocks divide S
    (True, 4, 2, True, 50, 50, 24, 10),     # GQA, ragged blocks of different sizes
    (True, 4, 1, True, 50, 50, 7, 13),      # MQA, ragged, query blocks smaller than key blocks
    (True, 4, 2, False, 50, 50, 512, 512),  # blocks clamped to the sequence: one tile
    (False, 4, 4, True, 64, 64, 16, 16),
    (False, 4, 2, False, 50, 50, 24, 10),
    (False, 4, 1, True, 50, 50, 13, 7),
    (False, 4, 2, False, 40, 50, 16, 12),   # cross attention, T != S
])
def test_matches_reference(causal, n, kh, segments, t, s, bq, bk):
    q, k, v, seg, ct = attention_inputs(0, 2, s, n, kh, 8, t=t, segments=segments)
    fn = lambda q, k, v: chunked_attention(q, k, v, causal=causal, segment_ids=seg,
                                           block_q=bq, block_k=bk)
    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg)
    _assert_matches(fn, ref, q, k, v, ct)


def test_bf16_forward_and_custom_scale():
    q, k, v, seg, _ = attention_inputs(1, 1, 40, 4, 2, 8, dtype=jnp.bfloat16, segments=True)
    out = jax.jit(lambda q, k, v: chunked_attention(q, k, v, causal=True, segment_ids=seg,
                                                    block_q=16, block_k=12, scale=0.3))(q, k, v)
    ref = jax.jit(lambda q, k, v: reference_attention(q, k, v, causal=True, segment_ids=seg,
                                                      scale=0.3))(q, k, v)
    assert out.dtype == jnp.bfloat16
    chex.assert_trees_all_close(out.astype(jnp.float32), ref.astype(jnp.float32),
                                atol=tolerance(jnp.bfloat16), rtol=tolerance(jnp.bfloat16))


@pytest.mark.parametrize("causal,segments,s", [(True, True, 1024), (False, False, 64)])
def test_ulysses_chunked_matches_reference(causal, segments, s):
    mesh = make_mesh(seq=4, data=1, devices=need_devices(4))
    # 8 query heads over 2 kv heads: P=4 > K=2, so kv heads are replicated before the exchange.
    q, k, v, seg, ct = attention_inputs(2, 1, s, 8, 2, 16, segments=segments)
    fn = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=seg,
                                           impl="chunked")
    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg)
    _assert_matches(fn, ref, q, k, v, ct)


def test_fwd_bwd_memory_is_linear_in_sequence():
    b, s, n, h = 1, 4096, 2, 32
    x = jax.ShapeDtypeStruct((b, s, n, h), jnp.float32)
    scores_bytes = b * n * s * s * 4  # one [B, N, S, S] fp32 score tensor

    def temp_bytes(attn):
        grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) ** 2), argnums=(0, 1, 2))
        return jax.jit(grad).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(lambda q, k, v: chunked_attention(q, k, v, causal=True,
                                                           block_q=256, block_k=256))
    dense = temp_bytes(lambda q, k, v: local_attention(q, k, v, causal=True, impl="xla"))
    assert dense > scores_bytes, (dense, scores_bytes)        # the check can fail
    assert chunked < scores_bytes / 10, (chunked, scores_bytes)


def _tiles_with_visible_keys(t, s, bq, bk, causal):
    """Independent count: (query block, key block) tiles with at least one unmasked entry."""
    qpos, kpos = np.arange(t), np.arange(s)
    allowed = (qpos[:, None] >= kpos[None, :]) if causal else np.ones((t, s), bool)
    return sum(allowed[i:i + bq, j:j + bk].any() for i in range(0, t, bq) for j in range(0, s, bk))


@pytest.mark.parametrize("s,bq,bk", [(50, 7, 13), (1024, 64, 64)])
def test_causal_skips_blocks_above_the_diagonal(s, bq, bk):
    # cost_analysis() counts a while loop's body once, so it cannot see the skipping; count the
    # tiles the forward and backward loops actually compute instead.
    q, k, v, _, ct = attention_inputs(3, 1, s, 2, 1, 4)
    visits = {}
    for causal in (True, False):
        plan = _Plan(s, s, bq, bk, causal)
        visits[causal] = _visits(q, k, v, None, ct, plan)
        want = _tiles_with_visible_keys(s, s, bq, bk, causal)
        assert visits[causal] == (want, want), (causal, visits[causal], want)
    nq, nk = -(-s // bq), -(-s // bk)
    assert visits[False] == (nq * nk, nq * nk)
    if nq >= 16:  # many blocks: causal computes about half the tiles
        assert visits[True][0] < 0.55 * visits[False][0], visits


def test_resolve_auto_and_errors():
    assert resolve_impl("auto", jnp.float32, 64, backend="cpu") == "chunked"
    assert resolve_impl("auto", jnp.bfloat16, 64, backend="cpu") == "chunked"
    assert resolve_impl("auto", jnp.float32, 64, backend="gpu") == "chunked"
    assert resolve_impl("auto", jnp.bfloat16, 64, backend="gpu") == "cudnn"
    assert resolve_impl("auto", jnp.bfloat16, 64, backend="gpu", segments=True) == "chunked"
    with pytest.raises(ValueError, match="packed layout"):  # never a dense [S, S] mask
        resolve_impl("cudnn", jnp.bfloat16, 64, backend="gpu", segments=True)
    assert resolve_impl("chunked", jnp.float32, 64, backend="cpu") == "chunked"
    q, k, v, _, _ = attention_inputs(4, 1, 12, 4, 2, 8, t=8)
    with pytest.raises(ValueError, match="T == S, got T 8, S 12"):
        chunked_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="query heads 4 not divisible by kv heads 3"):
        chunked_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), causal=False)


def _packed_ids(rng, b, s, docs, pad):
    """Rows of ``docs`` documents with random boundaries, ids 1..docs in order, then ``pad``
    padding positions with id 0 (as the data loader packs them)."""
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s - pad), docs - 1, replace=False))
        ids = np.zeros(s, np.int32)
        ids[:s - pad] = 1 + np.searchsorted(cuts, np.arange(s - pad), side="right")
        rows.append(ids)
    return np.stack(rows)


def _tiles_sharing_a_document(seg, t, bq, bk, causal):
    """Independent count: tiles holding a (query, key) pair of one document (any row)."""
    same = (seg[:, :, None] == seg[:, None, :]).any(0)                    # [T, S]
    if causal:
        same &= np.tril(np.ones((t, t), bool))
    return sum(same[i:i + bq, j:j + bk].any() for i in range(0, t, bq) for j in range(0, t, bk))


def _visits(q, k, v, seg, ct, plan):
    """Tiles the forward and the backward loop compute (padding and delta in their programs)."""
    out, lse, fwd = jax.jit(lambda q, k, v, seg: _forward(*_pad_inputs(q, k, v, seg, seg, plan),
                                                          plan, 1.0))(q, k, v, seg)

    def backward(q, k, v, seg, ct, out, lse):
        d_out = _pad_inputs(ct, k, v, None, None, plan)[0]
        return _backward(*_pad_inputs(q, k, v, seg, seg, plan), lse, _delta(out, d_out), d_out,
                         plan, 1.0)
    *grads, bwd = jax.jit(backward)(q, k, v, seg, ct, out, lse)
    return int(fwd), int(bwd)


@pytest.mark.parametrize("causal,b,s,bq,bk", [(True, 1, 512, 16, 16), (True, 2, 300, 16, 24),
                                              (False, 1, 512, 32, 32)])
def test_packed_rows_skip_tiles_between_documents(causal, b, s, bq, bk):
    """With ids that increase along the row the loops visit exactly the tiles that hold a
    pair of one document: about the sum of the documents' squares, not S²."""
    rng = np.random.default_rng(7)
    seg = _packed_ids(rng, b, s, docs=8, pad=0)
    plan = _Plan(s, s, bq, bk, causal)
    want = _tiles_sharing_a_document(seg, s, bq, bk, causal)
    # 2 query heads per kv head: the backward loops over key blocks outside; 4: over query
    # blocks outside (chunked._backward). Both visit the same tiles.
    for n in (4, 2):
        q, k, v, _, ct = attention_inputs(5, b, s, n, 1, 4)
        assert _visits(q, k, v, jnp.asarray(seg), ct, plan) == (want, want), n
    before = _visits(q, k, v, jnp.asarray(seg), ct, _Plan(s, s, bq, bk, causal,
                                                           skip_segments=False))
    assert before == (_tiles_with_visible_keys(s, s, bq, bk, causal),) * 2
    if b == 1:  # one row of 8 documents: far fewer tiles than the causal skip alone
        assert want < before[0] / 2, (want, before)


@pytest.mark.parametrize("ids", ["packed_with_padding", "recurring", "one_document"])
def test_segment_skipping_is_exact_for_any_ids(ids):
    """Padding (id 0 after the last document), ids that come back later in the row, a row
    that is one document: values and gradients equal the dense reference."""
    rng = np.random.default_rng(11)
    b, s = 2, 120
    if ids == "packed_with_padding":
        seg = _packed_ids(rng, b, s, docs=5, pad=17)
    elif ids == "recurring":
        seg = rng.integers(1, 4, (b, s)).repeat(1, axis=1)
        seg = np.repeat(seg[:, ::10], 10, axis=1)[:, :s]                  # runs of 10, ids recur
    else:
        seg = np.full((b, s), 3)
    seg = jnp.asarray(seg, jnp.int32)
    q, k, v, _, ct = attention_inputs(6, b, s, 4, 2, 8)
    for causal in (True, False):
        fn = lambda q, k, v: chunked_attention(q, k, v, causal=causal, segment_ids=seg,
                                               block_q=16, block_k=12)
        ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg)
        _assert_matches(fn, ref, q, k, v, ct)


def test_key_range_with_no_shared_document_gives_no_output():
    """A ring pair whose query chunk and key chunk share no document: output 0, logsumexp
    -inf, zero gradients (never NaN)."""
    from ulysses_jax.attention.chunked import block_backward, block_forward, block_plan
    q, k, v, _, ct = attention_inputs(8, 1, 40, 4, 2, 8)
    seg_q, seg_k = np.ones((1, 40), np.int32), np.full((1, 40), 2, np.int32)
    plan = block_plan(40, 40, False, 16, 16)
    out, lse = jax.jit(lambda *a: block_forward(*a, plan, 0.3))(q, k, v, seg_q, seg_k)
    out, lse = np.asarray(out), np.asarray(lse)
    assert bool(np.all(out == 0)) and bool(np.all(lse == -np.inf))
    grads = jax.jit(lambda *a: block_backward(*a, plan, 0.3))(q, k, v, seg_q, seg_k, lse,
                                                              np.zeros_like(lse), ct)
    for g in grads:
        assert bool(np.all(np.asarray(g) == 0)), g
