"""train.py end to end: configs, CLI errors, training, resume, preemption, NaN, multi-process."""
import functools
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.utils.configs import ROOT, SMALL, tiny_config
from tests.utils.devices import DEVICES, cli_env
from ulysses_jax.training.checkpoint import Checkpointer
from ulysses_jax.config import ConfigError, load_config
from ulysses_jax.plot import plot_metrics
from ulysses_jax.training.dry_run import dry_run
from ulysses_jax.training.trainer import TrainingDiverged, train

PRESETS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="trainer tests run on fake CPU devices")
_cfg = functools.partial(tiny_config, *SMALL)


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _losses(workdir):
    return {m["step"]: m["loss"] for m in _metrics(workdir) if "loss" in m}


def test_every_preset_loads():
    assert len(PRESETS) >= 4
    for path in PRESETS:
        cfg = load_config(path)
        assert cfg.seq_len % cfg.mesh.seq == 0


def test_chunk_notes_name_the_size_used():
    from ulysses_jax.training.trainer import chunk_notes
    assert chunk_notes(_cfg("mesh.seq=2", "model.loss_chunk=16", "model.mlp_chunk=64")) == []
    notes = chunk_notes(_cfg("seq_len=96", "mesh.seq=2", "model.loss_chunk=20",
                             "model.mlp_chunk=7"))
    assert notes == ["model.loss_chunk=20 does not divide the 48 tokens per device; chunks of "
                     "16 tokens are used",
                     "model.mlp_chunk=7 does not divide the 48 tokens per device; chunks of "
                     "6 tokens are used"], notes


@pytest.mark.parametrize("name", ["llama3-8b-128k", "qwen3-8b-128k", "llama-1b-32k"])
def test_big_presets_compile_reduced(name):
    """Full widths, one layer, a short sequence: the presets compile and the plan reports
    memory, FLOPs and the Ulysses all-to-alls."""
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"),
                      ["seq_len=1024", "model.n_layers=1"])
    plan = dry_run(cfg)
    assert plan["peak_bytes_per_device"] > 0 and plan["flops_per_device"] > 0
    assert plan["collectives"]["all-to-all"] >= 4, plan["collectives"]


@pytest.mark.parametrize("args,match", [
    (["foo.bar=1"], "config key 'foo'"),
    (["steps=many"], "config key 'steps'"),
    (["mesh.seq=3"], "seq_len 512 is not divisible by mesh.seq 3"),
    # Heads that mesh.seq does not divide are padded (head_layout.py; planned below);
    # a GQA grouping that does not exist, and head chunks a device cannot split, are refused.
    (["model.n_heads=8", "model.n_kv_heads=3"],
     "model.n_heads 8 is not divisible by model.n_kv_heads 3"),
    (["model.n_heads=6", "model.n_kv_heads=3", "mesh.seq=2", "ulysses.chunks=2"],
     "ulysses.chunks 2 must divide the kv heads per device, 3"),
    (["batch_size=3", "mesh.data=2", "mesh.seq=4"], "batch_size 3 is not divisible by mesh.data 2"),
    (["mesh.seq=8", "mesh.data=2", "batch_size=4"], "16 devices, but only 8 are available"),
    (["model.dtype=float8"], "model.dtype must be one of float32, bfloat16"),
    (["model.attn_impl=flash"], "model.attn_impl must be one of auto, xla, cudnn, chunked"),
    (["steps"], "override 'steps' is not of the form key=value"),
])
def test_cli_rejects_bad_config(args, match, capsys):
    sys.path.insert(0, ROOT)
    import train as cli
    rc = cli.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--dry-run", *args])
    err = capsys.readouterr().err
    assert rc == 2 and match in err and "Traceback" not in err, err


def test_cli_no_traceback_subprocess(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml",
                          "--workdir", str(tmp_path), "mesh.seq=5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=cli_env())
    assert out.returncode == 2
    assert "seq_len 512 is not divisible by mesh.seq 5" in out.stderr
    assert "Traceback" not in out.stderr


def test_short_run_loss_falls(tmp_path):
    cfg = _cfg("steps=25", "optimizer.lr=0.01", "eval_every=25", "checkpoint_every=10")
    summary = train(cfg, str(tmp_path), progress=False)
    metrics = _metrics(tmp_path)
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert summary["status"] == "done" and summary["step"] == 25
    assert np.mean(losses[-5:]) < losses[0] - 0.5, losses
    for key in ("step", "loss", "tokens_per_sec", "lr", "grad_norm", "step_time"):
        assert key in metrics[0], metrics[0]
    assert any("eval_loss" in m and np.isfinite(m["eval_loss"]) for m in metrics)
    assert os.path.exists(tmp_path / "config.yaml")
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 25
    png = plot_metrics(str(tmp_path))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


RESUME = ["optimizer.schedule_steps=6", "checkpoint_every=3", "mesh.seq=4", "mesh.data=1"]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """For test_resume_equals_uninterrupted, run once for both its meshes: the losses of the
    6 steps in one go, and the work directory of the first 3 (a checkpoint at step 3)."""
    root = tmp_path_factory.mktemp("resume")
    train(_cfg("steps=6", *RESUME), str(root / "full"), progress=False)
    train(_cfg("steps=3", *RESUME), str(root / "first3"), progress=False)
    return _losses(root / "full"), root / "first3"


@pytest.mark.parametrize("resume_mesh", [("4", "1"), ("2", "2")])
def test_resume_equals_uninterrupted(tmp_path, resume_mesh, resume_runs):
    full, first3 = resume_runs
    shutil.copytree(first3, tmp_path / "split")  # each mesh resumes its own copy
    seq, data = resume_mesh
    train(_cfg("steps=6", *RESUME, f"mesh.seq={seq}", f"mesh.data={data}"),
          str(tmp_path / "split"), progress=False)
    split = _losses(tmp_path / "split")
    # steps 4-6 came from the copied checkpoint: no step was logged twice
    assert [m["step"] for m in _metrics(tmp_path / "split") if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert sorted(split) == sorted(full) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([split[s] for s in range(1, 7)], [full[s] for s in range(1, 7)],
                               rtol=1e-5 if resume_mesh == ("4", "1") else 1e-4)


def test_nan_loss_stops_and_keeps_last_checkpoint(tmp_path):
    # A huge learning rate with no clipping blows the weights up within a few steps.
    cfg = _cfg("steps=30", "optimizer.lr=1e12", "optimizer.clip_norm=1e30",
               "optimizer.warmup_steps=0", "checkpoint_every=1")
    with pytest.raises(TrainingDiverged, match=r"loss is (nan|inf) at step (\d+)") as err:
        train(cfg, str(tmp_path), progress=False)
    bad_step = int(str(err.value).split("at step ")[1].split(";")[0])
    ckpt = Checkpointer(str(tmp_path / "checkpoints"))
    assert ckpt.latest_step() == bad_step - 1
    losses = _losses(tmp_path)
    assert all(np.isfinite(v) for v in losses.values()) and bad_step not in losses


def test_sigterm_saves_and_exits_zero(tmp_path):
    env = cli_env()
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--workdir", str(tmp_path),
         "--no-progress", *SMALL, "steps=100000", "checkpoint_every=0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    step = Checkpointer(str(tmp_path / "checkpoints")).latest_step()
    assert step is not None and 2 <= step < 100000, out
    assert f"SIGTERM: saved step {step}" in out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    """2 processes x 4 CPU devices (gloo), the global batch in 2 micro-batches
    (grad_accum_steps), give the loss curve of 1 process x 8 devices stepping it at once."""
    over = [*SMALL, "steps=4", "mesh.seq=4", "mesh.data=2", "batch_size=4",
            "checkpoint_every=2", "eval_batches=0"]
    train(_cfg(*over[len(SMALL):]), str(tmp_path / "one"), progress=False)
    port = _free_port()
    env = cli_env(devices=4)
    procs = [subprocess.Popen(
        [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--workdir",
         str(tmp_path / "two"), "--no-progress", "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i), *over, "grad_accum_steps=2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=1e-5)
    assert Checkpointer(str(tmp_path / "two" / "checkpoints")).latest_step() == 4


def test_cli_loss_curve_same_at_seq4_and_seq1(tmp_path):
    """The model issue's acceptance: same seed, mesh.seq=4 and mesh.seq=1, same loss curve."""
    for seq in (1, 4):
        train(_cfg("steps=8", f"mesh.seq={seq}", "checkpoint_every=0", "eval_batches=0"),
              str(tmp_path / f"seq{seq}"), progress=False)
    one, four = _losses(tmp_path / "seq1"), _losses(tmp_path / "seq4")
    assert sorted(one) == sorted(four) == list(range(1, 9))
    np.testing.assert_allclose([four[s] for s in one], [one[s] for s in one], rtol=1e-4)


def test_init_from_hugging_face_checkpoint(tmp_path):
    """init_from=DIR starts from the checkpoint's weights: step 1's loss is the imported
    model's loss on the first batch, computed independently here."""
    torch = pytest.importorskip("torch", reason="torch is not installed (requirements-baseline.txt)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import jax
    from flax import nnx
    from ulysses_jax import make_mesh
    from ulysses_jax.data import text as data_lib
    from ulysses_jax.hf import from_pretrained
    from ulysses_jax.models.loss import plain_cross_entropy
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      vocab_size=300, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf")
    cfg = _cfg("steps=2", f"init_from={tmp_path / 'hf'}", "mesh.seq=2", "checkpoint_every=0",
               "eval_batches=0", "optimizer.warmup_steps=0")
    train(cfg, str(tmp_path / "run"), progress=False)
    first = _losses(tmp_path / "run")[1]

    rows, _ = data_lib.build_rows("stdlib", data_lib.ByteTokenizer(), cfg.seq_len,
                                  cfg.data.heldout_fraction, cfg.seed)
    batch = next(data_lib.BatchIterator(rows, cfg.batch_size, cfg.seed))
    model = from_pretrained(str(tmp_path / "hf"), mesh=make_mesh(seq=1, data=1,
                                                                 devices=jax.devices()[:1]))
    loss = nnx.jit(lambda m, b: plain_cross_entropy(  # one program, not one per operation
        m(b["tokens"], b["positions"], b["segment_ids"]), b["targets"], b["loss_mask"]))
    expected = float(loss(model, batch))
    np.testing.assert_allclose(first, expected, rtol=1e-5)


def test_ring_mesh_loss_curve_equals_seq1(tmp_path):
    """Hybrid Ulysses x Ring (seq=2, ring=4; batches loaded in zigzag order) trains with the
    loss curve of one device per sequence."""
    for name, mesh in (("seq1", ["mesh.seq=1"]), ("ring", ["mesh.seq=2", "mesh.ring=4"])):
        train(_cfg("steps=6", "checkpoint_every=0", "eval_batches=0", *mesh),
              str(tmp_path / name), progress=False)
    one, ring = _losses(tmp_path / "seq1"), _losses(tmp_path / "ring")
    assert sorted(one) == sorted(ring) == list(range(1, 7))
    np.testing.assert_allclose([ring[s] for s in one], [one[s] for s in one], rtol=1e-4)


def test_ring_mesh_with_fewer_heads_than_devices_plans():
    """A 2-head model on 8 devices: pure Ulysses pads its heads to 8 (head_layout.py),
    the hybrid mesh splits the sequence over a ring instead; both compile."""
    plan = dry_run(_cfg("model.n_heads=2", "model.n_kv_heads=1", "mesh.seq=8"))
    assert plan["collectives"]["all-to-all"] > 0 and plan["mesh"]["seq"] == 8
    plan = dry_run(_cfg("model.n_heads=2", "model.n_kv_heads=1", "mesh.seq=2", "mesh.ring=4"))
    assert plan["collectives"]["collective-permute"] > 0 and plan["mesh"]["ring"] == 4


def test_ring_train_step_memory_grows_linearly():
    """Doubling the sequence at most about doubles the ring step's per-device peak: no
    quadratic buffers (e.g. per-step masks hoisted out of the layer loop and kept)."""
    over = ["model.n_heads=4", "model.n_kv_heads=2", "batch_size=1", "mesh.seq=1", "mesh.ring=8",
            "model.n_layers=2"]
    peaks = [dry_run(load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                                 over + [f"seq_len={s}"]))["peak_bytes_per_device"]
             for s in (4096, 8192)]
    assert peaks[1] < 2.25 * peaks[0], peaks


def test_bad_data_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.source"):
        train(_cfg("steps=1", f"data.source={tmp_path}/missing/*.txt"), str(tmp_path / "a"),
              progress=False)
    with pytest.raises(ConfigError, match="data.tokenizer"):
        train(_cfg("steps=1", f"data.tokenizer={tmp_path}/no_tokenizer.json"),
              str(tmp_path / "b"), progress=False)


def test_eval_runs_on_its_own_schedule_and_merges_into_records(tmp_path, capsys):
    """eval_every need not be a multiple of log_every; every record keeps step/loss/tok/s.
    Without a progress bar each record is also a line of the log (batch jobs see the loss)."""
    train(_cfg("steps=6", "log_every=4", "eval_every=3", "checkpoint_every=0"), str(tmp_path),
          progress=False)
    metrics = _metrics(tmp_path)
    assert [m["step"] for m in metrics] == [3, 4, 6]
    assert [("eval_loss" in m) for m in metrics] == [True, False, True]
    assert all("loss" in m and "tokens_per_sec" in m for m in metrics)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")]
    assert [l.split(":")[0] for l in lines] == ["step 3/6", "step 4/6", "step 6/6"]
    assert [("held-out loss" in l) for l in lines] == [True, False, True]
    assert f"loss {metrics[1]['loss']:.4f}, " in lines[1]
    assert not os.path.exists(tmp_path / "checkpoints" / "3")  # checkpoint_every=0: final only
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 6


def test_schedule_notes_say_when_the_schedule_is_not_what_the_keys_suggest(tmp_path):
    """A warmup as long as the schedule, and a resume with other steps and no schedule_steps
    (the schedule is stretched): each a note; the same steps, or schedule_steps set: none."""
    from ulysses_jax.training.trainer import schedule_notes
    from ulysses_jax.config import to_yaml
    warm = schedule_notes(_cfg("steps=3", "optimizer.warmup_steps=15"), str(tmp_path))
    assert warm == ["optimizer.warmup_steps 15 >= the schedule's 3 steps: the warmup is cut to "
                    "2 steps and the learning rate ends at its peak, with no decay"]
    (tmp_path / "config.yaml").write_text(to_yaml(_cfg("steps=3", "optimizer.warmup_steps=1")))
    notes = schedule_notes(_cfg("steps=5", "optimizer.warmup_steps=1"), str(tmp_path))
    assert len(notes) == 1 and notes[0].startswith("steps 5 here, 3 in the last run") and \
        "optimizer.schedule_steps=3" in notes[0]
    assert schedule_notes(_cfg("steps=3", "optimizer.warmup_steps=1"), str(tmp_path)) == []
    assert schedule_notes(_cfg("steps=5", "optimizer.warmup_steps=1",
                               "optimizer.schedule_steps=3"), str(tmp_path)) == []

