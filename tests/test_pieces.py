"""Pieces encoded as inside the whole text (ulysses_jax/data/pieces.py): for tiny tokenizers that
prepend a space (SentencePiece-style Metaspace "always" / "first", Llama 2's Prepend
normalizer, ByteLevel add_prefix_space; BPE and Unigram), the ids of a rendered conversation
are the ids transformers' apply_chat_template(tokenize=True) gives, where encoding each piece
on its own differs."""
import json

import numpy as np
import pytest

from ulysses_jax.data import chat, pieces
from ulysses_jax.data.text import load_tokenizer

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ["Say", "hi", "again", "the", "answer", "is", "user", "42", "[INST]", "[/INST]",
         "assistant", "system", "ok."]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama 2's format: the answer follows "[/INST]" after a space, inside the segment.
LLAMA2 = ("{% for m in messages %}{% if m['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
          "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' ' + eos_token }}"
          "{% endif %}{% endfor %}")
# Answers right after an added token: the answer's piece starts a segment.
TIGHT = ("{% for m in messages %}{% if m['role'] == 'user' %}"
         "{{ '<|im_start|>' + m['content'] + '<|im_end|>' }}"
         "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "tight": TIGHT}

# kind -> (model, what encodes the leading space, the setting prepend_setting names)
KINDS = {
    "metaspace-always-bpe": ("bpe", "always", 'Metaspace prepend_scheme "always"'),
    "metaspace-first-bpe": ("bpe", "first", 'Metaspace prepend_scheme "first"'),
    "prepend-normalizer-bpe": ("bpe", "normalizer", 'normalizer Prepend "▁"'),
    "metaspace-always-unigram": ("unigram", "always", 'Metaspace prepend_scheme "always"'),
    "bytelevel-prefix-space-bpe": ("bpe", "bytelevel", "ByteLevel add_prefix_space true"),
}


def _corpus(rng):
    # Words and spaces only, no newline: no merge crosses the newline after a role name, so
    # the pieces of a rendered conversation can put together exactly the whole text's ids.
    return [" ".join(rng.choice(WORDS, 30)) for _ in range(60)]


def write_prepending_tokenizer(path, kind: str, seed: int = 0) -> str:
    """A tiny tokenizer directory whose tokenizer.json prepends a space in the way of
    ``kind`` (KINDS); Llama 2's layout (Prepend + Replace normalizers, no pre-tokenizer) is
    trained with Metaspace first, so that, as in SentencePiece, no token holds a word gap."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    model, how, _ = KINDS[kind]
    corpus = _corpus(np.random.default_rng(seed))
    if how == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        scheme = "first" if how == "first" else "always"
        tok = Tokenizer(models.BPE(unk_token="<unk>") if model == "bpe" else models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
        tok.decoder = decoders.Metaspace(prepend_scheme=scheme)
        if model == "bpe":
            trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL,
                                          initial_alphabet=list("\n▁"))
        else:
            trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=SPECIAL,
                                              unk_token="<unk>", initial_alphabet=list("\n▁"))
    tok.train_from_iterator(corpus, trainer)
    if how == "normalizer":
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(path)


def _conversations(rng, n):
    say = lambda: " ".join(rng.choice(WORDS, int(rng.integers(1, 6))))  # noqa: E731
    convs = []
    for _ in range(n):
        msgs = []
        for _ in range(int(rng.integers(1, 4))):
            msgs += [{"role": "user", "content": say()},
                     {"role": "assistant", "content": say()}]
        convs.append(msgs)
    return convs


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_conversation_ids_equal_transformers(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    directory = write_prepending_tokenizer(tmp_path / kind, kind)
    tok = load_tokenizer(directory)
    assert [KINDS[kind][2] in s for s in pieces.prepend_setting(tok)] == [True]
    ref = transformers.PreTrainedTokenizerFast(
        tokenizer_file=f"{directory}/tokenizer.json", bos_token="<s>", eos_token="</s>")
    rng = np.random.default_rng()
    checked = naive_differs = 0
    for name, src in TEMPLATES.items():
        template = chat.ChatTemplate(src, {"bos_token": "<s>", "eos_token": "</s>"})
        ref.chat_template = src
        for msgs in _conversations(rng, 15):
            tokens, weights = chat.encode_conversation(tok, template, msgs)
            text = template.render(msgs)
            want = ref.apply_chat_template(msgs, tokenize=True, return_dict=False)
            assert want == ref.encode(text, add_special_tokens=False)
            assert tokens.tolist() == want, (name, msgs)
            # Weights still cover exactly the answers, each with its end of turn.
            sup = tokens[weights > 0]
            answers = [m["content"] for m in msgs if m["role"] == "assistant"]
            end = "<|im_end|>" if name == "chatml" else "</s>"
            assert ref.decode(sup.tolist()).replace(" ", "") == \
                "".join(a + end for a in answers).replace(" ", "")
            # Each piece encoded on its own (what encode_conversation did before) differs.
            _, spans = chat.supervised_spans(template, msgs)
            cuts = sorted({0, len(text), *[x for s in spans for x in s]})
            alone = np.concatenate(tok.encode_batch(
                [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]))
            naive_differs += alone.tolist() != want
            checked += 1
    assert checked == 45 and naive_differs > 0


def test_byte_level_tokenizers_encode_pieces_alone(tmp_path):
    """Tokenizers that prepend nothing (Llama 3, Qwen, GPT-2 style; bytes) keep encoding each
    piece on its own, as before."""
    from tests.test_chat import write_tokenizer_dir
    tok = load_tokenizer(write_tokenizer_dir(tmp_path / "tok", CHATML))
    assert pieces.prepend_setting(tok) == []
    text = ["<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n", "hi<|im_end|>", "\n"]
    got = pieces.encode_pieces(tok, text)
    want = tok.encode_batch(text)
    assert len(got) == 3 and all(np.array_equal(a, b) for a, b in zip(got, want))
    byte = load_tokenizer(None)
    assert pieces.prepend_setting(byte) == []
    assert [p.tolist() for p in pieces.encode_pieces(byte, ["ab", "c"])] == [[97, 98], [99]]
