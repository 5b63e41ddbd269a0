"""The programs a GPU runs, compiled by XLA's GPU compiler for 8 H100s (and A100s) with no GPU
here (ulysses_jax/gpu_target.py): the tiny preset's train step, its DPO and GRPO presets' train
steps, and a prefill and decode step. What the compiled GPU program must hold: the Ulysses
exchange (two all-to-alls forward and two backward per attention layer body), no all-gather
of activations except the vocabulary-parallel loss and embedding's own (they gather a chunk
of hidden states at a time, by design), cuDNN's fused attention wherever ``attn_impl=auto``
must pick it (bf16 packed rows on Hopper) and none on an A100, and the peak bytes per device
within 10% of the figure stated here (XLA:GPU's memory analysis with this suite's settings,
jax 0.12.0.1); the step-time model (ulysses_jax/time_model.py) reads each of these programs
whole. Skips, saying why, only where jax's CUDA plugin is not installed."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.utils.configs import ROOT, tiny_config
from tests.utils.devices import cli_env
from ulysses_jax import gpu_target, hlo, make_mesh, time_model
from ulysses_jax.hlo import attention_kernels, collective_counts

pytestmark = pytest.mark.skipif(
    not gpu_target.cuda_plugin_installed(),
    reason="jax's CUDA plugin is not installed (README's test command installs it: "
           "pip install \"jax[cuda13]==<jax's version>\")")

# (device bytes per device, XLA:GPU's memory analysis) measured with these settings.
PEAKS = {("tiny", "h100"): 27_560_124, ("tiny", "a100"): 25_108_884,
         ("tiny-dpo", "h100"): 18_065_732, ("tiny-grpo", "h100"): 42_854_368,
         ("decode", "h100"): 2_305_284}
_GATHER = re.compile(r"=\s*(.*?)\sall-gather(?:-start)?\(.*?op_name=\"([^\"]*)\"")
_ARRAY = re.compile(r"[a-z0-9]+\[([\d,]*)\]")
_VOCAB_SCOPE = re.compile(r"(^|[/(])(loss|embed)([)/]|$)")


def _cfg(preset, *over):
    return tiny_config("model.dtype=bfloat16", *over, preset=preset)


def _compiled_step(preset, target, *over):
    from ulysses_jax.training.dry_run import compile_step, device_and_host_bytes, target_mesh
    cfg = _cfg(preset, *over)
    t = gpu_target.load(target)
    compiled, _ = compile_step(cfg, target_mesh(cfg, t), t)
    return cfg, compiled.as_text(), device_and_host_bytes(compiled)


def _activation_gathers(text, rows, seq_len):
    """All-gathers outside the vocabulary-parallel loss and embedding that assemble a whole
    sequence of activations (a gathered array of shape [rows, seq_len, ...] or
    [rows * seq_len, ...]), as (result shape, op_name). Parameters a ZeRO-1 update gathers
    back after its sharded step are not activations and are not counted."""
    out, by_design = [], 0
    for line in text.splitlines():
        m = _GATHER.search(line)
        if not m:
            continue
        shape_text, op_name = m.groups()
        for dims in _ARRAY.findall(shape_text):
            d = [int(x) for x in filter(None, dims.split(","))]
            if d[:2] == [rows, seq_len] or (d and d[0] == rows * seq_len):
                if _VOCAB_SCOPE.search(op_name):
                    by_design += 1
                else:
                    out.append((dims, op_name))
    # the loss's own chunk gathers are the same kind: seeing them shows the rule still reads
    # XLA's HLO text
    assert by_design, "the vocabulary-parallel loss's gathers not found in the HLO text"
    return out


def _assert_ulysses_program(cfg, text):
    from ulysses_jax.training.trainer import rows_per_batch
    # every layer of the tiny presets is one scan body: 2 exchanges forward, 2 backward
    assert collective_counts(text)["all-to-all"] == 4, collective_counts(text)
    assert _activation_gathers(text, rows_per_batch(cfg) // cfg.mesh.data, cfg.seq_len) == []


@pytest.mark.parametrize("preset", ["tiny", "tiny-dpo", "tiny-grpo"])
def test_train_steps_for_h100s_exchange_by_all_to_all_and_run_cudnn(preset):
    cfg, text, (device, host) = _compiled_step(preset, "h100")
    _assert_ulysses_program(cfg, text)
    kernels = attention_kernels(text)
    assert kernels["cudnn"] >= 1 and kernels["cudnn_backward"] >= 1, kernels
    assert host == 0
    assert device == pytest.approx(PEAKS[preset, "h100"], rel=0.1)
    # the time model reads the whole program: its parts add up to the step, the fused
    # attention and the exchange are priced, every loop's trips are known
    modeled = time_model.step_time(text, gpu_target.load("h100").config_text, 8)
    kinds = modeled["by_kind"]
    assert sum(v for k, v in kinds.items() if k not in ("collectives_hidden", "overlapped")) \
        == pytest.approx(modeled["seconds"], rel=1e-9)
    assert kinds["attention_cudnn"] > 0 and kinds["matmul"] > 0, kinds
    assert kinds["collectives_exposed"] + kinds["collectives_hidden"] > 0, kinds
    assert modeled["loops_without_trip_count"] == 0


def test_save_attention_runs_cudnns_forward_once():
    """``model.remat=save_attention`` recomputes the layer as ``full`` does but keeps the
    fused attention's forward outputs: one forward call where ``full`` makes two, more
    bytes, less modeled time."""
    runs = {}
    for remat in ("full", "save_attention"):
        _, text, (device, _) = _compiled_step("tiny", "h100", f"model.remat={remat}")
        runs[remat] = (attention_kernels(text), device, time_model.step_time(
            text, gpu_target.load("h100").config_text, 8)["by_kind"]["attention_cudnn"])
    (full_k, full_bytes, full_s), (saved_k, saved_bytes, saved_s) = runs.values()
    assert (full_k["cudnn"], saved_k["cudnn"]) == (2, 1), runs
    assert full_k["cudnn_backward"] == saved_k["cudnn_backward"] == 1
    assert saved_bytes > full_bytes and saved_s < full_s, runs


@pytest.mark.parametrize("preset", ["llama3-8b-4m", "llama3-8b-1gpu"])
def test_offload_presets_compile_for_h100s_as_a_run_compiles_them(preset):
    """The two optimizer-offload presets compile with XLA's stock pipeline and the options a
    GPU run compiles the step with (the jitted step's own: the latency-hiding scheduler on,
    no pass turned off), fit an H100, keep their state in host memory, update it there and
    hold no collective in host code."""
    from ulysses_jax.training import fit
    from ulysses_jax.training.dry_run import compile_step, device_and_host_bytes, target_mesh
    from ulysses_jax.training.train_step import abstract_batch, make_train_step, state_layout
    cfg = tiny_config(preset=preset)
    t = gpu_target.load("h100")
    mesh = target_mesh(cfg, t)
    graphdef, abstract, shardings, tx = state_layout(cfg, mesh)
    run_step = make_train_step(cfg, mesh, graphdef, tx, shardings)
    run_options = dict(run_step.trace(abstract, abstract_batch(cfg, mesh))
                       .lower(lowering_platforms=("cuda",))._lowering._compiler_options_kvs)
    compiled, _ = compile_step(cfg, mesh, t)
    assert compiled.options == run_options == {gpu_target.OVERLAP_OPTION: True}
    device, host = device_and_host_bytes(compiled)
    assert device <= t.memory_bytes * fit.HEADROOM, (device, t.memory_bytes)
    assert host > device
    text = compiled.as_text()
    assert hlo.host_computations(text), "no host computation: the update is not on the host"
    assert sum(hlo.host_collectives(text).values()) == 0, hlo.host_collectives(text)


def test_host_collectives_are_seen():
    """The check above reads XLA's HLO: a host computation that reduces over a split axis
    holds an all-reduce there (compiled without the scheduler, which crashes on it:
    benchmarks/host_compute_repro.py)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compute_on import compute_on
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = make_mesh(seq=2, data=1, devices=jax.devices("cpu")[:2])
    host = NamedSharding(mesh, P("seq"), memory_kind="pinned_host")
    f = compute_on(lambda x: x / jnp.sqrt(jnp.sum(x * x)), compute_type="device_host",
                   out_memory_spaces=jax.memory.Space.Host)
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=host)
    text = gpu_target.compile(jax.jit(f, out_shardings=host), (x,),
                              gpu_target.load("h100")).as_text()
    assert hlo.host_collectives(text)["all-reduce"] == 1


def test_generation_for_h100s_moves_no_cache():
    """The prefill attends with cuDNN over the sequence split; the decode step reads each
    device's block of the head-split cache and moves no K or V (no all-to-all)."""
    from ulysses_jax.generation.abstract import compiled_programs
    t = gpu_target.load("h100")
    mesh = make_mesh(seq=8, data=1, devices=gpu_target.devices(t, 8))
    with gpu_target.compiling_for(t):
        progs = compiled_programs(_cfg("tiny").model, mesh, batch=4, prompt_len=256,
                                  new_tokens=64)
    prefill, decode = progs["prefill"].as_text(), progs["decode"].as_text()
    assert attention_kernels(prefill)["cudnn"] >= 1
    assert collective_counts(prefill)["all-to-all"] >= 2
    assert collective_counts(decode)["all-to-all"] == 0
    m = progs["decode"].memory_analysis()
    device = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes \
        - m.alias_size_in_bytes
    assert device == pytest.approx(PEAKS["decode", "h100"], rel=0.1)


def test_train_py_dry_run_for_a_target():
    """``train.py --dry-run --target a100`` prints XLA:GPU's figures as JSON. cuDNN's packed
    layout needs Hopper: on an A100 ``auto`` falls back to the chunked kernel, and the
    program holds no fused attention call."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                          os.path.join(ROOT, "configs", "tiny.yaml"), "--dry-run", "--target",
                          "a100", "--devices", "8", "model.dtype=bfloat16", "model.n_layers=1",
                          "seq_len=2048"],  # (past one tile: the chunked kernel's loops)
                         capture_output=True, text=True, env=cli_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    assert plan["compiler"] == "NVIDIA A100-SXM4-80GB"
    assert plan["device_memory_bytes"] == 85_100_068_864
    assert plan["collectives"]["all-to-all"] == 4
    assert plan["attention_kernels"]["cudnn"] == plan["attention_kernels"]["cudnn_backward"] == 0
    assert plan["attention_kernels"]["chunked"] > 0
    assert plan["peak_bytes_per_device"] == pytest.approx(PEAKS["tiny", "a100"], rel=0.1)
    # the step's modeled time, labelled so; the A100 attends with the chunked kernel
    assert plan["time_model"].startswith("modeled, not measured")
    assert plan["step_seconds_model"] > 0 and 0 < plan["mfu_model"] < 1
    assert plan["time_by_kind"]["attention_chunked"] > 0
    assert plan["tokens_per_second_model"] == pytest.approx(
        plan["batch_size"] * plan["seq_len"] / plan["step_seconds_model"], rel=1e-3)


def test_a_target_without_the_plugin_says_what_to_install(monkeypatch, capsys):
    import train
    from ulysses_jax.training import dry_run
    monkeypatch.setattr(gpu_target, "cuda_plugin_installed", lambda: False)
    assert dry_run.gpu_target is gpu_target
    code = train.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--dry-run",
                       "--target", "h100"])
    err = capsys.readouterr().err
    assert code == 2
    assert "needs jax's CUDA plugin, which is not installed: pip install \"jax[cuda13]==" in err
