"""train() on a prepared chat store: 6 steps straight equal 3 + resume to 6 exactly (same
mesh) and within 1e-4 on data=2 x seq=4; TensorBoard events hold the logged losses."""
import glob
import json
import os
import shutil
import struct

import numpy as np
import pytest

from tests.test_chat import CHATML, write_tokenizer_dir
from tests.utils.configs import tiny_config
from tests.utils.devices import DEVICES
from ulysses_jax.config import ConfigError
from ulysses_jax.data.prepare import prepare
from ulysses_jax.training.trainer import train

SMALL = ["seq_len=64", "batch_size=2", "model.d_model=32", "model.n_layers=1",
         "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=8", "model.ffn_dim=64",
         "model.loss_chunk=16", "log_every=1", "eval_batches=1", "optimizer.warmup_steps=2",
         "model.vocab_size=384", "optimizer.schedule_steps=6", "checkpoint_every=3"]

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="trainer tests run on fake CPU devices")


def _chat_store(tmp_path):
    rng = np.random.default_rng()
    tok_dir = write_tokenizer_dir(tmp_path / "tok", CHATML)
    words = ["Say", " hi", " again", " the", " answer", " is", " 42", " user"]
    say = lambda n: "".join(rng.choice(words, int(n)))  # noqa: E731
    with open(tmp_path / "chat.jsonl", "w") as f:
        for _ in range(80):
            msgs = [{"role": "system", "content": say(3)}]
            for _ in range(int(rng.integers(1, 3))):
                msgs += [{"role": "user", "content": say(rng.integers(1, 6))},
                         {"role": "assistant", "content": say(rng.integers(1, 8))}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    prepare([str(tmp_path / "chat.jsonl")], str(tmp_path / "store"), tok_dir, chat=True,
            progress=False)
    return str(tmp_path / "store"), tok_dir


def _cfg(store, *over):
    return tiny_config(*SMALL, f"data.source={store}", *over)


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _tb_scalars(workdir, tag):
    """{step: value} of ``tag`` in the run's TensorBoard event files (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event
    out = {}
    for path in sorted(glob.glob(os.path.join(workdir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            raw = f.read()
        i = 0
        while i < len(raw):
            (n,) = struct.unpack("<Q", raw[i:i + 8])
            event = Event.FromString(raw[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.tag == tag:
                    out[event.step] = v.simple_value
    return out


def test_chat_store_resume_exact_and_on_another_mesh(tmp_path):
    store, tok_dir = _chat_store(tmp_path)
    mesh = ["mesh.seq=4", "mesh.data=1"]
    train(_cfg(store, "steps=6", *mesh, "log_tensorboard=false"), str(tmp_path / "full"),
          progress=False)
    train(_cfg(store, "steps=3", *mesh), str(tmp_path / "split"), progress=False)
    shutil.copytree(tmp_path / "split", tmp_path / "other")
    train(_cfg(store, "steps=6", *mesh), str(tmp_path / "split"), progress=False)
    train(_cfg(store, "steps=6", "mesh.seq=4", "mesh.data=2"), str(tmp_path / "other"),
          progress=False)
    full, split, other = (_losses(tmp_path / w) for w in ("full", "split", "other"))
    assert sorted(full) == sorted(split) == sorted(other) == [1, 2, 3, 4, 5, 6]
    assert [split[s] for s in range(1, 7)] == [full[s] for s in range(1, 7)]  # exactly
    np.testing.assert_allclose([other[s] for s in range(1, 7)], [full[s] for s in range(1, 7)],
                               rtol=1e-4)
    assert len({round(full[s], 6) for s in full}) == 6  # steps saw different rows
    # TensorBoard: events beside metrics.jsonl, none when switched off.
    assert not glob.glob(str(tmp_path / "full" / "events.out.tfevents.*"))
    tb = _tb_scalars(str(tmp_path / "split"), "train/loss")
    assert sorted(tb) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([tb[s] for s in range(1, 7)], [split[s] for s in range(1, 7)],
                               rtol=1e-6)
    # Another tokenizer than the store's is refused before anything runs.
    other_tok = write_tokenizer_dir(tmp_path / "tok2", CHATML, seed=1)
    with pytest.raises(ConfigError, match="not the tokenizer the store"):
        train(_cfg(store, "steps=1", f"data.tokenizer={other_tok}"), str(tmp_path / "x"),
              progress=False)


def test_text_store_trains_with_heldout(tmp_path, capsys):
    rng = np.random.default_rng()
    words = ["def ", "return ", "x", " + 1\n", "é", "漢字", "\n", "(", ")"]
    with open(tmp_path / "c.jsonl", "w") as f:
        for _ in range(120):
            f.write(json.dumps({"text": "".join(rng.choice(words, int(rng.integers(5, 80))))})
                    + "\n")
    prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "store"), progress=False)
    summary = train(_cfg(str(tmp_path / "store"), "steps=2", "mesh.seq=4", "mesh.data=2",
                         "model.vocab_size=257", "data.heldout_fraction=0.1"),
                    str(tmp_path / "run"), progress=False)
    out = capsys.readouterr().out
    assert "data: text store: 120 documents" in out and "held-out rows" in out
    assert summary["step"] == 2 and np.isfinite(summary["loss"])
    assert summary["eval_loss"] is not None and np.isfinite(summary["eval_loss"])
    with pytest.raises(ConfigError, match="the store's tokenizer has 257 ids but "
                                          "model.vocab_size is 200"):
        train(_cfg(str(tmp_path / "store"), "steps=1", "model.vocab_size=200"),
              str(tmp_path / "bad"), progress=False)
