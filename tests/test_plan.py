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
