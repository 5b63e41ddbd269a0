"""load_config merges a preset and its overrides in one OmegaConf.merge (config.py): the same
Config as merging them one at a time, and a bad override still named as one at a time names
it (test_bad_input.py has the messages)."""
import dataclasses
import os

import pytest
from omegaconf import OmegaConf

from ulysses_jax import config as config_lib
from ulysses_jax.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_at_a_time(path, overrides):
    cfg = OmegaConf.structured(config_lib.Config)
    if path is not None:
        cfg = config_lib._merge(cfg, config_lib._load_yaml(path), "")
    for item in overrides:
        cfg = config_lib._merge(cfg, config_lib._parse_override(item), "")
    return OmegaConf.to_object(cfg)


@pytest.mark.parametrize("preset, overrides", [
    (None, []),
    ("tiny.yaml", ["seq_len=64", "model.d_model=32", "mesh.seq=4", "seq_len=128",
                   "model.lora.rank=4", "model.lora.targets=[q,v]", "optimizer.lr=1e-3"]),
    ("tiny-qwen3-next.yaml", ["model.mixer_pattern=DA", "model.n_layers=2", "mesh.seq=2",
                              "model.rope_scaling.type=linear", "model.rope_scaling.factor=2"]),
    ("tiny-grpo.yaml", ["grpo.reward_funcs=[answer_match]", "grpo.num_generations=2"]),
])
def test_one_merge_equals_one_at_a_time(preset, overrides):
    path = os.path.join(ROOT, "configs", preset) if preset else None
    got = load_config(path, overrides)
    assert dataclasses.asdict(got) == dataclasses.asdict(_one_at_a_time(path, overrides))
    if overrides:  # later overrides win, as one at a time
        assert dataclasses.asdict(got) != dataclasses.asdict(load_config(path, overrides[:-1]))


def test_defaults_are_not_changed_by_a_merge():
    before = OmegaConf.to_yaml(config_lib._defaults())
    load_config(None, ["seq_len=78", "model.n_layers=5", "mesh.seq=2"])
    assert OmegaConf.to_yaml(config_lib._defaults()) == before
    assert load_config(None, []).seq_len == load_config(None, []).seq_len != 78


def test_a_bad_override_after_good_ones_is_named():
    with pytest.raises(ConfigError, match="model.n_layerz"):
        load_config(None, ["seq_len=64", "model.n_layerz=2", "mesh.seq=2"])
    with pytest.raises(ConfigError, match="must hold keys such as mesh.<key>"):
        load_config(None, ["seq_len=64", "mesh=4"])
