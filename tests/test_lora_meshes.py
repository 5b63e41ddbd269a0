"""LoRA on the other kinds of mesh: the same LoRA run (tiny model, adapters on every
projection, ZeRO-3, bf16 base storage) on one device per sequence, on Ulysses x data and on
hybrid Ulysses x Ring (batches in zigzag order) logs the same losses and ends with the same
adapters, and the frozen weights of every run end bitwise alike."""
import json
import os

import numpy as np
import pytest

from tests.test_lora import TRAIN
from tests.utils.devices import DEVICES, need_devices
from ulysses_jax.config import load_config
from ulysses_jax.runs import read_params
from ulysses_jax.models import lora

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (pure Ulysses at mesh.seq 2 against one device: test_lora.py's resumed runs)
MESHES = {"seq1": ["mesh.seq=1"], "data2_seq2": ["mesh.data=2", "mesh.seq=2"],
          "ring2_seq2": ["mesh.seq=2", "mesh.ring=2"]}


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="trainer tests run on fake CPU devices")
def test_lora_trains_alike_on_every_mesh(tmp_path):
    from ulysses_jax.training.trainer import train
    need_devices(4)
    losses, adapters, frozen = {}, {}, {}
    for name, mesh in MESHES.items():
        cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), TRAIN + mesh + [
            "steps=3", "checkpoint_every=3", "optimizer.lr=0.01", "param_sharding=zero3",
            "model.lora.base_dtype=bfloat16"])
        run = str(tmp_path / name)
        train(cfg, run, progress=False)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            losses[name] = [json.loads(line)["loss"] for line in f]
        saved = dict(read_params(run, 3))
        adapters[name] = {k: v for k, v in saved.items() if lora.is_adapter(k)}
        frozen[name] = {k: v for k, v in saved.items() if not lora.is_adapter(k)}
    assert len(losses["seq1"]) == 3 and losses["seq1"][-1] < losses["seq1"][0]
    for name in MESHES:
        # Other meshes sum in other orders: equal within fp32 rounding.
        np.testing.assert_allclose(losses[name], losses["seq1"], rtol=1e-5, err_msg=name)
        assert sorted(adapters[name]) == sorted(adapters["seq1"])
        for k, v in adapters[name].items():
            np.testing.assert_allclose(v, adapters["seq1"][k], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name} {k}")
        # Every run starts from the seed's base: the frozen weights end bitwise alike.
        for k, v in frozen[name].items():
            assert np.array_equal(v, frozen["seq1"][k]), (name, k)
