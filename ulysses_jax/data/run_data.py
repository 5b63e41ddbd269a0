"""The data of a run: train and held-out rows from ``data.source`` (a token store, or text
files tokenized on the fly), checked against the model (vocabulary, tokenizer, images), and
the packed-attention bound they imply. Used by the objectives that read ``data.source``
(``training/objectives/``).
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax

from . import text as data_lib, vision_batches
from .packing import store_rows
from .prepare import file_hash
from .prompts import load_prompts
from .store import TokenStore, is_store
from ..config import Config, ConfigError
from ..families import family


def is_main() -> bool:
    """Process 0: the one that prints and writes the run's files."""
    return jax.process_index() == 0


def log(msg: str) -> None:
    """A line of the run's log, printed by process 0."""
    if is_main():
        print(msg, flush=True)


def load_data(cfg: Config):
    """Train and held-out rows; a bad data.* setting is a ConfigError (clean CLI exit)."""
    if is_store(cfg.data.source):
        return _load_store(cfg)
    try:
        tokenizer = data_lib.load_tokenizer(cfg.data.tokenizer)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"data.tokenizer {cfg.data.tokenizer!r}: {e}") from None
    _check_vocab(cfg, tokenizer)
    try:
        return data_lib.build_rows(cfg.data.source, tokenizer, cfg.seq_len,
                                   cfg.data.heldout_fraction, cfg.seed)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.source {cfg.data.source!r}: {e}") from None


def _check_vocab(cfg: Config, tokenizer) -> None:
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer: the tokenizer has {tokenizer.vocab_size} ids but "
                          f"model.vocab_size is {cfg.model.vocab_size}")


def load_prompt_data(cfg: Config):
    """A GRPO run's prompts (``prompts.load_prompts``): (train, held-out or None, tokenizer,
    fingerprint), tokenized with data.tokenizer, else init_from's tokenizer (and chat
    template), else bytes; a bad setting or row is a ConfigError."""
    path = cfg.data.tokenizer
    if path is None and cfg.init_from and os.path.isfile(
            os.path.join(cfg.init_from, "tokenizer.json")):
        path = cfg.init_from
    try:
        out = load_prompts(cfg.data.source, path, cfg.seq_len - cfg.grpo.max_completion_length,
                           cfg.data.heldout_fraction, cfg.seed)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"data.source {cfg.data.source!r}: {e}") from None
    _check_vocab(cfg, out[2])
    return out


def _load_store(cfg: Config):
    """Rows of a prepared token store (memory-mapped; ``packing.py``)."""
    try:
        train_rows, held_rows, notes = store_rows(cfg.data.source, cfg.seq_len,
                                                  cfg.data.heldout_fraction, cfg.seed,
                                                  cfg.data.chat_overflow)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.source {cfg.data.source!r}: {e}") from None
    manifest = train_rows.store.manifest
    if manifest["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"data.source {cfg.data.source!r}: the store's tokenizer has "
                          f"{manifest['vocab_size']} ids but model.vocab_size is "
                          f"{cfg.model.vocab_size}; set model.vocab_size to at least "
                          f"{manifest['vocab_size']}")
    if cfg.data.tokenizer is not None:  # training reads only tokens: no tokenizer needed
        try:
            store_tokenizer(cfg.data.source, cfg.data.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if family(cfg.model.family).vision:
        vision_batches.check_store(cfg, manifest)
    elif manifest.get("media"):
        raise ConfigError(f"data.source {cfg.data.source!r} holds images or videos, which "
                          f"need a multimodal model (model.family=qwen2_5_vl); "
                          f"model.family is {cfg.model.family}")
    for note in notes:
        log(f"data: {note}")
    return train_rows, held_rows


def store_tokenizer(source: str, tokenizer: str | None = None) -> str | None:
    """The tokenizer.json a token store was prepared with, as training resolves it:
    ``tokenizer`` (data.tokenizer: a tokenizer.json or a directory holding one) when given,
    else the path the store's manifest records; the file must still have the manifest's hash.

    Args:
      source: a token store directory (data.source).
      tokenizer: data.tokenizer, or None.
    Returns:
      The tokenizer.json's path, or None for a store prepared with the byte tokenizer
      (``data_lib.load_tokenizer(None)``).
    Raises:
      ValueError: the store is unreadable, ``tokenizer`` is not the store's tokenizer, or
        the recorded file is gone or has changed since the store was prepared.
    """
    recorded = TokenStore(source).manifest["tokenizer"]
    if tokenizer is not None:
        path = _tokenizer_file(tokenizer)
        if not os.path.isfile(path) or file_hash(path) != recorded["sha256"]:
            raise ValueError(f"data.tokenizer {tokenizer!r} is not the tokenizer the store "
                             f"{source!r} was prepared with ({recorded['path'] or 'bytes'}); "
                             f"unset data.tokenizer or prepare the store again")
        return path
    if recorded["path"] is None:
        return None
    path = _tokenizer_file(recorded["path"])
    if not os.path.isfile(path):
        raise ValueError(f"the store {source!r} was prepared with the tokenizer {path}, which "
                         f"no longer exists; put it back (sha256 {recorded['sha256']}...) or "
                         f"prepare the store again")
    got = file_hash(path)
    if got != recorded["sha256"]:
        raise ValueError(f"the store {source!r} was prepared with the tokenizer {path} of "
                         f"sha256 {recorded['sha256']}, but that file now has {got}: it has "
                         f"changed since; restore it or prepare the store again")
    return path


def _tokenizer_file(path: str) -> str:
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def pixel_options(rows) -> dict:
    """The image preprocessing a store's media were prepared with (its manifest), {} for
    data without media."""
    store = getattr(rows, "store", None)
    return vision_batches.pixel_options(store.manifest if store is not None else {})


def with_segment_bound(cfg: Config, train_rows, held_rows) -> Config:
    """``model.max_segments`` resolved: as given, or (0) from the data: 1.5 x the most
    documents any row of the first epoch holds (padding counts as one), rounded up to a
    multiple of 8. It sizes cuDNN's packed-layout arguments; rows with more still run
    exactly, through the fallback kernel (``attention/cudnn.py``)."""
    most = max(int(rows.segments_per_row(0, cfg.seed).max())
               for rows in (train_rows, held_rows) if rows is not None)
    bound = cfg.model.max_segments or 8 * math.ceil(1.5 * most / 8)
    log(f"data: up to {most} documents per row in the first epoch; packed attention "
         f"bound model.max_segments={bound}"
         f"{'' if cfg.model.max_segments else ' (from the data)'}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_segments=bound))
