"""Qwen2.5-VL end to end: a multimodal chat store (images of several sizes) trains with
train.py's tiny preset, the seq=4 loss curve (the tower split over the 4 devices) equals
seq=1's and learns, the held-out loss is evaluated, and the run exports to a directory that
transformers' Qwen2_5_VLForConditionalGeneration loads and runs with our logits."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.test_mm_data import noise, vl_tok, write_jsonl  # noqa: F401  (vl_tok is a fixture)
from tests.utils.devices import cli_env, need_devices
from ulysses_jax import make_mesh
from ulysses_jax.config import load_config
from ulysses_jax.runs import load
from ulysses_jax.models import multimodal
from ulysses_jax.data.store import TokenStore
from ulysses_jax.training.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "configs", "tiny-qwen2.5-vl.yaml")


@pytest.fixture
def store(tmp_path, vl_tok):
    from ulysses_jax.data.prepare import prepare
    (tmp_path / "data").mkdir()
    sizes = [(56, 84), (84, 56), (112, 56), (56, 56), (84, 112), (56, 112)]
    convs = []
    for i, (h, w) in enumerate(sizes * 3):
        name = f"img{i}.png"
        noise(tmp_path / "data" / name, h, w, seed=i)
        convs.append([{"role": "user", "content": [{"type": "image", "image": name},
                                                   {"type": "text", "text": "Say hi"}]},
                      {"role": "assistant", "content": " the answer is 42" if i % 2 else
                       " hi again"}])
    src = write_jsonl(tmp_path / "data" / "chat.jsonl", convs)
    out = tmp_path / "store"
    prepare([src], str(out), vl_tok, chat=True, progress=False)
    return str(out), vl_tok


def _overrides(store_path):
    manifest = TokenStore(store_path).manifest
    media = manifest["media"]
    return [f"data.source={store_path}", f"model.vocab_size={manifest['vocab_size']}",
            f"model.image_token_id={media['image_token_id']}",
            f"model.video_token_id={media['video_token_id']}", "seq_len=128", "batch_size=2",
            "log_every=1", "steps=4", "eval_every=2", "eval_batches=1", "checkpoint_every=2",
            "data.heldout_fraction=0.2", "optimizer.warmup_steps=1", "model.attn_impl=xla",
            "data.vision_patches=512"]  # these rows hold under 200 patches each


def test_multimodal_store_trains_evaluates_and_exports(store, tmp_path, capsys):
    path, tokenizer = store
    need_devices(4)
    runs = {}
    for seq in (1, 4):
        cfg = load_config(PRESET, _overrides(path) + [f"mesh.seq={seq}"])
        summary = train(cfg, str(tmp_path / f"run{seq}"), progress=False)
        assert summary["status"] == "done" and summary["eval_loss"] is not None
        with open(tmp_path / f"run{seq}" / "metrics.jsonl") as f:
            runs[seq] = [json.loads(line) for line in f]
    assert [r["step"] for r in runs[4]] == list(range(1, 5))
    np.testing.assert_allclose([r["loss"] for r in runs[4]], [r["loss"] for r in runs[1]],
                               rtol=2e-4)
    evals = [[r["eval_loss"] for r in runs[s] if "eval_loss" in r] for s in (1, 4)]
    np.testing.assert_allclose(evals[1], evals[0], rtol=2e-4)
    assert runs[1][-1]["loss"] < runs[1][0]["loss"] - 0.1

    # export the seq=4 run; transformers runs it on a conversation with an image
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "ulysses_jax.export", str(tmp_path / "run4"),
                           "--out", str(out), "--no-progress"], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'mrope_section': [2, 3, 3]" in done.stdout, done.stdout  # the decoder's RoPE
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(out), attn_implementation="eager", dtype=torch.float32).eval()
    st = TokenStore(path)
    doc = next(d for d in range(st.num_docs) if st.media(d))
    tokens = np.asarray(st.view(doc), np.int32)[None]
    from ulysses_jax.data import media
    pixels, grid = media.load_item(st.media(doc)[0], **media.load_options(st.manifest))
    cfg = load_config(PRESET, _overrides(path) + ["mesh.seq=1"]).model
    mm = (tokens == cfg.image_token_id).astype(np.int64)
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(tokens).long(),
                  pixel_values=torch.from_numpy(pixels),
                  image_grid_thw=torch.from_numpy(np.asarray(grid).reshape(1, 3)),
                  mm_token_type_ids=torch.from_numpy(mm)).logits.numpy()
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    loaded = load(str(tmp_path / "run4"), mesh)
    # The image inputs prepared on the host as the model's call does, the forward in one
    # program (Decoder.__call__'s path with positions and vision given).
    ours = nnx.merge(loaded.graphdef, loaded.params)
    positions, vision = multimodal.prepare(tokens, ours.cfg, shards=ours.visual.shards(),
                                           pixel_values=pixels,
                                           image_grid_thw=np.asarray(grid).reshape(1, 3))
    got = np.asarray(jax.jit(lambda p, *a: nnx.merge(loaded.graphdef, p)(*a))(
        loaded.params, jnp.asarray(tokens), positions, None, vision))
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) <= 1e-4

    # generation: the CLI on the run (mesh seq 2) with an image chat and a text prompt; the
    # greedy ids equal transformers' generate on the export (the run's tokenizer's EOS), the
    # image's pixels from its file; the trained model answers the image chat as it learned
    from ulysses_jax.generate import _template_of, encode_rows, main as generate_main, \
        media_options
    rows = [{"messages": [{"role": "user", "content": [
                {"type": "image", "image": "img4.png"}, {"type": "text", "text": "Say hi"}]}]},
            {"prompt": "Say hi"}]
    prompts, generated = tmp_path / "data" / "prompts.jsonl", tmp_path / "generated.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert generate_main([str(tmp_path / "run4"), "--prompts", str(prompts), "--out",
                          str(generated), "--max-new-tokens", "5", "--mesh-seq", "2",
                          "--no-progress"]) == 0
    got = [json.loads(line) for line in generated.read_text().splitlines()]
    ids, media = encode_rows(rows, loaded.tokenizer, _template_of(loaded, str(tmp_path / "run4")),
                             "prompts", media_options(loaded, str(tmp_path / "run4")),
                             base=str(tmp_path / "data"))
    assert media[1] is None and media[0]["image_grid_thw"].tolist() == [[1, 6, 8]]
    assert [r["prompt_tokens"] for r in got] == [len(i) for i in ids]
    for row, prompt, m in zip(got, ids, media):
        t = torch.tensor([prompt])
        kw = {k: torch.from_numpy(np.asarray(v)) for k, v in (m or {}).items()
              if v is not None}
        with torch.no_grad():
            made = hf.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                               max_new_tokens=5, eos_token_id=loaded.tokenizer.eos_id,
                               mm_token_type_ids=(t == cfg.image_token_id).long(), **kw)
        assert row["completion_ids"] == made[0, len(prompt):].tolist(), row
    # an image file that is not there: exit 2, the row and the file named, nothing written
    rows[0]["messages"][0]["content"][0]["image"] = "gone.png"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    generated.unlink()
    assert generate_main([str(tmp_path / "run4"), "--prompts", str(prompts), "--out",
                          str(generated), "--no-progress"]) == 2
    assert "row 1: image 'gone.png'" in capsys.readouterr().err and not generated.exists()
    assert got[0]["finish_reason"] == "stop" and got[0]["completion"] in (" hi again",
                                                                          " the answer is 42")


def test_store_and_model_must_agree(store):
    """The store's placeholder ids must be the model's, and its largest frame must fit the
    patch slots (the 84 x 112 images: 6 x 8 = 48 patches); both are config errors naming
    the numbers, checked before training."""
    from ulysses_jax.config import ConfigError
    from ulysses_jax.data.vision_batches import check_store
    path, _ = store
    manifest = TokenStore(path).manifest
    good = _overrides(path) + ["mesh.seq=1"]
    check_store(load_config(PRESET, good), manifest)
    for extra, match in ((["model.image_token_id=5"], "image_token_id is .* but model"),
                         (["data.vision_patches=8"], "largest frame has 48 patches")):
        with pytest.raises(ConfigError, match=match):
            check_store(load_config(PRESET, good + extra), manifest)


def test_zero3_tower_gathers_one_block_at_a_time():
    """Under ZeRO-3 the compiled train step all-gathers the tower's block weights inside the
    block loop, one block's at a time: never the stack of all blocks (the tiny preset's 3)."""
    from ulysses_jax.hlo import collective_shapes
    from ulysses_jax.training.dry_run import compile_step
    need_devices(4)
    cfg = load_config(PRESET, ["param_sharding=zero3", "data.vision_patches=256"])
    v = cfg.model.vision
    d, f, n = v.hidden_size, v.intermediate_size, v.num_heads
    block = {(d, 3, n, d // n), (d, f), (f, d), (n, d // n, d)}   # wqkv, w_gate/w_up, w_down, wo
    compiled, _ = compile_step(cfg)
    gathered = {tuple(s) for s in collective_shapes(compiled.as_text(), "all-gather")}
    assert {(1, *shape) for shape in block} <= gathered, sorted(gathered)   # a slice of the loop
    assert not {(v.depth, *shape) for shape in block} & gathered, sorted(gathered)


def test_store_patching_and_missing_placeholder_ids(store):
    """The store's patching must be the tower's (its pixels and placeholder counts were made
    with it); a store id of None (its tokenizer had no such pad: no such media) is not
    compared."""
    from ulysses_jax.config import ConfigError
    from ulysses_jax.data.vision_batches import check_store
    path, _ = store
    manifest = TokenStore(path).manifest
    cfg = load_config(PRESET, _overrides(path) + ["mesh.seq=1"])
    for key, value, field in (("patch_size", 16, "patch_size"),
                              ("merge_size", 1, "spatial_merge_size"),
                              ("temporal_patch_size", 1, "temporal_patch_size")):
        changed = {**manifest, "media": {**manifest["media"], key: value}}
        with pytest.raises(ConfigError, match=f"prepared with {key} {value} but "
                                              f"model.vision.{field} is"):
            check_store(cfg, changed)
    check_store(cfg, {**manifest, "media": {**manifest["media"], "video_token_id": None}})


def test_default_slots_follow_the_merge_size(store):
    """C = ceil(m^2 B S / G) + one default frame, a multiple of m^2 (module docstring)."""
    from ulysses_jax.data.vision_batches import DEFAULT_FRAME_PATCHES, vision_slots
    path, _ = store
    base = _overrides(path) + ["mesh.seq=1", "data.vision_patches=0"]  # B 2, S 128, G 1
    assert vision_slots(load_config(PRESET, base)) == 4 * 2 * 128 + DEFAULT_FRAME_PATCHES
    one = load_config(PRESET, base + ["model.vision.spatial_merge_size=1"])
    assert vision_slots(one) == 2 * 128 + DEFAULT_FRAME_PATCHES


def test_batch_errors_name_the_row_and_only_overflow_blames_the_slots(store, tmp_path):
    """A batch whose patches overflow the slots is a data.vision_patches ConfigError; tokens
    and media that disagree (pads without their image) or an unreadable file are the named
    row's ValueError, with no advice about the slots."""
    from ulysses_jax.config import ConfigError
    from ulysses_jax.data import packing, vision_batches
    path, _ = store
    st = TokenStore(path)
    cfg = load_config(PRESET, _overrides(path) + ["mesh.seq=1"])
    rows = packing.ChatRows(st, np.arange(st.num_docs), cfg.seq_len, shuffle=False)
    batch = rows.rows([0, 1])
    media = [rows.row_media(0), rows.row_media(1)]
    options = vision_batches.pixel_options(st.manifest)
    vision_batches.host_batch(batch, media, cfg, options, ["a", "b"])  # consistent: fine
    few = load_config(PRESET, _overrides(path) + ["mesh.seq=1", "data.vision_patches=40"])
    with pytest.raises(ConfigError, match=r"data.vision_patches 40 \(40 patch slots per "
                                          r"group\): .*; set it higher"):
        vision_batches.host_batch(batch, media, few, options, ["a", "b"])
    with pytest.raises(ValueError) as e:
        vision_batches.host_batch(batch, [media[0], []], cfg, options, ["a", "b"])
    assert not isinstance(e.value, ConfigError) and "vision_patches" not in str(e.value)
    assert str(e.value).startswith("batch row 1 (b): the tokens hold ")
    assert "image placeholders" in str(e.value)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    bad = [[{**media[0][0], "paths": [str(broken)]}, *media[0][1:]], media[1]]
    with pytest.raises(ValueError, match=f"batch row 0 \\(a\\): {broken}: cannot read this "
                                         f"image file"):
        vision_batches.host_batch(batch, bad, cfg, options, ["a", "b"])
