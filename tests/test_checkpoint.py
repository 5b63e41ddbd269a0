"""Checkpointer: exact round trips, resharding onto other meshes, retention, crash safety."""
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
# Private: Orbax's commit step (rename of the temp dir), patched to delay or fail a commit.
from orbax.checkpoint._src.path import atomicity

from tests.utils.devices import need_devices
from ulysses_jax.training.checkpoint import (Checkpointer, IncompatibleCheckpoint,
                                             NoCheckpointRestores, SaveFailed)
from ulysses_jax.mesh import DATA, SEQ, make_mesh

# Orbax's name for a step directory that is still being written (not public API; if Orbax
# renames it, the interrupted-save test fails here rather than passing vacuously).
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _train_state(seed):
    """A train state with random params and a non-trivial adamw state (mu, nu, count != 0)."""
    ks = jax.random.split(jax.random.key(seed), 6)
    params = {
        "embed": jax.random.normal(ks[0], (32, 16), jnp.float32),
        "layer": {"w": jax.random.normal(ks[1], (16, 24), jnp.float32),
                  "b": jax.random.normal(ks[2], (24,), jnp.float32)},
    }
    tx = optax.adamw(1e-3)
    opt = tx.init(params)
    for k in ks[3:5]:  # two updates so the moments are random, not zeros
        grads = jax.tree.map(lambda p: jax.random.normal(k, p.shape, p.dtype), params)
        _, opt = tx.update(grads, opt, params)
    step = jax.random.randint(ks[5], (), 1, 10_000, jnp.int32)
    return {"step": step, "params": params, "opt": opt}


def _spec(x):
    # Matrices split on axis 0 over every device, the rest replicated: the layout of the brief.
    return P((DATA, SEQ)) if x.ndim >= 2 else P()


def _place(state, mesh):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, _spec(x))), state)


def _abstract(state, mesh):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, _spec(x))),
        state)


def _assert_restored(restored, expected, abstract):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    leaves = list(zip(jax.tree.leaves(restored), jax.tree.leaves(expected),
                      jax.tree.leaves(abstract)))
    assert len(leaves) == 11  # step, 3 params, adam count, mu (3), nu (3)
    for got, want, target in leaves:
        assert isinstance(got, jax.Array)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # bitwise
        assert got.sharding == target.sharding, (got.sharding, target.sharding)


def _steps_on_disk(directory):
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def test_round_trip_same_mesh(tmp_path):
    devs = need_devices(8)
    mesh = make_mesh(seq=4, data=2, devices=devs)
    state = _place(_train_state(0), mesh)
    extra = {"data": {"epoch": 3, "offset": 12345}, "config": {"seq_len": 4096}, "loss": 2.5}
    with Checkpointer(tmp_path / "ckpt") as ck:
        assert ck.latest_step() is None
        assert ck.save(7, state, extra)
        abstract = _abstract(state, mesh)
        restored, got_extra = ck.restore(abstract)  # no wait(): restore finishes the save first
        assert ck.latest_step() == 7
        assert os.listdir(ck.directory) == ["7"]
    _assert_restored(restored, state, abstract)
    assert got_extra == extra
    # Something real was sharded: a matrix is split 8 ways on axis 0.
    assert restored["params"]["embed"].addressable_shards[0].data.shape == (4, 16)


@pytest.mark.parametrize("target", ["seq2_data4", "one_device"])
def test_restore_onto_another_mesh(tmp_path, target):
    devs = need_devices(8)
    saved_on = make_mesh(seq=4, data=2, devices=devs)
    state = _place(_train_state(1), saved_on)
    with Checkpointer(tmp_path / "ckpt") as ck:
        ck.save(3, state, {"pos": 99})
    new_mesh = (make_mesh(seq=2, data=4, devices=devs) if target == "seq2_data4"
                else make_mesh(seq=1, data=1, devices=devs[-1:]))
    abstract = _abstract(state, new_mesh)
    # A fresh Checkpointer, as a resumed run would open it.
    with Checkpointer(tmp_path / "ckpt") as ck:
        restored, extra = ck.restore(abstract)
    _assert_restored(restored, state, abstract)
    assert extra == {"pos": 99}


def test_keep_last_n_and_save_every(tmp_path):
    state = {"w": jax.random.normal(jax.random.key(2), (8, 4))}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state)
    with Checkpointer(tmp_path / "keep", keep=2) as ck:
        for step in range(1, 6):
            assert ck.save(step, jax.tree.map(lambda x: x + step, state), {"step": step})
        ck.wait()
        assert ck.latest_step() == 5
        assert ck.all_steps() == [4, 5]
        assert _steps_on_disk(ck.directory) == [4, 5]
        old, extra = ck.restore(abstract, step=4)  # a specific, not-latest step
        assert extra == {"step": 4}
        np.testing.assert_array_equal(np.asarray(old["w"]), np.asarray(state["w"] + 4))

    with Checkpointer(tmp_path / "every", keep=10, save_every=2) as ck:
        saved = [ck.save(step, state, {}) for step in range(1, 6)]
        assert saved == [False, True, False, True, False]
        assert ck.save(5, state, {}, force=True)  # e.g. the final step of a run
        assert not ck.save(4, state, {}, force=True)  # already there: not written twice
        ck.wait()
        assert ck.all_steps() == [2, 4, 5]
        assert _steps_on_disk(ck.directory) == [2, 4, 5]
    with Checkpointer(tmp_path / "every") as ck:  # a fresh reader sees the same
        assert ck.latest_step() == 5 and ck.all_steps() == [2, 4, 5]


def test_leftover_partial_save_is_ignored(tmp_path):
    """A crash mid-save leaves DIR/<step>.orbax-checkpoint-tmp: never the latest, then cleaned."""
    state = {"w": jax.random.normal(jax.random.key(3), (8, 4))}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state)
    root = tmp_path / "ckpt"
    with Checkpointer(root) as ck:
        ck.save(1, state, {"step": 1})
        ck.save(2, jax.tree.map(lambda x: x * 2, state), {"step": 2})
    # Make step 3 look half-written: a copy of a real step, renamed as Orbax's temp dir and
    # missing its commit marker and part of its array data.
    partial = root / f"3{TMP_SUFFIX}"
    shutil.copytree(root / "2", partial)
    os.remove(partial / "commit_success.txt")
    shutil.rmtree(partial / "state" / "d")
    with Checkpointer(root) as ck:
        assert ck.latest_step() == 2
        restored, extra = ck.restore(abstract)
        assert extra == {"step": 2}
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"] * 2))
        # The run can go on and write step 3 for real; the leftover is gone.
        assert ck.save(3, state, {"step": 3})
    assert sorted(os.listdir(root)) == ["1", "2", "3"]


def test_failed_commit_keeps_previous_checkpoint(tmp_path, monkeypatch):
    """A save that dies after writing its data but before the commit (the rename), with keep=1
    so step 1 is already scheduled for deletion: step 1 must survive and stay the latest."""
    state = {"w": jax.random.normal(jax.random.key(4), (8, 4))}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state)
    root = tmp_path / "ckpt"
    ck = Checkpointer(root, keep=1)
    ck.save(1, state, {"step": 1})
    ck.wait()

    async def crash(self):
        raise OSError("simulated crash before commit")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", crash)
    assert ck.save(2, jax.tree.map(lambda x: -x, state), {"step": 2})
    with pytest.raises(SaveFailed, match="saving checkpoint step 2 .* simulated crash"):
        ck.wait()
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["1", f"2{TMP_SUFFIX}"]
    assert ck.latest_step() == 1  # same process: the failed step is not counted
    ck.close()

    with Checkpointer(root, keep=1) as ck:  # a restarted run
        assert ck.latest_step() == 1
        restored, extra = ck.restore(abstract)
    assert extra == {"step": 1}
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))


def test_restore_waits_for_inflight_save(tmp_path, monkeypatch):
    """restore() right after an async save returns that save's data, not an error or step 1."""
    commit, may_commit = atomicity.AtomicRenameTemporaryPath.finalize, threading.Event()

    async def held_commit(self):
        may_commit.wait(timeout=30)  # timeout: a bug must fail the test, not hang it
        await commit(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held_commit)
    state = {"w": jax.random.normal(jax.random.key(5), (8, 4))}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state)
    with Checkpointer(tmp_path / "ckpt") as ck:
        may_commit.set()
        ck.save(1, state, {"step": 1})
        ck.wait()
        may_commit.clear()
        ck.save(2, jax.tree.map(lambda x: x + 1, state), {"step": 2})
        assert "2" not in os.listdir(ck.directory)  # not committed yet
        threading.Timer(0.3, may_commit.set).start()  # commits while restore is already waiting
        restored, extra = ck.restore(abstract)
    assert extra == {"step": 2}
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"] + 1))


def _damage(step_dir, how):
    if how == "truncated":  # every file of the arrays cut to half
        for path in (step_dir / "state").rglob("*"):
            if path.is_file():
                os.truncate(path, path.stat().st_size // 2)
    elif how == "deleted_arrays_file":
        os.remove(step_dir / "state" / "manifest.ocdbt")
    elif how == "deleted_extra":
        os.remove(step_dir / "extra" / "metadata")
    else:  # an empty step directory
        shutil.rmtree(step_dir)
        step_dir.mkdir()


def _three_steps(root):
    """Steps 1, 2, 3 of a small state w; returns (state, abstract)."""
    state = {"w": jax.random.normal(jax.random.key(6), (8, 4))}
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, jax.tree.map(lambda x: x * step, state), {"step": step})
    return state, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


@pytest.mark.parametrize("how", ["truncated", "deleted_arrays_file", "deleted_extra", "empty"])
def test_restore_newest_sets_damaged_steps_aside(tmp_path, how):
    root = tmp_path / "ckpt"
    state, abstract = _three_steps(root)
    _damage(root / "3", how)
    _damage(root / "2", how)
    with Checkpointer(root) as ck:
        step, restored, extra, moved = ck.restore_newest(abstract)
        assert (step, extra) == (1, {"step": 1})
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
        assert [line.split(" (")[0] for line in moved] == [
            f"step 3 -> {root}.damaged/3", f"step 2 -> {root}.damaged/2"]
        assert ck.all_steps() == [1] and ck.latest_step() == 1
        assert ck.save(2, state, {"step": 2})  # the run goes on past the set-aside steps
    assert _steps_on_disk(root) == [1, 2]
    assert sorted(os.listdir(f"{root}.damaged")) == ["2", "3"]  # kept, not deleted


def test_restore_newest_refuses_other_shapes_and_all_damaged(tmp_path):
    root = tmp_path / "ckpt"
    _, abstract = _three_steps(root)
    with Checkpointer(tmp_path / "none") as empty:
        assert empty.restore_newest(abstract) is None
    with Checkpointer(root) as ck:
        wider = {"w": jax.ShapeDtypeStruct((8, 5), abstract["w"].dtype,
                                           sharding=abstract["w"].sharding)}
        with pytest.raises(IncompatibleCheckpoint, match=r"w: saved \(8, 4\) float32, wanted "
                                                         r"\(8, 5\) float32") as err:
            ck.restore_newest(wider)
        assert err.value.step == 3 and err.value.extra == {"step": 3}
        for step in (1, 2, 3):
            _damage(root / str(step), "empty")
        with pytest.raises(NoCheckpointRestores, match="step 3: .*; step 2: .*; step 1: "):
            ck.restore_newest(abstract)
    assert _steps_on_disk(root) == [1, 2, 3]  # nothing moved when nothing restores
    assert not os.path.exists(f"{root}.damaged")


def test_bad_calls(tmp_path):
    with Checkpointer(tmp_path / "empty") as ck:
        assert os.path.isabs(ck.directory) and os.path.isdir(ck.directory)
        with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
            ck.restore({"w": jax.ShapeDtypeStruct((2,), jnp.float32,
                                                  sharding=NamedSharding(make_mesh(1, 1), P()))})
        with pytest.raises(ValueError, match=r"\['w'\]"):
            ck.restore({"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
    with pytest.raises(ValueError, match="keep must be a positive integer, got 0"):
        Checkpointer(tmp_path / "x", keep=0)
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(tmp_path / "x", save_every=0)


def test_leftovers_of_a_failed_read_are_dropped_and_nothing_else(monkeypatch):
    """After a checkpoint read fails, exceptions of abandoned Orbax / TensorStore coroutines
    and "Event loop is closed" reach no one; any other unraisable exception still reaches
    the previous hook, and installing twice wraps once."""
    import sys
    import types

    from ulysses_jax.training import checkpoint as ckpt_lib
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u))
    ckpt_lib.quiet_checkpoint_leftovers()
    ckpt_lib.quiet_checkpoint_leftovers()
    hook = sys.unraisablehook
    assert hook._drops_checkpoint_leftovers

    def coroutine_from(filename):
        scope = {}
        exec(compile("async def read():\n    pass\n", filename, "exec"), scope)
        return scope["read"]()

    ours, orbax_one = coroutine_from("/x/ulysses_jax/fake.py"), coroutine_from(
        "/site-packages/orbax/checkpoint/fake.py")
    unraisable = lambda error, obj: types.SimpleNamespace(  # noqa: E731
        exc_value=error, object=obj, exc_type=type(error), exc_traceback=None, err_msg=None)
    hook(unraisable(RuntimeError("Event loop is closed"), None))
    hook(unraisable(ValueError("NOT_FOUND"), orbax_one))
    assert seen == []
    other = unraisable(ValueError("a real bug"), ours)
    hook(other)
    hook(unraisable(RuntimeError("Event loop is closing soon"), None))
    assert [u.exc_value.args[0] for u in seen] == ["a real bug", "Event loop is closing soon"]
    for c in (ours, orbax_one):
        c.close()
