"""Training checkpoints: a thin wrapper around Orbax's ``CheckpointManager``.

Each checkpoint is one step directory ``DIR/<step>/`` with two items: ``state`` (a pytree of
``jax.Array``: step counter, params, optimizer state), written by every process for the shards
it owns, and ``extra`` (a JSON dict: data-iterator position, config, metrics).

Atomicity: Orbax writes a step into ``DIR/<step>.orbax-checkpoint-tmp`` and renames it to
``DIR/<step>`` only after every process has finished writing (on GCS, where rename is not
atomic, the final directory counts only once it holds ``commit_success.txt``). Step discovery
skips anything uncommitted, so a crash mid-save leaves the previous checkpoint as the latest one;
the leftover temp directory is deleted by the next ``Checkpointer`` on that directory before it
saves. Checkpoints beyond ``keep`` are deleted only after the new one is committed, so a failed
save never leaves fewer finished checkpoints than before.

Saves are asynchronous: ``save`` returns once the arrays are copied off the devices, the write
continues in a background thread. ``restore``, ``wait`` and ``close`` block until it is done.

Restoring reshards: the target layout comes from ``abstract_state`` (``ShapeDtypeStruct`` leaves
with ``.sharding``), so a run saved on one mesh resumes on another (or on one device).

Damage: a committed step whose files were later truncated or deleted (or an empty step
directory) fails to restore. ``restore_newest`` then falls back to the newest step that does
restore and moves the damaged newer ones to ``DIR.damaged/<step>`` (kept, not deleted). A step
that reads but holds other shapes than the requested state is not damage: it is refused
(``IncompatibleCheckpoint``) and nothing is moved.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as ocm

_STATE, _EXTRA = "state", "extra"


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (disk full, I/O error). That step is not a
    checkpoint; the ones before it are untouched."""


class IncompatibleCheckpoint(ValueError):
    """A readable checkpoint whose arrays do not match the requested state's shapes.

    Attributes: ``step``, ``extra`` (its JSON extras), ``diffs`` (one line per differing
    array, "path: saved ..., wanted ...")."""

    def __init__(self, step: int, extra: dict, diffs: list[str]):
        super().__init__(f"checkpoint step {step} holds other shapes: {'; '.join(diffs[:3])}"
                         f"{f' and {len(diffs) - 3} more' if len(diffs) > 3 else ''}")
        self.step, self.extra, self.diffs = step, extra, diffs


class NoCheckpointRestores(RuntimeError):
    """Every checkpoint in the directory is damaged; none was moved."""


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Handlers registered up front, so a step's metadata (shapes) can be read before, or
    without, restoring it."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state, extra = ocp.handlers.StandardCheckpointHandler(), ocp.handlers.JsonCheckpointHandler()
    for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
        registry.add(_STATE, args, state)
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add(_EXTRA, args, extra)
    return registry


def _is_leftover(unraisable) -> bool:
    """An exception nobody can catch any more, left by a failed checkpoint read or write:
    "Event loop is closed" (when one read or write fails, Orbax closes its event loop while
    TensorStore still completes the others, and each of their callbacks then fails that
    way), or the error of an abandoned Orbax / TensorStore coroutine collected after the
    first one was reported."""
    error, obj = unraisable.exc_value, unraisable.object
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    code = getattr(obj, "cr_code", None) or getattr(obj, "gi_code", None)
    where = getattr(code, "co_filename", "") or ""
    return any(part in where for part in ("orbax", "tensorstore"))


def quiet_checkpoint_leftovers() -> None:
    """Drops ``_is_leftover`` exceptions from ``sys.unraisablehook`` for the rest of the
    process (they can be collected long after the failure): the failure itself is reported
    once, as a clean message. Installed by every Checkpointer (and again at a failed read or
    write, in case something replaced the hook since); calling it again adds nothing."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_checkpoint_leftovers", False):
        return

    def hook(unraisable):
        if not _is_leftover(unraisable):
            previous(unraisable)

    hook._drops_checkpoint_leftovers = True
    sys.unraisablehook = hook


def _whole_replicas_on_cpu() -> None:
    """On CPU devices, each replicated array is written from one replica, whole.

    Orbax's default outside GPUs ("replica-parallel") cuts a replicated array into one slice
    per replica so that the replicas copy to the host in parallel. CPU devices share the
    host's memory, so the slices buy nothing there, and each is an eager slice that XLA
    compiles for its shape: a tiny run's two saves took 0.7 to 1.0 s longer with them and a
    135M model's final save about 6 s (8 fake CPU devices). Where the first
    device is not a CPU (GPUs), Orbax's choice stands.
    """
    if jax.devices()[0].platform != "cpu" or getattr(_whole_replicas_on_cpu, "done", False):
        return
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
    _whole_replicas_on_cpu.done = True


class Checkpointer:
    """Saves and restores (train state, JSON extras) pairs under one directory.

    Call every method from every process: Orbax coordinates who writes what.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3,
                 save_every: int | None = None):
        """Opens (creating if missing) a checkpoint directory.

        Args:
          directory: where step directories live, e.g. ``WORKDIR/checkpoints``; made absolute
            because Orbax's async writers and other processes must not depend on the cwd.
          keep: how many of the most recent checkpoints to keep (>= 1).
          save_every: ``save`` writes only steps that are multiples of this (unless forced);
            None writes every step it is given.
        """
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        _whole_replicas_on_cpu()
        # From now on, not at a failure: a failing write's leftovers can surface before
        # Orbax reports the write itself as failed.
        quiet_checkpoint_leftovers()
        if save_every is not None and (not isinstance(save_every, int) or save_every < 1):
            raise ValueError(f"save_every must be a positive integer or None, got {save_every!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep, self.save_every = keep, save_every
        # Explicit policies rather than max_to_keep/save_interval_steps (deprecated in 0.12).
        # No InitialSavePolicy: the first step must obey save_every like any other.
        # PreemptionCheckpointingPolicy saves at the step where JAX's preemption sync point
        # fires, so a preempted job loses no work.
        save_policy = ocm.AnySavePolicy([
            ocm.FixedIntervalPolicy(save_every or 1),
            ocm.PreemptionCheckpointingPolicy(),
        ])
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=save_policy,
            preservation_policy=ocm.LatestN(keep),
            create=True,
            cleanup_tmp_directories=True,  # leftovers of saves that crashed
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              handler_registry=_registry())
        self._saving: int | None = None  # the step of a save that may still be in flight

    def latest_step(self) -> int | None:
        """Returns the newest checkpoint step, or None when there is none.

        A save still running in the background in this process counts (``restore`` waits for
        it); unfinished saves from a crashed process never do.
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Returns the steps of the kept checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, extra: dict, *, force: bool = False) -> bool:
        """Starts writing checkpoint ``step`` (asynchronously).

        Args:
          step: the optimizer step this state is at.
          state: pytree of ``jax.Array`` (sharded or not) to save.
          extra: JSON-serialisable dict saved beside the state.
          force: save even if ``step`` is not a multiple of ``save_every``.

        Returns:
          True if a save was started; False if skipped (off the ``save_every`` grid, not newer
          than the latest checkpoint unless forced, or ``step`` already saved).

        Raises:
          SaveFailed: this save, or the previous one in the background, failed.
        """
        # Orbax waits for the previous save inside save() anyway; waiting here first lets a
        # failure of it go through wait()'s bookkeeping.
        self.wait()
        # Orbax raises on an existing step even when forced; a final forced save that lands on
        # a periodic one is normal in a training loop, so treat it as already done.
        if step in self._manager.all_steps():
            return False
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(state),
                                     _EXTRA: ocp.args.JsonSave(extra)})
        self._saving = step
        try:
            return self._manager.save(step, args=args, force=force)
        except Exception as e:  # the synchronous part: directories, array copies
            raise self._failed(e) from e

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """Reads a checkpoint into the layout described by ``abstract_state``.

        Args:
          abstract_state: pytree with the structure of the saved state whose leaves are
            ``jax.ShapeDtypeStruct`` with ``.sharding`` set for the target mesh, e.g.
            ``jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), ...)``.
          step: which checkpoint; default the latest finished one.

        Returns:
          ``(state, extra)``: arrays laid out as requested, and the saved dict.
        """
        missing = [jax.tree_util.keystr(path) for path, leaf in
                   jax.tree_util.tree_leaves_with_path(abstract_state)
                   if getattr(leaf, "sharding", None) is None]
        if missing:
            raise ValueError(f"abstract_state leaves need a .sharding for the target mesh; "
                             f"missing at {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")
        # A save of ours may still be in flight; finish it so "latest" means written.
        self.wait()
        if step is None:
            step = self._manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        out = self._manager.restore(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardRestore(abstract_state),
            _EXTRA: ocp.args.JsonRestore()}))
        return out[_STATE], out[_EXTRA]

    def restore_newest(self, abstract_state: Any,
                       check: Callable[[int, dict], None] | None = None):
        """Restores the newest checkpoint that restores, setting damaged newer ones aside.

        Args:
          abstract_state: as for ``restore``.
          check: ``check(step, extra)`` may refuse an intact checkpoint by raising (e.g. it
            was saved for other data); that ends the search, nothing is moved.

        Returns:
          None if there is no checkpoint, else ``(step, state, extra, moved)``: ``moved`` has
          one "step S -> path (reason)" line per damaged newer checkpoint moved aside.

        Raises:
          IncompatibleCheckpoint: the newest readable checkpoint has other shapes.
          NoCheckpointRestores: every checkpoint is damaged.
        """
        self.wait()
        wanted = _shapes(abstract_state)
        damaged = []
        for step in reversed(self.all_steps()):
            try:
                extra, saved = self._read_extra(step), self._saved_shapes(step)
            except Exception as e:  # any unreadable file: Orbax and TensorStore raise many types
                quiet_checkpoint_leftovers()
                damaged.append((step, e))
                continue
            diffs = _diff(saved, wanted)
            if diffs:
                raise IncompatibleCheckpoint(step, extra, diffs)
            if check is not None:
                check(step, extra)
            try:
                state = self.restore(abstract_state, step)[0]
            except Exception as e:
                quiet_checkpoint_leftovers()
                damaged.append((step, e))
                continue
            return step, state, extra, [self._set_aside(s, e) for s, e in damaged]
        if damaged:
            raise NoCheckpointRestores(
                f"no checkpoint in {self.directory} restores: " + "; ".join(
                    f"step {s}: {_first_line(e)}" for s, e in damaged))
        return None

    def _read_extra(self, step: int) -> dict:
        return self._manager.restore(
            step, args=ocp.args.Composite(**{_EXTRA: ocp.args.JsonRestore()}))[_EXTRA]

    def _saved_shapes(self, step: int) -> dict:
        tree = self._manager.metadata(step).item_metadata[_STATE]
        if tree is None:
            raise FileNotFoundError(f"no array metadata in step {step}")
        return _shapes(tree)

    def _set_aside(self, step: int, error: Exception) -> str:
        """Moves damaged step ``step`` to ``DIR.damaged/<step>[.n]``; returns a line on it."""
        aside = f"{self.directory}.damaged"
        target, n = os.path.join(aside, str(step)), 0
        while os.path.exists(target):
            n += 1
            target = os.path.join(aside, f"{step}.{n}")
        if jax.process_index() == 0:
            os.makedirs(aside, exist_ok=True)
            os.rename(os.path.join(self.directory, str(step)), target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint set aside {step}")
        self._manager.reload()
        return f"step {step} -> {target} ({_first_line(error)})"

    def wait(self) -> None:
        """Blocks until background saves (and old-checkpoint deletion) are finished.

        Raises:
          SaveFailed: a background save failed (raised once). That step is then not a
            checkpoint, and the previous ones stay usable.
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._failed(e) from e
        self._saving = None

    def _failed(self, error: Exception) -> SaveFailed:
        quiet_checkpoint_leftovers()
        # Orbax forgets the failed step but also the steps it had scheduled for deletion,
        # which are still on disk (deletion only follows a commit): re-read the directory.
        self._manager.reload()
        step, self._saving = self._saving, None
        return SaveFailed(f"saving checkpoint step {step} in {self.directory} failed: "
                          f"{_write_error(error)}")

    def close(self) -> None:
        """Waits for pending saves (raising SaveFailed, see ``wait``); releases Orbax threads."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """"a/b/c" -> (shape, dtype) of each array leaf. Keys are names only, so a namedtuple
    field (``.mu``) and the dict key Orbax saves it under (``["mu"]``) compare equal."""
    def name(k):
        return str(next(getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)))
    return {"/".join(name(k) for k in path): (tuple(leaf.shape), np.dtype(leaf.dtype).name)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _diff(saved: dict, wanted: dict) -> list[str]:
    """One line per array that differs between two ``_shapes`` dicts, in ``wanted``'s order
    (then the saved-only arrays)."""
    def show(entry):
        return "absent" if entry is None else f"{entry[0]} {entry[1]}"
    keys = list(wanted) + [k for k in saved if k not in wanted]
    return [f"{k}: saved {show(saved.get(k))}, wanted {show(wanted.get(k))}"
            for k in keys if saved.get(k) != wanted.get(k)]


def _write_error(error: BaseException) -> str:
    """The operating system's reason for a failed write ("No space left on device (errno
    28)"), which TensorStore reports inside a long message; else the error's first line."""
    code = getattr(error, "errno", None)
    if code is None:
        found = re.search(r"os_error_code='(\d+)'", str(error))
        code = int(found.group(1)) if found else None
    return f"{os.strerror(code)} (errno {code})" if code else _first_line(error)


def _first_line(error: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of an error, cut to ``limit`` characters (TensorStore's errors
    carry a long JSON spec; Orbax's read errors end in the repr of a bound method, dropped)."""
    text = str(error).strip()
    first = text.splitlines()[0].split(" See full TensorStore details")[0] if text else ""
    line = f"{type(error).__name__}: {first}"
    return line if len(line) <= limit else line[:limit] + " ..."
