"""The prompts of a GRPO run (``objective: grpo``): rows with ``prompt`` (text, or a list of
messages) and any other columns, which reward functions receive (``answer``, ...).

``data.source`` names .jsonl, .parquet files or datasets directories (``sources.iter_rows``).
A text prompt is tokenized as transformers tokenizes a prompt (the tokenizer's own BOS where
it adds one); messages are rendered with the tokenizer directory's chat template and the
generation prompt. Rows are split train / held-out by the hash of their names as documents
are (``text.heldout_mask``), and walked in a seeded order, a new permutation each epoch
(``PromptOrder``). A row's reference completion (its ``completion``, else its ``answer``, as
text; a list of messages: their contents) is what ``grpo.sft_warmup_steps`` trains on,
followed by the sampler's stop token.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from . import sources
from .chat import ChatTemplate, prompt_ids
from .text import _unit_hash, heldout_mask, load_tokenizer


@dataclasses.dataclass
class Prompts:
    """Prompt rows: ``names`` (file:line), ``rows`` (the records), ``ids`` (prompt token
    ids), ``references`` (reference completion ids, no stop token; or None)."""
    names: list[str]
    rows: list[dict]
    ids: list[np.ndarray]
    references: list[np.ndarray | None]

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, keep: np.ndarray) -> "Prompts":
        idx = np.flatnonzero(keep)
        return Prompts(*([v[i] for i in idx] for v in (self.names, self.rows, self.ids,
                                                          self.references)))


def _template(tokenizer_path: str | None):
    if tokenizer_path is None:
        return None
    directory = tokenizer_path if os.path.isdir(tokenizer_path) else \
        os.path.dirname(tokenizer_path)
    try:
        return ChatTemplate.from_dir(directory)
    except ValueError:
        return None


def load_prompts(source: str, tokenizer_path: str | None, max_prompt_tokens: int,
                 heldout_fraction: float = 0.0, seed: int = 0):
    """(train Prompts, held-out Prompts or None, tokenizer, fingerprint) of ``source``.

    Raises:
      ValueError: no rows, a row without a prompt (named), a chat row without a chat
        template, or a prompt longer than ``max_prompt_tokens`` (named, with the numbers).
    """
    paths = sources.expand_sources([p.strip() for p in source.split(",") if p.strip()])
    tokenizer = load_tokenizer(tokenizer_path)
    template = None
    names, rows, ids, refs = [], [], [], []
    for where, row in sources.iter_rows(paths):
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            tokens = np.asarray(tokenizer.encode_prompt(prompt), np.int32)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            template = template or _template(tokenizer_path)
            if template is None:
                raise ValueError(f"{where}: the prompt is a list of messages, but the "
                                 f"tokenizer ({tokenizer_path or 'bytes'}) has no chat "
                                 f"template")
            try:
                tokens = np.asarray(prompt_ids(tokenizer, template, prompt), np.int32)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        else:
            raise ValueError(f'{where}: a prompt row needs "prompt", a text or a list of '
                             f'messages (keys {sorted(row)})')
        if not len(tokens):
            raise ValueError(f"{where}: the prompt has no tokens")
        if len(tokens) > max_prompt_tokens:
            raise ValueError(f"{where}: the prompt has {len(tokens)} tokens, more than "
                             f"seq_len - grpo.max_completion_length = {max_prompt_tokens}")
        ref = row.get("completion", row.get("answer"))
        if isinstance(ref, list):  # a chat completion: its messages' contents
            ref = "".join(str(m.get("content") or "") for m in ref if isinstance(m, dict))
        refs.append(None if ref is None else
                    np.asarray(tokenizer.encode(str(ref)), np.int32))
        names.append(where)
        rows.append(row)
        ids.append(tokens)
    if not rows:
        raise ValueError(f"{source} holds no prompt rows")
    everything = Prompts(names, rows, ids, refs)
    held = heldout_mask(np.array([_unit_hash(n, seed) for n in names]), heldout_fraction)
    fingerprint = sources.fingerprint(paths, {"tokenizer": tokenizer_path,
                                              "heldout_fraction": heldout_fraction,
                                              "seed": seed})
    return (everything.subset(~held), everything.subset(held) if held.any() else None,
            tokenizer, fingerprint)


class PromptOrder:
    """The prompt indices of each step: epoch e is a permutation drawn from
    ``np.random.default_rng((seed, e))``, and a step may straddle two epochs. The position
    ``get_state()`` is plain JSON."""

    def __init__(self, n: int, seed: int, fingerprint: str):
        self.n, self.seed, self.fingerprint, self.next = n, seed, fingerprint, 0
        self._epoch = (None, None)  # (epoch, its permutation), drawn once per epoch

    def take(self, count: int) -> list[int]:
        out = []
        for g in range(self.next, self.next + count):
            epoch, i = divmod(g, self.n)
            if self._epoch[0] != epoch:
                self._epoch = (epoch, np.random.default_rng((self.seed, epoch)).permutation(
                    self.n))
            out.append(int(self._epoch[1][i]))
        self.next += count
        return out

    def get_state(self) -> dict:
        return {"next_prompt": self.next, "seed": self.seed, "fingerprint": self.fingerprint}

    def set_state(self, state: dict) -> None:
        if state.get("seed") != self.seed or state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"the data state was saved with seed {state.get('seed')} and "
                             f"prompts fingerprint {state.get('fingerprint')}; this run has "
                             f"seed {self.seed} and fingerprint {self.fingerprint} (other "
                             f"prompts or tokenizer)")
        self.next = int(state["next_prompt"])
