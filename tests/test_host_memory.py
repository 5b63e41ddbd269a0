"""The host-memory check (training/host_memory.py): its estimate against a count of the
model's own parameters, the refusal's numbers, where available memory is read from, and the
trainer and train.py refusing before anything is allocated."""
import dataclasses
import math
import os
import sys

import jax
import pytest
from flax import nnx

from tests.utils.configs import ROOT, SMALL, TINY
from tests.utils.data import small_corpus
from tests.utils.devices import DEVICES, need_devices
from ulysses_jax.config import ConfigError, load_config
from ulysses_jax.mesh import make_mesh
from ulysses_jax.training import host_memory
from ulysses_jax.training.train_step import build_model

sys.path.insert(0, ROOT)
import train as cli  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="the check is for CPU devices")

GiB = 2**30
# ~8M parameters: GiB-sized on 8 replicated devices, estimated but never allocated here.
MID = ["model.d_model=512", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=2",
       "model.head_dim=64", "model.ffn_dim=2048", "seq_len=256", "batch_size=2"]


def _mesh(n):
    return make_mesh(seq=n, data=1, devices=need_devices(n))


def _shapes(cfg, mesh):
    """The parameters' shapes, from the model itself (nnx.eval_shape: nothing allocated)."""
    state = nnx.state(nnx.eval_shape(lambda: build_model(cfg, mesh)), nnx.Param)
    return [x.shape for x in jax.tree.leaves(state)]


def _paths(cfg, mesh):
    """The parameters' paths, in ``_shapes``' order."""
    state = nnx.state(nnx.eval_shape(lambda: build_model(cfg, mesh)), nnx.Param)
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]


@pytest.mark.parametrize("mode", ["replicated", "zero3"])
def test_estimate_counts_one_copy_per_device_or_one_in_all(mode):
    """4 bytes a parameter: on each of the 4 devices when replicated, once in all with zero3
    (every tiny-preset array has an axis 4 divides); AdamW's two moments twice that plus the
    step counters; float32 gradients as the parameters; a checkpoint save one copy of
    parameters and moments; activations the layer inputs."""
    n = 4
    cfg = load_config(TINY, [f"mesh.seq={n}", f"param_sharding={mode}", "checkpoint_every=10"])
    mesh = _mesh(n)
    shapes = _shapes(cfg, mesh)
    count = sum(math.prod(s) for s in shapes)
    assert count > 100_000 and all(any(d % n == 0 for d in s) for s in shapes), shapes
    copies = n if mode == "replicated" else 1
    est = host_memory.estimate(cfg, mesh)
    train = est.phases["training"]
    assert est.params == count and est.devices == n
    assert train["parameters"] == 4 * count * copies
    assert train["gradients"] == 4 * count * copies
    counters = train["optimizer state"] - 8 * count * copies  # AdamW's and the schedule's
    assert 0 < counters <= 4 * 4 * n, counters  # a few int32 scalars on every device
    assert train["checkpoint save"] == 12 * count + counters // n
    m = cfg.model
    assert train["activations"] == m.n_layers * cfg.batch_size * cfg.seq_len * m.d_model * 4
    assert "init_from copy" not in est.phases["start-up"]
    start = host_memory.estimate(cfg, mesh, reads_init_from=True).phases["start-up"]
    assert start["init_from copy"] == 4 * count * copies
    assert start["init_from tensor"] == 4 * max(math.prod(s) for s in shapes)


def test_estimate_follows_the_memory_settings():
    """bf16 moments halve the optimizer state; an accumulator adds a gradient's bytes; a run
    without checkpoints before its last step holds no save copy while it trains."""
    mesh = _mesh(4)
    base = load_config(TINY, ["mesh.seq=4"])
    est = host_memory.estimate(base, mesh).phases["training"]
    bf16 = host_memory.estimate(load_config(TINY, ["mesh.seq=4",
                                                   "optimizer.moment_dtype=bfloat16"]),
                                mesh).phases["training"]
    assert abs(bf16["optimizer state"] - est["optimizer state"] / 2) <= 64
    accum = host_memory.estimate(load_config(TINY, ["mesh.seq=4", "grad_accum_steps=2"]),
                                 mesh).phases["training"]
    assert accum["gradient accumulator"] == est["gradients"]
    assert accum["activations"] == est["activations"] // 2  # a micro-batch at a time
    # LoRA: gradients (and moments) for the adapters only, the frozen base in bf16.
    lo = load_config(TINY, ["mesh.seq=4", "model.lora.rank=4", "model.lora.base_dtype=bfloat16"])
    lora_est = host_memory.estimate(lo, mesh).phases["training"]
    shapes = _shapes(lo, mesh)
    adapters = sum(math.prod(s) for s, k in zip(shapes, _paths(lo, mesh)) if "lora_" in k)
    assert 0 < adapters and lora_est["gradients"] == 4 * adapters * 4  # replicated on 4
    assert lora_est["parameters"] < est["parameters"]
    final_only = host_memory.estimate(load_config(TINY, ["mesh.seq=4", "checkpoint_every=0"]),
                                      mesh)
    assert "checkpoint save" not in final_only.phases["training"]
    assert final_only.phases["final save"]["checkpoint save"] == est["checkpoint save"]


def test_refusal_names_the_numbers_and_what_helps():
    mesh = _mesh(8)
    cfg = load_config(TINY, ["mesh.seq=8", *MID])
    phase, need = host_memory.estimate(cfg, mesh).peak
    assert phase == "training" and need > GiB
    assert host_memory.check(cfg, mesh, available=(need, "test")) is not None  # just fits
    with pytest.raises(ConfigError) as e:
        host_memory.check(cfg, mesh, available=(need - 1, "the test's number"))
    msg = str(e.value)
    zero3 = host_memory.estimate(dataclasses.replace(cfg, param_sharding="zero3"), mesh).peak[1]
    params = host_memory.estimate(cfg, mesh).params
    for part in (f"at least {need / GiB:.1f} GiB", f"{(need - 1) / GiB:.1f} GiB is available "
                 f"(the test's number)", "on its 8 CPU devices", f"{params / 1e6:,.1f}M parameters",
                 f"param_sharding=zero3 (one copy of the parameters, gradients and optimizer "
                 f"state over the 8 devices instead of one on each): at least {zero3 / GiB:.1f} "
                 f"GiB (under what is available)", "optimizer.moment_dtype=bfloat16",
                 "fewer devices",
                 "ULYSSES_SKIP_HOST_MEMORY_CHECK=1"):
        assert part in msg, (part, msg)
    assert zero3 < need / 4


def test_refusal_of_a_zero3_run_with_long_sequences_names_the_batch():
    """Nothing left in the state to cut: the message says so for the state, and names the
    batch when activations are a large part."""
    mesh = _mesh(4)
    cfg = load_config(TINY, ["mesh.seq=4", "param_sharding=zero3", "seq_len=131072",
                             "batch_size=8", "optimizer.moment_dtype=bfloat16"])
    est = host_memory.estimate(cfg, mesh)
    acts = est.phases["training"]["activations"]
    assert acts == 2 * 8 * 131072 * 128 * 4 and acts * 4 >= est.peak[1]
    with pytest.raises(ConfigError) as e:
        host_memory.check(cfg, mesh, available=(GiB // 10, "test"))
    msg = str(e.value)
    assert "param_sharding=zero3 (" not in msg and "moment_dtype=bfloat16 (" not in msg, msg
    assert (f"activations ({acts / GiB:.1f} GiB for 8 sequences of 131072 tokens at a time): "
            f"a larger grad_accum_steps") in msg, msg


def test_no_check_when_skipped_or_unknown(monkeypatch):
    mesh = _mesh(4)
    cfg = load_config(TINY, ["mesh.seq=4"])
    assert host_memory.check(cfg, mesh) is not None  # the tiny preset fits this machine
    monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
    assert host_memory.check(cfg, mesh) is None
    monkeypatch.setenv(host_memory.SKIP_ENV, "1")
    assert host_memory.check(cfg, mesh, available=(1, "test")) is None


def test_available_bytes_reads_meminfo_and_a_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2048 kB\nMemAvailable:   1000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_memory.available_bytes(str(meminfo), str(cgroup)) == (
        1024000, f"MemAvailable in {meminfo}")
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("5000\n")
    assert host_memory.available_bytes(str(meminfo), str(cgroup))[0] == 1024000
    (cgroup / "memory.max").write_text("405000\n")
    got, where = host_memory.available_bytes(str(meminfo), str(cgroup))
    assert got == 400000 and "memory.max" in where
    got, where = host_memory.available_bytes(str(tmp_path / "none"), str(tmp_path / "none"))
    assert got > 0 and where == "os.sysconf's available pages"


def test_train_refuses_before_allocating(monkeypatch, tmp_path, capsys):
    """train.py: exit 2, one paragraph, no traceback; the state was never built and the
    workdir holds no config.yaml and no checkpoint."""
    from ulysses_jax.training import resume, trainer
    monkeypatch.setattr(host_memory, "available_bytes", lambda: (GiB // 2, "a test's number"))

    def built(*args, **kwargs):
        raise AssertionError("the state was built")

    monkeypatch.setattr(trainer, "start_state", built)
    monkeypatch.setattr(resume, "init_state", built)
    workdir = tmp_path / "run"
    rc = cli.main(["--config", TINY, "--workdir", str(workdir), "--no-progress", *SMALL, *MID,
                   f"data.source={small_corpus(str(tmp_path / 'corpus'), n=4)}", "steps=1"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("error: not enough host memory: on its 8 CPU devices"), err
    assert "0.5 GiB is available (a test's number)" in err and "param_sharding=zero3" in err
    assert not (workdir / "config.yaml").exists()
    checkpoints = workdir / "checkpoints"
    assert not checkpoints.exists() or not os.listdir(checkpoints)
