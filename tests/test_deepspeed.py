"""ulysses_attention against DeepSpeed's own DistributedAttention (deepspeed.sequence.layer).

DeepSpeed runs as 4 gloo CPU processes started once for the module (``DeepSpeedWorkers``);
P=2 cases use ranks 0-1 of that world. Each case compares out, dq, dk, dv three ways:
ulysses_jax vs deepspeed, ulysses_jax vs the dense reference, deepspeed vs the reference.
Tolerances (fp32): out max|a - b| <= 1e-5; gradients max|a - b| / max|b| <= 1e-4, with b the
second side named (see ``compare.max_errors``).

Skips only when the workers cannot import torch or deepspeed (requirements-baseline.txt).
"""
import pytest

from ulysses_jax.interop.compare import (TENSORS, Case, DeepSpeedUnavailable, DeepSpeedWorkers,
                                 compare_deepspeed, make_inputs)

OUT_ABS, GRAD_REL = 1e-5, 1e-4
PAIRS = ("ulysses_jax vs deepspeed", "ulysses_jax vs reference", "deepspeed vs reference")


@pytest.fixture(scope="module")
def workers():
    try:
        w = DeepSpeedWorkers(4, timeout=180).__enter__()
    except DeepSpeedUnavailable as e:
        pytest.skip(f"torch/deepspeed not importable ({e}); install requirements-baseline.txt")
    yield w
    w.close()


def _case(**kw):
    base = dict(seq_len=32, head_dim=16, heads=8, batch=1, repeats=1, warmup=0, seed=7)
    return Case(**{**base, **kw})


@pytest.mark.parametrize("p, kv_heads, causal, batch", [
    (2, 2, True, 1),    # GQA, one kv head per rank
    (2, 4, False, 2),   # GQA, two kv heads per rank, batch of two
    (4, 4, True, 1),    # GQA, kv heads == P
    (4, 8, True, 1),    # MHA
    (4, 2, True, 1),    # kv heads < P: replicated (DeepSpeed needs the caller to do it)
])
def test_matches_deepspeed(workers, p, kv_heads, causal, batch):
    case = _case(p=p, kv_heads=kv_heads, causal=causal, batch=batch)
    report = compare_deepspeed(case, workers)
    assert report.cannot_run == []
    checked = 0
    for pair in PAIRS:
        for t in TENSORS:
            abs_err, rel_err = report.errors[(pair, t)]
            if t == "out":
                assert abs_err <= OUT_ABS, (pair, t, abs_err)
            else:
                assert rel_err <= GRAD_REL, (pair, t, rel_err)
            checked += 1
    assert checked == len(PAIRS) * len(TENSORS)
    assert report.failures == []
    assert report.median_s["deepspeed"] > 0 and report.median_s["ulysses_jax"] > 0
    if kv_heads < p:
        assert any("refuses kv_heads=2 < P=4" in n for n in report.notes), report.notes


def test_deepspeed_refuses_fewer_kv_heads_than_ranks(workers):
    """DistributedAttention asserts kv heads >= P; the comparison reports it, not fakes it."""
    case = _case(p=4, kv_heads=2, kv_repeat=False)
    result = workers.run(case, make_inputs(case))
    assert result.results is None
    assert "must be at least the sequence parallel size" in result.unsupported
