"""Sequences packed into rows: a step's sequences, given one per row from position 0 (segment
id 1), placed first fit in order into rows of the same length, each its own segment, with
every per-token field moved along (``grpo.packing``, ``dpo.packing``). Segments do not see
each other in attention and positions restart in each, so what every token is trained with
is unchanged; the row count is rounded up to a few sizes, each a train step compiled once.

With micro-batches packed apart (DPO's pairs stay in their micro-batch) the packed rows are
laid out as accumulate.py splits rows: from each of the D data replicas' blocks of rows,
micro-batch m takes its m-th block; so the packed rows of micro-batch m are those its
sequences fill, and nothing else.
"""
from __future__ import annotations

import numpy as np

from ..generation.generator import few_sizes

SEQUENCE_IDS = "sequence_ids"  # [R, S]: each token's sequence in its micro-batch, from 1


def packed_row_count(rows: int, multiple: int, most: int) -> int:
    """Rows of a packed batch: ``rows`` rounded up to a multiple of ``multiple`` (the data
    replicas x micro-batches that split it), then to one of 8 steps per power of two of
    those (``generator.few_sizes``), so that a run compiles its step for a few row counts;
    at most ``most``."""
    return min(few_sizes(rows, multiple), most)


def micro_batch_rows(n: int, data: int, micro: int) -> np.ndarray:
    """int [micro, n / micro]: the rows of each micro-batch of ``n`` rows, in the order it
    holds them (accumulate.micro_batches: block m of each data replica's n / data rows);
    one micro-batch holds all ``n`` in order."""
    if micro == 1:
        return np.arange(n)[None]
    return np.arange(n).reshape(data, micro, -1).swapaxes(0, 1).reshape(micro, -1)


def first_fit(lengths, capacity: int) -> tuple[list[tuple[int, int]], int]:
    """Each length's (row, offset) when each goes, in order, into the first row of
    ``capacity`` with room; and the rows used."""
    used, place = [], []
    for length in lengths:
        r = next((r for r, u in enumerate(used) if u + length <= capacity), len(used))
        if r == len(used):
            used.append(0)
        place.append((r, used[r]))
        used[r] += int(length)
    return place, len(used)


def pack_rows(rows: dict, multiple: int, micro: int = 1, sequence_ids: bool = False) -> dict:
    """The sequences of ``rows`` packed into fewer rows, first fit in order, each its own
    segment (ids 1, 2, ... in a row) with its positions and every per-token field (loss
    mask, advantages, token weights) moved along; empty rows pad the count to
    ``packed_row_count``.

    Args:
      rows: numpy [N, S] fields, one sequence per row from position 0 (segment id 1; a row
        without one packs nothing).
      multiple: the data replicas that split each micro-batch's packed rows (GRPO: data
        replicas x micro-batches, with ``micro`` 1).
      micro: micro-batches packed apart (``micro_batch_rows``), each into the same number
        of rows, laid out as accumulate.py splits them.
      sequence_ids: also ``SEQUENCE_IDS``: each token's sequence, its index among its
        micro-batch's sequences (the order ``micro_batch_rows`` gives) plus 1; 0 on padding.

    Returns:
      numpy [R, S] fields, R = micro x the rows per micro-batch.
    """
    n, s = rows["tokens"].shape
    lengths = (rows["segment_ids"] > 0).sum(1)
    members = micro_batch_rows(n, multiple, micro)                    # [micro, N / micro]
    plans = [first_fit(lengths[m], s) for m in members]
    count = packed_row_count(micro * max(used for _, used in plans), micro * multiple, n)
    slots = micro_batch_rows(count, multiple, micro)                  # [micro, R / micro]
    out = {k: np.zeros((count, s), v.dtype) for k, v in rows.items()}
    if sequence_ids:
        out[SEQUENCE_IDS] = np.zeros((count, s), np.int32)
    segments = np.zeros(count, np.int32)
    for m, (place, _) in enumerate(plans):
        for i, (g, (r, at)) in enumerate(zip(members[m], place)):
            row, length = slots[m, r], lengths[g]
            for k, v in rows.items():
                out[k][row, at:at + length] = v[g, :length]
            segments[row] += 1
            out["segment_ids"][row, at:at + length] = segments[row]
            if sequence_ids:
                out[SEQUENCE_IDS][row, at:at + length] = i + 1
    return out


def packed_segments(lengths, capacity: int, per_batch: int, multiple: int,
                    micro: int = 1) -> np.ndarray:
    """int64: the segments (its sequences, plus 1 for a padded tail) of each row that
    ``pack_rows(rows, multiple, micro)`` makes of consecutive batches of ``per_batch``
    sequences of ``lengths`` (a short last batch padded with empty ones, as held-out
    batches are); the empty rows that round the count up are left out."""
    lengths = np.asarray(lengths, np.int64)
    out = []
    for start in range(0, len(lengths), per_batch):
        batch = np.zeros(per_batch, np.int64)
        part = lengths[start:start + per_batch]
        batch[:len(part)] = part
        for members in micro_batch_rows(per_batch, multiple, micro):
            place, used = first_fit(batch[members], capacity)
            rows = np.array([r for r, _ in place])
            real = batch[members] > 0
            count = np.bincount(rows[real], minlength=used)
            fill = np.bincount(rows, weights=batch[members], minlength=used)
            out.extend(count + (fill < capacity))
    return np.array(out, np.int64)
