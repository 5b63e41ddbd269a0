"""Packing plans over a token store: rows of S tokens read straight from the memory maps.

Both classes have ``PackedRows``' interface (``num_rows``, ``row(index, epoch, seed)``,
``rows``, ``segments_per_row``, ``empty_rows``, ``fingerprint``), so ``BatchIterator``,
``shard_batch`` and the trainer use them unchanged, and a resume position stays one global
row index g (epoch g // num_rows): independent of workers, processes and mesh.

* ``StoreRows`` (text stores): the pretraining rule of ``text.py`` exactly (documents, each
  ending with EOS, in a seeded per-epoch order, cut into rows that read one token past their
  end). Only the order and cumulative lengths are held per epoch (16 bytes a document).
* ``ChatRows`` (chat stores): whole conversations per row, one segment each, placed by best
  fit (each conversation, in a seeded order, goes to the open row with the least room that
  still holds it). The plan is made once per run; each epoch visits its rows in a seeded
  order. A conversation longer than S is truncated to its first S tokens or dropped
  (``data.chat_overflow``); both are counted. One with images or videos is always dropped
  when longer than S: truncation could cut through its placeholders. The loss mask of token t is the weight of token
  t+1 (the target), so supervised targets are exactly the assistant answers' tokens.
"""
from __future__ import annotations

import bisect
import hashlib

import numpy as np

from .preference import PreferenceRows
from .text import PackedRows, PlannedRows, heldout_mask
from .store import TokenStore, unit_hash


class _StoreDocs:
    """The documents ``ids`` of a store as a lazy sequence of memory-map views."""

    def __init__(self, store: TokenStore, ids: np.ndarray):
        self.store, self.ids = store, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.store.view(int(self.ids[i]))


class StoreRows(PackedRows):
    """The pretraining packing rule over documents ``ids`` of a text store.

    Args:
      store: an open TokenStore of kind "text" (documents end with EOS).
      ids: int64 [n] the store documents to pack (a split).
      seq_len: S.
      shuffle: a seeded per-epoch document order (training) or the stored order (held-out).
    """

    def __init__(self, store: TokenStore, ids: np.ndarray, seq_len: int, shuffle: bool = True,
                 pad_id: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if len(ids) == 0:
            raise ValueError("no document to pack")
        self.store, self.ids = store, np.asarray(ids, np.int64)
        self.docs = _StoreDocs(store, self.ids)
        self.seq_len, self.eos_id, self.shuffle, self.pad_id = (seq_len, store.eos_id, shuffle,
                                                                pad_id)
        self.lengths = store.lengths()[self.ids]  # EOS included
        self.num_tokens = int(self.lengths.sum())
        self.num_rows = -(-(self.num_tokens - 1) // seq_len)
        self._layouts = {}

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{self.store.manifest['fingerprint']}\0{self.seq_len}\0{self.shuffle}".encode())
        h.update(self.ids.tobytes())
        return h.hexdigest()


class ChatRows(PlannedRows):
    """Whole conversations per row, best fit, over documents ``ids`` of a chat store.

    Args:
      store: an open TokenStore of kind "chat".
      ids: int64 [n] conversations to pack.
      seq_len: S.
      seed: seeds the plan (placement order); epoch e visits rows in rng((seed, e)) order.
      shuffle: False keeps the plan's rows in order every epoch (held-out data).
      overflow: "truncate" (keep the first S tokens) or "drop" a conversation longer than S;
        one with media is dropped either way (counted in ``num_long_media``).
    """

    def __init__(self, store: TokenStore, ids: np.ndarray, seq_len: int, seed: int = 0,
                 shuffle: bool = True, overflow: str = "truncate", pad_id: int = 0):
        if overflow not in ("truncate", "drop"):
            raise ValueError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.store, self.seq_len, self.shuffle, self.pad_id = store, seq_len, shuffle, pad_id
        self.eos_id, self.plan_seed, self.overflow = store.eos_id, seed, overflow
        ids = np.asarray(ids, np.int64)
        lengths = store.lengths()[ids]
        long = lengths > seq_len
        drop = dropped(store, ids, seq_len, overflow)
        self.num_long = int(long.sum())
        self.num_long_media = int((long & store.has_media()[ids]).sum())
        self.long_unsupervised = sum(  # truncation cut off every answer of these
            1 for d in ids[long & ~drop] if not store.view(int(d), weights=True)[1:seq_len].any())
        ids, lengths = ids[~drop], lengths[~drop]
        if len(ids) == 0:
            raise ValueError(f"no conversation fits in seq_len {seq_len} (all {self.num_long} "
                             f"are longer and dropped: data.chat_overflow is {overflow!r}, "
                             f"{self.num_long_media} hold images or videos, which are never "
                             f"truncated)")
        self.ids, self.lengths = ids, np.minimum(lengths, seq_len)
        rows = self._best_fit(np.random.default_rng(seed).permutation(len(ids)) if shuffle
                              else np.arange(len(ids)))
        self.row_start = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        self.row_docs = np.concatenate([np.asarray(r, np.int64) for r in rows])  # local idx
        self.row_fill = np.add.reduceat(self.lengths[self.row_docs], self.row_start[:-1])
        self.num_rows = len(rows)
        self.num_tokens = int(self.lengths.sum())
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _best_fit(self, order: np.ndarray) -> list[list[int]]:
        """Rows (lists of local conversation indices): each conversation goes to the open
        row with the least room that holds it; rooms are kept in buckets by size."""
        S, rows = self.seq_len, []
        rooms: list[int] = []  # sorted distinct room sizes with a non-empty bucket
        bucket: dict[int, list[int]] = {}  # room -> rows with that much room
        for i in order:
            n = int(self.lengths[i])
            k = bisect.bisect_left(rooms, n)
            if k == len(rooms):
                r, room = len(rows), S
                rows.append([])
            else:
                room = rooms[k]
                r = bucket[room].pop()
                if not bucket[room]:
                    del bucket[room]
                    rooms.pop(k)
            rows[r].append(int(i))
            left = room - n
            if left > 0:
                if left not in bucket:
                    bisect.insort(rooms, left)
                    bucket[left] = []
                bucket[left].append(r)
        return rows

    def _units(self) -> int:
        return self.num_rows

    def row(self, index: int, epoch: int = 0, seed: int = 0) -> dict:
        """Row ``index`` of ``epoch``: dict of FIELDS, each [S]."""
        if not 0 <= index < self.num_rows:
            raise IndexError(f"row {index} out of range [0, {self.num_rows})")
        r = int(self._perm(seed, epoch)[index])
        out = {f: v[0] for f, v in self.empty_rows(1).items()}
        p = 0
        for seg, i in enumerate(self.row_docs[self.row_start[r]:self.row_start[r + 1]], 1):
            n, d = int(self.lengths[i]), int(self.ids[i])
            tok = self.store.view(d)[:n]
            w = self.store.view(d, weights=True)[:n]
            mask = w[1:] > 0  # the target (next token) is an answer token
            out["tokens"][p:p + n] = tok
            out["targets"][p:p + n - 1] = np.where(mask, tok[1:], self.pad_id)
            out["loss_mask"][p:p + n - 1] = mask
            out["segment_ids"][p:p + n] = seg
            out["positions"][p:p + n] = np.arange(n)
            p += n
        return out

    def row_media(self, index: int, epoch: int = 0, seed: int = 0) -> list[dict]:
        """The images and videos of row ``index`` of ``epoch`` (the row ``row`` returns), in
        the order of their placeholders in the row: ``TokenStore.media``'s items of its
        conversations, segment by segment. [] for a row without media."""
        if not 0 <= index < self.num_rows:
            raise IndexError(f"row {index} out of range [0, {self.num_rows})")
        r = int(self._perm(seed, epoch)[index])
        return [item for i in self.row_docs[self.row_start[r]:self.row_start[r + 1]]
                for item in self.store.media(int(self.ids[i]))]

    def segments_per_row(self, epoch: int = 0, seed: int = 0) -> np.ndarray:
        """Segment ids per row of ``epoch`` (conversations, plus one for padding), [num_rows]."""
        counts = np.diff(self.row_start) + (self.row_fill < self.seq_len)
        return counts[self._perm(seed, epoch)].astype(np.int64)


def dropped(store: TokenStore, ids: np.ndarray, seq_len: int, overflow: str) -> np.ndarray:
    """bool [len(ids)]: the conversations ChatRows leaves out, those longer than seq_len that
    are dropped (``overflow`` "drop") or hold media (never truncated)."""
    long = store.lengths()[ids] > seq_len
    return long if overflow == "drop" else long & store.has_media()[ids]


def split_store(store: TokenStore, heldout_fraction: float, seed: int):
    """(train ids, held-out ids) of a store's documents, int64 each: a document is held out
    iff the hash of (its name, seed) is below the fraction (``text.heldout_mask``: both parts
    non-empty with >= 2 documents, a lone document kept for training)."""
    held = heldout_mask(unit_hash(store.doc_hashes(), seed), heldout_fraction)
    return np.flatnonzero(~held), np.flatnonzero(held)


def heldout_store_rows(path: str, seq_len: int, fraction: float, seed: int = 0,
                       overflow: str = "truncate"):
    """The held-out rows of the store at ``path`` as ``store_rows`` makes them (the same
    documents and packing), or None when none are held out; a ``fraction`` of 1 holds out
    every document (for evaluation: nothing is left to train on).

    Raises:
      ValueError: an unreadable store, a fraction outside [0, 1], or (chat) every held-out
        conversation is dropped for its length.
    """
    store = TokenStore(path)
    ids = (np.arange(store.num_docs, dtype=np.int64) if fraction == 1 else
           split_store(store, fraction, seed)[1])
    if not len(ids):
        return None
    if store.preference:
        return PreferenceRows(store, ids, seq_len, seed, shuffle=False, overflow=overflow)
    if not store.chat:
        return StoreRows(store, ids, seq_len, shuffle=False)
    if dropped(store, ids, seq_len, overflow).all():
        raise ValueError(f"all {len(ids)} held-out conversations are longer than seq_len "
                         f"{seq_len} and dropped (data.chat_overflow {overflow!r}, or images "
                         f"or videos, which are never truncated)")
    return ChatRows(store, ids, seq_len, seed, shuffle=False, overflow=overflow)


def store_rows(path: str, seq_len: int, heldout_fraction: float = 0.0, seed: int = 0,
               overflow: str = "truncate"):
    """(train rows, held-out rows or None, notes to log) of the store at ``path``."""
    store = TokenStore(path)
    train, held = split_store(store, heldout_fraction, seed)
    if len(train) == 0:
        raise ValueError(f"{path}: all {store.num_docs} document(s) fall in the held-out "
                         f"split (heldout_fraction {heldout_fraction}); lower it")
    if store.preference:
        rows = [PreferenceRows(store, ids, seq_len, seed, shuffle=s, overflow=overflow)
                for ids, s in ((train, True), (held, False)) if len(ids)]
        notes = [f"preference store: {sum(r.num_pairs for r in rows)} pairs, two rows of "
                 f"{seq_len} tokens each (chosen, rejected)"
                 + (f"; {sum(r.num_long for r in rows)} longer than seq_len were dropped"
                    if overflow == "drop" else "")]
    elif store.chat:
        dropped_held = 0
        if len(held) and seq_len > 0 and dropped(store, held, seq_len, overflow).all():
            # Every held-out conversation is too long: no held-out loss, training goes on.
            held, dropped_held = held[:0], len(held)
        rows = [ChatRows(store, ids, seq_len, seed, shuffle=s, overflow=overflow)
                for ids, s in ((train, True), (held, False)) if len(ids)]
        long = sum(r.num_long for r in rows)
        long_media = sum(r.num_long_media for r in rows)
        lost = sum(r.long_unsupervised for r in rows)
        n_rows = sum(r.num_rows for r in rows)
        fill = sum(r.num_tokens for r in rows) / (n_rows * seq_len)
        notes = [f"chat store: {n_rows} rows of {seq_len} tokens hold "
                 f"{sum(len(r.ids) for r in rows)} conversations ({fill:.1%} full); "
                 + (f"{long} longer than seq_len were dropped" if overflow == "drop" else
                    f"{long - long_media} longer than seq_len were truncated")
                 + (f" ({lost} of them lost every answer)" if lost else "")
                 + (f"; {long_media} longer than seq_len with images or videos were dropped "
                    f"(never truncated through their placeholders)"
                    if long_media and overflow == "truncate" else "")
                 + (f"; all {dropped_held} held-out conversations are longer than seq_len: "
                    f"no held-out rows" if dropped_held else "")]
    else:
        rows = [StoreRows(store, ids, seq_len, shuffle=s)
                for ids, s in ((train, True), (held, False)) if len(ids)]
        notes = [f"text store: {store.num_docs} documents, {store.manifest['num_tokens']} tokens"]
    return rows[0], (rows[1] if len(rows) > 1 else None), notes
