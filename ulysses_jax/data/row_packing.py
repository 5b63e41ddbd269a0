"""Sequences packed into rows: a step's sequences, given one per row from position 0 (segment
id 1), placed first fit in order into rows of the same length, each its own segment, with
every per-token field moved along (GRPO's ``grpo.packing``). Segments do not see each other
in attention and positions restart in each, so what every token is trained with is
unchanged; the row count is rounded up to a few sizes, each a train step compiled once."""
from __future__ import annotations

import numpy as np

from ..generation.generator import few_sizes


def packed_row_count(rows: int, multiple: int, most: int) -> int:
    """Rows of a packed batch: ``rows`` rounded up to a multiple of ``multiple`` (the data
    replicas x micro-batches that split it), then to one of 8 steps per power of two of
    those (``generator.few_sizes``), so that a run compiles its step for a few row counts;
    at most ``most``."""
    return min(few_sizes(rows, multiple), most)


def pack_rows(rows: dict, multiple: int) -> dict:
    """The sequences of ``rows`` (numpy [N, S] fields, one sequence per row from position 0,
    segment id 1) packed into fewer rows: each goes, in order, into the first row with room
    (first fit), as its own segment (ids 1, 2, ... in a row) with its positions and every
    per-token field (loss mask, advantages, token weights) moved along; empty rows pad the
    count to ``packed_row_count``. The rows' tokens and what each token is trained with are
    unchanged, so is the loss: segments do not see each other in attention."""
    n, s = rows["tokens"].shape
    lengths = (rows["segment_ids"] > 0).sum(1)
    used, place = [], []
    for length in lengths:
        r = next((r for r, u in enumerate(used) if u + length <= s), len(used))
        if r == len(used):
            used.append(0)
        place.append((r, used[r]))
        used[r] += int(length)
    out = {k: np.zeros((packed_row_count(len(used), multiple, n), s), v.dtype)
           for k, v in rows.items()}
    segments = [0] * len(used)
    for i, ((r, at), length) in enumerate(zip(place, lengths)):
        for k, v in rows.items():
            out[k][r, at:at + length] = v[i, :length]
        segments[r] += 1
        out["segment_ids"][r, at:at + length] = segments[r]
    return out
