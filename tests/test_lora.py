"""LoRA (model.lora, models/lora.py) against peft, in training, and in its config.

Parity: tiny random Llama and Qwen3 checkpoints written by transformers, wrapped by peft with
random nonzero A and B (B = 0 would hide a wrong B or scaling), and our Decoder with the same
adapters (interop/peft.py) on 1, 2 and 4 sequence-parallel devices: logits, the training
objective and the gradients of every adapter matrix (torch autograd vs jax.grad) agree within
1e-4 relative. Training: a few steps lower the loss, leave every frozen tensor bitwise as it
was, keep no optimizer state for frozen parameters, and a resumed run equals an uninterrupted
one.
"""
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.utils.devices import DEVICES, need_devices
from tests.utils.numerics import rel_error
from tests.utils.torch_models import ADAPTERS, randomize
from ulysses_jax import make_mesh
from ulysses_jax.config import ConfigError, LoraConfig, load_config
from ulysses_jax.hf import config_from_hf, load_params, read_config
from ulysses_jax.interop.peft import (EXPERT_PARAMETERS, adapter_tensors, peft_targets,
                                      with_adapters)
from ulysses_jax.models import lora
from ulysses_jax.models.decoder import Decoder
from ulysses_jax.training.objectives.sft import objective
from ulysses_jax.training.train_step import (batch_shardings, init_state, make_train_step,
                                             param_line)

torch = pytest.importorskip("torch", reason="torch is needed for the peft reference")
transformers = pytest.importorskip("transformers", reason="transformers is needed")
peft = pytest.importorskip("peft", reason="peft is the reference implementation of LoRA")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, S, B, R = 300, 32, 2, 4
TOL = 1e-4  # max|ours - theirs| / max|theirs|, fp32
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=V)
# name: (config class, config kwargs, LoraConfig of ours, mesh.seq sizes)
CASES = {
    "llama": ("LlamaConfig", dict(head_dim=16, tie_word_embeddings=True),
              LoraConfig(rank=R, alpha=8.0), (1, 2, 4)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=False),
              LoraConfig(rank=R, alpha=6.0, rslora=True, targets=("q", "v", "o", "down")),
              (1, 2, 4)),
    # The Gemma block (post-norms, GeGLU, softcaps, a sliding window).
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=16,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
               LoraConfig(rank=R, alpha=4.0, targets=("k", "o", "gate", "up")), (1, 2, 4)),
    # Routed experts (peft's target_parameters on the fused gate_up_proj and down_proj), split
    # over the devices (1 to 4 experts each).
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, norm_topk_prob=True),
                  LoraConfig(rank=R, alpha=8.0, targets=("q", "o", "experts")), (1, 2, 4)),
    # Every target: gated attention (q_proj's B also moves the output gate), the DeltaNet's
    # in_proj_qkvz / in_proj_ba / out_proj, the routed experts and the shared expert (peft's
    # target_parameters, interop/peft.py).
    "qwen3_next": ("Qwen3NextConfig", dict(
        head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, tie_word_embeddings=False),
        LoraConfig(rank=R, alpha=8.0), (1, 2, 4)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, peft-wrapped transformers model with random adapters)."""
    out = {}
    for i, (name, (cls, kw, ours, _)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, cls)(**SMALL, **kw), attn_implementation="eager")
        randomize(model, seed=i)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path, safe_serialization=True)
        # The targets as our adapter export names them.
        cfg = dataclasses.replace(config_from_hf(read_config(path)), lora=ours)
        config = peft.LoraConfig(r=ours.rank, lora_alpha=ours.alpha, lora_dropout=0.0,
                                 use_rslora=ours.rslora, **peft_targets(cfg))
        wrapped = peft.get_peft_model(model, config).eval()
        randomize(wrapped, seed=100 + i, special=[ADAPTERS], only="lora_")
        out[name] = (path, wrapped)
    return out


def _batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, V, (B, S)).astype(np.int32),
            "targets": rng.integers(0, V, (B, S)).astype(np.int32),
            "loss_mask": (rng.random((B, S)) < 0.8).astype(np.float32),
            "segment_ids": np.ones((B, S), np.int32),
            "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy()}


def _peft_reference(wrapped, batch):
    """peft's logits, masked mean loss and adapter gradients (peft's saved names)."""
    wrapped.zero_grad()
    logits = wrapped(torch.from_numpy(batch["tokens"]).long()).logits            # [B, S, V]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V),
                                           torch.from_numpy(batch["targets"]).long().reshape(-1),
                                           reduction="none")
    mask = torch.from_numpy(batch["loss_mask"]).reshape(-1)
    loss = (ce * mask).sum() / mask.sum()
    loss.backward()
    grads = {n.replace(".default", ""): p.grad.numpy().copy()
             for n, p in wrapped.named_parameters() if "lora_" in n}
    return logits.detach().numpy(), float(loss), grads


@pytest.mark.parametrize("name", list(CASES))
def test_matches_peft(checkpoints, name):
    """Logits, loss and every adapter gradient equal peft's (at mesh.seq 1, 2 and 4)."""
    path, wrapped = checkpoints[name]
    batch = _batch(len(name))
    want_logits, want_loss, want_grads = _peft_reference(wrapped, batch)
    theirs = {n: p.detach().numpy() for n, p in wrapped.named_parameters() if "lora_" in n}
    theirs = {n.replace(".default", ""): x for n, x in theirs.items()}
    checked = 0
    sizes = CASES[name][3]
    for p in sizes:
        mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
        # Softcapped attention runs in the chunked kernel only ("auto" picks it).
        base_cfg, base = load_params(path, mesh, attn_impl="auto" if name == "gemma2" else "xla")
        # (transformers' logits and loss leave out the MoE load-balancing term)
        cfg = dataclasses.replace(base_cfg, lora=CASES[name][2], router_aux_loss_coef=0.0)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, mesh=mesh,
                                                                   rngs=nnx.Rngs(0))))
        abstract = nnx.to_pure_dict(state)
        params = lora.overlay(with_adapters(cfg, abstract, theirs), base)
        # (device_put and host arrays: no staging or slicing program per array shape)
        params = jax.tree.map(jax.device_put, params)
        sharded = {k: jax.device_put(v, batch_shardings(mesh)[k]) for k, v in batch.items()}
        trained = lora.trainable_params(params, cfg.lora)
        # The trained subtree is exactly the adapters peft trains.
        assert sum(x.size for x in jax.tree.leaves(trained)) == sum(
            x.size for x in theirs.values())

        @jax.jit
        def run(trained, batch):
            full = lora.overlay(params, trained)
            logits = nnx.merge(graphdef, full)(batch["tokens"])                 # [B, S, V]
            (obj, _), grads = jax.value_and_grad(
                lambda t: objective(graphdef, lora.overlay(params, t), batch, mesh),
                has_aux=True)(trained)
            return logits, obj, grads

        logits, loss, grads = run(_host(trained), sharded)
        assert rel_error(np.asarray(logits), want_logits) <= TOL, (name, p)
        assert abs(float(loss) - want_loss) / abs(want_loss) <= TOL, (name, p, loss, want_loss)
        got = adapter_tensors(cfg, grads)
        assert sorted(got) == sorted(want_grads)
        for n, g in got.items():
            assert rel_error(g, want_grads[n]) <= TOL, (name, p, n, rel_error(g, want_grads[n]))
            checked += 1
        print(f"{name} seq={p}: logits {rel_error(np.asarray(logits), want_logits):.2e}, loss "
              f"{abs(float(loss) - want_loss) / abs(want_loss):.2e}, adapter grads max "
              f"{max(rel_error(g, want_grads[n]) for n, g in got.items()):.2e}")
    assert checked == len(sizes) * len(want_grads)


# A model small enough that each run compiles and trains in seconds on 2 cores (test_train's).
TRAIN = ["seq_len=64", "batch_size=2", "model.d_model=32", "model.n_layers=2",
         "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=8", "model.ffn_dim=64",
         "model.loss_chunk=16", "log_every=1", "eval_batches=0", "optimizer.warmup_steps=0",
         "mesh.seq=2", "model.lora.rank=4", "model.lora.alpha=8"]


def _host(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def _paths(tree) -> list[tuple]:
    return [tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in p)
            for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="trainer tests run on fake CPU devices")
def test_steps_train_only_adapters():
    """A few steps on one batch: the loss falls, the adapters (and the norms named in
    model.lora.trainable) move, every frozen tensor stays bitwise what it was, in bf16
    storage (model.lora.base_dtype), and the optimizer holds state for trained leaves only;
    with ZeRO-3 and two accumulated micro-batches (the accumulator: trained leaves only)."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), TRAIN + [
        "optimizer.lr=0.01", "steps=4", "model.lora.trainable=[norms]",
        "model.lora.base_dtype=bfloat16", "param_sharding=zero3", "grad_accum_steps=2"])
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    graphdef, state, shardings, tx = init_state(cfg, mesh)
    before = _host(state["params"])
    trained = lora.trainable_params(before, cfg.model.lora)
    trained_paths = set(_paths(trained))
    assert trained_paths and all(lora.is_adapter(p) or any("norm" in str(k) for k in p)
                                 for p in trained_paths)
    n_trained = sum(x.size for x in jax.tree.leaves(trained))
    assert f"{n_trained / 1e6:.4f}M trained" in param_line(cfg, before)
    assert before["layers"]["attn"]["wq"].dtype == jnp.bfloat16
    assert before["layers"]["mlp"]["lora_up_a"].dtype == np.float32
    assert before["embed"].dtype == np.float32
    # Optimizer state: per trained leaf (mu and nu), nothing for the frozen ones.
    moments = [p for p in _paths(state["opt_state"]) if "mu" in p or "nu" in p]
    assert len(moments) == 2 * len(trained_paths)
    assert {p[p.index("mu") + 1:] for p in moments if "mu" in p} == trained_paths
    assert sum(np.asarray(x).size for x in jax.tree.leaves(state["opt_state"])) < \
        2 * sum(x.size for x in jax.tree.leaves(trained)) + 8

    step = make_train_step(cfg, mesh, graphdef, tx, shardings)
    batch = _batch(7)
    batch["tokens"] %= cfg.model.vocab_size
    batch["targets"] %= cfg.model.vocab_size
    batch = {k: np.concatenate([v, v], axis=1) for k, v in batch.items()}  # [2, 64]
    batch["positions"] = np.broadcast_to(np.arange(64, dtype=np.int32), (2, 64)).copy()
    batch = {k: jax.device_put(v, batch_shardings(mesh)[k]) for k, v in batch.items()}
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.01, losses
    after = _host(state["params"])
    changed = 0
    for path, x, y in zip(_paths(before), jax.tree.leaves(before), jax.tree.leaves(after)):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        if path in trained_paths:
            changed += not np.array_equal(x, y)
        else:
            assert np.array_equal(x, y), f"frozen {path} changed"
    assert changed == len(trained_paths)


@pytest.fixture(scope="module")
def lora_runs(checkpoints, tmp_path_factory):
    """train.py's loop on the Qwen3 base (init_from) with adapters: "full", 4 steps in one
    go; "split", stopped after step 2 and resumed to 4; "moved", split's step 2 resumed on
    one device instead of two. Returns the runs' parent dir."""
    if DEVICES[0].platform != "cpu":
        pytest.skip("trainer tests run on fake CPU devices")
    from ulysses_jax.training.trainer import train
    root = tmp_path_factory.mktemp("lora_runs")
    over = TRAIN + [f"init_from={checkpoints['qwen3'][0]}", "checkpoint_every=2",
                    "optimizer.schedule_steps=4", "optimizer.lr=0.01"]
    cfg = lambda steps: load_config(os.path.join(ROOT, "configs", "tiny.yaml"),  # noqa: E731
                                    over + [f"steps={steps}"])
    train(cfg(4), str(root / "full"), progress=False)
    train(cfg(2), str(root / "split"), progress=False)
    shutil.copytree(root / "split", root / "moved")
    train(cfg(4), str(root / "split"), progress=False)
    train(dataclasses.replace(cfg(4), mesh=dataclasses.replace(cfg(4).mesh, seq=1)),
          str(root / "moved"), progress=False)
    return root


def test_init_from_resume_keeps_base_bitwise(checkpoints, lora_runs):
    """A run stopped at step 2 and resumed to 4 equals one run of 4 steps (also resumed on
    another mesh, within rounding), and the final checkpoint's frozen weights are bitwise
    the ones loaded from the base."""
    from ulysses_jax.runs import read_params
    losses = {}
    for run in ("full", "split", "moved"):
        with open(lora_runs / run / "metrics.jsonl") as f:
            losses[run] = [json.loads(line)["loss"] for line in f]
    assert len(losses["full"]) == 4 and losses["split"] == losses["full"], losses
    # On another mesh the sums run in another order: equal within fp32 rounding.
    np.testing.assert_allclose(losses["moved"], losses["full"], rtol=1e-5)

    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    _, loaded = load_params(checkpoints["qwen3"][0], mesh)
    loaded = dict(zip(_paths(loaded), jax.tree.leaves(_host(loaded))))
    saved = dict(read_params(str(lora_runs / "full"), 4))
    adapters = [k for k in saved if lora.is_adapter(k)]
    assert len(adapters) == 2 * 7 and set(saved) == set(loaded) | set(adapters)
    for keys, x in loaded.items():
        assert np.array_equal(saved[keys], x), keys
    assert any(np.any(saved[k] != 0) for k in adapters if k[-1].endswith("_b"))


def test_resume_with_other_adapters_is_refused(checkpoints, lora_runs):
    from ulysses_jax.training.trainer import train
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), TRAIN + [
        f"init_from={checkpoints['qwen3'][0]}", "steps=6", "model.lora.rank=8"])
    with pytest.raises(ConfigError, match=r"model.lora.rank 4 there, 8 now"):
        train(cfg, str(lora_runs / "full"), progress=False)


def test_export_adapter_loads_in_peft_and_merged(checkpoints, lora_runs, tmp_path):
    """The run's adapters exported as a peft directory: peft.PeftModel.from_pretrained on the
    base gives our logits; --merge gives weights transformers loads with the same logits."""
    from ulysses_jax.export import export_adapter, export_run
    run = str(lora_runs / "full")
    summary = export_adapter(run, str(tmp_path / "adapter"))
    assert summary["tensors"] == 2 * 2 * 7
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        conf = json.load(f)
    assert conf["base_model_name_or_path"] == checkpoints["qwen3"][0]
    assert (conf["r"], conf["lora_alpha"], conf["use_rslora"]) == (4, 8.0, False)
    assert sorted(conf["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    export_run(run, str(tmp_path / "merged"), merge=True, progress=False)
    _exports_give_our_logits(run, 4, checkpoints["qwen3"][0], tmp_path)


def _exports_give_our_logits(run: str, step: int, base: str, out) -> None:
    """peft.PeftModel.from_pretrained(base, out/adapter) and transformers on out/merged give
    the logits of our model with the run's parameters at ``step``."""
    from ulysses_jax.runs import read_params, run_config
    cfg = run_config(run).model
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0))))
    params = {}
    for keys, x in read_params(run, step):
        node = params
        for k in keys[:-1]:
            node = node.setdefault(int(k) if k.isdigit() else k, {})
        node[keys[-1]] = jax.device_put(x)
    tokens = _batch(3)["tokens"] % cfg.vocab_size
    ours = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))

    def hf(path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32).eval()

    with torch.no_grad():
        tok = torch.from_numpy(tokens).long()
        peft_model = peft.PeftModel.from_pretrained(hf(base), str(out / "adapter")).eval()
        via_peft = peft_model(tok).logits.numpy()
        via_merge = hf(str(out / "merged"))(tok).logits.numpy()
    assert rel_error(via_peft, ours) <= TOL, rel_error(via_peft, ours)
    assert rel_error(via_merge, ours) <= TOL, rel_error(via_merge, ours)


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="trainer tests run on fake CPU devices")
def test_moe_run_trains_experts_and_exports(checkpoints, tmp_path):
    """Qwen3-MoE from its checkpoint, adapters on attention and every routed expert, experts
    split over two devices: the loss falls, the frozen weights (experts included) stay
    bitwise the loaded ones, and the adapter (peft's target_parameters) and --merge exports
    give our logits in peft and transformers."""
    from ulysses_jax.export import export_adapter, export_run
    from ulysses_jax.runs import read_params
    from ulysses_jax.training.trainer import train
    base = checkpoints["qwen3_moe"][0]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), TRAIN + [
        f"init_from={base}", "steps=4", "checkpoint_every=4", "optimizer.lr=0.02",
        "model.lora.targets=[q,o,experts]", "model.router_aux_loss_coef=0.0"])
    run = str(tmp_path / "run")
    train(cfg, run, progress=False)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    assert losses[-1] < losses[0], losses
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    _, loaded = load_params(base, mesh)
    loaded = dict(zip(_paths(loaded), jax.tree.leaves(_host(loaded))))
    saved = dict(read_params(run, 4))
    adapters = [k for k in saved if lora.is_adapter(k)]
    assert len(adapters) == 2 * 4 and set(saved) == set(loaded) | set(adapters)
    assert any(k[-1] == "w_gate" for k in loaded)
    for keys, x in loaded.items():
        assert np.array_equal(saved[keys], x), keys
    assert all(np.any(saved[k] != 0) for k in adapters if k[-1].endswith("_b"))
    summary = export_adapter(run, str(tmp_path / "adapter"))
    assert summary["tensors"] == 2 * 2 * 4
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        conf = json.load(f)
    assert conf["target_modules"] == ["o_proj", "q_proj"]
    assert conf["target_parameters"] == list(EXPERT_PARAMETERS)
    export_run(run, str(tmp_path / "merged"), merge=True, progress=False)
    _exports_give_our_logits(run, 4, base, tmp_path)
    # init_adapter reads the exported directory back to the adapters the run saved.
    from ulysses_jax.interop.peft_adapter import load_adapter
    from ulysses_jax.training.train_step import state_layout
    from ulysses_jax.runs import run_config
    again = dataclasses.replace(run_config(run), init_adapter=str(tmp_path / "adapter"))
    _, abstract, _, _ = state_layout(again, make_mesh(seq=2, data=1, devices=need_devices(2)))
    read, _ = load_adapter(again, abstract["params"])
    read = dict(zip(_paths(read), jax.tree.leaves(read)))
    assert sorted(read) == sorted(adapters)
    for keys in adapters:
        np.testing.assert_array_equal(read[keys], saved[keys])


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="trainer tests run on fake CPU devices")
@pytest.mark.parametrize("base,groups", [("qwen3", "[embed,norms,head]"), ("llama", "[embed]")])
def test_trained_groups_export_as_modules_to_save(checkpoints, tmp_path, base, groups):
    # (tiny.yaml ties the head; init_from then sets the checkpoint's own tie_embeddings)
    """A run that also trains embeddings, norms and the head (untied Qwen3) or the tied
    embedding (Llama) exports them as peft's modules_to_save: peft's model from the adapter
    directory, and transformers' from the --merge export, give our logits."""
    from ulysses_jax.export import export_adapter, export_run
    from ulysses_jax.training.trainer import train
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), TRAIN + [
        f"init_from={checkpoints[base][0]}", "steps=2", "checkpoint_every=2",
        "optimizer.lr=0.01", "model.lora.targets=[q,v]", f"model.lora.trainable={groups}",
        f"model.tie_embeddings={str(base == 'llama').lower()}"])
    run = str(tmp_path / "run")
    train(cfg, run, progress=False)
    export_adapter(run, str(tmp_path / "adapter"))
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        conf = json.load(f)
    want = {"[embed,norms,head]": ["embed_tokens", "input_layernorm", "k_norm", "lm_head",
                                   "norm", "post_attention_layernorm", "q_norm"],
            "[embed]": ["embed_tokens"]}[groups]
    assert conf["modules_to_save"] == want
    export_run(run, str(tmp_path / "merged"), merge=True, progress=False)
    _exports_give_our_logits(run, 2, checkpoints[base][0], tmp_path)
    # init_adapter reads the directory back: the adapters and the trained groups as saved.
    from ulysses_jax.runs import read_params, run_config
    from ulysses_jax.interop.peft_adapter import load_adapter
    from ulysses_jax.training.train_step import state_layout
    again = dataclasses.replace(run_config(run), init_adapter=str(tmp_path / "adapter"))
    _, abstract, _, _ = state_layout(again, make_mesh(seq=2, data=1, devices=need_devices(2)))
    read, _ = load_adapter(again, abstract["params"])
    read = dict(zip(_paths(read), jax.tree.leaves(read)))
    saved = dict(read_params(run, 2))
    assert sorted(read) == sorted(k for k in saved if lora.is_trainable(k, again.model.lora))
    for keys, x in read.items():
        np.testing.assert_array_equal(x, saved[keys], err_msg=str(keys))


@pytest.mark.skipif(DEVICES[0].platform != "cpu", reason="trainer tests run on fake CPU devices")
def test_qwen3_next_run_exports(checkpoints, tmp_path):
    """Qwen3-Next from its checkpoint with every target (gated attention, DeltaNet, routed
    and shared experts) on two devices: the loss falls, and the adapter export (the shared
    expert by target_parameters) and --merge give our logits in peft and transformers;
    init_adapter reads the export back."""
    from ulysses_jax.export import export_adapter, export_run
    from ulysses_jax.runs import read_params, run_config
    from ulysses_jax.interop.peft_adapter import load_adapter
    from ulysses_jax.training.train_step import state_layout
    from ulysses_jax.training.trainer import train
    base = checkpoints["qwen3_next"][0]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), TRAIN + [
        f"init_from={base}", "steps=3", "checkpoint_every=3", "optimizer.lr=0.02",
        "model.router_aux_loss_coef=0.0"])
    run = str(tmp_path / "run")
    train(cfg, run, progress=False)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    assert losses[-1] < losses[0], losses
    summary = export_adapter(run, str(tmp_path / "adapter"))
    # per layer: DeltaNet (3) or attention (4), shared expert (3), routed experts (2); A and B
    assert summary["tensors"] == 2 * (3 + 4 + 2 * (3 + 2))
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        conf = json.load(f)
    assert conf["target_modules"] == ["in_proj_ba", "in_proj_qkvz", "k_proj", "o_proj",
                                      "out_proj", "q_proj", "v_proj"]
    assert conf["target_parameters"][:2] == list(EXPERT_PARAMETERS)
    export_run(run, str(tmp_path / "merged"), merge=True, progress=False)
    _exports_give_our_logits(run, 3, base, tmp_path)
    # peft would read target_modules gate_proj as the routed experts: refused, with the reason.
    from ulysses_jax.interop.peft_adapter import adapter_targets
    _, problems = adapter_targets({"target_modules": ["q_proj", "gate_proj"]}, 2,
                                  run_config(run).model)
    assert any("as the routed experts' fused weights" in p for p in problems), problems
    again = dataclasses.replace(run_config(run), init_adapter=str(tmp_path / "adapter"))
    _, abstract, _, _ = state_layout(again, make_mesh(seq=2, data=1, devices=need_devices(2)))
    read, _ = load_adapter(again, abstract["params"])
    saved = {tuple(map(str, k)): x for k, x in read_params(run, 3) if lora.is_adapter(k)}
    read = {tuple(map(str, k)): x for k, x in zip(_paths(read), jax.tree.leaves(read))}
    assert sorted(read) == sorted(saved)
    for keys in saved:
        np.testing.assert_array_equal(read[keys], saved[keys])


def test_export_cli_writes_an_adapter_and_refuses_what_it_cannot(lora_runs, tmp_path,
                                                                    capsys):
    from ulysses_jax.export import ExportError, export_run, main
    run = str(lora_runs / "full")
    assert main([run, "--out", str(tmp_path / "cli"), "--step", "2"]) == 0
    assert sorted(os.listdir(tmp_path / "cli")) == ["adapter_config.json",
                                                    "adapter_model.safetensors"]
    assert "exported the LoRA adapters of step 2" in capsys.readouterr().out
    with pytest.raises(ExportError, match="trained LoRA adapters"):
        export_run(run, str(tmp_path / "x"), progress=False)


def test_token_chunked_mlp_equals_unchunked():
    """model.mlp_chunk (TiledMLP: the adapters travel through its shard_map and custom
    backward with the weights): loss and adapter gradients equal the unchunked model's."""
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), TRAIN).model
    batch = {k: np.concatenate([v % cfg.vocab_size if v.dtype == np.int32 else v] * 2, axis=1)
             for k, v in _batch(5).items()}
    batch["positions"] = np.broadcast_to(np.arange(2 * S, dtype=np.int32), (B, 2 * S)).copy()
    batch = {k: jax.device_put(v, batch_shardings(mesh)[k]) for k, v in batch.items()}
    results = []
    for chunk in (0, 8):
        c = dataclasses.replace(cfg, mlp_chunk=chunk, attn_impl="xla", n_layers=1)
        graphdef, state = nnx.split(Decoder(c, mesh=mesh, rngs=nnx.Rngs(0)))
        params = nnx.to_pure_dict(state)
        # Nonzero B everywhere (the same draws for both models).
        rng = np.random.default_rng(5)
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
            if str(p[-1].key).endswith("_b") else x, params)
        trained = lora.trainable_params(params, c.lora)
        (loss, _), grads = jax.jit(jax.value_and_grad(
            lambda t: objective(graphdef, lora.overlay(params, t), batch, mesh),
            has_aux=True))(trained)
        results.append((float(loss), _host(grads)))
    (l0, g0), (l1, g1) = results
    assert abs(l0 - l1) <= 1e-5 * abs(l0)
    for path, a, b in zip(_paths(g0), jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert rel_error(b, a) <= 1e-4, path


@pytest.mark.parametrize("over,match", [
    (["model.lora.rank=-2"], r"model.lora.rank must be 0 \(off\) or positive, got -2"),
    (["model.lora.rank=4", "model.lora.dropout=0.05"],
     r"model.lora.dropout must be 0.0: adapter dropout is not implemented yet, got 0.05"),
    (["model.lora.rank=4", "model.lora.targets=[q,qkv]"], r"model.lora.targets \['q', 'qkv'\]"),
    (["model.lora.rank=4", "model.lora.targets=[]"], r"non-empty list of distinct"),
    (["model.lora.rank=4", "model.lora.alpha=0"], r"model.lora.alpha must be positive, got 0"),
    (["model.lora.rank=4", "model.lora.trainable=[bias]"], r"has \['bias'\]; the groups"),
    (["model.lora.rank=4", "model.lora.trainable=[head]"], r"the head is the embedding"),
    (["model.lora.trainable=[embed]"], r"needs adapters: set model.lora.rank > 0"),
    (["model.lora.rank=4", "model.lora.base_dtype=float16"], r"model.lora.base_dtype must be"),
    (["model.lora.rank=4", "model.lora.trainable=[vision]"], r"names 'vision', but model.fam"),
    (["model.lora=4"], r"must hold keys such as model.lora.<key>"),
    (["model.lora.rnk=4"], r"model.lora.rnk"),
])
def test_config_errors(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(os.path.join(ROOT, "configs", "tiny.yaml"), over)


def test_config_keys_and_scaling():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        "model.lora.rank=16", "model.lora.alpha=32", "model.lora.targets=[q,v]",
        "model.lora.trainable=[embed,norms]", "model.lora.rslora=true"])
    lo = cfg.model.lora
    assert (lo.rank, lo.targets, lo.trainable) == (16, ("q", "v"), ("embed", "norms"))
    assert lora.scaling(lo) == 32 / 4 and lora.scaling(dataclasses.replace(lo, rslora=False)) == 2
    assert load_config(os.path.join(ROOT, "configs", "tiny.yaml")).model.lora.rank == 0
