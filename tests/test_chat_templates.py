"""--chat-template (ulysses_jax/data/chat_templates.py): the named formats render their published
texts; a template file for a tokenizer directory without a template (or a tokenizer_config.json);
the store's copy of its template and the manifest's record; a replaced template changes the hash
and the tokens; prepare's rebuild check; the CLI's errors."""
import json
import os

import numpy as np
import pytest

from tests.test_chat import CHATML, LLAMA3, TRAP, supervised_runs, write_tokenizer_dir
from ulysses_jax.data import chat, chat_templates
from ulysses_jax.data.__main__ import main as data_cli
from ulysses_jax.data.prepare import prepare
from ulysses_jax.data.store import TokenStore
from ulysses_jax.data.text import load_tokenizer

CONV = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there! How can I help?"},
        {"role": "user", "content": "Tell me a joke."}]
# The formats' published texts of CONV, then the generation prompt that follows.
KNOWN = {
    # ChatML (OpenAI's chatml.md; Qwen's model cards).
    "chatml": ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
               "<|im_start|>user\nHello<|im_end|>\n"
               "<|im_start|>assistant\nHi there! How can I help?<|im_end|>\n"
               "<|im_start|>user\nTell me a joke.<|im_end|>\n",
               "<|im_start|>assistant\n"),
    # Llama 3 Instruct (Meta's model card, "Prompt format").
    "llama3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
               "You are a helpful assistant.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nHi there! How can I help?"
               "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|>",
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    # Zephyr (HuggingFaceH4/zephyr-7b-beta's model card; EOS </s> for Mistral).
    "zephyr": ("<|system|>\nYou are a helpful assistant.</s>\n<|user|>\nHello</s>\n"
               "<|assistant|>\nHi there! How can I help?</s>\n<|user|>\nTell me a joke.</s>\n",
               "<|assistant|>\n"),
}
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "</s>"}
# A file template that renders eos_token, for a tokenizer directory with no config at all.
EOS_TEMPLATE = ("{# ChatML with the tokenizer's EOS ending each turn (é) #}\n"
                "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                "+ eos_token + '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}\n")


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_formats_render_their_published_text(name):
    text, prompt = KNOWN[name]
    template = chat.ChatTemplate(chat_templates.FORMATS[name], SPECIAL)
    assert template.render(CONV) == text
    assert template.render(CONV, add_generation_prompt=True) == text + prompt
    # Answers are masked through the turn's end token.
    full, spans = chat.supervised_spans(template, CONV[:3])
    end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "zephyr": "</s>"}[name]
    assert [full[a:b] for a, b in spans] == ["Hi there! How can I help?" + end]
    if name == "zephyr":  # no tool role in the format: refused, not dropped
        with pytest.raises(ValueError, match="the zephyr format has no tool role"):
            template.render(CONV + [{"role": "tool", "content": "42"}])


def test_formats_render_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = write_tokenizer_dir(tmp_path / "tok", CHATML, eos="</s>")
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    checked = 0
    for name, src in chat_templates.FORMATS.items():
        ours = chat.ChatTemplate(src, {"bos_token": ref.bos_token, "eos_token": ref.eos_token})
        for gen in (False, True):
            assert ours.render(CONV, gen) == ref.apply_chat_template(
                CONV, chat_template=src, tokenize=False, add_generation_prompt=gen)
            checked += 1
    assert checked == 6


def _base_dir(tmp_path):
    """A base model's tokenizer directory: tokenizer.json only (no tokenizer_config.json)."""
    directory = write_tokenizer_dir(tmp_path / "base", CHATML)
    os.remove(os.path.join(directory, "tokenizer_config.json"))
    return directory


def _write_chats(path, convs=(TRAP, TRAP[1:3])):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return str(path)


def test_file_template_for_a_tokenizer_without_one(tmp_path):
    """A base tokenizer (no template, no tokenizer_config.json) + --chat-template FILE: a chat
    store rendered with the file, the tokenizer's EOS as eos_token, a byte-exact copy of the
    file in the store and the manifest's record of it."""
    directory = _base_dir(tmp_path)
    with pytest.raises(ValueError, match="has no chat template.*--chat-template"):
        prepare([_write_chats(tmp_path / "c.jsonl")], str(tmp_path / "x"), directory,
                chat=True, progress=False)
    path = tmp_path / "my template.jinja"
    path.write_bytes(EOS_TEMPLATE.encode())
    out = tmp_path / "store"
    manifest, built = prepare([_write_chats(tmp_path / "c.jsonl")], str(out), directory,
                              chat=True, progress=False, chat_template=str(path))
    assert built and manifest["kind"] == "chat" and manifest["num_docs"] == 2
    special = {"bos_token": "", "eos_token": "<|endoftext|>", "pad_token": "", "unk_token": ""}
    assert manifest["chat_template"] == {"file": "chat_template.jinja", "origin": "file",
                                         "path": str(path), "special": special}
    assert (out / "chat_template.jinja").read_bytes() == path.read_bytes()
    assert manifest["template_sha256"] == chat.ChatTemplate(EOS_TEMPLATE, special).hash
    stored = chat_templates.stored_template(str(out), manifest)
    assert stored.source == EOS_TEMPLATE and stored.special == special
    store, tok = TokenStore(str(out)), load_tokenizer(directory)
    runs = supervised_runs(tok, store.doc(0), store.doc(0, weights=True))[0]
    assert runs == ["Say hi<|endoftext|>", "hi<|endoftext|>"]
    # The copy is checked against template_sha256: an edited copy is refused.
    (out / "chat_template.jinja").write_text(EOS_TEMPLATE.replace("im_start", "im_begin"))
    with pytest.raises(ValueError, match="not the template the store was rendered with"):
        chat_templates.stored_template(str(out), manifest)


def test_format_replaces_the_tokenizers_template(tmp_path):
    """--chat-template chatml on a directory whose own template is Llama-3 style: another
    template_sha256, other tokens; each store keeps the template it was rendered with."""
    directory = write_tokenizer_dir(tmp_path / "tok", LLAMA3, eos="<|eot_id|>")
    src = _write_chats(tmp_path / "c.jsonl")
    own, _ = prepare([src], str(tmp_path / "own"), directory, chat=True, progress=False)
    given, _ = prepare([src], str(tmp_path / "given"), directory, chat=True, progress=False,
                       chat_template="chatml")
    assert own["chat_template"]["origin"] == "tokenizer"
    assert given["chat_template"]["origin"] == "format"
    assert given["chat_template"]["name"] == "chatml"
    assert (tmp_path / "own" / "chat_template.jinja").read_text() == LLAMA3
    assert (tmp_path / "given" / "chat_template.jinja").read_text() == \
        chat_templates.FORMATS["chatml"]
    assert own["template_sha256"] != given["template_sha256"]
    a, b = TokenStore(str(tmp_path / "own")), TokenStore(str(tmp_path / "given"))
    assert a.doc(0).tolist() != b.doc(0).tolist()
    tok = load_tokenizer(directory)
    assert supervised_runs(tok, b.doc(0), b.doc(0, weights=True))[0] == \
        ["Say hi<|im_end|>", "hi<|im_end|>"]
    assert supervised_runs(tok, a.doc(0), a.doc(0, weights=True))[0] == \
        ["Say hi<|eot_id|>", "hi<|eot_id|>"]
    # The special values still come from the directory's tokenizer_config.json.
    assert given["chat_template"]["special"]["bos_token"] == "<|begin_of_text|>"


def test_rerun_with_another_template_refuses_then_force_rebuilds(tmp_path):
    directory = write_tokenizer_dir(tmp_path / "tok", CHATML)
    src, out = [_write_chats(tmp_path / "c.jsonl")], str(tmp_path / "s")
    first, built = prepare(src, out, directory, chat=True, progress=False,
                           chat_template="chatml")
    assert built
    assert prepare(src, out, directory, chat=True, progress=False,
                   chat_template="chatml") == (first, False)
    path = tmp_path / "t.jinja"
    path.write_text(chat_templates.FORMATS["chatml"])  # the same text, from a file
    with pytest.raises(ValueError, match=r"other inputs \(the same chat template from "
                                         r"elsewhere: format chatml -> file .*t.jinja\)"):
        prepare(src, out, directory, chat=True, progress=False, chat_template=str(path))
    path.write_text(EOS_TEMPLATE)  # another template, same file
    with pytest.raises(ValueError, match=r"other inputs \(another chat template: "
                                         f"template_sha256 {first['template_sha256']} -> "):
        prepare(src, out, directory, chat=True, progress=False, chat_template=str(path))
    with pytest.raises(ValueError, match=r"other inputs \(another chat template"):
        prepare(src, out, directory, chat=True, progress=False)  # its own template: ok too
    second, built = prepare(src, out, directory, chat=True, progress=False, force=True,
                            chat_template=str(path), workers=2)
    assert built and second["template_sha256"] != first["template_sha256"]
    assert (tmp_path / "s" / "chat_template.jinja").read_text() == EOS_TEMPLATE
    assert prepare(src, out, directory, chat=True, progress=False,
                   chat_template=str(path))[1] is False
    # Worker processes render with the given template too: the same store as one process.
    one, _ = prepare(src, str(tmp_path / "one"), directory, chat=True, progress=False,
                     chat_template=str(path))
    assert one["template_sha256"] == second["template_sha256"]
    for d in range(2):
        np.testing.assert_array_equal(TokenStore(out).doc(d), TokenStore(str(tmp_path / "one"))
                                      .doc(d))


def _plain_tokenizer(path):
    """A byte-level BPE tokenizer.json whose only special token is <|endoftext|> (a base
    model's without chat tokens), with no tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Say hi again, the answer is 42"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_cli_errors(tmp_path, capsys):
    """Each bad --chat-template exits 2 with one line naming the file or format and the rule;
    nothing is written."""
    base, plain = _base_dir(tmp_path), _plain_tokenizer(tmp_path / "plain")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }")
    src = _write_chats(tmp_path / "c.jsonl")
    cases = [
        (["--chat-template", "chatml"], base,
         "--chat-template chatml needs --chat"),
        (["--chat", "--chat-template", str(tmp_path / "nope.jinja")], base,
         f"--chat-template {tmp_path / 'nope.jinja'}: no such file"),
        (["--chat", "--chat-template", "chatlm"], base,
         "--chat-template chatlm: not a known format name (the formats are chatml, llama3, "
         "zephyr)"),
        (["--chat", "--chat-template", str(bad)], base,
         f"--chat-template {bad}: the chat template does not parse (line 1"),
        (["--chat", "--chat-template", str(tmp_path)], base, "is a directory, not a template"),
        (["--chat", "--chat-template", "llama3"], base,
         f"format llama3 renders bos_token, but the tokenizer cannot supply it: {base} has no "
         f"tokenizer_config.json"),
        (["--chat", "--chat-template", "chatml"], plain,
         "format chatml: its marker <|im_start|> must be one token of the tokenizer"),
    ]
    for flags, tokenizer, message in cases:
        rc = data_cli(["prepare", src, "--tokenizer", tokenizer, "--out",
                       str(tmp_path / "s"), "--workers", "1", "--no-progress", *flags])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and message in err, (flags, err)
        assert len(err.splitlines()) == 1 and not (tmp_path / "s").exists()
    # A base tokenizer without chat tokens takes the zephyr format (EOS from its vocabulary).
    assert data_cli(["prepare", src, "--tokenizer", plain, "--out", str(tmp_path / "z"),
                     "--workers", "1", "--no-progress", "--chat", "--chat-template",
                     "zephyr"]) == 0
    assert "chat template from format zephyr" in capsys.readouterr().out
    manifest = TokenStore(str(tmp_path / "z")).manifest
    assert manifest["chat_template"]["special"]["eos_token"] == "<|endoftext|>"


@pytest.mark.parametrize("case", ["replaced", "base"])
def test_export_template_renders_as_the_store(tmp_path, case):
    """The files an export writes beside the copied tokenizer files: transformers'
    AutoTokenizer then renders the store's own template, text and ids, whether it replaced the
    directory's template (whose config key is rewritten) or the directory had no
    tokenizer_config.json at all (one is written, with the EOS the template rendered)."""
    import shutil
    transformers = pytest.importorskip("transformers")
    if case == "replaced":
        directory, given = write_tokenizer_dir(tmp_path / "tok", LLAMA3, eos="<|eot_id|>"), "chatml"
    else:
        directory, given = _base_dir(tmp_path), "zephyr"
    convs = (TRAP, TRAP[1:3])
    store_dir = str(tmp_path / "s")
    manifest, _ = prepare([_write_chats(tmp_path / "c.jsonl", convs)], store_dir, directory,
                          chat=True, progress=False, chat_template=given)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # what export copies
        if os.path.exists(os.path.join(directory, name)):
            shutil.copy(os.path.join(directory, name), out)
    written = chat_templates.export_template(store_dir, manifest, str(out))
    assert written == ["chat_template.jinja", "tokenizer_config.json"]
    assert (out / "chat_template.jinja").read_text() == chat_templates.FORMATS[given]
    config = json.loads((out / "tokenizer_config.json").read_text())
    if case == "replaced":
        assert config["chat_template"] == chat_templates.FORMATS["chatml"]
    else:
        assert config["eos_token"] == "<|endoftext|>" and "chat_template" not in config
    ref = transformers.AutoTokenizer.from_pretrained(str(out))
    stored, store = chat_templates.stored_template(store_dir, manifest), TokenStore(store_dir)
    for d, conv in enumerate(convs):
        assert ref.apply_chat_template(conv, tokenize=False) == stored.render(conv)
        assert ref.apply_chat_template(conv, tokenize=True, return_dict=False) == \
            store.doc(d).tolist()
    # Written once, a second call changes nothing more.
    assert chat_templates.export_template(store_dir, manifest, str(out)) == \
        ["chat_template.jinja"]
