"""cuDNN's packed layout for packed documents: everything around the cuDNN call.

jax's cuDNN call checks the GPU while tracing, so here (no GPU) it is replaced by an
independent dense implementation that reads ONLY the offsets and lengths; a wrong conversion
or plumbing then shows as a mismatch against ``reference_attention`` with segment ids.
benchmarks/gpu_check.py runs the real call on a GPU.
"""
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.utils.devices import need_devices
from tests.utils.numerics import assert_rel_close, tolerance
from ulysses_jax import make_mesh, reference_attention, ulysses_attention
from ulysses_jax.attention import cudnn, ulysses
from ulysses_jax.attention.kernels import resolve_impl


_layout = jax.jit(cudnn.packed_layout, static_argnums=1)
_reference = jax.jit(reference_attention, static_argnames="causal")


def _brute_force_layout(seg, m):
    """Runs of equal adjacent ids, by a Python loop: (offsets [M+1], lengths [M], ok)."""
    runs = []
    for pos, x in enumerate(seg):
        if pos == 0 or x != seg[pos - 1]:
            runs.append([pos, 0])
        runs[-1][1] += 1
    ids = [seg[start] for start, _ in runs]
    ok = len(runs) <= m and len(set(ids)) == len(ids)
    offsets = [r[0] for r in runs][:m] + [-1] * (m + 1 - min(len(runs), m))
    lengths = [r[1] for r in runs][:m] + [-1] * (m - min(len(runs), m))
    return offsets, lengths, ok


def _random_row(rng, s, kind):
    if kind == "packed":  # ids 1..n in order, padding 0 at the tail sometimes
        n = int(rng.integers(1, 9))
        cuts = np.sort(rng.choice(np.arange(1, s), min(n - 1, s - 1), replace=False))
        row = 1 + np.searchsorted(cuts, np.arange(s), side="right")
        pad = int(rng.integers(0, s // 3)) if rng.random() < 0.5 else 0
        row[s - pad:] = 0
        return row
    if kind == "singletons":  # many one-token documents
        return np.arange(s) % 50 + 1
    return rng.integers(0, 4, s)  # random ids: runs recur


def test_layout_matches_brute_force_on_random_packings():
    rng = np.random.default_rng(0)
    checked = 0
    for trial in range(60):
        s, m = int(rng.integers(1, 40)), int(rng.integers(1, 10))
        kind = ["packed", "singletons", "random"][trial % 3]
        seg = np.stack([_random_row(rng, s, kind) for _ in range(3)]).astype(np.int32)
        offsets, lengths, ok = _layout(seg, m)
        offsets, lengths = np.asarray(offsets), np.asarray(lengths)
        want = [_brute_force_layout(list(row), m) for row in seg]
        assert bool(ok) == all(w[2] for w in want), (seg, m)
        for b, (w_off, w_len, w_ok) in enumerate(want):
            if w_ok:  # offsets and lengths are only used when every row fits
                assert offsets[b].tolist() == w_off, (seg[b], m, offsets[b])
                assert lengths[b].tolist() == w_len, (seg[b], m, lengths[b])
                assert sum(x for x in w_len if x > 0) == s
        checked += 1
    assert checked == 60


@pytest.mark.parametrize("row,m,ok", [
    ([5] * 8, 1, True),                       # one document
    ([1, 1, 2, 2, 3, 3, 0, 0], 4, True),      # the maximum number of runs, padding included
    ([1, 1, 2, 2, 3, 3, 0, 0], 3, False),     # one run more than the bound
    ([1, 1, 2, 2, 1, 1, 3, 3], 8, False),     # id 1 comes back later
    ([1, 2, 3, 4, 5, 6, 7, 8], 8, True),      # one-token documents
])
def test_layout_edge_cases(row, m, ok):
    seg = np.asarray([row], np.int32)
    offsets, lengths, got_ok = _layout(seg, m)
    offsets, lengths = np.asarray(offsets), np.asarray(lengths)
    w_off, w_len, w_ok = _brute_force_layout(row, m)
    assert bool(got_ok) == w_ok == ok
    if ok:
        assert offsets[0].tolist() == w_off and lengths[0].tolist() == w_len


def _dense_from_offsets(q, k, v, offsets, lengths, *, causal, scale):
    """Stand-in for cuDNN: attention within [offset, offset + length) runs, nothing else."""
    s = q.shape[1]
    pos = jnp.arange(s)
    inside = ((pos[None, None, :] >= offsets[:, :-1, None]) &
              (pos[None, None, :] < (offsets[:, :-1] + lengths)[:, :, None]) &
              (lengths[:, :, None] > 0))                                  # [B, M, S]
    doc = jnp.argmax(inside, axis=1) + jnp.where(inside.any(1), 0, -(10 ** 6))  # [B, S]
    allowed = doc[:, :, None] == doc[:, None, :]
    if causal:
        allowed &= pos[:, None] >= pos[None, :]
    kh = k.shape[2]
    g = q.shape[2] // kh
    qg = q.astype(jnp.float32).reshape(*q.shape[:2], kh, g, q.shape[3])
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale
    logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
    out = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(logits, -1), v.astype(jnp.float32))
    return out.reshape(q.shape).astype(q.dtype)


def _zeros(q, k, v, offsets, lengths, *, causal, scale):
    return jnp.zeros_like(q)


@pytest.fixture
def packed_on_cpu(monkeypatch):
    """Routes 'auto' to the packed kernel (as on a Hopper GPU) with ``fake`` as the call."""
    def use(fake):
        monkeypatch.setattr(cudnn, "_cudnn_packed_call", fake)
        monkeypatch.setattr(ulysses, "mesh_kernel", lambda *a, **kw: "cudnn_packed")
    return use


def _grads(fn, q, k, v, ct):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * ct), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@partial(jax.jit, static_argnums=0)
def _reference_grads(causal, q, k, v, seg, ct):
    """_grads of reference_attention with segment ids as an argument (one compile per causal)."""
    def loss(q, k, v):
        out = reference_attention(q, k, v, causal=causal, segment_ids=seg)
        return jnp.sum(out * ct), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def _packed_inputs(seed, s, docs, n=8, kh=2, h=16, pad=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (2, s, n, h))
    k = jax.random.normal(ks[1], (2, s, kh, h))
    v = jax.random.normal(ks[2], (2, s, kh, h))
    ct = jax.random.normal(ks[3], q.shape)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(2):  # boundaries anywhere: documents cross the P shard boundaries
        cuts = np.sort(rng.choice(np.arange(1, s - pad), docs - 1, replace=False))
        row = 1 + np.searchsorted(cuts, np.arange(s), side="right")
        row[s - pad:] = 0
        rows.append(row)
    return q, k, v, jnp.asarray(np.stack(rows), jnp.int32), ct


@pytest.mark.parametrize("p,causal,pad", [(1, True, 0), (2, True, 5), (4, True, 0),
                                          (4, False, 3)])
def test_ulysses_with_packed_kernel_matches_reference(packed_on_cpu, p, causal, pad):
    """The exchange gathers each row's ids; the offsets built from them, run by an attention
    that sees nothing but offsets and lengths, equal the dense reference with segment ids."""
    packed_on_cpu(_dense_from_offsets)
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    q, k, v, seg, ct = _packed_inputs(p, 64, docs=6, pad=pad)
    fn = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=seg,
                                           max_segments=8)
    out, grads = _grads(fn, q, k, v, ct)
    out_ref, grads_ref = _reference_grads(causal, q, k, v, seg, ct)
    tol = tolerance(jnp.float32)
    chex.assert_trees_all_close(out, out_ref, atol=tol, rtol=tol)
    for name, g, gr in zip("qkv", grads, grads_ref):
        chex.assert_trees_all_close(g, gr, atol=tol, rtol=tol, custom_message=f"d{name}")


@pytest.mark.parametrize("docs,bound,takes_fast_path", [(6, 8, True), (6, 6, True),
                                                        (6, 5, False)])
def test_rows_over_the_bound_run_the_exact_fallback(packed_on_cpu, docs, bound,
                                                    takes_fast_path):
    """A stand-in that returns zeros shows which branch ran: within the bound the packed
    call's output is the result; past it the chunked kernel's, equal to the reference."""
    packed_on_cpu(_zeros)
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    q, k, v, seg, _ = _packed_inputs(9, 64, docs=docs)
    out = jax.jit(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, segment_ids=seg,
                                                    max_segments=bound))(q, k, v)
    if takes_fast_path:
        assert bool(jnp.all(out == 0))
    else:
        tol = tolerance(jnp.float32)
        chex.assert_trees_all_close(out, _reference(q, k, v, segment_ids=seg),
                                    atol=tol, rtol=tol)


def test_recurring_ids_run_the_exact_fallback(packed_on_cpu):
    packed_on_cpu(_zeros)
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    q, k, v, _, _ = _packed_inputs(10, 64, docs=2)
    seg = jnp.asarray(np.repeat([[1, 2, 1, 3]], 16, axis=1).repeat(2, 0), jnp.int32)
    out = jax.jit(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, segment_ids=seg,
                                                    max_segments=8))(q, k, v)
    tol = tolerance(jnp.float32)
    chex.assert_trees_all_close(out, _reference(q, k, v, segment_ids=seg),
                                atol=tol, rtol=tol)


H100, A100 = (9, 0), (8, 0)


@pytest.mark.parametrize("impl,dtype,backend,cap,segments,heads,want", [
    ("auto", jnp.bfloat16, "gpu", H100, False, (8, 2), "cudnn"),
    ("auto", jnp.bfloat16, "gpu", H100, True, (8, 2), "cudnn_packed"),
    ("auto", jnp.float16, "gpu", H100, True, (8, 8), "cudnn_packed"),
    ("auto", jnp.bfloat16, "gpu", A100, True, (8, 2), "chunked"),     # packed needs Hopper
    ("auto", jnp.bfloat16, "gpu", A100, False, (8, 2), "cudnn"),
    ("auto", jnp.float32, "gpu", H100, True, (8, 2), "chunked"),      # cuDNN: bf16/fp16 only
    ("auto", jnp.bfloat16, "cpu", None, True, (8, 2), "chunked"),
    ("auto", jnp.bfloat16, "cpu", None, False, (8, 2), "chunked"),
    ("cudnn", jnp.bfloat16, "gpu", H100, True, (8, 2), "cudnn_packed"),
    ("chunked", jnp.bfloat16, "gpu", H100, True, (8, 2), "chunked"),
    ("xla", jnp.float32, "cpu", None, True, (8, 2), "xla"),
])
def test_kernel_choice(impl, dtype, backend, cap, segments, heads, want, monkeypatch):
    monkeypatch.setattr(cudnn, "_jax_version", lambda: (0, 11))
    assert resolve_impl(impl, dtype, 64, backend=backend, segments=segments, capability=cap,
                        heads=heads) == want


def test_kernel_choice_head_dims_and_refusals(monkeypatch):
    monkeypatch.setattr(cudnn, "_jax_version", lambda: (0, 11))
    kw = dict(backend="gpu", segments=True, heads=(8, 2))
    assert resolve_impl("auto", jnp.bfloat16, 256, capability=H100, **kw) == "cudnn_packed"
    assert resolve_impl("auto", jnp.bfloat16, 256, capability=A100,
                        backend="gpu") == "chunked"                       # > 128 before Hopper
    assert resolve_impl("auto", jnp.bfloat16, 60, capability=H100, **kw) == "chunked"
    with pytest.raises(ValueError, match="Hopper .* compute capability 8.0"):
        resolve_impl("cudnn", jnp.bfloat16, 64, capability=A100, **kw)
    with pytest.raises(ValueError, match="needs a GPU backend"):
        resolve_impl("cudnn", jnp.bfloat16, 64, backend="cpu")
    # jax 0.10 scales kv offsets by the query heads: wrong for GQA, fine for MHA.
    monkeypatch.setattr(cudnn, "_jax_version", lambda: (0, 10))
    assert resolve_impl("auto", jnp.bfloat16, 64, capability=H100, **kw) == "chunked"
    assert resolve_impl("auto", jnp.bfloat16, 64, capability=H100, backend="gpu",
                        segments=True, heads=(8, 8)) == "cudnn_packed"
    with pytest.raises(ValueError, match="jax 0.10 .* GQA"):
        resolve_impl("cudnn", jnp.bfloat16, 64, capability=H100, **kw)


def test_mesh_of_cpu_devices_never_gets_cudnn():
    """The kernel follows the mesh's devices, not JAX's default backend (on a GPU host the
    test meshes are CPU devices)."""
    mesh = make_mesh(seq=2, data=1, devices=jax.devices("cpu")[:2])
    q = jnp.zeros((1, 8, 4, 64), jnp.bfloat16)
    assert ulysses.mesh_kernel("auto", q, mesh, True, (2, 1)) == "chunked"
    assert ulysses.mesh_kernel("auto", q, mesh, False, (2, 1)) == "chunked"
    with pytest.raises(ValueError, match="needs a GPU backend, but the backend is 'cpu'"):
        ulysses.mesh_kernel("cudnn", q, mesh, False, (2, 1))


@pytest.mark.parametrize("remat", ["none", "save_dots"])
def test_model_train_step_through_packed_kernel(packed_on_cpu, remat):
    """The packed kernel (its lax.cond included) inside the model's layer scan, under remat
    and grad: loss and gradients equal the model on the chunked kernel."""
    from tests.test_model import _batch, _loss_and_grads, _setup
    batch = _batch(21)
    over = {"model.remat": remat, "model.max_segments": 4}
    _, mesh, g, s, _, _ = _setup(2, 1, **over)
    l0, g0 = _loss_and_grads(g, s, batch, mesh)
    traced = []
    packed_on_cpu(lambda *a, **kw: traced.append(1) or _dense_from_offsets(*a, **kw))
    l1, g1 = _loss_and_grads(g, s, batch, mesh)
    assert traced  # the packed call is in the program
    assert_rel_close(l1, l0, 1e-5)
    assert_rel_close(g1, g0, 1e-5)
