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
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

_STATE, _EXTRA = "state", "extra"


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
                                              item_names=(_STATE, _EXTRA))

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
          The error of the previous save if it failed in the background (see ``wait``).
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
        return self._manager.save(step, args=args, force=force)

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

    def wait(self) -> None:
        """Blocks until background saves (and old-checkpoint deletion) are finished.

        Raises:
          The error of a background save that failed (once). That step is then not a
          checkpoint, and the previous ones stay usable.
        """
        try:
            self._manager.wait_until_finished()
        except Exception:
            # Orbax forgets the failed step but also the steps it had scheduled for deletion,
            # which are still on disk (deletion only follows a commit): re-read the directory.
            self._manager.reload()
            raise

    def close(self) -> None:
        """Waits for pending saves (raising a failure, see ``wait``); releases Orbax threads."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
