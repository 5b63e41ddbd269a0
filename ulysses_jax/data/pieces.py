"""Text encoded piece by piece, each piece as it is encoded inside the whole text.

Chat rendering tokenizes a conversation's text in pieces (prompts and answers apart, so that
no token straddles an answer's boundary). Most tokenizers encode a piece as they encode it
inside the whole text. SentencePiece-style tokenizers do not: they prepend a space ("▁") to
the text they encode, so each piece would get one (``"assistant\\n" | "hi"`` gives ``▁hi``
where the whole text has ``hi``). The settings that do it (``prepend_setting``):

- pre_tokenizer ``Metaspace`` with ``prepend_scheme: "always"`` (Llama 2 / Mistral v0.1
  converted by older transformers, T5): a space before every segment, where segments are the
  text between added tokens (``<s>``, ``<|im_end|>``, ...);
- ``Metaspace`` with ``prepend_scheme: "first"`` (newer conversions): a space at the very
  start of the text only;
- normalizer ``Prepend("▁")`` (Llama 2's own tokenizer.json): as ``"always"``;
- pre_tokenizer ``ByteLevel`` with ``add_prefix_space: true``: as ``"always"``.

For such a tokenizer a piece after the first is encoded as the whole text encodes it:
  - if the text before it ends with an added token T, the piece starts a segment there:
    ``encode(T + piece)`` without T's token gives exactly that segment's context;
  - otherwise its head (the text before its first added token) continues a segment: it is
    encoded with a copy of the tokenizer that prepends nothing, and the rest (from that
    added token on, where every segment starts after an added token, as in the whole text)
    with the tokenizer itself.
Then the pieces' ids put together are the ids of the whole text wherever no merge crosses a
piece boundary (tested against transformers' ``encode`` of the whole rendered text).
"""
from __future__ import annotations

import json
import weakref
from typing import Sequence

import numpy as np

_CONTINUATION = weakref.WeakKeyDictionary()  # HFTokenizer -> _Continuation | None


def _strip_prepend(node, found: list[str]):
    """``node`` (a normalizer / pre_tokenizer JSON tree) with its space prepending turned off;
    appends a description of each setting turned off to ``found``. None drops the node."""
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "Sequence":
        key = "normalizers" if "normalizers" in node else "pretokenizers"
        kept = [_strip_prepend(n, found) for n in node.get(key, [])]
        return {**node, key: [n for n in kept if n is not None]}
    if kind == "Metaspace" and node.get("prepend_scheme", "always") != "never":
        found.append(f'pre_tokenizer Metaspace prepend_scheme "{node.get("prepend_scheme")}"')
        return {**node, "prepend_scheme": "never"}
    if kind == "Prepend":
        found.append(f'normalizer Prepend "{node.get("prepend")}"')
        return None
    if kind == "ByteLevel" and node.get("add_prefix_space"):
        found.append("pre_tokenizer ByteLevel add_prefix_space true")
        return {**node, "add_prefix_space": False}
    return node


class _Continuation:
    """The tokenizer without its space prepending, and its added tokens' ids."""

    def __init__(self, config: dict, found: list[str]):
        import tokenizers
        self.settings = found
        self.tok = tokenizers.Tokenizer.from_str(json.dumps(config))
        self.added = set(self.tok.get_added_tokens_decoder())


def prepend_setting(tokenizer) -> list[str]:
    """The settings by which ``tokenizer`` prepends a space to the text it encodes (empty for
    byte-level BPE such as Llama 3's, Qwen's, GPT-2's, and for the byte tokenizer)."""
    cont = _continuation(tokenizer)
    return cont.settings if cont else []


def _continuation(tokenizer) -> _Continuation | None:
    raw = getattr(tokenizer, "_tok", None)  # HFTokenizer's tokenizers.Tokenizer
    if raw is None:
        return None
    if tokenizer not in _CONTINUATION:
        config, found = json.loads(raw.to_str()), []
        for key in ("normalizer", "pre_tokenizer"):
            config[key] = _strip_prepend(config.get(key), found)
        _CONTINUATION[tokenizer] = _Continuation(config, found) if found else None
    return _CONTINUATION[tokenizer]


def encode_pieces(tokenizer, pieces: Sequence[str]) -> list[np.ndarray]:
    """The ids of each of ``pieces`` as encoded inside ``"".join(pieces)`` (module docstring).

    Args:
      tokenizer: ``text.HFTokenizer`` or ``text.ByteTokenizer``.
      pieces: consecutive pieces of one text.

    Returns:
      one int32 array per piece, without the tokenizer's BOS/EOS post-processing.
    """
    cont = _continuation(tokenizer)
    if cont is None:
        return tokenizer.encode_batch(list(pieces))
    raw = tokenizer._tok
    out, before = [], None  # before: the added token ending the text so far (None: none)
    for k, piece in enumerate(pieces):
        if not piece:
            out.append(np.zeros(0, np.int32))
            continue
        if k == 0:
            text = piece
            enc = raw.encode(text, add_special_tokens=False)
            ids = enc.ids
        elif before is not None:  # the piece starts a segment, as after `before` in the text
            text = before + piece
            enc = raw.encode(text, add_special_tokens=False)
            if not enc.ids or enc.ids[0] != raw.token_to_id(before):
                raise ValueError(f"the added token {before!r} does not encode as itself "
                                 f"before {piece[:40]!r}: cannot encode the piece as the "
                                 f"whole text encodes it")
            ids = enc.ids[1:]
        else:  # the head continues a segment: no prepended space; the rest from its token on
            head = cont.tok.encode(piece, add_special_tokens=False)
            first = next((i for i, t in enumerate(head.ids) if t in cont.added), None)
            if first is None:
                text, enc, ids = piece, head, head.ids
            else:
                text = piece[head.offsets[first][0]:]
                enc = raw.encode(text, add_special_tokens=False)
                ids = head.ids[:first] + enc.ids
        out.append(np.asarray(ids, np.int32))
        # The next piece starts a segment if this one ends with an added token (what follows
        # it, if anything, is whitespace the token absorbed: an added token's rstrip).
        last = enc.ids[-1] if enc.ids else None
        ends = last in cont.added and not text[enc.offsets[-1][1]:].strip()
        before = raw.id_to_token(last) if ends else None
    return out
