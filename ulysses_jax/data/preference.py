"""Preference pairs (DPO): TRL's ``prompt`` / ``chosen`` / ``rejected`` records -> a store of
pairs -> rows of chosen and rejected sequences.

**Encoding** (``encode_pair``). A record's three fields are all text or all message lists:
- text: the prompt, then each completion followed by EOS (as TRL's DPOTrainer appends it);
- conversational: the prompt rendered with the generation prompt, ``P``; each completion is
  the rest of ``render(prompt + completion)`` after ``P``, through its end-of-turn token (the
  whitespace after it is not part of it, as an SFT answer's span in ``chat.py``). A template
  whose rendering of prompt + completion does not start with ``P`` is refused (not
  prefix-stable).
Pieces are tokenized as inside the whole text (``pieces.py``), so no token straddles the
prompt's end. A pair is one store document: the prompt's tokens once, then the chosen, then
the rejected completion's, with per-token weights 0, 1 and 2 telling them apart
(``WEIGHT_CHOSEN``, ``WEIGHT_REJECTED``).

**Rows** (``PreferenceRows``). Each pair gives two rows of S tokens, the chosen sequence
(prompt + chosen) and the rejected one (prompt + rejected), each one segment from position 0
and padded after it; the loss mask marks the targets that are completion tokens. Rows 2i
and 2i + 1 of an epoch are pair i's chosen and rejected rows, so a batch of 2B rows holds B
whole pairs, and so does every data replica's and every micro-batch's block of it. A pair
whose longer sequence exceeds S is never truncated: it is an error naming it, or with
``data.chat_overflow=drop`` it is dropped and counted.
"""
from __future__ import annotations

import os

import numpy as np

from .chat import NotPrefixStable, _check_messages, _render
from .pieces import encode_pieces
from .row_packing import packed_segments
from .sources import PAIR_KEYS
from .store import NAMES, TokenStore
from .text import FIELDS, PlannedRows

WEIGHT_CHOSEN, WEIGHT_REJECTED = 1, 2
MAX_NAMED = 5


class BadPair(ValueError):
    """A record that cannot be a preference pair (named in the message)."""


def _completion_texts(template, pair: dict, name: str) -> tuple[str, list[str]]:
    """(rendered prompt with the generation prompt, [chosen text, rejected text])."""
    prompt = pair["prompt"]
    _check_messages(prompt, f"{name} prompt")
    head = _render(template, prompt, len(prompt), name, add_generation_prompt=True)
    texts = []
    for key in ("chosen", "rejected"):
        messages = list(prompt) + list(pair[key])
        _check_messages(messages, f"{name} {key}")
        full = _render(template, messages, len(messages), name)
        if not full.startswith(head):
            raise NotPrefixStable(
                f"{name}: the chat template is not prefix-stable for the {key} completion: "
                f"the prompt + {key} text does not start with the prompt rendered with the "
                f"generation prompt; pick a template that renders each turn the same "
                f"whatever follows it")
        texts.append(full[len(head):].rstrip())
    return head, texts


def encode_pair(tokenizer, template, pair: dict, name: str = "pair"):
    """Tokens and weights of one pair: the prompt's tokens (weight 0), the chosen
    completion's (1), the rejected completion's (2).

    Args:
      tokenizer: ``text.HFTokenizer`` or ``text.ByteTokenizer``.
      template: a ``chat.ChatTemplate`` for conversational records (None: text only).
      pair: {"prompt", "chosen", "rejected"}, each text or a list of messages.

    Raises:
      BadPair: text mixed with message lists, messages without a chat template, an empty
        prompt or completion; NotPrefixStable: the template rewrites the prompt.
    """
    kinds = {k: isinstance(pair[k], list) for k in PAIR_KEYS}
    if len(set(kinds.values())) > 1:
        got = ", ".join(k + (" as messages" if v else " as text") for k, v in kinds.items())
        raise BadPair(f"{name}: prompt, chosen and rejected must all be text or all be message "
                      f"lists; got {got}")
    if kinds["prompt"]:
        if template is None:
            raise BadPair(f"{name}: a conversational pair (message lists) needs a chat "
                          f"template: give --tokenizer a directory with one, or "
                          f"--chat-template")
        head, texts = _completion_texts(template, pair, name)
        eos = []
    else:
        head, texts, eos = pair["prompt"], [pair["chosen"], pair["rejected"]], [tokenizer.eos_id]
    encoded = [encode_pieces(tokenizer, [head, t]) for t in texts]
    prompt = encoded[0][0]
    if not np.array_equal(prompt, encoded[1][0]):  # the first piece encodes on its own
        raise BadPair(f"{name}: the prompt encodes differently before the two completions")
    if not len(prompt):
        raise BadPair(f"{name}: the prompt encodes to no token (the first completion token "
                      f"would have nothing to be predicted from)")
    parts, weights = [prompt], [np.zeros(len(prompt), np.uint8)]
    for (_, ids), w, key in zip(encoded, (WEIGHT_CHOSEN, WEIGHT_REJECTED),
                                ("chosen", "rejected")):
        ids = np.concatenate([np.asarray(ids, np.int32), np.asarray(eos, np.int32)])
        if not len(ids):
            raise BadPair(f"{name}: the {key} completion encodes to no token")
        parts.append(ids)
        weights.append(np.full(len(ids), w, np.uint8))
    return np.concatenate(parts).astype(np.int32), np.concatenate(weights)


def pair_lengths(store: TokenStore, ids: np.ndarray) -> np.ndarray:
    """int64 [len(ids), 3]: each pair's prompt, chosen and rejected token counts."""
    out = np.zeros((len(ids), 3), np.int64)
    for i, d in enumerate(ids):
        w = np.asarray(store.view(int(d), weights=True))
        out[i] = [np.count_nonzero(w == v) for v in (0, WEIGHT_CHOSEN, WEIGHT_REJECTED)]
    return out


def store_names(store: TokenStore, ids) -> list[str]:
    """The record names (file:line or file:row) of documents ``ids`` of a preference store."""
    path = os.path.join(store.path, NAMES)
    if not os.path.isfile(path):
        return [f"pair {int(d)}" for d in ids]
    with open(path, encoding="utf-8") as f:
        names = f.read().split("\n")
    return [names[int(d)] for d in ids]


class PreferenceRows(PlannedRows):
    """Chosen and rejected rows of the pairs ``ids`` of a preference store (module docstring).

    Args:
      store: an open TokenStore of kind "preference".
      ids: int64 [n] the store documents (pairs) to use.
      seq_len: S.
      seed: epoch e visits the pairs in rng((seed, e)) order (``shuffle``).
      shuffle: False keeps the given order every epoch (held-out data, evaluation).
      overflow: ``data.chat_overflow``: "drop" leaves out a pair longer than S (counted in
        ``num_long``); anything else refuses it.
      pad_id: token and target value of padding.

    Attributes:
      ref: float32 [num store documents, 2] or None: the reference log-probabilities of each
        pair's chosen and rejected completion (``attach_reference``); rows then carry a
        ``ref_logps`` field.
      packed: None, or how batches of these rows are packed (``dpo.packing``): (sequences
        per batch, data replicas, micro-batches), ``row_packing.pack_rows``' split; then
        ``segments_per_row`` counts the packed rows' segments.
    """

    row_fields: tuple = ()
    _FINGERPRINT_KIND = "\0preference"

    def __init__(self, store: TokenStore, ids: np.ndarray, seq_len: int, seed: int = 0,
                 shuffle: bool = True, overflow: str = "truncate", pad_id: int = 0):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 for preference pairs, got {seq_len}")
        self.store, self.seq_len, self.shuffle, self.pad_id = store, seq_len, shuffle, pad_id
        self.eos_id, self.plan_seed, self.overflow = store.eos_id, seed, overflow
        ids = np.asarray(ids, np.int64)
        lengths = pair_lengths(store, ids)
        longest = lengths[:, 0] + lengths[:, 1:].max(axis=1)
        long = longest > seq_len
        self.num_long = int(long.sum())
        if self.num_long and overflow != "drop":
            named = [f"{n} ({int(t)} tokens)" for n, t in
                     zip(store_names(store, ids[long][:MAX_NAMED]), longest[long][:MAX_NAMED])]
            raise ValueError(
                f"{self.num_long} preference pair(s) are longer than seq_len {seq_len} with "
                f"their longer completion: {'; '.join(named)}"
                f"{'; ...' if self.num_long > MAX_NAMED else ''}. Pairs are never truncated: "
                f"raise seq_len, or set data.chat_overflow=drop to leave them out (counted)")
        self.ids, self.lengths = ids[~long], lengths[~long]
        if not len(self.ids):
            raise ValueError(f"no preference pair fits in seq_len {seq_len} (all "
                             f"{self.num_long} are longer and dropped)")
        self.num_pairs = len(self.ids)
        self.num_rows = 2 * self.num_pairs
        self.num_tokens = int((2 * self.lengths[:, 0] + self.lengths[:, 1:].sum(1)).sum())
        self.ref = None
        self.packed = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def attach_reference(self, ref: np.ndarray) -> None:
        """Rows from now on carry ``ref_logps`` (float32 scalars): ``ref[document, 0]`` on a
        chosen row, ``ref[document, 1]`` on a rejected one."""
        self.ref = np.asarray(ref, np.float32)
        self.row_fields = ("ref_logps",)

    def _units(self) -> int:  # epochs visit pairs, each as its two rows
        return self.num_pairs

    def pair_row(self, i: int, which: int) -> dict:
        """Local pair ``i``'s chosen (``which`` 0) or rejected (1) row: dict of FIELDS [S]
        (plus ``ref_logps`` with a reference attached)."""
        d = int(self.ids[i])
        tok = np.asarray(self.store.view(d), np.int32)
        w = np.asarray(self.store.view(d, weights=True))
        keep = (w == 0) | (w == (WEIGHT_CHOSEN, WEIGHT_REJECTED)[which])
        tok, sup = tok[keep], w[keep] > 0
        n = len(tok)
        out = {f: v[0] for f, v in self.empty_rows(1).items()}
        out["tokens"][:n] = tok
        out["targets"][:n - 1] = np.where(sup[1:], tok[1:], self.pad_id)
        out["loss_mask"][:n - 1] = sup[1:]
        out["segment_ids"][:n] = 1
        out["positions"][:n] = np.arange(n)
        if self.ref is not None:
            out["ref_logps"] = self.ref[d, which]
        return out

    def row(self, index: int, epoch: int = 0, seed: int = 0) -> dict:
        """Row ``index`` of ``epoch``: pair ``index // 2``'s chosen (even) or rejected (odd)
        row."""
        if not 0 <= index < self.num_rows:
            raise IndexError(f"row {index} out of range [0, {self.num_rows})")
        return self.pair_row(int(self._perm(seed, epoch)[index // 2]), index % 2)

    def rows(self, global_rows, seed: int = 0) -> dict:
        rs = [self.row(g % self.num_rows, g // self.num_rows, seed) for g in global_rows]
        return {f: np.stack([r[f] for r in rs]) for f in FIELDS + self.row_fields}

    def empty_rows(self, n: int) -> dict:
        out = super().empty_rows(n)
        if self.ref is not None:
            out["ref_logps"] = np.zeros(n, np.float32)
        return out

    def segments_per_row(self, epoch: int = 0, seed: int = 0) -> np.ndarray:
        """1 per row, plus 1 for a padded tail; with ``packed``, those of the rows the
        epoch's batches are packed into."""
        pair = self._perm(seed, epoch)
        fill = self.lengths[pair, 0][:, None] + self.lengths[pair, 1:]     # [pairs, 2]
        if self.packed is not None:
            return packed_segments(fill.reshape(-1), self.seq_len, *self.packed)
        return (1 + (fill < self.seq_len)).reshape(-1).astype(np.int64)
