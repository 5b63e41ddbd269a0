"""python -m ulysses_jax.export: a run started from a Llama-3.1-shaped Hugging Face checkpoint
(llama3 RoPE scaling, its own tokenizer), trained a few steps, exported; transformers loads
the export (model and tokenizer) with the same scaling and our logits on the trained
weights. A run from a chat token store exports the store's tokenizer and chat template.
Bad inputs exit 2 with a message."""
import filecmp
import json
import os

import numpy as np
import pytest

from tests.utils.data import relocated_store_run, small_corpus
from tests.utils.devices import DEVICES

torch = pytest.importorskip("torch", reason="torch is not installed (requirements-baseline.txt)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from ulysses_jax import make_mesh  # noqa: E402
from ulysses_jax.config import load_config  # noqa: E402
from ulysses_jax.export import main as export_main  # noqa: E402
from ulysses_jax.training.checkpoint import Checkpointer  # noqa: E402
from ulysses_jax.training.train_step import state_layout  # noqa: E402
from ulysses_jax.training.trainer import train  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="trainer tests run on fake CPU devices")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
EOS = "<|end_of_text|>"
# The model's forward as one program per token shape (graphdef static): the steps share it.
_forward = jax.jit(lambda graphdef, params, tokens: nnx.merge(graphdef, params)(tokens),
                   static_argnums=0)


def write_hf_checkpoint(path, rope=ROPE):
    """A tiny random Llama written by transformers, with a byte-level BPE tokenizer.json
    (trained here on a stdlib file) and a tokenizer_config.json naming its EOS."""
    from tokenizers import decoders, models, pre_tokenizers, trainers
    os.makedirs(path, exist_ok=True)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([open(os.__file__).read()], trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=tok.get_vocab_size(),
        tie_word_embeddings=False, max_position_embeddings=256, rope_parameters=dict(rope),
        eos_token_id=tok.token_to_id(EOS))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, the HF checkpoint it started from, its export with 2 KiB shards)."""
    tmp = tmp_path_factory.mktemp("export")
    hf = write_hf_checkpoint(str(tmp / "hf"))
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        "seq_len=64", "batch_size=2", "mesh.seq=2", "steps=3", "log_every=1", "eval_batches=0",
        "checkpoint_every=2", "optimizer.warmup_steps=0", "optimizer.lr=0.01", f"init_from={hf}",
        f"data.source={small_corpus(tmp / 'corpus')}", "data.heldout_fraction=0.25"])
    train(cfg, str(tmp / "run"), progress=False)
    out = str(tmp / "out")
    assert export_main([str(tmp / "run"), "--out", out, "--max-shard-gb", str(2 / 2 ** 20),
                        "--no-progress"]) == 0
    return str(tmp / "run"), hf, out


def _our_logits(run_dir, step, tokens):
    """Logits of the run's model with the checkpoint restored the trainer's way (Orbax, into
    the train state's layout on one device): independent of the export's reader."""
    cfg = load_config(os.path.join(run_dir, "config.yaml"), ["mesh.seq=1"])
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    graphdef, abstract, _, _ = state_layout(cfg, mesh)
    with Checkpointer(os.path.join(run_dir, "checkpoints")) as ckpt:
        state, _ = ckpt.restore(abstract, step)
    return np.asarray(_forward(graphdef, state["params"], tokens))


def test_transformers_loads_the_trained_export(run):
    run_dir, hf, out = run
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    from safetensors import safe_open
    files = sorted(set(index["weight_map"].values()))
    sizes = []
    for name in files:
        with safe_open(os.path.join(out, name), framework="np") as f:
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items()
                                              if v == name)
            sizes.append([f.get_tensor(k).nbytes for k in f.keys()])
    # 2 KiB shards: several tensors up to 2 KiB, or one larger tensor alone.
    assert len(files) > 2 and any(len(s) > 1 for s in sizes)
    assert all(sum(s) <= 2 ** 11 or len(s) == 1 for s in sizes), sizes
    assert index["metadata"]["total_size"] == sum(map(sum, sizes))
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    original = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.rope_parameters == original.config.rope_parameters
    assert model.config.eos_token_id == original.config.eos_token_id
    assert set(index["weight_map"]) == set(model.state_dict())
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("def export(run_dir):\n    return run_dir", add_special_tokens=False)["input_ids"]
    assert ids == tokenizers.Tokenizer.from_file(os.path.join(hf, "tokenizer.json")).encode(
        "def export(run_dir):\n    return run_dir", add_special_tokens=False).ids
    assert tok.eos_token == EOS

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, (2, 48)).astype(np.int32)
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        initial = original(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    ours = _our_logits(run_dir, 3, tokens)
    scale = np.abs(ours).max()
    assert np.abs(theirs - initial).max() > 100 * 1e-5 * scale  # trained weights, not the initial
    np.testing.assert_allclose(theirs, ours, atol=1e-5 * scale, rtol=1e-4)


def test_older_step_and_bfloat16(run, tmp_path, capsys):
    """--step 2 --dtype bfloat16: one file (no index) holding step 2's weights rounded to
    bf16, as transformers loads them. The run trained on text with a tokenizer that has no
    chat template: the export has none and says so."""
    run_dir, _, _ = run
    out = str(tmp_path / "bf16")
    assert export_main([run_dir, "--out", out, "--step", "2", "--dtype", "bfloat16",
                        "--no-progress"]) == 0
    assert "; chat template: none: the run trained without a chat template" in \
        capsys.readouterr().out
    assert not os.path.exists(os.path.join(out, "chat_template.jinja"))
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, (1, 32))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    ours = _our_logits(run_dir, 2, tokens.astype(np.int32))
    assert np.abs(theirs - ours).max() < 0.05 * np.abs(ours).max()  # bf16 weights
    assert not np.allclose(theirs, _our_logits(run_dir, 3, tokens.astype(np.int32)))


@pytest.mark.parametrize("case, args, words", [
    ("no_run", ["{tmp}/nothing", "--out", "{tmp}/o"], ["{tmp}/nothing does not exist"]),
    ("no_config", ["{tmp}", "--out", "{tmp}/o"], ["has no config.yaml"]),
    ("no_checkpoint", ["{empty_run}", "--out", "{tmp}/o"], ["has no checkpoint"]),
    ("step", ["{run}", "--out", "{tmp}/o", "--step", "7"],
     ["step 7 is not a checkpoint", "steps 2, 3"]),
    ("dtype", ["{run}", "--out", "{tmp}/o", "--dtype", "float16"],
     ["--dtype must be one of float32, bfloat16, got 'float16'"]),
    ("out_not_empty", ["{run}", "--out", "{run}"], ["is not an empty directory"]),
])
def test_bad_input_exits_2_with_a_message(run, tmp_path, capsys, case, args, words):
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text(open(os.path.join(run[0], "config.yaml")).read())
    fill = dict(tmp=str(tmp_path), run=run[0], empty_run=str(empty_run))
    assert export_main([a.format(**fill) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for word in words:
        assert word.format(**fill) in err, err
    assert not os.path.exists(tmp_path / "o")


def test_evaluate_gives_the_same_numbers_on_the_run_and_its_export(run):
    """python -m ulysses_jax.evaluate on the Hugging Face export (its tokenizer.json, the
    run's corpus given as --data) equals the evaluation of the run it came from."""
    from ulysses_jax.evaluate import evaluate
    run_dir, _, out = run
    source = load_config(os.path.join(run_dir, "config.yaml")).data.source
    grid = dict(seq_len=256, mesh_seq=2, batches=1, lengths=[256], depths=[0.5], trials=1,
                progress=False, data=source, heldout_fraction=0.25, generate=False)
    ours, exported = evaluate(run_dir, **grid), evaluate(out, **grid)
    assert ours["loss_by_position"]["tokens"] == exported["loss_by_position"]["tokens"]
    np.testing.assert_allclose(exported["loss_by_position"]["loss"],
                               ours["loss_by_position"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(exported["passkey"]["answer_loss"],
                               ours["passkey"]["answer_loss"], rtol=1e-5)


def test_parameters_are_read_layer_by_layer(run):
    """The export reads each stored parameter slice by slice (TensorStore on Orbax's files);
    every slice equals the parameter restored by Orbax itself."""
    from ulysses_jax.runs import LayerReader, read_params
    run_dir = run[0]
    whole = dict(read_params(run_dir, 3))
    lazy = dict(read_params(run_dir, 3, by_layer=True))
    assert whole.keys() == lazy.keys() and any(k[0] == "layers" for k in whole)
    for keys, x in lazy.items():
        assert isinstance(x, LayerReader), keys
        assert x.shape == whole[keys].shape
        for i in range(len(x)):
            np.testing.assert_array_equal(x[i], whole[keys][i])
        with pytest.raises(IndexError):
            x[len(x)]


def test_chat_store_run_exports_the_store_tokenizer_and_chat_template(chat_store_run, tmp_path,
                                                                       capsys):
    """A run from a chat store with data.tokenizer unset: the export holds the store's
    tokenizer files, transformers' apply_chat_template renders as the store was rendered,
    and evaluate on the export (the store as --data) gives the run's numbers."""
    from ulysses_jax.evaluate import evaluate
    from ulysses_jax.data.chat import ChatTemplate
    run, store, tok_dir = chat_store_run
    out = str(tmp_path / "hf")
    assert export_main([run, "--out", out, "--no-progress"]) == 0
    assert (f"tokenizer files: tokenizer.json, tokenizer_config.json, chat_template.jinja (the "
            f"tokenizer of the chat store {store} and the chat template it keeps, from the "
            f"tokenizer); chat template: chat_template.jinja") in capsys.readouterr().out
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(os.path.join(out, name), os.path.join(tok_dir, name), shallow=False)
    assert filecmp.cmp(os.path.join(out, "chat_template.jinja"),
                       os.path.join(store, "chat_template.jinja"), shallow=False)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "system", "content": "Say hi"},
                {"role": "user", "content": "the answer"},
                {"role": "assistant", "content": "is 42"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == ChatTemplate.from_dir(tok_dir).render(messages)
    assert text.startswith("<|im_start|>system\nSay hi<|im_end|>")
    assert tok(text, add_special_tokens=False)["input_ids"] == tokenizers.Tokenizer.from_file(
        os.path.join(tok_dir, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert tok.eos_token == "<|im_end|>"
    grid = dict(seq_len=128, mesh_seq=2, batches=1, batch_size=2, lengths=[128], depths=[0.5],
                trials=1, progress=False, generate=False)
    ours = evaluate(run, **grid)
    exported = evaluate(out, data=store, heldout_fraction=0.2, **grid)
    assert exported["tokenizer"] == os.path.join(out, "tokenizer.json")
    assert exported["loss_by_position"]["tokens"] == ours["loss_by_position"]["tokens"]
    assert sum(ours["loss_by_position"]["tokens"]) > 0
    nan = lambda xs: [np.nan if x is None else x for x in xs]  # noqa: E731
    np.testing.assert_allclose(nan(exported["loss_by_position"]["loss"]),
                               nan(ours["loss_by_position"]["loss"]), rtol=1e-5)
    np.testing.assert_allclose(exported["passkey"]["answer_loss"],
                               ours["passkey"]["answer_loss"], rtol=1e-5)


@pytest.mark.parametrize("change, words", [
    ("store copy", ["chat_template.jinja is not the template the store was rendered with",
                    "prepare the store again"]),
    ("template, no store copy", ["is a chat store rendered with the chat template of hash",
                                 "restore its tokenizer_config.json"]),
    ("tokenizer", ["has changed since; restore it or prepare the store again"]),
])
def test_chat_store_run_with_a_changed_tokenizer_is_refused(chat_store_run, tmp_path, capsys,
                                                            change, words):
    """Nothing is written when the store's tokenizer or chat template is no longer the one
    it was prepared with (an export would serve another template than the run trained on):
    the store's own copy of its template edited; for a store without one (prepared before
    stores kept it), its tokenizer directory's template changed."""
    run, store, tok = relocated_store_run(*chat_store_run, tmp_path)
    if change == "store copy":
        with open(os.path.join(store, "chat_template.jinja"), "a") as f:
            f.write("{# edited #}")
    elif change == "template, no store copy":
        manifest_path = os.path.join(store, "manifest.json")
        with open(manifest_path) as f:
            manifest = json.load(f)
        del manifest["chat_template"]
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
        os.remove(os.path.join(store, "chat_template.jinja"))
        path = os.path.join(tok, "tokenizer_config.json")
        with open(path) as f:
            config = json.load(f)
        before = config["chat_template"]
        config["chat_template"] = before.replace("'\\n'", "'\\n\\n'")
        assert config["chat_template"] != before
        with open(path, "w") as f:
            json.dump(config, f)
    else:
        with open(os.path.join(tok, "tokenizer.json"), "a") as f:
            f.write("\n")
    out = str(tmp_path / "o")
    assert export_main([run, "--out", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the run's data.source") and "Traceback" not in err
    for word in words:
        assert word in err, err
    assert not os.path.exists(out)


def test_chat_store_run_exports_the_template_the_store_keeps(chat_store_run, tmp_path, capsys):
    """A store prepared with --chat-template chatml (not the tokenizer's template), whose
    tokenizer directory's template changed since: the export writes the store's own template,
    rewrites the copied tokenizer_config.json's stale "chat_template" to it, and transformers'
    AutoTokenizer renders the store's conversations to the store's text and tokens."""
    from ulysses_jax.data import chat_templates
    from ulysses_jax.data.prepare import prepare
    from ulysses_jax.data.store import TokenStore
    run, store, tok = relocated_store_run(*chat_store_run, tmp_path)
    with open(os.path.join(store, "manifest.json")) as f:
        sources = json.load(f)["sources"]
    manifest, built = prepare(sources, store, tok, chat=True, force=True, progress=False,
                              chat_template="chatml")
    assert built and manifest["chat_template"]["origin"] == "format"
    path = os.path.join(tok, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    stale = config["chat_template"].replace("'\\n'", "'\\n\\n'")
    assert stale != config["chat_template"]
    with open(path, "w") as f:
        json.dump(config | {"chat_template": stale}, f)
    out = str(tmp_path / "hf")
    assert export_main([run, "--out", out, "--no-progress"]) == 0
    assert "and the chat template it keeps, from format chatml" in capsys.readouterr().out
    chatml = chat_templates.FORMATS["chatml"]
    with open(os.path.join(out, "chat_template.jinja")) as f:
        assert f.read() == chatml
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == chatml
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = chat_templates.stored_template(store, manifest)
    with open(sources[0]) as f:
        convs = [json.loads(line)["messages"] for line in f][:5]
    docs = TokenStore(store)
    checked = 0
    for d, conv in enumerate(convs):
        assert hf_tok.apply_chat_template(conv, tokenize=False) == ours.render(conv)
        assert hf_tok.apply_chat_template(conv, tokenize=True, return_dict=False) == \
            docs.doc(d).tolist()
        checked += 1
    assert checked == 5


# A template file for a base model's tokenizer (its tokenizer_config.json has none): turns as
# "role:\ncontent<eos>\n", the answer supervised up to and including its <eos>. No token
# merges across an answer's boundary here, so the store's ids are also those of the whole
# rendered text (docs/DATA.md: prepare encodes prompts and answers apart).
BASE_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:\n{% endif %}")


def test_base_checkpoint_trains_on_chat_with_a_given_template_and_exports_it(tmp_path, capsys):
    """The base-model recipe of docs/DATA.md: a checkpoint whose tokenizer has no chat
    template, a template file given to prepare --chat, train.py init_from, export: the export
    carries that template, and transformers' apply_chat_template on the export gives the
    store's text and token ids of every conversation."""
    from ulysses_jax.data import chat_templates
    from ulysses_jax.data.__main__ import main as data_main
    from ulysses_jax.data.store import TokenStore
    base = write_hf_checkpoint(str(tmp_path / "base"))
    assert not os.path.exists(os.path.join(base, "chat_template.jinja"))
    with open(os.path.join(base, "tokenizer_config.json")) as f:
        assert "chat_template" not in json.load(f)
    with open(tmp_path / "turns.jinja", "w") as f:
        f.write(BASE_TEMPLATE)
    rng = np.random.default_rng()
    words = ["the", " answer", " is", " forty", " two", " say", " hi", " again"]
    say = lambda n: "".join(rng.choice(words, int(n)))  # noqa: E731
    convs = [[{"role": "user", "content": say(rng.integers(1, 6))},
              {"role": "assistant", "content": say(rng.integers(1, 8))}] for _ in range(24)]
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": c}) + "\n" for c in convs)
    store = str(tmp_path / "store")
    assert data_main(["prepare", str(tmp_path / "chat.jsonl"), "--out", store, "--tokenizer",
                      base, "--chat", "--chat-template", str(tmp_path / "turns.jinja"),
                      "--no-progress"]) == 0
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        "seq_len=64", "batch_size=2", "mesh.seq=2", "steps=2", "log_every=1", "eval_batches=0",
        "checkpoint_every=2", "model.loss_chunk=16", f"init_from={base}",
        f"data.source={store}"])
    train(cfg, str(tmp_path / "run"), progress=False)
    out = str(tmp_path / "hf")
    capsys.readouterr()
    assert export_main([str(tmp_path / "run"), "--out", out, "--no-progress"]) == 0
    assert "chat template: chat_template.jinja" in capsys.readouterr().out
    with open(os.path.join(out, "chat_template.jinja")) as f:
        assert f.read() == BASE_TEMPLATE
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    manifest = TokenStore(store).manifest
    ours = chat_templates.stored_template(store, manifest)
    docs = TokenStore(store)
    assert docs.manifest["num_docs"] == len(convs)
    checked = 0
    for d, conv in enumerate(convs):
        text = hf_tok.apply_chat_template(conv, tokenize=False)
        assert text == ours.render(conv) and text.endswith(f"{hf_tok.eos_token}\n")
        assert hf_tok.apply_chat_template(conv, tokenize=True, return_dict=False) == \
            docs.doc(d).tolist()
        checked += 1
    assert checked == len(convs)
