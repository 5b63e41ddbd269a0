"""``init_adapter``: a run continues a peft LoRA adapter on its ``init_from`` base.

The adapter is made by peft itself (random nonzero A and B on a tiny random Llama, saved with
save_pretrained). Start: our start state's logits and first train step's loss equal peft's
model's (mesh.seq 1 and 2). Training: steps from it lower the loss, a resume reads its own
checkpoint (the adapter directory is gone by then), and the exported adapter, loaded by peft on
the base, gives our trained model's logits. Errors: every rule of interop/peft_adapter.py, from
the files alone (no compile).
"""
import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from tests.test_lora import SMALL, TOL, TRAIN
from tests.utils.devices import DEVICES, need_devices
from tests.utils.numerics import rel_error
from tests.utils.torch_models import ADAPTERS, randomize
from ulysses_jax import make_mesh
from ulysses_jax.config import ConfigError, load_config
from ulysses_jax.interop.peft_adapter import adapter_targets
from ulysses_jax.models.decoder import Decoder
from ulysses_jax.training.checkpoint import Checkpointer
from ulysses_jax.training.resume import initial_adapters, resolve_init_from, start_state
from ulysses_jax.training.train_step import batch_shardings, make_train_step, state_layout

torch = pytest.importorskip("torch", reason="torch is needed for the peft reference")
transformers = pytest.importorskip("transformers", reason="transformers is needed")
peft = pytest.importorskip("peft", reason="peft makes and reads the adapters")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
N_TENSORS = 2 * 2 * len(TARGETS)  # layers x (A, B) x targets
OVER = TRAIN + ["model.lora.targets=[q,v,o,down]", "optimizer.lr=0.01"]
SEQ = 64  # TRAIN's seq_len


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base checkpoint dir, peft adapter dir, the peft model): a tiny random Llama and an
    adapter with random nonzero A and B on q, v, o, down, as peft saves it."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SMALL, head_dim=16, tie_word_embeddings=True),
        attn_implementation="eager")
    randomize(model, seed=3)
    base = str(tmp_path_factory.mktemp("base"))
    model.save_pretrained(base, safe_serialization=True)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                             init_lora_weights=False)
    wrapped = peft.get_peft_model(_hf(base), config).eval()
    randomize(wrapped, seed=103, special=[ADAPTERS], only="lora_")
    adapter = str(tmp_path_factory.mktemp("adapter"))
    wrapped.save_pretrained(adapter)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    return base, adapter, wrapped


def _config(tiny, *over, adapter=None):
    base, default, _ = tiny
    return resolve_init_from(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), OVER + [
        f"init_from={base}", f"init_adapter={adapter or default}", *over]))


def _batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, SMALL["vocab_size"], (2, SEQ)).astype(np.int32),
            "targets": rng.integers(0, SMALL["vocab_size"], (2, SEQ)).astype(np.int32),
            "loss_mask": (rng.random((2, SEQ)) < 0.8).astype(np.float32),
            "segment_ids": np.ones((2, SEQ), np.int32),
            "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (2, SEQ)).copy()}


@pytest.mark.parametrize("seq", [1, 2])
def test_start_equals_peft(tiny, tmp_path, seq):
    """The start state (init_from + init_adapter): its logits and the first train step's loss
    equal peft's model's."""
    _, adapter, wrapped = tiny
    cfg = _config(tiny, f"mesh.seq={seq}")
    mesh = make_mesh(seq=seq, data=1, devices=need_devices(seq))
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    start, (graphdef, state, shardings, tx), note = start_state(cfg, mesh, ckpt, None)
    ckpt.close()
    assert start == 0
    assert f"init_adapter: {N_TENSORS} LoRA tensors from {adapter}" in note
    assert "warning" not in note
    batch = _batch(seq)
    with torch.no_grad():
        logits = wrapped(torch.from_numpy(batch["tokens"]).long()).logits          # [B, S, V]
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            torch.from_numpy(batch["targets"]).long().reshape(-1), reduction="none")
        mask = torch.from_numpy(batch["loss_mask"]).reshape(-1)
        want_loss = float((ce * mask).sum() / mask.sum())
    ours = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(state["params"], batch["tokens"])
    assert rel_error(np.asarray(ours), logits.numpy()) <= TOL
    sharded = {k: jax.device_put(v, batch_shardings(mesh)[k]) for k, v in batch.items()}
    _, metrics = make_train_step(cfg, mesh, graphdef, tx, shardings)(state, sharded)
    assert abs(float(metrics["loss"]) - want_loss) <= TOL * want_loss, (metrics, want_loss)


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="trainer tests run on fake CPU devices")
def test_training_continues_resumes_and_exports(tiny, tmp_path, capsys):
    """Two steps from the adapter; the adapter directory removed; resumed to four from the
    run's own checkpoint. The loss falls, and the exported adapter loaded by peft on the base
    gives the trained model's logits, base_model_name_or_path still init_from."""
    from ulysses_jax.export import export_adapter
    from ulysses_jax.runs import read_params, run_config
    from ulysses_jax.training.trainer import train
    base, adapter, _ = tiny
    copy = str(tmp_path / "adapter")
    shutil.copytree(adapter, copy)
    run = str(tmp_path / "run")
    over = ("checkpoint_every=2", "optimizer.schedule_steps=4")
    train(_config(tiny, "steps=2", *over, adapter=copy), run, progress=False)
    assert f"init_adapter: {N_TENSORS} LoRA tensors from {copy}" in capsys.readouterr().out
    shutil.rmtree(copy)
    train(_config(tiny, "steps=4", *over, adapter=copy), run, progress=False)
    assert f"init_adapter {copy!r} not read: the checkpoint holds" in capsys.readouterr().out
    with open(os.path.join(run, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.01, losses

    out = str(tmp_path / "exported")
    assert export_adapter(run, out)["tensors"] == N_TENSORS
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == base
    cfg = run_config(run)
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg.model, mesh=mesh,
                                                           rngs=nnx.Rngs(0))))
    params = {}
    for keys, x in read_params(run, 4):
        node = params
        for k in keys[:-1]:
            node = node.setdefault(int(k) if k.isdigit() else k, {})
        node[keys[-1]] = x
    tokens = _batch(9)["tokens"]
    ours = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(_hf(base), out).eval()(
            torch.from_numpy(tokens).long()).logits.numpy()
    assert rel_error(ours, theirs) <= TOL, rel_error(ours, theirs)


# --- errors: from the files and shapes alone -------------------------------------------

@pytest.fixture(scope="module")
def layouts():
    """Abstract parameters per config (state_layout: eval_shape only), cached by LoRA keys."""
    cache = {}

    def get(cfg):
        key = (cfg.model.lora, cfg.model.d_model)
        if key not in cache:
            mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
            cache[key] = state_layout(dataclasses.replace(
                cfg, mesh=dataclasses.replace(cfg.mesh, seq=1)), mesh)[1]["params"]
        return cache[key]
    return get


def _edited(tiny, tmp_path, conf=None, tensors=None):
    """A copy of the adapter with adapter_config.json updated by ``conf`` (None values
    deleted) and the tensors changed by ``tensors(dict) -> dict``."""
    from safetensors.numpy import load_file, save_file
    out = str(tmp_path / "edited")
    shutil.copytree(tiny[1], out)
    file = os.path.join(out, "adapter_config.json")
    with open(file) as f:
        c = json.load(f)
    for k, v in (conf or {}).items():
        c.pop(k) if v is None else c.__setitem__(k, v)
    with open(file, "w") as f:
        json.dump(c, f)
    if tensors:
        weights = os.path.join(out, "adapter_model.safetensors")
        save_file(tensors(load_file(weights)), weights)
    return out


_A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("over,conf,tensors,match", [
    (["model.lora.rank=8"], None, None,
     r"r 4 there, model.lora.rank 8 here; run with model.lora.rank=4 to continue"),
    (["model.lora.alpha=16"], None, None,
     r"lora_alpha 8 there, model.lora.alpha 16.0 here; run with model.lora.alpha=8"),
    (["model.lora.rslora=true"], None, None,
     r"use_rslora False there, model.lora.rslora True here; run with model.lora.rslora=false"),
    (["model.lora.targets=[q,k,v,o,gate,up,down]"], None, None,
     r"\(our targets \['q', 'v', 'o', 'down'\]\) there, model.lora.targets \['q', 'k', 'v', "
     r"'o', 'gate', 'up', 'down'\] here; run with model.lora.targets=\[q,v,o,down\]"),
    ([], {"peft_type": "IA3"}, None, r"peft_type is 'IA3'; only LORA adapters are read"),
    ([], {"use_dora": True}, None, r"use_dora True is not supported"),
    ([], {"lora_bias": True}, None, r"lora_bias True is not supported"),
    ([], {"modules_to_save": ["lm_head"]}, None, r"modules_to_save \['lm_head'\] there, but model.lora.trainable \[\] trains \[\]"),
    ([], {"rank_pattern": {"q_proj": 8}}, None, r"rank_pattern \{'q_proj': 8\} is not supp"),
    ([], {"alpha_pattern": {"v_proj": 2}}, None, r"alpha_pattern \{'v_proj': 2\} is not"),
    ([], {"layers_to_transform": [0]}, None, r"layers_to_transform \[0\] is not supported"),
    ([], {"bias": "all"}, None, r"bias 'all' is not supported \(adapters without biases"),
    ([], {"init_lora_weights": "pissa_niter_4"}, None, r"also rewrote the base weights"),
    ([], {"target_modules": ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]}, None,
     r"target_modules \['lm_head'\] are not projections our adapters cover"),
    ([], {"target_modules": r"model\.layers\.0\..*(q|v|o|down)_proj"}, None,
     r"selects self_attn.q_proj in layers \[0\] of 2 only"),
    ([], None, lambda t: {k: v for k, v in t.items() if k != _A0},
     r"adapter_model.safetensors lacks 1 of the 16 tensors model.lora needs: " + _A0),
    ([], None, lambda t: {**t, "base_model.model.lm_head.lora_A.weight": np.zeros((4, 64))},
     r"holds 1 tensors model.lora has no place for: base_model.model.lm_head.lora_A"),
    ([], None, lambda t: {**t, _A0: np.zeros((4, 32), np.float32)},
     rf"tensor {_A0} is \[4, 32\] there, \[4, 64\] expected"),
])
def test_adapter_errors(tiny, tmp_path, layouts, over, conf, tensors, match):
    cfg = _config(tiny, *over, adapter=_edited(tiny, tmp_path, conf, tensors))
    with pytest.raises(ConfigError, match=match):
        initial_adapters(cfg, layouts(cfg))


def test_directory_errors(tiny, tmp_path, layouts):
    cfg = _config(tiny, adapter=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"nowhere'?: not a directory"):
        initial_adapters(cfg, layouts(cfg))
    os.makedirs(tmp_path / "bin")
    shutil.copy(os.path.join(tiny[1], "adapter_config.json"), tmp_path / "bin")
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"")
    cfg = _config(tiny, adapter=str(tmp_path / "bin"))
    with pytest.raises(ConfigError, match=r"has no adapter_model.safetensors \(only "
                                          r"adapter_model.bin, a pickle, which is not read"):
        initial_adapters(cfg, layouts(cfg))


@pytest.mark.parametrize("over,match", [
    (["init_adapter=x", "model.lora.rank=4"], r"init_adapter 'x' needs the base model it adapts "
                                              r"\(init_from, got None\)"),
    (["init_adapter=x", "init_from=y"], r"model.lora.rank > 0 as the adapter's r, got 0\)"),
])
def test_config_errors(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(os.path.join(ROOT, "configs", "tiny.yaml"), over)


def test_accepted_variants_and_notes(tiny, tmp_path, layouts):
    """A regular expression or "all-linear" that selects whole projections is accepted; a
    base of another name and a dropout are logged, not refused."""
    conf = {"target_modules": r".*\.(q|v|o|down)_proj", "lora_dropout": 0.1,
            "base_model_name_or_path": "org/other-model"}
    cfg = _config(tiny, adapter=_edited(tiny, tmp_path, conf))
    adapters, notes = initial_adapters(cfg, layouts(cfg))
    attn = adapters["layers"]["attn"]
    assert sorted(attn) == ["lora_o_a", "lora_o_b", "lora_q_a", "lora_q_b", "lora_v_a",
                            "lora_v_b"] and attn["lora_q_a"].shape == (2, 64, 4)  # [L, D, R]
    assert any("saved for base model 'org/other-model'" in n for n in notes), notes
    assert any("lora_dropout 0.1" in n for n in notes), notes
    assert adapter_targets({"target_modules": "all-linear"}, 2) == (
        ["q", "k", "v", "o", "gate", "up", "down"], [])
    assert adapter_targets({"target_modules": ["self_attn.q_proj", "up_proj"]}, 2) == (
        ["q", "up"], [])
    # The routed experts' adapters (peft's target_parameters, as the MoE export writes them).
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert adapter_targets({"target_modules": ["q_proj"], "target_parameters": experts},
                           2) == (["q", "experts"], [])
    assert adapter_targets({"target_parameters": ["down_proj", "gate_up_proj"]}, 2) == (
        ["experts"], [])
    got, problems = adapter_targets({"target_modules": ["q_proj"],
                                     "target_parameters": ["mlp.experts.down_proj"]}, 2)
    assert got == ["q"] and "for the routed experts, as" in problems[0], problems


def test_dry_run_checks_the_adapter(tiny):
    """--dry-run reads init_adapter as the run would: a fitting adapter is noted, one that
    does not fit model.lora is refused before anything compiles."""
    from ulysses_jax.training.dry_run import dry_run
    plan = dry_run(_config(tiny))
    assert any(n.startswith(f"init_adapter: {N_TENSORS} LoRA tensors") for n in plan["notes"])
    with pytest.raises(ConfigError, match=r"r 4 there, model.lora.rank 8 here"):
        dry_run(_config(tiny, "model.lora.rank=8"))
