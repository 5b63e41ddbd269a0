"""Corpora -> tokenized documents -> packed [B, S] batches, sharded P("data", "seq").

Pipeline: ``load_documents`` gives (name, text) pairs; ``split_documents`` splits them into
train / held-out by a stable hash of the name; a tokenizer turns each text into int32 ids;
``PackedRows`` packs the documents of one epoch into rows of S tokens; ``BatchIterator`` walks
the rows B at a time with a small JSON-able position; ``shard_batch`` builds global jax.Arrays
of which each process only materialises the rows and sequence slices its own devices hold.

Packing rule. Each document gets EOS appended; an epoch's documents (order drawn from
``np.random.default_rng((seed, epoch))``) form one stream of N tokens. Row r holds
``tokens = stream[rS : rS+S]`` and ``targets = stream[rS+1 : rS+S+1]``: a row reads one token
past its end, and the next row starts again at that token. So every next-token pair
(doc[i], doc[i+1]) of every document, including (last token, EOS), is in exactly one row per
epoch, none is lost at a row boundary. ``loss_mask`` is 0 where the target belongs to another
document (EOS -> next document's first token), on padding (tail of the last row), and nowhere
else. ``segment_ids`` number the document pieces of a row 1, 2, 3, ... (0 = padding) and
``positions`` count from 0 at the start of each piece, because attention (restricted by
segment ids) sees only the piece. Rows per epoch are ceil((N - 1) / S), the same every epoch.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from functools import lru_cache
from typing import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..mesh import DATA, RING, SEQ, act_spec, axis_size

FIELDS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
Batch = dict  # field name -> np.ndarray [B, S] (or [S] for one row)

# ---------------------------------------------------------------------------------------------
# Tokenizers


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus EOS = 256 (vocab_size 257)."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        """Returns int32 [len(text.encode())]; surrogates become U+FFFD's bytes."""
        data = text.encode("utf-8", errors="replace")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_prompt(self, text: str) -> np.ndarray:
        """A prompt to generate from: the bytes (this tokenizer adds no special tokens)."""
        return self.encode(text)

    def decode(self, ids) -> str:
        """Drops ids >= 256 (EOS); invalid UTF-8 (a cut character) becomes U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# Pretraining end-of-document tokens, most specific first (Qwen/GPT-2, Llama 3, Llama 2 /
# Mistral / T5, Gemma). Chat turn ends (<|im_end|>, <|eot_id|>) are deliberately not here.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (via the ``tokenizers`` package), same interface.

    EOS is, in this order: ``eos_token`` if given; ``eos_token`` of a ``tokenizer_config.json``
    beside the file; the first of ``EOS_CANDIDATES`` in the vocabulary. Otherwise ValueError:
    borrowing an ordinary token as EOS would silently corrupt training.
    Texts are encoded without the tokenizer's own special tokens (BOS/EOS post-processing);
    packing adds EOS itself.
    """

    def __init__(self, path: str, eos_token: str | None = None):
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError("HFTokenizer needs the Hugging Face tokenizers package: "
                              "pip install tokenizers") from e
        self.path = path
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception for any bad file
            raise ValueError(f"{path} is not a tokenizer.json the tokenizers package can read: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if eos_token is None and os.path.exists(config):
            eos_token = _eos_from_config(config)
        names = (eos_token,) if eos_token else EOS_CANDIDATES
        ids = [self._tok.token_to_id(n) for n in names]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"no EOS token in {path}: looked for {list(names)}; "
                             f"pass eos_token= naming one")
        self.eos_id = int(found[0])

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_prompt(self, text: str) -> np.ndarray:
        """A prompt to generate from, as transformers tokenizes it: with the tokenizer's own
        special tokens (a BOS where its post-processor adds one)."""
        return np.asarray(self._tok.encode(text).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encs]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def _eos_from_config(path: str) -> str | None:
    """``eos_token`` of a tokenizer_config.json: a string, or {"content": ...} in older files."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(path: str | None, eos_token: str | None = None):
    """None -> ByteTokenizer; a tokenizer.json, or a directory holding one -> HFTokenizer."""
    if path is None:
        return ByteTokenizer()
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    return HFTokenizer(path, eos_token)


# ---------------------------------------------------------------------------------------------
# Corpora

# Lib/test holds deliberately broken files (bad encodings, bad syntax) and multi-MB data
# modules that would dominate the corpus; site-packages differs from machine to machine.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@lru_cache(maxsize=1)
def _stdlib(root: str) -> tuple[tuple[str, str], ...]:
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                full = os.path.join(dirpath, fn)
                with open(full, "rb") as f:
                    text = f.read().decode("utf-8", errors="replace")
                docs.append((os.path.relpath(full, root).replace(os.sep, "/"), text))
    return tuple(sorted(docs))


def stdlib_documents() -> list[tuple[str, str]]:
    """The running Python's standard-library ``.py`` files as (relative path, text), sorted.

    Skips site-packages and test directories (see ``_SKIP_DIRS``). The corpus depends on the
    Python version (3.11 and 3.12 differ), so splits and row counts do too. Cached per process.
    """
    return list(_stdlib(sysconfig.get_paths()["stdlib"]))


def text_documents(paths: Sequence[str]) -> list[tuple[str, str]]:
    """Reads local files: ``.txt``/``.md`` = one document each, named by the path;
    ``.jsonl`` = one document per non-blank line (its "text" field), named ``path:line``."""
    docs = []
    for path in paths:
        if path.endswith((".txt", ".md")):
            with open(path, encoding="utf-8", errors="replace") as f:
                docs.append((path, f.read()))
        elif path.endswith(".jsonl"):
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    text = _jsonl_text(line, f"{path}:{n}")
                    if text is not None:
                        docs.append((f"{path}:{n}", text))
        else:
            raise ValueError(f"{path}: unsupported file type, expected .txt, .md or .jsonl")
    return docs


def _jsonl_text(line: bytes, where: str) -> str | None:
    """The "text" of one .jsonl line (None for a blank line); ValueError naming ``where``
    (file:line) and the rule otherwise."""
    try:
        line = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {e.start} of the line)") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line "
                         f'must be an object such as {{"text": "..."}}') from None
    if not isinstance(record, dict) or "text" not in record:
        got = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
        raise ValueError(f'{where}: each line must be an object with a "text" field, got {got}')
    if not isinstance(record["text"], str):
        raise ValueError(f'{where}: "text" must be a string, got '
                         f'{type(record["text"]).__name__}')
    return record["text"]


def load_documents(source: str) -> list[tuple[str, str]]:
    """"stdlib", or comma-separated files / directories (searched recursively for .txt, .md,
    .jsonl) / glob patterns. Files are read in sorted order, each once."""
    if source == "stdlib":
        return stdlib_documents()
    paths = []
    for item in (s.strip() for s in source.split(",") if s.strip()):
        if os.path.isdir(item):
            found = [p for ext in ("txt", "md", "jsonl")
                     for p in glob.glob(os.path.join(item, "**", f"*.{ext}"), recursive=True)]
        else:
            found = glob.glob(item)
        if not found:
            raise ValueError(f"data source {item!r} matches no file")
        paths.extend(found)
    return text_documents(sorted(set(paths)))


def _unit_hash(name: str, seed: int) -> float:
    """A stable hash of (seed, name) in [0, 1); Python's hash() is salted per process."""
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def heldout_mask(h: np.ndarray, heldout_fraction: float) -> np.ndarray:
    """bool [n]: the documents held out, those whose hash ``h`` in [0, 1) is below the
    fraction. Training always keeps a document: with a fraction > 0, an empty part takes the
    document whose hash is nearest to the cut, so with >= 2 documents both parts are
    non-empty, and a lone document is never held out."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    held = h < heldout_fraction
    if heldout_fraction > 0 and len(h):
        if held.all():
            held[np.argmax(h)] = False
        elif not held.any() and len(h) >= 2:
            held[np.argmin(h)] = True
    return held


def split_documents(docs, heldout_fraction: float, seed: int = 0):
    """Splits (name, text) docs into (train, heldout), input order kept within each.

    A doc is held out iff the hash of (seed, name) is < heldout_fraction, so membership does
    not depend on order or on the other docs (``heldout_mask``: both parts non-empty with
    >= 2 docs, a lone doc kept for training).
    """
    held = heldout_mask(np.array([_unit_hash(name, seed) for name, _ in docs]),
                        heldout_fraction)
    return ([d for d, x in zip(docs, held) if not x], [d for d, x in zip(docs, held) if x])


# ---------------------------------------------------------------------------------------------
# Packing


class PackedRows:
    """Tokenized documents packed into rows of ``seq_len`` (rule in the module docstring).

    Rows are built on demand from (epoch, index) in O(S + log(num docs)); nothing per epoch is
    stored beyond the document order and its cumulative lengths.

    Args:
      docs: token arrays, one per document, without EOS (EOS is appended here). Documents that
        are empty are dropped: they hold no next-token pair.
      seq_len: S.
      eos_id: id appended to each document.
      shuffle: draw the document order per epoch from (seed, epoch); False keeps the given
        order every epoch (held-out data).
      pad_id: token and target value of padding and of masked targets.
    """

    def __init__(self, docs: Sequence[np.ndarray], seq_len: int, eos_id: int,
                 shuffle: bool = True, pad_id: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        eos = np.array([eos_id], np.int32)
        self.docs = [np.concatenate([np.asarray(d, np.int32), eos]) for d in docs if len(d)]
        if not self.docs:
            raise ValueError("no non-empty document to pack")
        self.seq_len, self.eos_id, self.shuffle, self.pad_id = seq_len, eos_id, shuffle, pad_id
        self.lengths = np.array([len(d) for d in self.docs], np.int64)
        self.num_tokens = int(self.lengths.sum())  # N, EOS included
        self.num_rows = -(-(self.num_tokens - 1) // seq_len)
        self._layouts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    @property
    def fingerprint(self) -> str:
        """Identifies the packed data (not the order), to catch resuming on other data."""
        h = hashlib.blake2b(digest_size=8)
        h.update(np.array([self.seq_len, self.eos_id, int(self.shuffle)]).tobytes())
        h.update(self.lengths.tobytes())
        return h.hexdigest()

    def _layout(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, start offset in the stream of each ordered doc), [num_docs] each."""
        key = (seed, epoch) if self.shuffle else (0, 0)
        if key not in self._layouts:
            if len(self._layouts) >= 2:  # a batch touches at most two epochs
                self._layouts.pop(next(iter(self._layouts)))
            n = len(self.docs)
            order = (np.random.default_rng(key).permutation(n) if self.shuffle
                     else np.arange(n))
            starts = np.concatenate([[0], np.cumsum(self.lengths[order])[:-1]])
            self._layouts[key] = (order, starts)
        return self._layouts[key]

    def row(self, index: int, epoch: int = 0, seed: int = 0) -> Batch:
        """Row ``index`` (< num_rows) of ``epoch``: dict of FIELDS, each [S]."""
        if not 0 <= index < self.num_rows:
            raise IndexError(f"row {index} out of range [0, {self.num_rows})")
        order, starts = self._layout(seed, epoch)
        S, N = self.seq_len, self.num_tokens
        a = index * S
        stop = min(a + S + 1, N)  # one token past the row: the last target
        first = np.searchsorted(starts, a, side="right") - 1
        last = np.searchsorted(starts, stop - 1, side="right") - 1
        window = np.concatenate([
            self.docs[order[k]][max(a - starts[k], 0):stop - starts[k]]
            for k in range(first, last + 1)])  # stream[a:stop]
        j = np.arange(a, min(a + S, N))  # stream positions of this row's tokens
        k = np.searchsorted(starts, j, side="right") - 1  # ordered doc of each token
        offset = j - starts[k]
        n = len(j)
        mask = offset + 1 < self.lengths[order[k]]  # target inside the same document
        out = {f: v[0] for f, v in self.empty_rows(1).items()}
        out["tokens"][:n] = window[:n]
        # The stream's final EOS has no successor: pad the window by one so shapes line up.
        out["targets"][:n] = np.where(mask, np.append(window[1:], self.pad_id)[:n], self.pad_id)
        out["loss_mask"][:n] = mask
        out["segment_ids"][:n] = k - first + 1
        out["positions"][:n] = j - np.maximum(starts[k], a)
        return out

    def segments_per_row(self, epoch: int = 0, seed: int = 0) -> np.ndarray:
        """Segment ids per row of ``epoch`` (document pieces, plus one for a padded tail),
        int [num_rows], from the layout alone (no row is built)."""
        order, starts = self._layout(seed, epoch)
        a = np.arange(self.num_rows, dtype=np.int64) * self.seq_len
        stop = np.minimum(a + self.seq_len, self.num_tokens)  # one past each row's last token
        first = np.searchsorted(starts, a, side="right") - 1
        last = np.searchsorted(starts, stop - 1, side="right") - 1
        return (last - first + 1 + (stop - a < self.seq_len)).astype(np.int64)

    def rows(self, global_rows: Sequence[int], seed: int = 0) -> Batch:
        """Stacks rows by global index g (epoch g // num_rows, row g % num_rows): [len, S]."""
        rs = [self.row(g % self.num_rows, g // self.num_rows, seed) for g in global_rows]
        return {f: np.stack([r[f] for r in rs]) for f in FIELDS}

    def empty_rows(self, n: int) -> Batch:
        """n rows of padding (loss_mask 0), to fill a last eval batch: [n, S]."""
        return {f: np.full((n, self.seq_len), self.pad_id if f in ("tokens", "targets") else 0,
                           np.float32 if f == "loss_mask" else np.int32) for f in FIELDS}


class PlannedRows(PackedRows):
    """Rows made from a plan over a store's documents (``ids``), visited per epoch in a
    seeded order of ``_units()`` units (``shuffle``; the plan's order otherwise); the
    fingerprint covers the store, the length, the plan's seed, ``overflow`` and the
    documents (plus ``_FINGERPRINT_KIND``)."""

    _FINGERPRINT_KIND = ""

    def _units(self) -> int:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{self.store.manifest['fingerprint']}\0{self.seq_len}\0{self.shuffle}\0"
                 f"{self.plan_seed}\0{self.overflow}{self._FINGERPRINT_KIND}".encode())
        h.update(self.ids.tobytes())
        return h.hexdigest()

    def _perm(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch) if self.shuffle else (0, 0)
        if key not in self._perms:
            if len(self._perms) >= 2:  # a batch touches at most two epochs
                self._perms.pop(next(iter(self._perms)))
            n = self._units()
            self._perms[key] = (np.random.default_rng(key).permutation(n) if self.shuffle
                                else np.arange(n))
        return self._perms[key]


def tokenize(docs, tokenizer) -> list[np.ndarray]:
    """Token arrays (no EOS) of (name, text) docs."""
    return tokenizer.encode_batch([text for _, text in docs])


def build_rows(source: str, tokenizer, seq_len: int, heldout_fraction: float = 0.05,
               seed: int = 0) -> tuple[PackedRows, PackedRows | None]:
    """Loads, splits, tokenizes and packs: (train rows shuffled per epoch, held-out rows in
    a fixed order, or None when heldout_fraction is 0)."""
    train, held = split_documents(load_documents(source), heldout_fraction, seed)
    eos = tokenizer.eos_id
    return (PackedRows(tokenize(train, tokenizer), seq_len, eos, shuffle=True),
            PackedRows(tokenize(held, tokenizer), seq_len, eos, shuffle=False) if held else None)


# ---------------------------------------------------------------------------------------------
# Batches


class BatchIterator:
    """Global batches [B, S] over ``rows``, epoch after epoch, forever.

    Batch k holds global rows k*B ... k*B+B-1 (row g is row g % num_rows of epoch
    g // num_rows), so a batch may straddle two epochs and no row is dropped. The position is
    ``get_state()`` = {"next_row", "seed", "fingerprint"}: plain JSON.

    Args:
      rows: a PackedRows.
      batch_size: B, the global batch size.
      seed: the document-order seed (epoch e uses rng((seed, e))).
    """

    def __init__(self, rows: PackedRows, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.next_row = 0

    @property
    def epoch(self) -> int:
        """Epoch of the next batch's first row."""
        return self.next_row // self.rows.num_rows

    def get_state(self) -> dict:
        return {"next_row": self.next_row, "seed": self.seed,
                "fingerprint": self.rows.fingerprint}

    def set_state(self, state: dict) -> None:
        """Continues from ``state``; ValueError if it was saved with another seed or data."""
        if state["seed"] != self.seed or state["fingerprint"] != self.rows.fingerprint:
            raise ValueError(
                f"data state was saved with seed {state['seed']} and data fingerprint "
                f"{state['fingerprint']}; this iterator has seed {self.seed} and fingerprint "
                f"{self.rows.fingerprint} (different corpus, tokenizer or seq_len)")
        self.next_row = int(state["next_row"])

    def rows_fn(self) -> Callable[[int, int], Batch]:
        """rows_fn(start, stop) -> rows start..stop-1 of the next batch, [stop-start, S]."""
        base, rows, seed = self.next_row, self.rows, self.seed
        return lambda start, stop: rows.rows(range(base + start, base + stop), seed)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        """The next batch as numpy: dict of FIELDS, each [B, S]."""
        batch = self.rows_fn()(0, self.batch_size)
        self.next_row += self.batch_size
        return batch

    def next_global(self, mesh: Mesh, order: np.ndarray | None = None) -> dict[str, jax.Array]:
        """The next batch as global arrays sharded P("data", "seq"); see ``shard_batch``."""
        batch = shard_batch(self.rows_fn(), mesh, (self.batch_size, self.rows.seq_len), order,
                            getattr(self.rows, "row_fields", ()))
        self.next_row += self.batch_size
        return batch


def eval_batches(rows: PackedRows, batch_size: int,
                 max_batches: int | None = None) -> Iterator[Batch]:
    """One pass over ``rows`` in their fixed order (epoch 0), numpy [B, S] per field.
    The last batch is filled with padding rows (loss_mask 0) so every batch has one shape."""
    count = -(-rows.num_rows // batch_size)
    for b in range(count if max_batches is None else min(count, max_batches)):
        ids = range(b * batch_size, min((b + 1) * batch_size, rows.num_rows))
        batch = rows.rows(ids)
        if len(ids) < batch_size:
            pad = rows.empty_rows(batch_size - len(ids))
            batch = {f: np.concatenate([batch[f], pad[f]]) for f in batch}
        yield batch


def shard_batch(source: Batch | Callable[[int, int], Batch], mesh: Mesh,
                shape: tuple[int, int] | None = None,
                order: np.ndarray | None = None,
                row_fields: Sequence[str] = (),
                token_fields: Sequence[str] = ()) -> dict[str, jax.Array]:
    """Global batch arrays [B, S] sharded ``NamedSharding(mesh, P("data", "seq"))``.

    Built with ``jax.make_array_from_callback``: each process computes only the row blocks
    its own devices hold (once per block, shared by its seq devices and all fields) and
    slices their sequence parts, so this works unchanged under multi-process jax.distributed.

    Args:
      source: ``rows_fn(start, stop)`` returning rows start..stop-1 of the batch as a dict of
        FIELDS [stop-start, S] (e.g. ``BatchIterator.rows_fn()``), or a full numpy batch
        (every process then holds all of it).
      mesh: a mesh with "data" and "seq" axes.
      shape: (B, S); required for a rows_fn, read off a numpy batch.
      order: optional token order [S] applied to every row (``x[:, order]``), e.g. the zigzag
        order of ring attention; positions travel with their tokens, so they stay true.
      row_fields: fields of one value per row, [B] (a preference batch's ``ref_logps``),
        sharded P("data").
      token_fields: more fields of one value per token, [B, S] (GRPO's advantages), laid
        out like the FIELDS.

    Returns:
      dict of FIELDS and ``token_fields``, each a jax.Array [B, S], and of ``row_fields``,
      each [B].
    """
    if isinstance(source, dict):
        shape = source["tokens"].shape
        batch = source
        source = lambda start, stop: {f: v[start:stop] for f, v in batch.items()}  # noqa: E731
    B, S = shape
    if B % axis_size(mesh, DATA):
        raise ValueError(f"batch size {B} is not divisible by the data axis size "
                         f"{axis_size(mesh, DATA)}")
    n_seq = axis_size(mesh, SEQ) * axis_size(mesh, RING)
    if S % n_seq:
        what = (f"the seq axis size {n_seq}" if axis_size(mesh, RING) == 1 else
                f"ring x seq = {axis_size(mesh, RING)} x {axis_size(mesh, SEQ)} = {n_seq}")
        raise ValueError(f"sequence length {S} is not divisible by {what}")
    sharding = NamedSharding(mesh, act_spec(mesh))
    blocks: dict[tuple[int, int], Batch] = {}
    per_token = tuple(FIELDS) + tuple(token_fields)

    def block(field, index):
        rows, cols = index
        start, stop, _ = rows.indices(B)
        if (start, stop) not in blocks:
            rows_ = source(start, stop)
            if order is not None:
                rows_ = {f: v[:, order] if f in per_token else v for f, v in rows_.items()}
            blocks[(start, stop)] = rows_
        return blocks[(start, stop)][field][:, cols]

    def row_block(field, index):
        rows = index[0]
        block(FIELDS[0], (rows, slice(None)))  # builds (and keeps) the rows' block
        start, stop, _ = rows.indices(B)
        return blocks[(start, stop)][field]

    out = {f: jax.make_array_from_callback(shape, sharding, lambda i, f=f: block(f, i))
           for f in per_token}
    by_row = NamedSharding(mesh, P(act_spec(mesh)[0]))
    out.update({f: jax.make_array_from_callback((B,), by_row, lambda i, f=f: row_block(f, i))
                for f in row_fields})
    return out
