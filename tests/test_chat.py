"""Chat masks (ulysses_jax.data.chat): golden spans for a ChatML-style and a Llama-3-style
template, the trap of an answer equal to earlier user text, refusals, and prepare --chat."""
import json

import numpy as np
import pytest

from ulysses_jax.data import chat, prepare as prepare_lib
from ulysses_jax.data.text import load_tokenizer
from ulysses_jax.data.store import TokenStore

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Drops the text of every assistant answer but the last: the history the model is trained on
# would differ from what it sees at inference.
UNSTABLE = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
            "{{ '<|im_start|>assistant\\n(earlier answer)<|im_end|>\\n' }}{% else %}"
            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# The trap: the first answer repeats the user's words exactly; a mask found by searching for
# the answer's text would land on the user turn.
TRAP = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Say hi"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "hi"}]


def write_tokenizer_dir(path, template, eos="<|im_end|>", seed=0):
    """A small byte-level BPE tokenizer directory with the chat special tokens and
    ``template`` in its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = np.random.default_rng(seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = ["Say", " hi", " again", " the", " answer", " is", " user", "\n", " 42"]
    tok.train_from_iterator(["".join(rng.choice(words, 40)) for _ in range(40)], trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": eos, "bos_token": "<|begin_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(path)


def decode(tokenizer, ids):
    """Text of ids, special tokens included (HFTokenizer.decode drops them)."""
    return tokenizer._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def supervised_runs(tokenizer, tokens, weights):
    """Decoded runs of consecutive weight-1 tokens, and the index each starts at."""
    runs, starts, j = [], [], 0
    while j < len(tokens):
        if weights[j]:
            k = j
            while k < len(tokens) and weights[k]:
                k += 1
            runs.append(decode(tokenizer, tokens[j:k]))
            starts.append(j)
            j = k
        else:
            j += 1
    return runs, starts


GOLDEN = {
    "chatml": (CHATML, "<|im_end|>", [
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hi<|im_end|>\n"
        "<|im_start|>assistant\n",
        "Say hi<|im_end|>",
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n",
        "hi<|im_end|>",
        "\n"]),
    "llama3": (LLAMA3, "<|eot_id|>", [
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nSay hi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "Say hi<|eot_id|>",
        "<|start_header_id|>user<|end_header_id|>\n\nagain<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "hi<|eot_id|>",
        ""]),
}


@pytest.mark.parametrize("style", sorted(GOLDEN))
def test_golden_spans_and_weights(tmp_path, style):
    template_src, eos, pieces = GOLDEN[style]
    directory = write_tokenizer_dir(tmp_path / style, template_src, eos)
    template = chat.ChatTemplate.from_dir(directory)
    text, spans = chat.supervised_spans(template, TRAP)
    assert text == "".join(pieces)
    a1 = len(pieces[0])
    a2 = a1 + len(pieces[1]) + len(pieces[2])
    assert spans == [(a1, a1 + len(pieces[1])), (a2, a2 + len(pieces[3]))]
    # The user's "Say hi" sits before the first span: searching for the answer's text would
    # have found it first.
    assert text.index("Say hi") < a1 and text[a1:a1 + 6] == "Say hi"

    tok = load_tokenizer(directory)
    tokens, weights = chat.encode_conversation(tok, template, TRAP)
    assert tokens.dtype == np.int32 and weights.dtype == np.uint8 and len(tokens) == len(weights)
    runs, starts = supervised_runs(tok, tokens, weights)
    assert runs == [pieces[1], pieces[3]]
    assert decode(tok, tokens[:starts[0]]) == pieces[0]  # the user's "Say hi" is unsupervised
    assert tokens[starts[0] + len(tok.encode("Say hi"))] == tok._tok.token_to_id(eos)
    assert decode(tok, tokens) == text


def test_matches_transformers_apply_chat_template(tmp_path):
    """Our sandboxed rendering is the text transformers renders, prompt prefixes included."""
    transformers = pytest.importorskip("transformers")
    checked = 0
    for name, src in (("chatml", CHATML), ("llama3", LLAMA3)):
        directory = write_tokenizer_dir(tmp_path / name, src)
        ref = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
        ours = chat.ChatTemplate.from_dir(directory)
        for i in range(1, len(TRAP) + 1):  # transformers refuses an empty conversation
            for gen in (False, True):
                assert ours.render(TRAP[:i], gen) == ref.apply_chat_template(
                    TRAP[:i], tokenize=False, add_generation_prompt=gen)
                checked += 1
    assert checked == 20


def test_tool_turns_are_not_supervised(tmp_path):
    template = chat.ChatTemplate(CHATML)
    msgs = [{"role": "user", "content": "the answer"},
            {"role": "assistant", "content": "call 42"},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "the answer is 42"}]
    text, spans = chat.supervised_spans(template, msgs)
    assert [text[a:b] for a, b in spans] == ["call 42<|im_end|>", "the answer is 42<|im_end|>"]


def test_refusals(tmp_path):
    with pytest.raises(chat.NotPrefixStable, match="not prefix-stable at assistant message 2"):
        chat.supervised_spans(chat.ChatTemplate(UNSTABLE), TRAP, "conv.jsonl:7")
    with pytest.raises(chat.NoSupervision, match="conv.jsonl:3: no supervised token"):
        chat.supervised_spans(chat.ChatTemplate(CHATML),
                              [{"role": "user", "content": "hi"},
                               {"role": "user", "content": "anyone?"}], "conv.jsonl:3")
    # An empty answer still trains the end-of-turn token: that is supervision.
    text, spans = chat.supervised_spans(chat.ChatTemplate(CHATML),
                                        [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": ""}])
    assert [text[a:b] for a, b in spans] == ["<|im_end|>"]
    with pytest.raises(ValueError, match="role 'robot'"):
        chat.supervised_spans(chat.ChatTemplate(CHATML), [{"role": "robot", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no chat template"):
        chat.ChatTemplate.from_dir(str(tmp_path))


def test_prepare_chat_counts_and_names_unsupervised(tmp_path):
    directory = write_tokenizer_dir(tmp_path / "tok", CHATML)
    lines = [{"messages": TRAP}, {"messages": [{"role": "user", "content": "hi"}]},
             {"messages": TRAP[:3]}, {"messages": [{"role": "system", "content": "x"}]}]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "store"
    with pytest.raises(chat.NoSupervision, match=r"2 conversation\(s\) have no supervised "
                       r"token.*chat.jsonl:2.*chat.jsonl:4"):
        prepare_lib.prepare([str(src)], str(out), directory, chat=True, progress=False)
    assert not out.exists() and not list(tmp_path.glob("store.tmp-*"))
    src.write_text("".join(json.dumps(x) + "\n" for x in lines[::2]))
    manifest, built = prepare_lib.prepare([str(src)], str(out), directory, chat=True,
                                          progress=False)
    assert built and manifest["kind"] == "chat" and manifest["num_docs"] == 2
    store, tok = TokenStore(str(out)), load_tokenizer(directory)
    assert manifest["template_sha256"] == chat.ChatTemplate.from_dir(directory).hash
    runs = supervised_runs(tok, store.doc(0), store.doc(0, weights=True))[0]
    assert runs == ["Say hi<|im_end|>", "hi<|im_end|>"]
    assert manifest["num_supervised"] == sum(int(store.doc(d, True).sum()) for d in range(2))
    with pytest.raises(ValueError, match="--chat needs --tokenizer"):
        prepare_lib.prepare([str(src)], str(tmp_path / "x"), None, chat=True, progress=False)


def test_chat_from_parquet_and_datasets_directory(tmp_path):
    """Messages as a list<struct> column: a parquet file and a save_to_disk directory (Arrow
    IPC stream + state.json) give the same conversations as the jsonl."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    directory = write_tokenizer_dir(tmp_path / "tok", CHATML)
    convs = [TRAP, TRAP[1:3], [{"role": "user", "content": "x"},
                               {"role": "assistant", "content": "the answer is 42"}]]
    table = pa.table({"messages": convs, "id": [0, 1, 2]})
    pq.write_table(table, tmp_path / "c.parquet")
    ds = tmp_path / "ds"
    ds.mkdir()
    with pa.OSFile(str(ds / "data-00000-of-00001.arrow"), "wb") as f:
        with pa.ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
    (ds / "state.json").write_text(json.dumps({"_data_files": [
        {"filename": "data-00000-of-00001.arrow"}]}))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    stores = {}
    for name, src in (("jsonl", tmp_path / "c.jsonl"), ("parquet", tmp_path / "c.parquet"),
                      ("ds", ds)):
        manifest, _ = prepare_lib.prepare([str(src)], str(tmp_path / f"s-{name}"), directory,
                                          chat=True, progress=False)
        assert manifest["num_docs"] == 3
        stores[name] = TokenStore(str(tmp_path / f"s-{name}"))
    checked = 0
    for d in range(3):
        for name in ("parquet", "ds"):
            np.testing.assert_array_equal(stores[name].doc(d), stores["jsonl"].doc(d))
            np.testing.assert_array_equal(stores[name].doc(d, True), stores["jsonl"].doc(d, True))
            checked += 1
    assert checked == 6


def test_packed_rows_supervise_exactly_the_answers(tmp_path):
    """prepare --chat, then ChatRows: each conversation is one segment of one row, and its
    supervised targets decode to exactly its assistant answers, each with <|im_end|>."""
    from ulysses_jax.data.packing import ChatRows
    rng = np.random.default_rng()
    directory = write_tokenizer_dir(tmp_path / "tok", CHATML)
    words = ["Say", " hi", " again", " the", " answer", " is", " 42", " user"]
    say = lambda n: "".join(rng.choice(words, int(n)))  # noqa: E731
    convs = []
    for _ in range(30):
        msgs = [{"role": "system", "content": say(2)}]
        for _ in range(int(rng.integers(1, 4))):
            q = say(rng.integers(1, 5))
            a = q if rng.random() < 0.3 else say(rng.integers(1, 6))  # answers that echo
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        convs.append(msgs)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    prepare_lib.prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "s"), directory, chat=True,
                        workers=2, progress=False)
    store, tok = TokenStore(str(tmp_path / "s")), load_tokenizer(directory)
    rows = ChatRows(store, np.arange(store.num_docs), 256, seed=5)
    assert rows.num_long == 0
    seen = []
    for r in range(rows.num_rows):
        row = rows.row(r, epoch=0, seed=5)
        plan = int(rows._perm(5, 0)[r])
        docs = rows.ids[rows.row_docs[rows.row_start[plan]:rows.row_start[plan + 1]]]
        assert int(row["segment_ids"].max()) == len(docs)
        for seg, d in enumerate(docs, 1):
            idx = np.flatnonzero(row["segment_ids"] == seg)
            sup = row["loss_mask"][idx] > 0
            runs = supervised_runs(tok, row["targets"][idx], sup.astype(np.uint8))[0]
            answers = [m["content"] + "<|im_end|>" for m in convs[d] if m["role"] == "assistant"]
            assert runs == answers, (d, runs, answers)
            seen.append(int(d))
    assert sorted(seen) == list(range(len(convs)))


@pytest.mark.parametrize("message, what", [
    ({"role": "user"}, "UndefinedError"),  # no "content": the template reads m['content']
    ({"role": "user", "content": None}, "TypeError"),
    ({"role": "user", "content": [{"type": "text", "text": "hi"}]}, "TypeError")])
def test_template_errors_name_the_conversation(tmp_path, capsys, message, what):
    """A conversation the template cannot render is a bad input (ValueError naming it and the
    template's complaint; the CLI exits 2), not a crash with a traceback."""
    from ulysses_jax.data.__main__ import main as data_cli
    msgs = [message, {"role": "assistant", "content": "x"}]
    with pytest.raises(ValueError, match=f"conv.jsonl:9: the chat template failed to render "
                                         f"messages\\[:.\\].*{what}"):
        chat.supervised_spans(chat.ChatTemplate(CHATML), msgs, "conv.jsonl:9")
    directory = write_tokenizer_dir(tmp_path / "tok", CHATML)
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": TRAP}) + "\n"
                                      + json.dumps({"messages": msgs}) + "\n")
    for workers in ("1", "2"):
        assert data_cli(["prepare", str(tmp_path / "c.jsonl"), "--chat", "--tokenizer",
                         directory, "--out", str(tmp_path / "s"), "--workers", workers,
                         "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "c.jsonl:2: the chat template failed" in err, err
        assert len(err.splitlines()) == 1 and not (tmp_path / "s").exists()


def test_generation_tag_and_syntax_errors(tmp_path):
    """Templates written for transformers' assistant masks wrap answers in
    {% generation %}...{% endgeneration %}: they render as without the tag. A template that
    does not parse is a ValueError naming the directory, not a jinja2 traceback."""
    tagged = CHATML.replace("{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                            "'<|im_end|>' + '\\n' }}",
                            "{{ '<|im_start|>' + m['role'] + '\\n' }}{% generation %}"
                            "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}")
    assert tagged != CHATML
    for i in range(1, len(TRAP) + 1):
        for gen in (False, True):
            assert chat.ChatTemplate(tagged).render(TRAP[:i], gen) == \
                chat.ChatTemplate(CHATML).render(TRAP[:i], gen)
    directory = write_tokenizer_dir(tmp_path / "tok", "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match=f"{directory}: the chat template does not parse"):
        chat.ChatTemplate.from_dir(directory)


def test_special_tokens_are_part_of_the_inputs(tmp_path):
    """The template renders bos_token/eos_token from tokenizer_config.json: changing one
    changes the text, so prepare must not answer "nothing to do" with the old store."""
    directory = write_tokenizer_dir(tmp_path / "tok", chat.ChatTemplate(CHATML).source
                                    .replace("{% for", "{{ bos_token }}{% for", 1))
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": TRAP}) + "\n")
    args = ([str(tmp_path / "c.jsonl")], str(tmp_path / "s"), directory)
    manifest, built = prepare_lib.prepare(*args, chat=True, progress=False)
    assert built and manifest["num_docs"] == 1
    config = tmp_path / "tok" / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    config.write_text(json.dumps(cfg | {"bos_token": "<|endoftext|>"}))
    with pytest.raises(ValueError, match="holds a token store of other inputs"):
        prepare_lib.prepare(*args, chat=True, progress=False)
    manifest2, built = prepare_lib.prepare(*args, chat=True, force=True, progress=False)
    assert built and manifest2["template_sha256"] != manifest["template_sha256"]
    first = TokenStore(str(tmp_path / "s")).doc(0)[0]
    assert first == load_tokenizer(directory)._tok.token_to_id("<|endoftext|>")


def test_template_file_wins_over_the_config_key_as_in_transformers(tmp_path):
    """A directory with both a tokenizer_config.json "chat_template" and a chat_template.jinja
    renders with the file, as transformers does (an export writes both)."""
    transformers = pytest.importorskip("transformers")
    directory = write_tokenizer_dir(tmp_path / "tok", LLAMA3)
    (tmp_path / "tok" / "chat_template.jinja").write_text(CHATML)
    ours = chat.ChatTemplate.from_dir(directory)
    assert ours.source == CHATML
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    assert ours.render(TRAP, True) == ref.apply_chat_template(
        TRAP, tokenize=False, add_generation_prompt=True)
    assert ours.render(TRAP, True).startswith("<|im_start|>system")
