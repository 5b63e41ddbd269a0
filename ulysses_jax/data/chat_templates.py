"""Which chat template a chat store is rendered with, and the copy the store keeps.

``prepare --chat`` renders conversations with the tokenizer directory's own template
(``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``), or with the one
``--chat-template`` gives: a jinja file, or the name of a well-known format (``FORMATS``), for
a base model's tokenizer that has none or to replace its own. The values a template renders
(``bos_token``, ``eos_token``, ...) come from the directory's tokenizer_config.json in every
case; for a given template, a missing ``eos_token`` is the tokenizer's EOS (the token the store
records as ``eos_id``), and a value the template uses that the tokenizer cannot supply is an
error.

The store keeps the template's text as ``STORE/chat_template.jinja`` and records in its
manifest where it came from and the values it rendered, so an export can write the very
template the model was trained with (``stored_template`` checks it against
``template_sha256``).
"""
from __future__ import annotations

import json
import os

from .chat import ChatTemplate, _special

# Each renders its format's published text exactly (tests/test_chat_templates.py holds the
# texts). Roles the format has no header for are refused, not silently dropped.
FORMATS = {
    # ChatML (OpenAI; Qwen, Hermes, ...): no default system prompt.
    "chatml": "{% for message in messages %}"
              "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
              " + '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    # Llama 3 Instruct (Meta's template: content trimmed, BOS before the first header).
    "llama3": "{% for message in messages %}"
              "{% set content = '<|start_header_id|>' + message['role'] + "
              "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}"
              "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
              "{{ content }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    # Zephyr (HuggingFaceH4): plain-text role headers, each turn ends with the EOS token.
    "zephyr": "{% for message in messages %}"
              "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
              "{{ raise_exception('the zephyr format has no ' + message['role'] + ' role') }}"
              "{% endif %}"
              "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
}
# Tokens a format's text is built from: each must be one token of the tokenizer.
MARKERS = {"chatml": ("<|im_start|>", "<|im_end|>"),
           "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
           "zephyr": ()}
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
STORED = "chat_template.jinja"  # the store's copy


def _read_config(directory: str) -> dict | None:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return config if isinstance(config, dict) else {}


def _given_source(given: str) -> tuple[str, dict, str]:
    """(jinja source, origin, what errors call it) of ``--chat-template given``."""
    names = ", ".join(sorted(FORMATS))
    if given in FORMATS:
        return FORMATS[given], {"origin": "format", "name": given}, f"format {given}"
    what = f"--chat-template {given}"
    if os.path.isdir(given):
        raise ValueError(f"{what} is a directory, not a template file: give a jinja file "
                         f"(such as a tokenizer directory's chat_template.jinja) or one of the "
                         f"format names {names}")
    if not os.path.isfile(given):
        if os.sep in given or "." in os.path.basename(given):
            raise ValueError(f"{what}: no such file; give an existing jinja template file, or "
                             f"one of the format names {names}")
        raise ValueError(f"{what}: not a known format name (the formats are {names}) and no "
                         f"such file; give one of those names or a jinja template file")
    try:
        with open(given, encoding="utf-8") as f:  # universal newlines, as transformers reads
            source = f.read()
    except UnicodeDecodeError:
        raise ValueError(f"{what}: not a UTF-8 text file; a chat template is jinja "
                         f"text") from None
    return source, {"origin": "file", "path": os.path.abspath(given)}, what


def load(directory: str, given: str | None, tokenizer) -> tuple[ChatTemplate, dict]:
    """The chat template of a prepare, and where it came from.

    Args:
      directory: the tokenizer directory (its tokenizer_config.json gives the special values).
      given: ``--chat-template``: None for the directory's own template, a format name
        (``FORMATS``) or a jinja file's path.
      tokenizer: the loaded ``text.HFTokenizer`` (its EOS when the config names none; the
        format's markers must be single tokens of it).

    Returns:
      (template, origin): origin is ``{"origin": "tokenizer"}``, ``{"origin": "file",
      "path": ABS}`` or ``{"origin": "format", "name": NAME}``.

    Raises:
      ValueError: the directory has no template (and none is given); a given file is
        missing, not text or does not parse; an unknown format name; a template using a
        special value (``eos_token``, ...) the tokenizer cannot supply; a format whose
        markers the tokenizer splits into several tokens.
    """
    if given is None:
        return ChatTemplate.from_dir(directory), {"origin": "tokenizer"}
    source, origin, what = _given_source(given)
    config = _read_config(directory)
    special = {k: _special((config or {}).get(k)) for k in SPECIAL_KEYS}
    if not special["eos_token"]:  # the EOS that HFTokenizer found (EOS_CANDIDATES)
        special["eos_token"] = tokenizer._tok.id_to_token(tokenizer.eos_id)
    template = ChatTemplate(source, special, where=what)
    for key in SPECIAL_KEYS:
        if key in template.variables and not special[key]:
            why, fix = ((f"{directory} has no tokenizer_config.json",
                         f"write one there with \"{key}\"") if config is None else
                        (f"{directory}/tokenizer_config.json has no \"{key}\"",
                         f"add \"{key}\" to it"))
            raise ValueError(f"{what} renders {key}, but the tokenizer cannot supply it: "
                             f"{why}; {fix}, or use a template that does not render it")
    for marker in MARKERS.get(origin.get("name"), ()):
        n = len(tokenizer.encode(marker))
        if n != 1:
            raise ValueError(
                f"{what}: its marker {marker} must be one token of the tokenizer, and "
                f"{directory}'s tokenizer splits it into {n} tokens (it is not one of its "
                f"special tokens), so generation could not stop at the end of a turn; use a "
                f"format whose markers the tokenizer has (llama3 for a Llama 3 tokenizer; "
                f"zephyr needs only an EOS token), or give the template as a file to train "
                f"the markers as several tokens anyway")
    return template, origin


def describe_origin(origin: dict) -> str:
    """``the tokenizer``, ``format chatml`` or ``file /abs/path.jinja``."""
    kind = origin.get("origin", "tokenizer")
    return {"format": f"format {origin.get('name')}", "file": f"file {origin.get('path')}",
            "tokenizer": "the tokenizer"}.get(kind, kind)


def write_stored(store_dir: str, template: ChatTemplate) -> None:
    """Writes the template's text as ``store_dir/chat_template.jinja`` (its newlines as
    they are, on any system)."""
    with open(os.path.join(store_dir, STORED), "w", encoding="utf-8", newline="") as f:
        f.write(template.source)


def manifest_entry(template: ChatTemplate, origin: dict) -> dict:
    """The manifest's ``chat_template``: the stored file, where it came from, its values."""
    return {"file": STORED, **origin, "special": dict(template.special)}


def stored_template(store_dir: str, manifest: dict) -> ChatTemplate | None:
    """The template a chat store was rendered with, from its copy; None for a store that
    has no copy (a text store, or one prepared before stores kept their template).

    Raises:
      ValueError: the copy is gone or is not the template of the manifest's
        ``template_sha256`` (edited since prepare).
    """
    entry = manifest.get("chat_template")
    if not isinstance(entry, dict):
        return None
    path = os.path.join(store_dir, entry["file"])
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        raise ValueError(f"{store_dir}: the store's chat template {path} cannot be read "
                         f"({e.strerror}); prepare the store again") from None
    template = ChatTemplate(source, entry.get("special"), where=path)
    if template.hash != manifest.get("template_sha256"):
        raise ValueError(f"{path} is not the template the store was rendered with: its hash "
                         f"{template.hash} is not the manifest's template_sha256 "
                         f"{manifest.get('template_sha256')} (edited since prepare); prepare "
                         f"the store again")
    return template


def export_template(store_dir: str, manifest: dict, out_dir: str) -> list[str]:
    """Makes the tokenizer files in ``out_dir`` (already copied from the store's tokenizer
    directory, if it had them) render as the store was rendered.

    Writes ``out_dir/chat_template.jinja`` from the store's copy (hash-checked), which
    transformers prefers to a tokenizer_config.json "chat_template"; a "chat_template" key
    in ``out_dir/tokenizer_config.json`` is rewritten to the same text, so that readers of
    the key agree; special values the template rendered that the config lacks (a base
    directory's EOS) are added to it, or written to a new one
    (``"tokenizer_class": "PreTrainedTokenizerFast"``, which reads tokenizer.json as is).

    Returns:
      The names written (empty for a store without a copy of its template).
    Raises:
      ValueError: the store's copy is gone or edited (``stored_template``).
    """
    template = stored_template(store_dir, manifest)
    if template is None:
        return []
    with open(os.path.join(out_dir, STORED), "w", encoding="utf-8", newline="") as f:
        f.write(template.source)
    path = os.path.join(out_dir, "tokenizer_config.json")
    config = _read_config(out_dir)
    new = dict(config) if config is not None else {"tokenizer_class": "PreTrainedTokenizerFast"}
    if "chat_template" in new:
        new["chat_template"] = template.source
    for key, value in template.special.items():
        if value and not _special(new.get(key)):
            new[key] = value
    if new == config:
        return [STORED]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(new, f, indent=2, ensure_ascii=False)
    return [STORED, "tokenizer_config.json"]
