"""init_from with the run's own RoPE: an explicitly set model.rope_scaling / rope_theta
replaces the checkpoint's (how an unscaled model's context is extended), the startup log says
so, and the run trains the model it would have loaded from a config.json with that scaling.
A preset's dry run plans its model before the init_from checkpoint is downloaded."""
import functools
import json
import os
import shutil

import numpy as np
import pytest

from tests.utils.configs import ROOT, tiny_config
from tests.utils.data import small_corpus
from tests.utils.devices import DEVICES
from ulysses_jax.config import RopeScalingConfig, load_config
from ulysses_jax.training.dry_run import dry_run
from ulysses_jax.training.resume import resolve_init_from
from ulysses_jax.training.trainer import train

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("torch", reason="torch is not installed (requirements-baseline.txt)")
pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="trainer tests run on fake CPU devices")
SMALL = ["seq_len=64", "batch_size=2", "log_every=1", "eval_batches=0", "checkpoint_every=0",
         "optimizer.warmup_steps=0", "model.loss_chunk=16"]
YARN = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
        "model.rope_scaling.original_max_position_embeddings=16"]
_cfg = functools.partial(tiny_config, *SMALL)


@pytest.fixture(scope="module")
def unscaled(tmp_path_factory):
    """A tiny random Llama without RoPE scaling, theta 10,000, written by transformers; large
    weights, so that its attention (and RoPE) matters to the loss."""
    import torch
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "llama"
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   vocab_size=300, tie_word_embeddings=False,
                                   initializer_range=0.5)  # attention that RoPE changes
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"))


def test_set_scaling_and_theta_replace_the_checkpoints(unscaled):
    notes = []
    cfg = resolve_init_from(_cfg(f"init_from={unscaled}", *YARN), notes)
    assert cfg.model.rope_scaling == RopeScalingConfig(type="yarn", factor=4.0,
                                                       original_max_position_embeddings=16)
    assert cfg.model.d_model == 32 and cfg.model.rope_theta == 10000.0  # the rest: checkpoint's
    assert notes == ["init_from: model.rope_scaling {type: yarn, factor: 4.0, "
                     "original_max_position_embeddings: 16, beta_fast: 32.0, beta_slow: 1.0, "
                     "attention_factor: 0.0, mscale: 0.0, mscale_all_dim: 0.0, truncate: True} "
                     "from the config replaces the checkpoint's {type: default}"]
    notes = []
    cfg = resolve_init_from(_cfg(f"init_from={unscaled}", "model.rope_theta=500000"), notes)
    assert cfg.model.rope_theta == 500000.0 and cfg.model.rope_scaling.type == "default"
    assert notes == ["init_from: model.rope_theta 500000.0 from the config replaces the "
                     "checkpoint's 10000.0"]
    notes = []
    assert resolve_init_from(_cfg(f"init_from={unscaled}"), notes).model.rope_scaling.type == \
        "default" and notes == []


def _first_loss(cfg, workdir):
    train(cfg, workdir, progress=False)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return json.loads(f.readline())["loss"]


def test_run_trains_the_model_with_the_set_scaling(unscaled, corpus, tmp_path, capsys):
    """Step 1's loss with model.rope_scaling=yarn on the command line equals the loss of the
    same checkpoint whose config.json says yarn (imported the ordinary way), and differs from
    the unscaled model's."""
    scaled = str(tmp_path / "scaled")
    shutil.copytree(unscaled, scaled)
    with open(os.path.join(scaled, "config.json")) as f:
        hf = json.load(f)
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16}
    with open(os.path.join(scaled, "config.json"), "w") as f:
        json.dump(hf, f)
    steps = ["steps=1", "mesh.seq=2", f"data.source={corpus}"]
    overridden = _first_loss(_cfg(f"init_from={unscaled}", *steps, *YARN), str(tmp_path / "a"))
    assert "model.rope_scaling {type: yarn" in capsys.readouterr().out
    from_file = _first_loss(_cfg(f"init_from={scaled}", *steps), str(tmp_path / "b"))
    plain = _first_loss(_cfg(f"init_from={unscaled}", *steps), str(tmp_path / "c"))
    np.testing.assert_allclose(overridden, from_file, rtol=1e-6)
    assert abs(overridden - plain) > 1e-4 * plain
    with open(tmp_path / "a" / "config.yaml") as f:
        assert "type: yarn" in f.read()


def test_dry_run_plans_a_preset_before_its_checkpoint_is_downloaded(tmp_path):
    cfg = _cfg(f"init_from={tmp_path}/not_downloaded", "mesh.seq=2", *YARN)
    plan = dry_run(cfg)
    assert plan["params"] > 0 and plan["collectives"]["all-to-all"] > 0
    assert any("has no config.json (not downloaded yet?)" in n for n in plan["notes"])
    from ulysses_jax.config import ConfigError
    with pytest.raises(ConfigError, match="has no config.json; download the checkpoint there"):
        train(cfg, str(tmp_path / "run"), progress=False)  # training needs the checkpoint
    assert not os.path.exists(tmp_path / "run")


def test_context_presets_name_a_checkpoint_and_their_scaling():
    qwen = load_config(os.path.join(ROOT, "configs", "qwen3-8b-yarn-128k.yaml"))
    assert qwen.init_from and qwen.seq_len == 131072
    s = qwen.model.rope_scaling
    assert (s.type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    assert s.original_max_position_embeddings * s.factor == qwen.seq_len
    llama = load_config(os.path.join(ROOT, "configs", "llama3.1-8b-256k.yaml"))
    assert llama.init_from and llama.seq_len > 131072 and llama.mesh.seq == 8
    assert llama.model.rope_scaling.type == "llama3"
