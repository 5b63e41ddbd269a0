"""The token store: a prepared corpus on disk, read through memory maps.

Layout of a store directory (written by ``prepare.py``)::

    manifest.json        format, version, kind ("text" | "chat" | "preference"), dtype, counts,
                         tokenizer and
                         template hashes, the inputs' fingerprint, the shard list
    tokens-NNNNN.bin     token ids, dtype uint16 when the vocabulary fits (<= 65536), else
                         uint32; the documents back to back (text documents end with EOS)
    weights-NNNNN.bin    chat: uint8 per token, 1 on tokens of assistant answers; preference:
                         0 on the prompt, 1 on the chosen and 2 on the rejected completion
                         (a pair is one document: prompt, chosen, rejected; preference.py)
    names.txt            preference only: each pair's record name (file:line), a line each
    offsets.bin          int64 [num_docs + 1]: document d is tokens [off[d], off[d+1]) of the
                         shards laid end to end; no document spans two shards
    doc_hash.bin         uint64 [num_docs]: a hash of each document's name (file:line), which
                         the held-out split uses, so membership does not depend on order
    chat_template.jinja  chat only: the chat template the conversations were rendered with
                         (manifest "chat_template": where it came from, the special values)
    media.jsonl          chat stores with images / videos only: one JSON list per document of
                         its media items in token order ([] for none; see ``TokenStore.media``)
    media_offsets.bin    int64 [num_docs + 1]: byte offsets of the lines of media.jsonl
    media_inputs.json    [[path, size, mtime_ns], ...] of every media file and frame folder read,
                         which a later prepare stats to see whether the store is current

Reading maps the files; nothing proportional to the number of tokens is read at open. Arrays
proportional to the number of documents (offsets, hashes: 16 bytes a document) are read when
a packing plan is made.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

FORMAT, VERSION = "ulysses-jax-token-store", 1
MANIFEST, OFFSETS, DOC_HASH = "manifest.json", "offsets.bin", "doc_hash.bin"
MEDIA, MEDIA_OFFSETS, MEDIA_INPUTS = "media.jsonl", "media_offsets.bin", "media_inputs.json"
NAMES = "names.txt"  # preference stores: each pair's record name (file:line), a line each


def is_store(path: str) -> bool:
    """True if ``path`` is a directory holding a store's manifest."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def name_hash(name: str) -> int:
    """A stable 64-bit hash of a document name (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def unit_hash(hashes: np.ndarray, seed: int) -> np.ndarray:
    """Per-document numbers in [0, 1) from name hashes and a seed (splitmix64 finaliser),
    float64 [num_docs]: the held-out split takes those below the fraction."""
    with np.errstate(over="ignore"):
        z = hashes.astype(np.uint64) ^ np.uint64((seed * 0x9E3779B97F4A7C15) % (1 << 64))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class StoreWriter:
    """Appends documents to a store being built in ``directory`` (a temporary one).

    Args:
      directory: where the files go (created).
      dtype: token dtype (``token_dtype``).
      chat: also write per-token weights and each document's media items (the media files are
        removed at ``finish`` when no document had any).
      shard_tokens: start a new shard once one holds at least this many tokens.
      preference: a store of preference pairs: weights and record names, no media.
    """

    def __init__(self, directory: str, dtype, chat: bool, shard_tokens: int = 1 << 30,
                 preference: bool = False):
        os.makedirs(directory, exist_ok=True)
        self.dir, self.dtype, self.chat = directory, np.dtype(dtype), chat or preference
        self.preference = preference
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self.num_tokens = self.num_docs = self.num_supervised = 0
        self._offsets = open(os.path.join(directory, OFFSETS), "wb")
        self._hashes = open(os.path.join(directory, DOC_HASH), "wb")
        self._offsets.write(np.zeros(1, np.int64).tobytes())
        self._tok = self._wts = None
        self.num_images = self.num_videos = self.max_frame_patches = 0
        self._media = self._media_offsets = None
        self._names = open(os.path.join(directory, NAMES), "w", encoding="utf-8") \
            if preference else None
        if chat and not preference:
            self._media = open(os.path.join(directory, MEDIA), "wb")
            self._media_offsets = open(os.path.join(directory, MEDIA_OFFSETS), "wb")
            self._media_offsets.write(np.zeros(1, np.int64).tobytes())

    @property
    def has_media(self) -> bool:
        return self.num_images + self.num_videos > 0

    def _open_shard(self):
        self._close_shard()
        n = len(self.shards)
        shard = {"tokens": f"tokens-{n:05d}.bin", "start": self.num_tokens, "num_tokens": 0,
                 "weights": f"weights-{n:05d}.bin" if self.chat else None}
        self.shards.append(shard)
        self._tok = open(os.path.join(self.dir, shard["tokens"]), "wb")
        if self.chat:
            self._wts = open(os.path.join(self.dir, shard["weights"]), "wb")

    def _close_shard(self):
        for f in (self._tok, self._wts):
            if f is not None:
                f.close()
        self._tok = self._wts = None

    def add(self, tokens: np.ndarray, name_hash_: int, weights: np.ndarray | None = None,
            media: list[dict] | None = None, name: str | None = None):
        """One document: tokens [T] (ids < 2**bits of dtype), weights uint8 [T] for chat, and
        for chat its media items in token order (``TokenStore.media``'s format); a
        preference pair's record ``name``."""
        if not self.shards or self.shards[-1]["num_tokens"] >= self.shard_tokens:
            self._open_shard()
        self._tok.write(np.asarray(tokens).astype(self.dtype).tobytes())
        if self.chat:
            self._wts.write(np.asarray(weights, np.uint8).tobytes())
            self.num_supervised += int(np.count_nonzero(weights))
        if self.preference:
            self._names.write(("" if self.num_docs == 0 else "\n") + name.replace("\n", " "))
        elif self.chat:
            media = media or []
            self._media.write(json.dumps(media, separators=(",", ":")).encode() + b"\n")
            self._media_offsets.write(np.array([self._media.tell()], np.int64).tobytes())
            for item in media:
                if item["kind"] == "image":
                    self.num_images += 1
                else:
                    self.num_videos += 1
                self.max_frame_patches = max(self.max_frame_patches,
                                             item["grid"][1] * item["grid"][2])
        self.shards[-1]["num_tokens"] += len(tokens)
        self.num_tokens += len(tokens)
        self.num_docs += 1
        self._offsets.write(np.array([self.num_tokens], np.int64).tobytes())
        self._hashes.write(np.array([name_hash_], np.uint64).tobytes())

    def finish(self, manifest: dict) -> dict:
        """Closes the files and writes manifest.json (``manifest`` plus counts and shards)."""
        self._close_shard()
        self._offsets.close()
        self._hashes.close()
        if self.preference:
            self._names.close()
        elif self.chat:
            self._media.close()
            self._media_offsets.close()
            if not self.has_media:  # a text-only chat store stays as it always was
                os.remove(os.path.join(self.dir, MEDIA))
                os.remove(os.path.join(self.dir, MEDIA_OFFSETS))
        manifest = {"format": FORMAT, "version": VERSION, **manifest,
                    "kind": ("preference" if self.preference else
                             "chat" if self.chat else "text"), "dtype": self.dtype.name,
                    "num_docs": self.num_docs, "num_tokens": self.num_tokens,
                    "shards": self.shards}
        if self.chat:
            manifest["num_supervised"] = self.num_supervised
        if self.preference:
            manifest["num_pairs"] = self.num_docs
        with open(os.path.join(self.dir, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        return manifest


class TokenStore:
    """A store opened for reading; token files are memory-mapped on first use.

    Attributes:
      manifest: the parsed manifest.json.
      offsets: int64 [num_docs + 1], memory-mapped.
      chat: True for a chat store (weights present).
      preference: True for a store of preference pairs (``preference.py``).
    """

    def __init__(self, path: str):
        self.path = path
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                m = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable token store ({e})") from None
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise ValueError(f"{path}: manifest.json is format {m.get('format')!r} version "
                             f"{m.get('version')!r}; this code reads {FORMAT!r} version "
                             f"{VERSION}: prepare the store again")
        self.manifest = m
        self.chat = m["kind"] == "chat"
        self.preference = m["kind"] == "preference"
        self.dtype = np.dtype(m["dtype"])
        self.offsets = np.memmap(os.path.join(path, OFFSETS), np.int64, mode="r")
        if len(self.offsets) != m["num_docs"] + 1 or self.offsets[-1] != m["num_tokens"]:
            raise ValueError(f"{path}: offsets.bin holds {len(self.offsets) - 1} documents "
                             f"ending at token {int(self.offsets[-1])}; manifest.json says "
                             f"{m['num_docs']} and {m['num_tokens']}: the store is damaged")
        for entry in m["shards"]:  # a stat per file: a damaged store fails here, not mid-run
            for what, itemsize in (("tokens", self.dtype.itemsize), ("weights", 1)):
                if entry.get(what) is None:
                    continue
                want = entry["num_tokens"] * itemsize
                try:
                    got = os.path.getsize(os.path.join(path, entry[what]))
                except OSError:
                    got = None
                if got != want:
                    raise ValueError(f"{path}: {entry[what]} "
                                     f"{'is missing' if got is None else f'holds {got} bytes'}; "
                                     f"manifest.json says {entry['num_tokens']} tokens, "
                                     f"{want} bytes: the store is damaged, prepare it again")
        self._starts = np.array([s["start"] for s in m["shards"]], np.int64)
        self._maps: dict[tuple[int, str], np.memmap] = {}
        self._media = self._media_offsets = None
        if "media" in m:
            try:
                self._media_offsets = np.memmap(os.path.join(path, MEDIA_OFFSETS), np.int64,
                                                mode="r")
                size = os.path.getsize(os.path.join(path, MEDIA))
            except OSError as e:
                raise ValueError(f"{path}: the manifest lists media but {e}: the store is "
                                 f"damaged, prepare it again") from None
            if len(self._media_offsets) != m["num_docs"] + 1 or self._media_offsets[-1] != size:
                raise ValueError(f"{path}: {MEDIA_OFFSETS} and {MEDIA} ({size} bytes) do not "
                                 f"match {m['num_docs']} documents: the store is damaged, "
                                 f"prepare it again")

    @property
    def num_docs(self) -> int:
        return self.manifest["num_docs"]

    @property
    def eos_id(self) -> int:
        return self.manifest["eos_id"]

    def lengths(self) -> np.ndarray:
        """Tokens per document, int64 [num_docs]."""
        return np.diff(np.asarray(self.offsets))

    def doc_hashes(self) -> np.ndarray:
        """uint64 [num_docs] name hashes."""
        return np.fromfile(os.path.join(self.path, DOC_HASH), np.uint64)

    def _map(self, shard: int, what: str) -> np.memmap:
        key = (shard, what)
        if key not in self._maps:
            entry = self.manifest["shards"][shard]
            dtype = self.dtype if what == "tokens" else np.uint8
            self._maps[key] = np.memmap(os.path.join(self.path, entry[what]), dtype, mode="r",
                                        shape=(entry["num_tokens"],))
        return self._maps[key]

    def view(self, d: int, weights: bool = False) -> np.ndarray:
        """Document d's tokens [T] in the store's dtype (or its uint8 weights [T]) as a view
        of the memory map: slicing it reads only the slice."""
        a, b = int(self.offsets[d]), int(self.offsets[d + 1])
        s = int(np.searchsorted(self._starts, a, side="right") - 1)
        start = int(self._starts[s])
        return self._map(s, "weights" if weights else "tokens")[a - start:b - start]

    def doc(self, d: int, weights: bool = False) -> np.ndarray:
        """Document d's tokens as int32 [T] (or its uint8 weights [T] with ``weights``)."""
        return np.asarray(self.view(d, weights), np.uint8 if weights else np.int32)

    def media(self, d: int) -> list[dict]:
        """Document d's images and videos in the order of their placeholders in its tokens.

        Returns:
          [{"kind": "image" | "video", "paths": [absolute path, ...], "grid": [t, h, w],
          "second_per_grid_ts": float | None}, ...]: an image has one path, t = 1 and
          second_per_grid_ts None; a video lists its sampled frames (t = ceil(frames /
          temporal_patch_size)) and temporal_patch_size / sampled fps. [] for a document
          without media and for every document of a store without media.
        """
        if self._media_offsets is None:
            return []
        if self._media is None:
            self._media = np.memmap(os.path.join(self.path, MEDIA), np.uint8, mode="r")
        a, b = int(self._media_offsets[d]), int(self._media_offsets[d + 1])
        return json.loads(self._media[a:b].tobytes())

    def has_media(self) -> np.ndarray:
        """bool [num_docs]: which documents hold at least one image or video."""
        if self._media_offsets is None:
            return np.zeros(self.num_docs, bool)
        return np.diff(np.asarray(self._media_offsets)) > len(b"[]\n")
