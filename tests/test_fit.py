"""Fit or say so (training/fit.py): before any state exists the trainer compiles its train step
and holds XLA's memory analysis of it, with what lives beside it, against the memory the run
has (``ULYSSES_MEMORY_BUDGET`` lowers it here); ``model.remat=auto`` picks the least
recomputation that fits.

- under ``auto`` a run at the machine's memory keeps every activation (none); at a budget
  one byte short of what that needs (a run's buffers may take ``fit.HEADROOM`` of it) it takes the first of save_dots, full that fits (each candidate
  before it over the budget), trains to the same losses and gradient norms within 1e-6, and
  logs its choice (stdout, config.yaml, metrics.jsonl's first record);
- an SFT, a DPO and a GRPO run with ``model.remat=none`` named and a budget below any setting
  exit 2 through train.py's ``main`` with the numbers by part and each setting's compiled need,
  before any step and without a checkpoint, metrics or config.yaml; the same workdir then
  trains under ``auto``.
"""
import json
import os
import sys

import numpy as np
import pytest

from tests.utils.configs import ROOT, SMALL, tiny_config
from tests.utils.devices import DEVICES
from ulysses_jax.config import ConfigError
from ulysses_jax.data import prepare as prepare_lib
from ulysses_jax.training import fit, objectives
from ulysses_jax.training.host_memory import BUDGET_ENV, parse_bytes
from ulysses_jax.training.trainer import build_mesh, train

sys.path.insert(0, ROOT)
import train as cli  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="trainer tests run on fake CPU devices")

# Two layers of 256 tokens on 2 devices: the activations a policy keeps are most of the step.
LONG = [*SMALL, "seq_len=256", "model.n_layers=2", "mesh.seq=2", "mesh.data=1",
        "checkpoint_every=0", "eval_every=0", "log_tensorboard=false"]


def test_sizes_and_a_bad_budget_are_read_or_refused(monkeypatch):
    assert parse_bytes("3GiB") == 3 * 2**30
    assert parse_bytes("500 MB") == 500 * 10**6
    assert parse_bytes("1.5kib") == 1536
    assert parse_bytes("12") == 12
    for bad in ("lots", "3 GiBs", "-1GB", ""):
        with pytest.raises(ValueError, match="not a size"):
            parse_bytes(bad)
    monkeypatch.setenv(BUDGET_ENV, "two gigs")
    mesh = build_mesh(tiny_config(*LONG))
    with pytest.raises(ConfigError, match=f"{BUDGET_ENV}: not a size: 'two gigs'"):
        fit.budget(mesh)


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def kept_run(tmp_path_factory):
    """(workdir, records) of a run under ``auto`` at the machine's memory: 3 steps, a
    checkpoint at the end."""
    workdir = tmp_path_factory.mktemp("kept") / "run"
    cfg = tiny_config(*LONG, "steps=3")
    assert cfg.model.remat == "auto"  # the default
    train(cfg, str(workdir), progress=False)
    return str(workdir), _records(workdir)


def test_auto_picks_the_least_recomputation_that_fits_and_trains_the_same(
        kept_run, monkeypatch, tmp_path, capsys):
    """At the machine's budget ``auto`` keeps everything (none); at one byte under what none
    needs it recomputes (the first candidate at or under the budget, each tried one over it),
    with the same losses and gradient norms."""
    cfg = tiny_config(*LONG, "steps=3")
    kept = kept_run[1]
    assert kept[0]["remat"] == "none" and kept[0]["remat_tried"] == {}
    need = kept[0]["memory_needed_bytes"]
    assert 0 < kept[0]["peak_bytes_per_device"] * 2 <= need  # 2 devices, each its step
    capsys.readouterr()
    budget = int(need / fit.HEADROOM) - 1  # a run's buffers may take HEADROOM of it
    monkeypatch.setenv(BUDGET_ENV, str(budget))
    train(cfg, str(tmp_path / "auto"), progress=False)
    out = capsys.readouterr().out
    auto = _records(tmp_path / "auto")
    chosen, tried = auto[0]["remat"], auto[0]["remat_tried"]
    assert chosen in ("save_dots", "full") and auto[0]["memory_budget_bytes"] == budget
    assert tried["none"] == need and all(v > budget * fit.HEADROOM for v in tried.values())
    assert list(tried) + [chosen] == ["none", "save_dots", "full"][:len(tried) + 1]
    assert auto[0]["memory_needed_bytes"] <= budget * fit.HEADROOM
    assert "remat" not in auto[1]  # the first record only
    assert f"memory: model.remat={chosen} (auto: none needs {fit.gib(need)}" in out
    with open(tmp_path / "auto" / "config.yaml") as f:
        assert f"  remat: {chosen}\n" in f.read()
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in auto], [r[key] for r in kept],
                                   rtol=1e-6, err_msg=key)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """{"dpo": a preference store, "grpo": a prompt file}; SFT reads the built-in corpus."""
    tmp = tmp_path_factory.mktemp("fit_data")
    words = ["alpha", "beta", "gamma", "the", "cat", "dog", "runs", "sleeps"]
    rng = np.random.default_rng(0)
    pairs = tmp / "pairs.jsonl"
    with open(pairs, "w") as f:
        for _ in range(24):
            f.write(json.dumps({"prompt": " ".join(rng.choice(words, 6)),
                                "chosen": " " + " ".join(rng.choice(words[:3], 2)),
                                "rejected": " " + " ".join(rng.choice(words[3:], 2))}) + "\n")
    prepare_lib.prepare([str(pairs)], str(tmp / "store"), None, preference=True,
                        progress=False)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from make_retrieval import rows
    prompts = tmp / "prompts.jsonl"
    with open(prompts, "w") as f:
        for row in rows(12, seed=1):
            f.write(json.dumps(row) + "\n")
    return {"dpo": f"data.source={tmp / 'store'}", "grpo": f"data.source={prompts}"}


RUNS = {
    "sft": [],
    "dpo": ["objective=dpo", "batch_size=2", "model.vocab_size=257"],
    "grpo": ["objective=grpo", "model.vocab_size=257", "grpo.reward_funcs=[answer_match]",
             "grpo.num_generations=2", "grpo.max_completion_length=4", "batch_size=1",
             "grpo.sft_warmup_steps=0"],
}


@pytest.mark.parametrize("objective", list(RUNS))
def test_a_run_that_cannot_fit_exits_2_before_any_step_and_the_workdir_then_trains(
        objective, data, monkeypatch, tmp_path, capsys):
    over = [*LONG, *RUNS[objective], *([data[objective]] if objective in data else []),
            "steps=1"]
    workdir = str(tmp_path / "run")
    monkeypatch.setenv(BUDGET_ENV, "2MiB")
    argv = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--workdir", workdir,
            "--no-progress", *over]
    assert cli.main([*argv, "model.remat=none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not enough memory: with model.remat=none, the run needs "), err
    assert "MiB on this process's 2 CPU devices (whose arrays all live in this machine's RAM) " \
           "(the train step " in err
    assert f"but 2.0 MiB is available ({BUDGET_ENV}=2MiB), of which a run may take 90% " in err
    for setting in ("model.remat=full: ", "param_sharding=zero3: ", "seq_len=128: "):
        assert setting in err and "(still over)" in err.split(setting)[1].split(";")[0], err
    assert "ULYSSES_SKIP_HOST_MEMORY_CHECK=1" in err
    if objective == "grpo":
        assert "the sampler's KV cache " in err
    left = set(os.listdir(workdir))
    assert not left & {"metrics.jsonl", "config.yaml"}, left
    checkpoints = os.path.join(workdir, "checkpoints")
    assert not os.path.exists(checkpoints) or not os.listdir(checkpoints)
    monkeypatch.delenv(BUDGET_ENV)  # the same workdir, under auto: it trains
    assert cli.main(argv) == 0
    assert "memory: model.remat=none (auto): needs " in capsys.readouterr().out
    first = _records(workdir)[0]
    assert first["step"] == 1 and first["remat"] == "none"


def test_generate_and_evaluate_refuse_a_program_that_cannot_fit(kept_run, monkeypatch,
                                                                tmp_path, capsys):
    """Their programs are checked when compiled, before they run: what each allocates
    against the memory left; at the machine's memory the same commands run."""
    from ulysses_jax import evaluate, generate
    prompts, out = tmp_path / "prompts.jsonl", str(tmp_path / "out.jsonl")
    prompts.write_text('{"prompt": "def f(x):"}\n')
    gen = [kept_run[0], "--prompts", str(prompts), "--out", out, "--max-new-tokens", "4",
           "--no-progress"]
    ev = [kept_run[0], "--batches", "1", "--no-generation", "--no-progress", "--out",
          str(tmp_path / "eval")]
    monkeypatch.setenv(BUDGET_ENV, "64KiB")
    assert generate.main(gen) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not enough memory for the prefill program of a batch of 1 "
                          "rows: running it allocates "), err
    assert f"({BUDGET_ENV}=64KiB, less what is in use; a run may take 90% of it). Lower " \
           "--batch-size" in err
    assert not os.path.exists(out)
    assert evaluate.main(ev) == 2
    err = capsys.readouterr().err
    assert "error: not enough memory for the loss program of 1 rows of 256 tokens: " in err, err
    assert not os.path.exists(tmp_path / "eval" / "eval.json")
    monkeypatch.delenv(BUDGET_ENV)
    assert generate.main(gen) == 0 and os.path.exists(out)
