"""Faults of a run: kill -9 at any moment, a damaged newest checkpoint, an unfinished metrics
line, two runs on one workdir, a full disk, a NaN loss, a refused resume, signals.

After each, the run is finished (or refused) and checked against one uninterrupted run of the
same config: every step appears exactly once in metrics.jsonl and the curve (loss, lr,
grad_norm, tokens of every step) is that run's, exactly. The config fixes
optimizer.schedule_steps, so a step's numbers do not depend on ``steps``.
"""
import json
import gc
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest

from tests.utils.configs import ROOT, SMALL, TINY, tiny_config
from tests.utils.devices import DEVICES, cli_env
from ulysses_jax.config import load_config
from ulysses_jax.training.checkpoint import Checkpointer
from ulysses_jax.training.trainer import TrainingDiverged, train

sys.path.insert(0, ROOT)
import train as cli  # noqa: E402

STEPS = 12  # the reference run; checkpoint_every=2 and keep 3 leave steps 8, 10, 12
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a step still being written
CURVE = ("loss", "lr", "grad_norm", "tokens")

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="trainer tests run on fake CPU devices")


@pytest.fixture(scope="module", autouse=True)
def _fresh_compiles():
    """Every program here is compiled fresh, in this process and in the runs it launches
    (``_launch``): these tests compare loss curves across processes bit for bit. In the full
    suite, with the train step read back from the shared compilation cache, the resumed runs
    reported losses and gradient norms 1 ulp off the reference at a few steps (not
    seen when this module runs alone; cause not isolated)."""
    from jax._src import compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    """Overrides shared by every run here: the small model on a small generated corpus."""
    corpus = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["def", "return", "self", "x", "value", "for", "in", "if", "None", "print"]
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(
            "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(60)))
    return [*SMALL, f"data.source={corpus}", "eval_batches=0", "checkpoint_every=2",
            f"optimizer.schedule_steps={STEPS}"]


def _cfg(common, *extra):
    return tiny_config(*common, f"steps={STEPS}", *extra)


@pytest.fixture(scope="module")
def reference(common, tmp_path_factory):
    """(workdir, curve) of one uninterrupted run of STEPS steps."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    train(_cfg(common), str(workdir), progress=False)
    return workdir, _curve(workdir)


def _records(workdir):
    """Every complete line of metrics.jsonl (an unfinished last line is not a record)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    return [json.loads(line) for line in lines[:-1]]


def _curve(workdir):
    records = _records(workdir)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(steps) + 1)), f"steps logged: {steps}"
    return {r["step"]: tuple(r[k] for k in CURVE) for r in records}


def _assert_reference_curve(workdir, reference):
    curve = _curve(workdir)
    assert sorted(curve) == list(range(1, STEPS + 1)), sorted(curve)
    assert curve == reference[1]  # same program, same restored bits: equal, not close


def _copy(reference, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(reference[0], workdir)
    return workdir


def _steps_on_disk(workdir):
    return sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())


def _saving(workdir):
    d = workdir / "checkpoints"
    return d.exists() and any(TMP_SUFFIX in n for n in os.listdir(d))


# Runs the rest of its argv as a Python process whose files cannot grow past argv[1] bytes:
# a write past that fails with EFBIG, as one on a full disk fails with ENOSPC (Python ignores
# SIGXFSZ, so the write returns the error rather than killing the process).
FILE_SIZE_LIMITED = ("import os, resource, sys; "
                     "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2); "
                     "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


_LAUNCHED = []


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    yield
    while _LAUNCHED:
        proc = _LAUNCHED.pop()
        if proc.poll() is None:  # a failed test left it running
            proc.kill()
            proc.wait()


def _launch(common, workdir, *extra, file_size_limit=None):
    """train.py as a user runs it, output in files (a pipe nobody reads could block it)."""
    out = open(f"{workdir}.out", "a")
    env = cli_env()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compiled fresh (``_fresh_compiles``)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    limit = ["-c", FILE_SIZE_LIMITED, str(file_size_limit)] if file_size_limit else []
    _LAUNCHED.append(subprocess.Popen(
        [sys.executable, *limit, "train.py", "--config", TINY, "--workdir", str(workdir),
         "--no-progress", *common, f"steps={STEPS}", *extra],
        cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
    return _LAUNCHED[-1]


def _output(workdir):
    with open(f"{workdir}.out") as f:
        return f.read()


def _wait(proc, workdir, condition, what, timeout=180):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}:\n" + \
            _output(workdir)[-3000:]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_kill_9_at_random_moments_then_rerun(common, reference, tmp_path):
    """kill -9 during start-up, during a checkpoint save and between steps, again and again;
    every rerun resumes, and the run finishes with the uninterrupted run's records."""
    rng = random.Random(1234)  # seeded: a failure replays
    workdir = tmp_path / "run"
    killed_in_save = []
    for moment in ("start-up", "save", "training"):
        seen = max([r["step"] for r in _records(workdir)], default=0)
        # checkpoint_every=1: a save at every step, so saves take much of the time.
        proc = _launch(common, workdir, "checkpoint_every=1")
        if moment == "start-up":
            time.sleep(rng.uniform(0.2, 2.0))
        elif moment == "save":
            while True:  # frozen while a save is seen in progress, so the kill lands in it
                _wait(proc, workdir, lambda: _saving(workdir), "a checkpoint save")
                proc.send_signal(signal.SIGSTOP)
                if _saving(workdir):
                    break
                proc.send_signal(signal.SIGCONT)
        else:
            target = seen + rng.randint(1, 2)
            _wait(proc, workdir, lambda: any(r["step"] >= target for r in _records(workdir)),
                  f"step {target}")
            time.sleep(rng.uniform(0.0, 0.3))
        assert proc.poll() is None, "the run ended before the kill:\n" + _output(workdir)
        killed_in_save.append(_saving(workdir))
        proc.kill()
        proc.wait()
    assert killed_in_save[1], killed_in_save
    assert _steps_on_disk(workdir), "no run got as far as a checkpoint"
    train(_cfg(common), str(workdir), progress=False)
    _assert_reference_curve(workdir, reference)


def test_damaged_newest_checkpoint_falls_back(common, reference, tmp_path, capsys):
    """Every file of step 12's arrays cut to half: the rerun says so in one line, keeps the
    damaged step aside and resumes from step 10. (Deleted files and an empty step directory:
    test_checkpoint.py, on the Checkpointer alone.)"""
    workdir = _copy(reference, tmp_path)
    for path in (workdir / "checkpoints" / str(STEPS) / "state").rglob("*"):
        if path.is_file():
            os.truncate(path, path.stat().st_size // 2)
    train(_cfg(common), str(workdir), progress=False)
    gc.collect()  # abandoned reads of the damaged step are reported when collected
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Exception ignored" not in captured.err, \
        captured.err[-3000:]
    lines = [line for line in captured.out.splitlines()
             if line.startswith("warning: checkpoint")]
    assert len(lines) == 1 and lines[0].startswith(f"warning: checkpoint step {STEPS} -> "), lines
    assert lines[0].endswith(f"resumed from step {STEPS - 2}"), lines
    aside = workdir / "checkpoints.damaged" / str(STEPS)
    assert aside.is_dir() and str(aside) in lines[0]  # kept, not deleted
    assert _steps_on_disk(workdir) == [STEPS - 4, STEPS - 2, STEPS]
    _assert_reference_curve(workdir, reference)


def test_unfinished_metrics_line_does_not_block_resume(common, reference, tmp_path, capsys):
    """A kill while writing step 12's record: a prefix of that line, no checkpoint 12."""
    workdir = _copy(reference, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / str(STEPS))
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][:15])
    train(_cfg(common), str(workdir), progress=False)
    assert "dropped the unfinished last line" in capsys.readouterr().out
    _assert_reference_curve(workdir, reference)


def test_second_run_is_refused_and_sigint_saves(common, reference, tmp_path, capsys):
    """While a run trains, a second one on its workdir is refused (holder's pid, exit 2,
    nothing touched); SIGINT then makes the first save and exit 0, like SIGTERM."""
    workdir = tmp_path / "run"
    proc = _launch(common, workdir, "steps=100000", "checkpoint_every=1")
    _wait(proc, workdir, lambda: len(_records(workdir)) >= 2, "two logged steps")
    config = (workdir / "config.yaml").read_bytes()
    rc = cli.main(["--config", TINY, "--workdir", str(workdir), "--no-progress", *common,
                   f"steps={STEPS}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"is in use by another run (process {proc.pid} on" in err, err
    assert (workdir / "config.yaml").read_bytes() == config

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, _output(workdir)
    step = Checkpointer(str(workdir / "checkpoints")).latest_step()
    assert f"SIGINT: saved step {step} to" in _output(workdir)
    assert 2 <= step < STEPS, f"the run passed step {STEPS} before the signal landed"
    assert sorted(_curve(workdir)) == list(range(1, step + 1))
    train(_cfg(common), str(workdir), progress=False)
    _assert_reference_curve(workdir, reference)


def test_disk_full_during_a_save(common, reference, tmp_path):
    """A write that fails (here: a file size limit, as a full disk would) during the save of
    step 12: one paragraph, exit 2, nothing older lost; the rerun finishes the run."""
    workdir = _copy(reference, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / str(STEPS))  # resume from 10, save 12 again
    proc = _launch(common, workdir, file_size_limit=32 * 1024)
    assert proc.wait(timeout=300) == 2, _output(workdir)
    out = _output(workdir)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert "Traceback" not in out and len(errors) == 1, out[-3000:]
    assert f"saving checkpoint step {STEPS} in" in errors[0] and "errno" in errors[0], errors
    assert f"checkpoints of steps {STEPS - 4}, {STEPS - 2} are intact" in errors[0], errors
    assert _steps_on_disk(workdir) == [STEPS - 4, STEPS - 2]
    train(_cfg(common), str(workdir), progress=False)
    _assert_reference_curve(workdir, reference)


def test_nan_before_any_checkpoint_then_rerun(common, reference, tmp_path):
    """A NaN stop with no checkpoint yet says so (no "step None"), and a rerun in the same
    workdir starts over without doubling the records the stopped run had written."""
    workdir = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as err:
        train(load_config(TINY, [*common, "steps=30", "optimizer.lr=1e12",
                                 "optimizer.clip_norm=1e30", "optimizer.warmup_steps=0",
                                 "checkpoint_every=0"]), str(workdir), progress=False)
    message = str(err.value)
    assert "step None" not in message and "a rerun starts from step 0" in message, message
    assert _records(workdir), "the stopped run logged no step before the NaN"
    train(_cfg(common), str(workdir), progress=False)
    _assert_reference_curve(workdir, reference)


def test_refused_resume_changes_nothing(common, reference, tmp_path, capsys):
    """Another model shape, seq_len or corpus: exit 2 naming the setting, and config.yaml,
    metrics.jsonl and the checkpoints stay as they were."""
    workdir = _copy(reference, tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("another corpus\n" * 200)
    files = lambda: {p: p.read_bytes() for p in workdir.rglob("*")  # noqa: E731
                     if p.is_file() and p.name != "train.lock"}  # the lock takes our pid
    before = files()
    for override, expected in [
            ("model.d_model=64", "with another model shape (model.d_model 32 there, 64 now)"),
            ("seq_len=32", "for other data (seq_len 64 there, 32 now)"),
            (f"data.source={other}", "for other data (data.source")]:
        rc = cli.main(["--config", TINY, "--workdir", str(workdir), "--no-progress", *common,
                       f"steps={STEPS + 2}", override])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"cannot resume from checkpoint step {STEPS}" in err and expected in err, err
        assert files() == before, override


@pytest.mark.parametrize("sig,moment", [(signal.SIGTERM, "start-up"), (signal.SIGINT, "compile")])
def test_signal_before_training_exits_cleanly(common, tmp_path, sig, moment):
    workdir = tmp_path / "run"
    proc = _launch(common, workdir)
    if moment == "start-up":
        time.sleep(0.5)  # importing JAX
    else:  # the line printed just before the train step is compiled
        _wait(proc, workdir, lambda: "model: " in _output(workdir), "the compile")
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 0, _output(workdir)
    out = _output(workdir)
    assert "Traceback" not in out, out
    assert f"stopped by {sig.name} before training started" in out, out
    assert _records(workdir) == []
