"""``dpo.reference: precompute``: every pair's reference log-probabilities, recorded once.

Before step 1 the initial model (the run's step-0 parameters: ``init_from``, or the seeded
initialisation) runs over every pair the run uses (train and held-out), a micro-batch at a
time, and each completion's summed log-probability goes to ``WORKDIR/reference_logps.npy``
(float32 [store documents, 2]: chosen, rejected; NaN for documents the run does not use).
Then the reference costs no parameters and no second forward pass per step: the rows carry
their ``ref_logps``.

The pass is resumable: every ``SAVE_EVERY_S`` seconds the part done so far is written to
``reference_logps.partial.npy`` (with ``reference_logps.json`` naming the data and how far it
got), so an interrupted run continues where it stopped. A run that resumes after step 0 reads
the finished file; the reference of a run never changes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from ...config import Config
from ...data import text as data_lib
from ...data.preference import PreferenceRows
from ...data.run_data import is_main, log

FILE, PARTIAL, META = "reference_logps.npy", "reference_logps.partial.npy", "reference_logps.json"
SAVE_EVERY_S = 60.0


class ReferenceError(ValueError):
    """The recorded reference cannot serve this run (named in the message)."""


def _identity(cfg: Config, pairs: np.ndarray, rows: list[PreferenceRows]) -> dict:
    """What the recorded values depend on: the data and the initial model."""
    return {"store": rows[0].store.manifest["fingerprint"], "seq_len": cfg.seq_len,
            "pairs": len(pairs), "pairs_hash": hashlib.blake2b(pairs.tobytes(),
                                                               digest_size=8).hexdigest(),
            "init_from": cfg.init_from, "init_adapter": cfg.init_adapter, "seed": cfg.seed,
            "model": hashlib.blake2b(json.dumps(dataclasses.asdict(cfg.model),
                                                sort_keys=True).encode(),
                                     digest_size=8).hexdigest()}


def _write(path: str, array: np.ndarray) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def load_or_compute(cfg: Config, logps_fn, params, rows: list[PreferenceRows],
                    workdir: str, start: int, progress: bool = True) -> np.ndarray:
    """The reference log-probabilities [store documents, 2] of ``rows``' pairs, read from
    ``workdir`` or computed with ``logps_fn(params, batch) -> logps [2b]`` (the step-0
    parameters; ``batch``: numpy FIELDS [2b, S] of b pairs' rows, 2i and 2i + 1 pair i's
    chosen and rejected, as the step's batches hold them before packing) and recorded.

    Raises:
      ReferenceError: ``start`` > 0 (the run has trained) and no finished record of this
        data and model is in ``workdir``: the initial parameters are gone, so it cannot be
        made again here.
    """
    pairs = np.unique(np.concatenate([r.ids for r in rows])).astype(np.int64)
    ident = _identity(cfg, pairs, rows)
    meta_path = os.path.join(workdir, META)
    meta = None
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    same = meta is not None and meta.get("identity") == ident
    done_file = os.path.join(workdir, FILE)
    if same and meta.get("done") == len(pairs) and os.path.exists(done_file):
        log(f"dpo: reference log-probabilities of {len(pairs)} pairs read from {done_file}")
        return np.load(done_file)
    if start > 0:
        raise ReferenceError(
            f"dpo.reference=precompute: this run resumes at step {start}, but {done_file} "
            f"does not hold the finished reference log-probabilities of this data and model "
            f"({'missing' if meta is None else 'recorded for other data or another model' if not same else 'unfinished'}); "
            f"they can only be computed from the step-0 model. Restore the file, or start "
            f"the run in a new workdir")
    num_docs = rows[0].store.num_docs
    ref = np.full((num_docs, 2), np.nan, np.float32)
    done = 0
    partial = os.path.join(workdir, PARTIAL)
    if same and os.path.exists(partial):
        ref, done = np.load(partial), int(meta["done"])
        log(f"dpo: continuing the reference pass at pair {done} of {len(pairs)}")
    all_rows = PreferenceRows(rows[0].store, pairs, cfg.seq_len, shuffle=False,
                              overflow="drop")
    micro = cfg.batch_size // cfg.grad_accum_steps  # pairs per pass: a micro-batch's memory
    bar = tqdm(total=len(pairs), initial=done, desc="reference", unit="pair",
               dynamic_ncols=True, disable=not (progress and is_main()))
    t0, last_save = time.time(), time.time()

    def save(n):
        if is_main():
            _write(partial, ref)
            with open(meta_path + ".tmp", "w") as f:
                json.dump({"identity": ident, "done": n}, f)
            os.replace(meta_path + ".tmp", meta_path)

    try:
        for first in range(done, len(pairs), micro):
            ids = list(range(first, min(first + micro, len(pairs))))
            rows_ = [all_rows.pair_row(i, w) for i in ids for w in (0, 1)]
            batch = {f: np.stack([r[f] for r in rows_]) for f in data_lib.FIELDS}
            if len(ids) < micro:  # padding pairs: no completion token, results unused
                pad = all_rows.empty_rows(2 * (micro - len(ids)))
                batch = {f: np.concatenate([batch[f], pad[f]]) for f in data_lib.FIELDS}
            logps = logps_fn(params, batch)
            logps = _host(logps)[:2 * len(ids)].reshape(-1, 2)
            ref[all_rows.ids[ids]] = logps
            bar.update(len(ids))
            if time.time() - last_save > SAVE_EVERY_S:
                save(ids[-1] + 1)
                last_save = time.time()
    finally:
        bar.close()
    if is_main():
        _write(done_file, ref)
        with open(meta_path + ".tmp", "w") as f:
            json.dump({"identity": ident, "done": len(pairs)}, f)
        os.replace(meta_path + ".tmp", meta_path)
        if os.path.exists(partial):
            os.remove(partial)
    log(f"dpo: reference log-probabilities of {len(pairs)} pairs computed in "
        f"{time.time() - t0:.1f} s and saved to {done_file}")
    return ref


def _host(x) -> np.ndarray:
    if jax.process_count() == 1:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
