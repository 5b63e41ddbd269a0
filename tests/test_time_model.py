"""The step-time model's rules (ulysses_jax/time_model.py) on small HLO programs written
here, priced with rates made up for the test, so that each expected figure is a sum done by
hand: a loop body counted its trip count, an operand only sliced counted by its slice, a
GEMM at the matmul rate, an asynchronous all-to-all hidden by the compute between its start
and its done, a collective across hosts on the network, cuDNN's branch taken over the
chunked fallback, and the target files' rates. The model on programs XLA's GPU compiler
built is checked in test_gpu_compile.py and against the H200's measured steps by
benchmarks/time_model.py (docs/PERF.md)."""
import math

import pytest

from ulysses_jax import gpu_target, time_model

RATES = """
memory_bandwidth: 1000000000000
# time-model matmul_bf16_tflops = 100  test
# time-model matmul_tf32_tflops = 50  test
# time-model hbm_bandwidth_fraction = 0.5  test
# time-model kernel_launch_us = 2  test
# time-model collective_launch_us = 10  test
# time-model nvlink_gbps = 100  test
# time-model network_gbps = 10  test
# time-model collective_bandwidth_fraction = 0.5  test
# time-model gpus_per_host = 8  test
# time-model pcie_gbps = 20  test
# time-model host_compute_gbps = 4  test
# time-model attention_cudnn_d64_s1024_tflops = 10  test
# time-model attention_cudnn_d64_s4096_tflops = 40  test
# time-model attention_chunked_d64_s1024_tflops = 1  test
"""
HBM = 0.5e12      # bytes/s: memory_bandwidth x hbm_bandwidth_fraction
LAUNCH = 2e-6
MB = 256 * 1024 * 4  # an f32[256,1024]

ADD = """
%fused_add (p0: f32[256,1024], p1: f32[256,1024]) -> f32[256,1024] {
  %p0 = f32[256,1024]{1,0} parameter(0)
  %p1 = f32[256,1024]{1,0} parameter(1)
  ROOT %add.1 = f32[256,1024]{1,0} add(%p0, %p1)
}
"""

LOOP = ADD + """
%fused_slice (p0.1: f32[16,256,1024], p1.1: s32[]) -> f32[1,256,1024] {
  %p0.1 = f32[16,256,1024]{2,1,0} parameter(0)
  %p1.1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %ds = f32[1,256,1024]{2,1,0} dynamic-slice(%p0.1, %p1.1, %c0, %c0), dynamic_slice_sizes={1,256,1024}
}

%body (param: (s32[], f32[16,256,1024], f32[256,1024])) -> (s32[], f32[16,256,1024], f32[256,1024]) {
  %param = (s32[], f32[16,256,1024]{2,1,0}, f32[256,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %w = f32[16,256,1024]{2,1,0} get-tuple-element(%param), index=1
  %x = f32[256,1024]{1,0} get-tuple-element(%param), index=2
  %slice_fusion = f32[1,256,1024]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %b = f32[256,1024]{1,0} bitcast(%slice_fusion)
  %add_fusion = f32[256,1024]{1,0} fusion(%x, %b), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f32[16,256,1024]{2,1,0}, f32[256,1024]{1,0}) tuple(%i, %w, %add_fusion)
}

%cond (param.1: (s32[], f32[16,256,1024], f32[256,1024])) -> pred[] {
  %param.1 = (s32[], f32[16,256,1024]{2,1,0}, f32[256,1024]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[16,256,1024], b: f32[256,1024]) -> f32[256,1024] {
  %a = f32[16,256,1024]{2,1,0} parameter(0)
  %b.1 = f32[256,1024]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[16,256,1024]{2,1,0}, f32[256,1024]{1,0}) tuple(%zero, %a, %b.1)
  %loop = (s32[], f32[16,256,1024]{2,1,0}, f32[256,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"16"}}
  ROOT %out = f32[256,1024]{1,0} get-tuple-element(%loop), index=2
}
"""


def _seconds(text, devices=8):
    r = time_model.step_time(text, RATES, devices)
    shown = sum(v for k, v in r["by_kind"].items()
                if k not in ("collectives_hidden", "overlapped"))
    assert shown == pytest.approx(r["seconds"], rel=1e-9), r  # the kinds add up to the step
    return r


def test_a_loop_body_counts_its_trips_and_a_sliced_operand_its_slice():
    r = _seconds(LOOP)
    # per trip: the slice reads 1 MB of the stacked 16 MB and writes 1 MB (its index 4 bytes);
    # the add reads 2 MB and writes 1 MB; each a launch
    per_trip = (2 * MB + 4) / HBM + LAUNCH + 3 * MB / HBM + LAUNCH
    assert r["seconds"] == pytest.approx(16 * per_trip, rel=1e-6)
    assert r["by_kind"]["other_fusions"] == pytest.approx(16 * per_trip, rel=1e-6)
    assert r["loops_without_trip_count"] == 0
    unknown = LOOP.replace(', backend_config={"known_trip_count":{"n":"16"}}', "")
    r = _seconds(unknown)
    assert r["seconds"] == pytest.approx(per_trip, rel=1e-6)
    assert r["loops_without_trip_count"] == 1


VIEWS = """
%fused_update (p0.2: f32[16,256,1024], p1.2: f32[256,1024], p2.2: s32[]) -> f32[16,262144] {
  %p0.2 = f32[16,256,1024]{2,1,0} parameter(0)
  %view = f32[16,262144]{1,0} bitcast(%p0.2)
  %p1.2 = f32[256,1024]{1,0} parameter(1)
  %row = f32[1,262144]{1,0} bitcast(%p1.2)
  %p2.2 = s32[] parameter(2)
  %c1 = s32[] constant(0)
  ROOT %dus = f32[16,262144]{1,0} dynamic-update-slice(%view, %row, %p2.2, %c1)
}

%fused_read (p0.3: f32[16,256,1024], p1.3: s32[]) -> f32[1,262144] {
  %p0.3 = f32[16,256,1024]{2,1,0} parameter(0)
  %view.1 = f32[16,262144]{1,0} bitcast(%p0.3)
  %p1.3 = s32[] parameter(1)
  %c2 = s32[] constant(0)
  ROOT %ds.1 = f32[1,262144]{1,0} dynamic-slice(%view.1, %p1.3, %c2), dynamic_slice_sizes={1,262144}
}

ENTRY %main (a: f32[16,256,1024], b: f32[256,1024], i: s32[]) -> f32[1,262144] {
  %a = f32[16,256,1024]{2,1,0} parameter(0)
  %b = f32[256,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %up = f32[16,262144]{1,0} fusion(%a, %b, %i), kind=kLoop, calls=%fused_update
  %a2 = f32[16,256,1024]{2,1,0} bitcast(%up)
  ROOT %rd = f32[1,262144]{1,0} fusion(%a2, %i), kind=kLoop, calls=%fused_read
}
"""


def test_a_buffer_seen_through_a_bitcast_is_updated_in_place_and_read_by_its_slice():
    """A stacked buffer that a fusion views through a bitcast (the layer loop's per-layer
    checkpoints and gradients): the update writes one row and reads it, the read reads one
    row and writes it; the 16-row buffer itself is never counted whole."""
    r = _seconds(VIEWS)
    assert r["seconds"] == pytest.approx((2 * MB + 4) / HBM + LAUNCH + (2 * MB + 4) / HBM
                                         + LAUNCH, rel=1e-6)


GEMM = """
%fused_dot (p0: bf16[1024,2048], p1: bf16[2048,4096]) -> bf16[1024,4096] {
  %p0 = bf16[1024,2048]{1,0} parameter(0)
  %p1 = bf16[2048,4096]{1,0} parameter(1)
  ROOT %dot = bf16[1024,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[1024,2048], w: bf16[2048,4096]) -> bf16[1024,4096] {
  %x = bf16[1024,2048]{1,0} parameter(0)
  %w = bf16[2048,4096]{1,0} parameter(1)
  ROOT %gemm = bf16[1024,4096]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(f)/dot_general"}
}
"""


def test_a_gemm_runs_at_the_matmul_rate_and_f32_at_tf32():
    flops = 2 * 1024 * 4096 * 2048
    r = _seconds(GEMM)
    assert r["by_kind"]["matmul"] == pytest.approx(flops / 100e12 + LAUNCH, rel=1e-6)
    assert r["by_op"][0]["op_name"] == "jit(f)/dot_general"
    r = _seconds(GEMM.replace("bf16", "f32"))
    assert r["seconds"] == pytest.approx(flops / 50e12 + LAUNCH, rel=1e-6)
    # a GEMM too thin for its bytes is priced by them: [1024, 2048] x [2048, 8]
    thin = GEMM.replace("4096", "8")
    moved = 2 * (1024 * 2048 + 2048 * 8 + 1024 * 8)
    assert _seconds(thin)["seconds"] == pytest.approx(moved / HBM + LAUNCH, rel=1e-6)


def _exchange(groups: str, start_to_done: str) -> str:
    return ADD + f"""
ENTRY %main (x: bf16[8,1024,1024], y: f32[256,1024], z: f32[256,1024]) -> bf16[8,1024,1024] {{
  %x = bf16[8,1024,1024]{{2,1,0}} parameter(0)
  %y = f32[256,1024]{{1,0}} parameter(1)
  %z = f32[256,1024]{{1,0}} parameter(2)
  %a2a-start = ((bf16[8,1024,1024]{{2,1,0}}), bf16[8,1024,1024]{{2,1,0}}) all-to-all-start(%x), channel_id=1, replica_groups={groups}, dimensions={{0}}
  {start_to_done}
  %a2a-done = bf16[8,1024,1024]{{2,1,0}} all-to-all-done(%a2a-start)
  ROOT %t = (bf16[8,1024,1024]{{2,1,0}}) tuple(%a2a-done)
}}
"""


def test_an_all_to_all_is_hidden_by_the_compute_between_its_start_and_done():
    sent = 16 * 2 ** 20 * 3 / 4                        # 16 MiB over 4 devices: 3/4 leave
    a2a = sent / (0.5 * 100e9) + 10e-6
    add = 3 * MB / HBM + LAUNCH
    between = "%f = f32[256,1024]{1,0} fusion(%y, %z), kind=kLoop, calls=%fused_add"
    r = _seconds(_exchange("mesh['data'=2,'seq'=4] {'seq'}", between))
    assert r["seconds"] == pytest.approx(a2a, rel=1e-6)         # the add runs under it
    assert r["by_kind"]["collectives_hidden"] == pytest.approx(add, rel=1e-6)
    assert r["by_kind"]["collectives_exposed"] == pytest.approx(a2a - add, rel=1e-6)
    r = _seconds(_exchange("mesh['data'=2,'seq'=4] {'seq'}", ""))
    assert r["by_kind"]["collectives_exposed"] == pytest.approx(a2a, rel=1e-6)
    # 32 devices, 8 to a host: the group crosses hosts and goes over the network
    r = _seconds(_exchange("mesh['data'=2,'seq'=16] {'data','seq'}", ""), devices=32)
    assert r["seconds"] == pytest.approx(16 * 2 ** 20 * 31 / 32 / (0.5 * 10e9) + 10e-6,
                                         rel=1e-6)
    r = _seconds(_exchange("[4,2]<=[8]", ""))                    # iota groups of 2
    assert r["seconds"] == pytest.approx(16 * 2 ** 20 / 2 / (0.5 * 100e9) + 10e-6, rel=1e-6)


ATTENTION = """
%chunked_body (p: (s32[], bf16[1,4096,8,64])) -> (s32[], bf16[1,4096,8,64]) {
  %p = (s32[], bf16[1,4096,8,64]{3,2,1,0}) parameter(0)
  %big = f32[1,4096,8,64]{3,2,1,0} constant({...})
  ROOT %t = (s32[], bf16[1,4096,8,64]{3,2,1,0}) tuple(%p)
}

%chunked_cond (p.1: (s32[], bf16[1,4096,8,64])) -> pred[] {
  %p.1 = (s32[], bf16[1,4096,8,64]{3,2,1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%branch_chunked (q: bf16[1,4096,8,64]) -> bf16[1,4096,8,64] {
  %q = bf16[1,4096,8,64]{3,2,1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], bf16[1,4096,8,64]{3,2,1,0}) tuple(%z, %q)
  %w = (s32[], bf16[1,4096,8,64]{3,2,1,0}) while(%init), condition=%chunked_cond, body=%chunked_body, metadata={op_name="jit(step)/attention/cond/branch_0_fun/chunked_attention/while"}
  ROOT %o = bf16[1,4096,8,64]{3,2,1,0} get-tuple-element(%w), index=1
}

%branch_cudnn (q.1: bf16[1,4096,8,64]) -> bf16[1,4096,8,64] {
  %q.1 = bf16[1,4096,8,64]{3,2,1,0} parameter(0)
  %fa = (bf16[1,8,4096,64]{3,1,2,0}, u8[0]{0}) custom-call(%q.1, %q.1, %q.1), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[1,4096,8,64]{3,2,1,0}, bf16[1,4096,8,64]{3,2,1,0}, bf16[1,4096,8,64]{3,2,1,0}}, backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["1", "8", "4096", "4096"]}, "mask_type": "CAUSAL"}}
  ROOT %o.1 = bf16[1,4096,8,64]{3,2,1,0} bitcast(%fa)
}

ENTRY %main (pred: pred[], q.2: bf16[1,4096,8,64]) -> bf16[1,4096,8,64] {
  %pred = pred[] parameter(0)
  %q.2 = bf16[1,4096,8,64]{3,2,1,0} parameter(1)
  ROOT %c.1 = bf16[1,4096,8,64]{3,2,1,0} conditional(%pred, %q.2, %q.2), true_computation=%branch_chunked, false_computation=%branch_cudnn
}
"""


def test_cudnn_is_taken_over_its_chunked_fallback_and_each_kernel_at_its_rate():
    fwd = 4 * 1 * 8 * 64 * 4096 * 4096 / 2             # causal: half the pairs
    r = _seconds(ATTENTION)
    assert r["by_kind"]["attention_chunked"] == 0
    assert r["seconds"] == pytest.approx(fwd / 40e12 + LAUNCH, rel=1e-6)
    backward = ATTENTION.replace('"__cudnn$fmhaSoftmax"', '"__cudnn$fmhaSoftmaxBackward"')
    assert _seconds(backward)["seconds"] == pytest.approx(2.5 * fwd / 40e12 + LAUNCH, rel=1e-6)
    # without cuDNN in the program the chunked call runs, priced per call at its rate (its
    # loop body, a stand-in here, is not walked); 4096 is past its one measured length
    only_chunked = ATTENTION.replace("false_computation=%branch_cudnn",
                                     "false_computation=%branch_chunked")
    only_chunked = only_chunked.replace('custom_call_target="__cudnn$fmhaSoftmax"',
                                        'custom_call_target="other"')
    r = _seconds(only_chunked)
    assert r["by_kind"]["attention_chunked"] == pytest.approx(fwd / 1e12, rel=1e-6)


def test_rates_interpolate_between_measured_lengths_and_every_target_names_its_sources():
    r = time_model.rates(RATES)
    assert r["hbm_gbps"] == 1000
    assert r.attention_tflops("cudnn", 64, 2048) == pytest.approx(25)   # log-linear, halfway
    assert r.attention_tflops("cudnn", 64, 512) == 10 and r.attention_tflops("cudnn", 64, 1 << 20) == 40
    assert r.attention_tflops("cudnn", 128, 4096) == 40                 # the nearest head dim
    needed = {"matmul_bf16_tflops", "matmul_tf32_tflops", "hbm_bandwidth_fraction",
              "kernel_launch_us", "collective_launch_us", "nvlink_gbps", "network_gbps",
              "collective_bandwidth_fraction", "gpus_per_host", "pcie_gbps",
              "host_compute_gbps", "hbm_gbps"}
    for name in gpu_target.names():
        rates = time_model.rates(gpu_target.load(name).config_text)
        assert needed <= set(rates.values), (name, needed - set(rates.values))
        assert all(rates.sources[k] for k in rates.values), name
        for kernel in ("cudnn", "chunked"):
            assert math.isfinite(rates.attention_tflops(kernel, 128, 8192))


def test_a_permute_goes_over_the_network_only_where_a_pair_crosses_hosts():
    def program(pairs):
        return f"""
ENTRY %main (x: bf16[8,1024,1024]) -> bf16[8,1024,1024] {{
  %x = bf16[8,1024,1024]{{2,1,0}} parameter(0)
  ROOT %cp = bf16[8,1024,1024]{{2,1,0}} collective-permute(%x), channel_id=1, source_target_pairs={pairs}
}}
"""
    size = 16 * 2 ** 20
    assert _seconds(program("{{0,1},{1,0}}"), devices=16)["seconds"] == pytest.approx(
        size / (0.5 * 100e9) + 10e-6, rel=1e-6)
    assert _seconds(program("{{7,8},{8,7}}"), devices=16)["seconds"] == pytest.approx(
        size / (0.5 * 10e9) + 10e-6, rel=1e-6)
