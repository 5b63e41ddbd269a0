"""Generation on tiny models (ulysses_jax/generation, python -m ulysses_jax.generate): each
decode step's logits equal a full forward pass of the unsharded model over prompt + generated
tokens (sliding windows, biases, q/k norms, padded heads); sampling gives the same tokens on
every mesh and in any batch; the sampling filters are transformers' warpers; the cache is 1/P
per device by the compiled memory analysis; the CLI on a run directory, and its bad input.
(The real checkpoint against transformers' generate: test_real_checkpoint.py.)"""
import contextlib
import io
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.utils.devices import DEVICES, need_devices
from ulysses_jax import make_mesh
from ulysses_jax.config import load_config
from ulysses_jax.generate import main as generate_main
from ulysses_jax.generation import GenerationError, Generator, Sampling
from ulysses_jax.generation.generator import shrink_plan
from ulysses_jax.generation.sampling import filtered
from ulysses_jax.models.decoder import Decoder

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="generation tests run on fake CPU devices")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.d_model=32", "model.ffn_dim=64", "model.head_dim=8", "model.vocab_size=97"]
PROMPTS = [[5, 17, 3, 44, 9, 12, 60, 2, 31], [7, 8], [90, 1, 4, 4, 4, 15]]


def _model(p: int, *over, preset="tiny.yaml", data=1, ring=1):
    """(cfg, mesh of ``data`` replicas x ``ring`` x p seq devices, params): a preset's model,
    seed 0, laid out on that mesh."""
    cfg = load_config(os.path.join(ROOT, "configs", preset), SMALL + list(over)).model
    mesh = make_mesh(seq=p, data=data, ring=ring, devices=need_devices(p * data * ring))
    params = nnx.to_pure_dict(nnx.state(Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0))))
    return cfg, mesh, params


VARIANTS = {
    "p1": (1, []),
    # 8 query / 2 kv heads on 3 devices: padded heads; a window that the prompts outgrow
    "p3_window_bias_qk_norm": (3, ["model.sliding_window=4", "model.layer_pattern=LG",
                                   "model.qkv_bias=true", "model.qk_norm=true",
                                   "--samples=3"]),
    "p4_window": (4, ["model.sliding_window=3", "model.layer_pattern=L"]),  # kv heads copied
    # Gemma 3 / 2: (1 + w) norms, post norms, GeGLU, sqrt(D) embeddings, a local RoPE base,
    # attention and final softcaps, a softmax scale of its own
    "p2_gemma": (2, ["model.family=gemma", "model.sliding_window=4", "model.layer_pattern=LG",
                     "model.rope_local_theta=10000", "model.qk_norm=true",
                     "model.attn_softcap=20", "model.final_softcap=10",
                     "model.attn_scale=0.25"]),
    # 8 experts over the 4 devices, top-2: a new token's experts reached by all-to-all
    "p4_moe": (4, ["model.moe_ffn_dim=16", "--preset=tiny-moe.yaml"]),
    # 2 data replicas x 2 seq devices: the 3 rows made 4 (a copy), 2 per replica
    "d2_p2_window": (2, ["model.sliding_window=4", "model.layer_pattern=LG", "--data=2",
                         "--samples=3"]),
    "d2_p2_moe": (2, ["model.moe_ffn_dim=16", "--preset=tiny-moe.yaml", "--data=2"]),
    # a hybrid mesh, ring 2 x seq 2: Ulysses over its 4 devices
    "r2_p2_window": (2, ["model.sliding_window=3", "model.layer_pattern=LG", "--ring=2"]),
    # Qwen3-Next: DeltaNet states of 8 value heads over 8 devices (its 4 key heads copied
    # twice), a gated attention layer, experts with a shared one; a prompt of 5 chunks
    "p8_qwen3_next": (8, ["--preset=tiny-qwen3-next.yaml", "model.moe_ffn_dim=16",
                          "model.moe_shared_ffn_dim=16", "model.linear_key_dim=8",
                          "model.linear_value_dim=8", "--long=1", "--samples=3"]),
}
LONG = [[(7 * i) % 90 + 3 for i in range(70)]]


def test_deltanet_heads_must_split_over_the_devices():
    """Qwen3-Next on 3 devices: its 8 DeltaNet value heads do not split; refused when the
    generator is made, before anything is compiled (nor the parameters looked at: their
    shapes stand for them)."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-qwen3-next.yaml"), SMALL).model
    mesh = make_mesh(seq=3, data=1, devices=need_devices(3))
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda: Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0)))))
    with pytest.raises(GenerationError, match="linear value heads 8 are not divisible by the "
                                              "seq axis size 3"):
        Generator(params, cfg, mesh)


def _variant(name):
    """(cfg, mesh, params, its "--" options) of a ``VARIANTS`` entry."""
    p, over = VARIANTS[name]
    opts = dict(o[2:].split("=", 1) for o in over if o.startswith("--"))
    return (*_model(p, *[o for o in over if not o.startswith("--")],
                    preset=opts.get("preset", "tiny.yaml"), data=int(opts.get("data", 1)),
                    ring=int(opts.get("ring", 1))), opts)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_logits_equal_a_full_forward_pass(variant):
    """Every new token's logits against a full forward pass of the unsharded model over the
    row's prompt and its tokens; greedy, the tokens are their argmax. The variants with
    "--samples=3" sample 3 completions of each prompt at temperature 1 instead, prefilled
    once: each sample against its own tokens (windows of 4 that the 5 new tokens outgrow, a
    pool per kind, DeltaNet states copied per sample, data replicas)."""
    cfg, mesh, params, opts = _variant(variant)
    prompts = PROMPTS + (LONG if "long" in opts else [])
    g = int(opts.get("samples", 1))
    got = Generator(params, cfg, mesh).generate(
        prompts, max_new_tokens=5, keep_logits=True, num_samples=g, seed=5,
        sampling=Sampling(temperature=1.0 if g > 1 else 0.0))
    written = [q for q in prompts for _ in range(g)]
    rows = [q + c.ids[:-1] for q, c in zip(written, got, strict=True)]
    for prompt, c, row, whole in zip(written, got, rows, _forward_logits(cfg, rows)):
        assert len(c.ids) == 5 and c.finish_reason == "length"
        want = whole[len(prompt) - 1:len(row)]            # the logits that chose each new id
        np.testing.assert_allclose(np.stack(c.logits), want, atol=1e-4, rtol=0)
        if g == 1:
            assert c.ids == list(want.argmax(-1)), (c.ids, want.argmax(-1))
    if g > 1:
        assert len({tuple(c.ids) for c in got}) > len(prompts)  # the samples differ


def _forward_logits(cfg, rows):
    """The unsharded model's logits [n, S, V] over ``rows`` (token lists), right-padded: a
    causal model's logits at a row's own positions do not see the padding after them."""
    ref = Decoder(cfg, mesh=make_mesh(seq=1, data=1, devices=DEVICES[:1]), rngs=nnx.Rngs(0))
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    return np.asarray(nnx.jit(lambda m, t: m(t))(ref, jnp.asarray(tokens)))


def test_samples_draw_as_their_prompt_written_g_times():
    """With one seed, 3 samples per prompt give the tokens (and logits) of the prompts
    written 3 times (sample g of prompt i draws as row 3i + g), from one prefill over the 3
    prompts; greedy, the samples equal one."""
    cfg, mesh, params, _ = _variant("p3_window_bias_qk_norm")
    gen = Generator(params, cfg, mesh)
    s = Sampling(temperature=1.0)
    shared = gen.generate(PROMPTS, max_new_tokens=6, sampling=s, seed=5, num_samples=3,
                          keep_logits=True)
    assert [k[1] for k in gen._programs if k[0] == "prefill"] == [3]
    alone = gen.generate([q for q in PROMPTS for _ in range(3)], max_new_tokens=6,
                         sampling=s, seed=5, keep_logits=True)
    assert [c.ids for c in shared] == [c.ids for c in alone]
    for a, b in zip(shared, alone):
        np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), atol=1e-5, rtol=0)
    greedy = gen.generate(PROMPTS, max_new_tokens=6, num_samples=2)
    one = gen.generate(PROMPTS, max_new_tokens=6)
    assert [c.ids for c in greedy] == [c.ids for c in one for _ in range(2)]


@pytest.mark.parametrize("variant,sampling", [("d2_p2_window", Sampling(temperature=1.0)),
                                              ("p8_qwen3_next", Sampling(temperature=1.0)),
                                              ("p3_window_bias_qk_norm", Sampling())])
def test_finished_rows_stop_costing(variant, sampling):
    """Completions that stop at different steps (stop ids: the second tokens of 8 of the 12
    rows, so that at least 8 stop by step 1): the rows going on continue in smaller compiled
    batches, their caches gathered into them (fewer prompts, and fewer samples per prompt),
    and every row's tokens and reason are those of the same request without stop ids cut at
    its first stop id (a batch that never shrinks). Seeded sampling over 2 data replicas with windows and on
    Qwen3-Next (DeltaNet states gathered); greedy with a pool per kind."""
    cfg, mesh, params, _ = _variant(variant)
    gen = Generator(params, cfg, mesh)
    prompts = PROMPTS + [LONG[0][:20]]
    kw = dict(max_new_tokens=10, sampling=sampling, seed=2, num_samples=3)
    whole = gen.generate(prompts, **kw)
    assert len({k for k in gen._programs if k[0] == "decode"}) == 1
    eos = {c.ids[1] for c in whole[:8]}
    rows = gen.timings["decode_rows"]
    got = gen.generate(prompts, eos_ids=eos, **kw)
    want = []
    for c in whole:
        stop = next((i for i, t in enumerate(c.ids) if t in eos), None)
        want.append((c.ids, "length") if stop is None else (c.ids[:stop + 1], "stop"))
    assert [(c.ids, c.finish_reason) for c in got] == want
    assert len({len(ids) for ids, _ in want}) >= 2, want  # stops at different steps
    sizes = sorted({k[1] for k in gen._programs if k[0] == "decode"})
    assert len(sizes) >= 2 and sizes[0] <= 12 // 2, sizes
    assert gen.timings["decode_rows"] - rows < 12 * 9, gen.timings


def test_a_batch_goes_on_smaller_when_at_most_half_of_it_is_left():
    """``shrink_plan`` on 4 prompts x 3 samples: the prompts with rows going on, as many
    rows each as the fullest has, a short prompt's extra row a copy that writes nothing;
    none when the rounding to the data replicas keeps more than half."""
    going = np.array([0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 0, 0], bool)
    kept, rows, writes = shrink_plan(going, 4, 1)
    assert kept.tolist() == [1, 2] and rows.tolist() == [4, 4, 6, 8]
    assert writes.tolist() == [True, False, True, True]
    kept, rows, writes = shrink_plan(going, 4, 2)  # 2 prompts: a multiple of 2 already
    assert kept.tolist() == [1, 2]
    assert shrink_plan(going, 4, 4) is None           # 4 x 2 rows > 12 / 2
    assert shrink_plan(np.ones(12, bool), 4, 1) is None
    kept, rows, writes = shrink_plan(going & (np.arange(12) == 4), 4, 2)
    assert kept.tolist() == [1, 1] and rows.tolist() == [4, 4] and writes.tolist() == [
        True, False]


def test_sampling_is_the_same_on_every_mesh_and_in_any_batch():
    """Temperature, top-k and top-p with one seed: the same tokens on 1 and 4 devices and on
    2 data replicas x 2, and a row generated alone (its index given) as in the batch; another
    seed changes them."""
    s = Sampling(temperature=1.5, top_k=20, top_p=0.9)
    runs = {}
    for data, p in ((2, 2), (1, 1), (1, 4)):
        cfg, mesh, params = _model(p, data=data)
        gen = Generator(params, cfg, mesh)
        runs[data, p] = [c.ids for c in gen.generate(PROMPTS, max_new_tokens=6, sampling=s,
                                                     seed=3)]
    assert runs[1, 1] == runs[1, 4] == runs[2, 2], runs
    runs[4] = runs[1, 4]
    alone = gen.generate(PROMPTS[2:], max_new_tokens=6, sampling=s, seed=3, rows=[2])
    assert alone[0].ids == runs[4][2]
    other = [c.ids for c in gen.generate(PROMPTS, max_new_tokens=6, sampling=s, seed=4)]
    assert other != runs[4]
    greedy = [c.ids for c in gen.generate(PROMPTS, max_new_tokens=6)]
    assert greedy != runs[4]


@pytest.mark.parametrize("t,k,p", [(1.0, 5, 1.0), (0.7, 0, 0.8), (1.3, 10, 0.5),
                                   (1.0, 0, 0.999)])
def test_filters_are_transformers_warpers(t, k, p):
    """``sampling.filtered``: what transformers' temperature, top-k and top-p warpers leave
    (the same tokens removed, the same values kept)."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
    logits[1, :5] = logits[1, 5]  # ties at the boundary
    theirs = torch.from_numpy(logits.copy())
    for warper in ([lp.TemperatureLogitsWarper(t)] + ([lp.TopKLogitsWarper(k)] if k else [])
                   + ([lp.TopPLogitsWarper(p)] if p < 1 else [])):
        theirs = warper(None, theirs)
    theirs = theirs.numpy()
    ours = np.asarray(jax.jit(lambda x: filtered(x, Sampling(t, k, p)))(logits))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs))
    np.testing.assert_allclose(ours[~np.isinf(ours)], theirs[~np.isinf(theirs)], rtol=1e-6)


def _decode(gen):
    """(the decode program, its cache's two parts: the prompts', the new tokens')."""
    key = next(k for k in gen._programs if k[0] == "decode")
    return gen._programs[key], gen.cache_layouts[key]


def _bytes(parts, mesh, layers) -> int:
    return sum(part.bytes_per_device(mesh, layers) for part in parts)


def test_the_cache_is_split_over_the_devices():
    """The decode program's arguments per device (XLA's compiled memory analysis): on 2
    devices smaller than on 1 by exactly half of the cache (both parts; 8 query / 2 kv heads:
    one kv head per device), the parameters being replicated on both; with 2 data replicas
    of those 2 devices, by half again (each replica holds its half of the rows)."""
    sizes = {}
    prompts = PROMPTS + PROMPTS[:1]  # 4 rows, 2 per replica
    one = make_mesh(seq=1, data=1, devices=DEVICES[:1])
    for data, p in ((1, 1), (1, 2), (2, 2)):
        cfg, mesh, params = _model(p, data=data)
        gen = Generator(params, cfg, mesh)
        gen.generate(prompts, max_new_tokens=3)
        decode, parts = _decode(gen)
        sizes[data, p] = decode.memory_analysis().argument_size_in_bytes
        assert parts[0].heads.k_local == 2 // p
        assert _bytes(parts, mesh, cfg.n_layers) == _bytes(parts, one, cfg.n_layers) // (
            data * p)
    whole = _bytes(parts, one, cfg.n_layers)
    assert whole > 0 and sizes[1, 1] - sizes[1, 2] == whole // 2, (sizes, whole)
    assert sizes[1, 2] - sizes[2, 2] == whole // 4, (sizes, whole)


def test_the_prompts_cache_is_held_once_per_prompt():
    """4 samples of each of 3 prompts against the 12 prompts written out (XLA's compiled
    memory analysis of the decode program, 2 devices): the arguments differ by exactly the
    prompt part of the 9 rows the samples do not repeat; every other argument is the same
    size."""
    cfg, mesh, params = _model(2)
    sizes, prompt_parts = {}, {}
    for prompts, g in ((PROMPTS, 4), ([q for q in PROMPTS for _ in range(4)], 1)):
        gen = Generator(params, cfg, mesh)
        gen.generate(prompts, max_new_tokens=3, num_samples=g)
        decode, parts = _decode(gen)
        sizes[g] = decode.memory_analysis().argument_size_in_bytes
        prompt_parts[g] = parts[0].bytes_per_device(mesh, cfg.n_layers)
        assert parts[0].batch == len(prompts) and parts[1].batch == 12
    assert prompt_parts[1] == 4 * prompt_parts[4] > 0
    assert sizes[1] - sizes[4] == prompt_parts[1] - prompt_parts[4], (sizes, prompt_parts)


@pytest.mark.parametrize("pattern", ["LG", "L"])
def test_window_layers_keep_only_their_window(pattern):
    """The decode program's arguments per device (XLA's compiled memory analysis) on 2
    devices: with a window of 4 on the local layers (pattern LG: local and global layers in
    one stack, a pool per kind; L: every layer local), each local layer keeps 4 entries of
    the S = 16 prompt slots and 4 of the T = 6 new ones, exactly: the arguments shrink by
    (S - 4) + (T - 4) slots of each local layer against the same model with a window of 64
    (beyond both: every slot kept)."""
    sizes, parts = {}, {}
    for window in (4, 64):
        cfg, mesh, params = _model(2, f"model.sliding_window={window}",
                                   f"model.layer_pattern={pattern}")
        gen = Generator(params, cfg, mesh)
        gen.generate(PROMPTS, max_new_tokens=6)
        decode, parts[window] = _decode(gen)
        sizes[window] = decode.memory_analysis().argument_size_in_bytes
    kinds = cfg.layer_kinds()
    prompt, new = parts[4]
    assert (prompt.slots, prompt.ring("L"), prompt.ring("G")) == (16, 4, 16)
    assert (new.slots, new.ring("L"), new.ring("G")) == (6, 4, 6)
    assert "L" in kinds and (pattern == "L") == ("G" not in kinds)
    assert [part.ring("L") for part in parts[64]] == [16, 6]
    local = ["L"] * kinds.count("L")
    saved = _bytes(parts[64], mesh, local) - _bytes(parts[4], mesh, local)
    assert saved > 0 and sizes[64] - sizes[4] == saved, (sizes, saved)


@pytest.fixture(scope="module")
def hf_without_template(chat_store_run, tmp_path_factory):
    """The store run exported as a Hugging Face directory, with its chat template removed
    and max_position_embeddings set to 64."""
    from ulysses_jax.export import export_run
    run, _, _ = chat_store_run
    out = tmp_path_factory.mktemp("gen_export") / "hf"
    export_run(run, str(out), progress=False)
    for name in ("chat_template.jinja",):
        if (out / name).exists():
            (out / name).unlink()
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(hf, max_position_embeddings=64)))
    return str(out)


def _main(argv):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = generate_main(argv)
    return code, stdout.getvalue()


def test_cli_on_a_run_directory(chat_store_run, tmp_path):
    """A run directory: a text row and a chat row (the store's template), 2 data replicas x
    2 seq devices (a row each); every output field, the summary last, and the same ids as a
    second call on 1 device, and as each of 2 greedy samples per row (in row order)."""
    run, _, _ = chat_store_run
    rows = [{"prompt": "Say hi", "id": 7},
            {"messages": [{"role": "user", "content": "Say hi again"}]}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = []
    for p, g in ((2, 1), (1, 1), (1, 2)):
        out = tmp_path / f"out{p}_{g}.jsonl"
        code, stdout = _main([run, "--prompts", str(prompts), "--out", str(out),
                              "--max-new-tokens", "4", "--mesh-seq", str(p), "--mesh-data",
                              str(p), "--num-samples", str(g), "--no-progress"])
        assert code == 0
        outs.append([json.loads(line) for line in out.read_text().splitlines()])
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert set(summary) == {"rows", "prompt_tokens", "completion_tokens", "compile_s",
                                "prefill_s", "decode_s", "decode_tokens_per_s"}
        assert summary["rows"] == 2 * g
    for got in outs[:2]:
        assert [{k: r[k] for k in given} for r, given in zip(got, rows)] == rows
        assert [r["sample"] for r in got] == [0, 0]
        for r in got:
            assert 1 <= len(r["completion_ids"]) <= 4 and r["prompt_tokens"] >= 1
            assert r["finish_reason"] in ("stop", "length") and isinstance(r["completion"], str)
    assert [r["completion_ids"] for r in outs[0]] == [r["completion_ids"] for r in outs[1]]
    twice = [{**r, "sample": k} for r in outs[1] for k in range(2)]
    assert outs[2] == twice
    assert outs[0][1]["prompt_tokens"] > outs[0][0]["prompt_tokens"]  # the template's turns


@pytest.mark.parametrize("case,words", [
    ("no_model", ["is neither a training run", "nor a Hugging Face"]),
    ("empty", ["has no rows"]),
    ("neither", ["row 2 has neither \"prompt\"", "nor \"messages\""]),
    ("chat_without_template", ["row 1 is a chat", "has no chat template"]),
    ("image_for_a_text_model", ["row 1 holds images or videos", "has no vision tower"]),
    ("too_long", ["row 1: its", "prompt tokens plus 60 new tokens exceed the model's 64 "
                  "positions"]),
    ("nan_temperature", ["temperature must be >= 0", "got nan"]),
    ("out_is_a_directory", ["is a directory; give a file name"]),
    ("too_many_devices", ["--mesh-seq x --mesh-data must be between 1 and the 8 devices",
                          "got 4 x 3"]),
    ("no_samples", ["--num-samples must be >= 1 (completions per prompt), got 0"]),
])
def test_bad_input_exits_2_and_writes_nothing(hf_without_template, tmp_path, capsys, case,
                                             words):
    model = str(tmp_path / "nothing") if case == "no_model" else hf_without_template
    rows = {"no_model": [{"prompt": "a"}], "empty": [],
            "neither": [{"prompt": "a"}, {"text": "b"}],
            "chat_without_template": [{"messages": [{"role": "user", "content": "hi"}]}],
            "image_for_a_text_model": [{"messages": [{"role": "user", "content": [
                {"type": "image", "image": "cat.png"}, {"type": "text", "text": "hi"}]}]}],
            "too_long": [{"prompt": "hello there, a few words"}]}.get(case, [{"prompt": "a"}])
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = {"too_long": ["--max-new-tokens", "60"], "nan_temperature": ["--temperature", "nan"],
             "too_many_devices": ["--mesh-seq", "4", "--mesh-data", "3"],
             "no_samples": ["--num-samples", "0"]}.get(case, [])
    if case == "out_is_a_directory":
        out = tmp_path / "a_directory"
        out.mkdir()
    code, _ = _main([model, "--prompts", str(prompts), "--out", str(out), "--no-progress",
                     *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    assert (out.is_dir() if case == "out_is_a_directory" else not out.exists())
    assert not os.path.exists(str(out) + ".tmp")
    shutil.rmtree(tmp_path, ignore_errors=True)
