"""The memory planner: its answer fits and one step longer does not; bad input fails cleanly.

Each compile of a train step takes seconds on 2 cores, so the search test shares one memoised
measurement (``dry_run``'s peak, keyed by the config actually compiled) between the test's own
checks and the planner, and caps the search so it needs three compiles in all.
"""
import dataclasses
import os

import pytest

from tests.utils.devices import need_devices
from ulysses_jax import plan
from ulysses_jax.config import ConfigError, load_config
from ulysses_jax.training.dry_run import dry_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMALL = ["batch_size=1", "mesh.data=1", "mesh.seq=2", "model.n_layers=1", "model.d_model=32",
         "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.ffn_dim=64",
         "model.loss_chunk=256"]


def _memo_peak():
    cache = {}

    def peak(cfg):
        key = (cfg.seq_len, cfg.mesh.seq, cfg.mesh.data)
        if key not in cache:
            cache[key] = dry_run(cfg)["peak_bytes_per_device"]
        return cache[key]
    return peak, cache


def test_answer_fits_and_one_step_longer_does_not():
    need_devices(2)
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), SMALL)
    g = 512
    peak, cache = _memo_peak()
    at = lambda n: dataclasses.replace(cfg, seq_len=n)
    m1024, m1536 = peak(at(1024)), peak(at(1536))
    assert m1024 < m1536, "memory must grow with length for this test to mean anything"
    budget = (m1024 + m1536) // 2

    lines = []
    got = plan.longest_fitting_seq_len(cfg, budget, granularity=g, max_seq_len=1536,
                                       measure=peak, progress=lines.append)
    assert got is not None and got % g == 0 and got % cfg.mesh.seq == 0
    assert peak(at(got)) <= budget
    assert got + g > 1536 or peak(at(got + g)) > budget
    assert got == 1024
    assert lines and all("P=2" in line for line in lines)
    assert {n for n, _, _ in cache} == {512, 1024, 1536}

    # Below the smallest candidate's peak nothing fits (no new compile: 512 is cached).
    assert plan.longest_fitting_seq_len(cfg, peak(at(512)) - 1, granularity=g,
                                        measure=peak) is None


def test_bad_input_raises_and_cli_exits_cleanly(capsys):
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), SMALL)
    never = lambda c: pytest.fail("no compile should happen for bad input")
    with pytest.raises(ValueError, match="memory budget must be positive"):
        plan.longest_fitting_seq_len(cfg, 0, measure=never)
    with pytest.raises(ValueError, match="below the search unit 1024"):
        plan.longest_fitting_seq_len(cfg, 1 << 30, max_seq_len=512, measure=never)
    # A rule that depends on P (heads P does not divide are padded now, head_layout.py):
    # experts split evenly over the devices.
    bad_p = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, seq=3),
                                model=dataclasses.replace(cfg.model, num_experts=8))
    with pytest.raises(ConfigError, match="num_experts 8 is not divisible by the mesh's 3"):
        plan.longest_fitting_seq_len(bad_p, 1 << 30, measure=never)

    cases = [
        (["--memory-gb", "1", "--p", "1,3", "model.num_experts=8"],
         "P=3: model.num_experts 8 is not divisible by the mesh's 3 devices"),
        (["--memory-gb", "-2"], "--memory-gb must be a positive number, got -2.0"),
        (["--memory-gb", "1", "--p", "two"], "--p must be comma-separated positive integers"),
        (["--memory-gb", "1", "model.no_such_key=1"], "no_such_key"),
    ]
    for extra, message in cases:
        code = plan.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), *extra])
        err = capsys.readouterr().err
        assert code == 2, (extra, err)
        assert message in err and "Traceback" not in err, (extra, err)


def test_target_table_reports_and_ranks_the_modeled_time(monkeypatch, capsys):
    """With ``--target`` each answer's modeled tokens/s per GPU and MFU join the table,
    marked as modeled, and the P whose longest length trains fastest by the model is
    named. The compiles are stood in for (their figures are the time model's and the GPU
    compiler's, checked in test_time_model.py and test_gpu_compile.py): device bytes grow
    with the tokens per device, P=2's model is the faster."""
    import ulysses_jax.training.dry_run as dry_run_module

    def stand_in(cfg, target=None):
        assert target == "h100"
        p = cfg.mesh.seq
        return {"peak_bytes_per_device": cfg.seq_len // p * 2 ** 20, "host_bytes_per_device": 0,
                "step_seconds_model": 1.0, "tokens_per_second_per_gpu_model": 1000.0 * p,
                "mfu_model": 0.1 * p}
    monkeypatch.setattr(dry_run_module, "dry_run", stand_in)
    monkeypatch.setattr(plan.gpu_target, "cuda_plugin_installed", lambda: True)
    assert plan.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--memory-gb",
                      "1", "--p", "1,2", "--granularity", "256", "--max-seq-len", "4096",
                      "--target", "h100"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] in (["1"], ["2"])}
    assert rows["1"][1:6] == ["1024", "1.00", "0.00", "1,000", "10.0%"], out
    assert rows["2"][1:6] == ["2048", "1.00", "0.00", "2,000", "20.0%"], out
    assert "* modeled, not measured" in out and "at its longest length: P=2" in out
