"""Chat data: OpenAI-style messages -> tokens and per-token loss weights (assistant-only loss).

A conversation is a list of ``{"role": "system" | "user" | "assistant" | "tool", "content": ...}``
rendered with the chat template of a Hugging Face tokenizer directory
(``tokenizer_config.json``'s ``chat_template``), in a sandboxed jinja2 environment set up as
transformers sets up its own (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``,
``tojson``, ``strftime_now``), so the text is what ``apply_chat_template`` would give.

Supervised spans come from rendering prefixes, never from searching for an answer's text: for
assistant message i, ``P = render(messages[:i], add_generation_prompt=True)`` and
``Q = render(messages[:i+1])``; the answer is ``Q[len(P):]`` up to and including its
end-of-turn token (trailing whitespace after it, e.g. ChatML's newline, is not supervised). An
answer equal to earlier user or system text therefore cannot move the mask. The template must
be prefix-stable (Q starts with P, and the whole conversation's text starts with Q); one that
rewrites earlier turns (e.g. drops reasoning of past answers) is refused, since the text the
model would be trained on then differs from what it sees at inference.

Text is tokenized piece by piece (prompt pieces and answer pieces separately), so no token
straddles a span boundary: a token is either wholly supervised or not. Each piece is encoded
as inside the whole text (``pieces.py``): a SentencePiece-style tokenizer that prepends a space
to what it encodes does not get one at the start of every piece.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Sequence

import numpy as np

from .pieces import encode_pieces

ROLES = ("system", "user", "assistant", "tool")


class NotPrefixStable(ValueError):
    """The chat template renders a conversation's prefix differently from its start."""


class NoSupervision(ValueError):
    """A conversation with no assistant token to train on."""


def _special(value) -> str:
    """A special token of tokenizer_config.json: a string, or {"content": ...}."""
    return value.get("content", "") if isinstance(value, dict) else (value or "")


class ChatTemplate:
    """The chat template of a tokenizer directory, rendered in a jinja2 sandbox.

    Args:
      template: the jinja2 source.
      special: values for the template's variables such as ``bos_token`` and ``eos_token``.
      where: names the template's origin in errors (its tokenizer directory, file or format).

    Attributes:
      variables: the names the template reads that it does not set (``messages``,
        ``bos_token``, ...).
    """

    def __init__(self, template: str, special: dict | None = None,
                 where: str = "chat template"):
        import jinja2
        import jinja2.ext
        import jinja2.meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"the chat template refused the conversation: {message}")

        class Generation(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag)
            renders its body: spans here come from rendering prefixes, not from the tag."""
            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, Generation])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
            x, ensure_ascii=False, indent=indent, sort_keys=kw.get("sort_keys", False))
        env.globals["raise_exception"] = raise_exception
        # As transformers: templates such as Llama 3.2's print today's date in the system turn
        # (the store then depends on the day it was prepared; its template hash does not).
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.source = template
        try:
            self._template = env.from_string(template)
            # The names it reads that no tag sets: which special values it needs.
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(
                env.parse(template)))
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{where}: the chat template does not parse (line {e.lineno}: "
                             f"{e.message})") from None
        self.special = dict(special or {})

    @classmethod
    def from_dir(cls, path: str) -> "ChatTemplate":
        """From ``path/chat_template.jinja``, else ``path/tokenizer_config.json``'s
        ``chat_template`` (transformers' order: the file wins when both are there)."""
        config_path = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            None)
        if not isinstance(template, str):
            raise ValueError(f"{path} has no chat template: chat data needs a tokenizer "
                             f"directory whose tokenizer_config.json has a \"chat_template\" "
                             f"(or a chat_template.jinja beside it), or --chat-template (a "
                             f"jinja file, or a format name such as chatml)")
        special = {k: _special(config.get(k)) for k in
                   ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(template, special, where=path)

    @property
    def hash(self) -> str:
        """Of the source and the special-token values it renders (bos_token, ...)."""
        key = json.dumps([self.source, self.special], sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     **self.special)


def prompt_ids(tokenizer, template: ChatTemplate, messages: Sequence[dict]) -> list[int]:
    """The ids of ``messages`` rendered with the generation prompt (the template writes any
    BOS itself): what a model answering them reads. ValueError when the template cannot
    render them (jinja2 raises its own kinds for a bad conversation)."""
    try:
        text = template.render(messages, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 (jinja2's errors, named in the message)
        raise ValueError(f"the chat template cannot render its messages: "
                         f"{type(e).__name__}: {e}") from None
    return [int(i) for i in tokenizer.encode(text)]


def _check_messages(messages, name: str) -> None:
    if not messages:
        raise NoSupervision(f"{name}: an empty conversation has no assistant turn")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ValueError(f"{name}: message {i} has role {m.get('role')!r}; roles are "
                             f"{', '.join(ROLES)}")


def _render(template: ChatTemplate, messages: Sequence[dict], upto: int, name: str,
            add_generation_prompt: bool = False) -> str:
    """``template.render(messages[:upto])``; any error the template raises (a message without
    "content", content that is not a string, ``raise_exception``) is a ValueError naming the
    conversation, so prepare reports a bad record instead of crashing."""
    try:
        return template.render(messages[:upto], add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - a template is user code: it can raise anything
        raise ValueError(f"{name}: the chat template failed to render messages[:{upto}] "
                         f"({type(e).__name__}: {e}); fix the conversation's messages or "
                         f"the template") from None


def supervised_spans(template: ChatTemplate, messages: Sequence[dict],
                     name: str = "conversation") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans [a, b) of its assistant answers.

    Raises:
      NotPrefixStable: the template is not prefix-stable at some assistant turn.
      NoSupervision: no assistant turn renders any text to train on.
    """
    _check_messages(messages, name)
    full = _render(template, messages, len(messages), name)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(template, messages, i, name, add_generation_prompt=True)
        upto = _render(template, messages, i + 1, name)
        if not upto.startswith(prompt) or not full.startswith(upto):
            which = ("the text up to it does not start with the prompt rendered with the "
                     "generation prompt" if not upto.startswith(prompt) else
                     "the whole conversation's text does not start with the text up to it")
            raise NotPrefixStable(
                f"{name}: the chat template is not prefix-stable at assistant message {i}: "
                f"{which}. Masks are found by rendering prefixes, so such a template (one "
                f"that rewrites earlier turns) cannot be used; pick a template that renders "
                f"each turn the same whatever follows it")
        end = len(upto.rstrip())  # through the end-of-turn token, not the whitespace after
        if end > len(prompt):
            spans.append((len(prompt), end))
    if not spans:
        raise NoSupervision(f"{name}: no supervised token (no assistant answer with text)")
    return full, spans


def encode_conversation(tokenizer, template: ChatTemplate, messages: Sequence[dict],
                        name: str = "conversation",
                        expand=None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and loss weights of one conversation.

    Args:
      expand: optional, called on each piece's ids in text order, returns the ids stored for
        it (``media.Expander`` repeats image / video placeholders); they keep the piece's
        weight.

    Returns:
      (tokens int32 [T], weights uint8 [T]): weight 1 on the tokens of assistant answers
      (each through its end-of-turn token), 0 elsewhere.
    """
    text, spans = supervised_spans(template, messages, name)
    cuts, flags = [0], []
    for a, b in spans:
        if a > cuts[-1]:
            cuts.append(a)
            flags.append(0)
        cuts.append(b)
        flags.append(1)
    if len(text) > cuts[-1]:
        cuts.append(len(text))
        flags.append(0)
    pieces = encode_pieces(tokenizer, [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])])
    if expand is not None:
        pieces = [expand(p) for p in pieces]
    tokens = np.concatenate(pieces).astype(np.int32)
    weights = np.concatenate([np.full(len(p), f, np.uint8) for p, f in zip(pieces, flags)])
    if not weights.any():
        raise NoSupervision(f"{name}: no supervised token (the answers encode to no token)")
    return tokens, weights
