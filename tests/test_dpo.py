"""DPO (objective: dpo): preference stores, the loss against transformers + peft + TRL's
formulas, and training runs.

Exactness: a tiny random Llama written by transformers, wrapped by peft with random nonzero
adapters, is the policy; the reference is the same model with the adapters disabled (what
TRL's DPOTrainer does for a peft model). Each sequence's log-probability is computed in torch
as TRL's concatenated_forward does (log_softmax of the shifted logits, gathered, masked to
the completion, summed), and the losses with TRL's formulas (sigmoid, sigmoid with label
smoothing, hinge, length-normalised IPO). Ours, at mesh.seq 1, 2 and 4 (2 and 4 split the
vocabulary too), must give the same loss (1e-5 relative) and adapter gradients (1e-4), with
prompts of very different lengths in one batch, padded and packed (dpo.packing: sequences
sharing rows as segments).
"""
import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.test_chat import CHATML, write_tokenizer_dir
from tests.utils.devices import need_devices
from ulysses_jax import make_mesh
from ulysses_jax.config import ConfigError, DPOConfig, LoraConfig, load_config
from ulysses_jax.data import prepare as prepare_lib
from ulysses_jax.data.packing import store_rows
from ulysses_jax.data.row_packing import pack_rows
from ulysses_jax.data.store import TokenStore
from ulysses_jax.hf import config_from_hf, load_params, read_config
from ulysses_jax.interop.peft import adapter_tensors, peft_targets, with_adapters
from ulysses_jax.models import lora
from ulysses_jax.models.decoder import Decoder
from ulysses_jax.training.objectives import dpo
from ulysses_jax.training.train_step import batch_shardings

torch = pytest.importorskip("torch", reason="torch is needed for the reference")
transformers = pytest.importorskip("transformers", reason="transformers is needed")
peft = pytest.importorskip("peft", reason="peft gives the adapters-off reference")

V, S = 300, 32


# ---- preference stores ---------------------------------------------------------------------

def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_prepare_text_and_conversational_pairs(tmp_path, capsys):
    tok_dir = write_tokenizer_dir(tmp_path / "tok", CHATML)
    src = _jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "Say hi", "chosen": " hi", "rejected": " the answer is 42"},
        {"prompt": [{"role": "user", "content": "Say hi"}],
         "chosen": [{"role": "assistant", "content": "hi"}],
         "rejected": [{"role": "assistant", "content": "the answer is 42"}]}])
    manifest, built = prepare_lib.prepare([src], str(tmp_path / "store"), tok_dir,
                                          preference=True, progress=False)
    assert built and manifest["kind"] == "preference" and manifest["num_pairs"] == 2
    store = TokenStore(str(tmp_path / "store"))
    from ulysses_jax.data.text import load_tokenizer
    tok = load_tokenizer(tok_dir)
    from tests.test_chat import decode
    for d, (prompt, chosen, rejected) in enumerate([
            ("Say hi", " hi<|im_end|>", " the answer is 42<|im_end|>"),
            ("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n", "hi<|im_end|>",
             "the answer is 42<|im_end|>")]):
        ids, w = store.doc(d), store.doc(d, weights=True)
        # the prompt once, then the chosen and the rejected completion (text pairs end with
        # EOS, which is <|im_end|> here; a chat completion ends with its end-of-turn token)
        assert [decode(tok, ids[w == k]) for k in (0, 1, 2)] == [prompt, chosen, rejected]
        assert list(w) == sorted(w)
    with open(tmp_path / "store" / "names.txt") as f:
        assert f.read().split("\n") == [f"{src}:1", f"{src}:2"]
    # The same records from parquet: the same tokens.
    import pyarrow as pa
    import pyarrow.parquet as pq
    records = [json.loads(line) for line in open(src)]
    pq.write_table(pa.Table.from_pylist(records[:1]), tmp_path / "pairs.parquet")
    prepare_lib.prepare([str(tmp_path / "pairs.parquet")], str(tmp_path / "pq"), tok_dir,
                        preference=True, progress=False)
    assert list(TokenStore(str(tmp_path / "pq")).doc(0)) == list(store.doc(0))
    # Rows: pair i's chosen and rejected sequences at rows 2i, 2i + 1, the completion's
    # tokens as targets.
    rows, _, _ = store_rows(str(tmp_path / "store"), 64, 0.0, 0)
    assert rows.num_rows == 4
    from ulysses_jax.data.__main__ import main as data_main
    data_main(["show", str(tmp_path / "store"), "--seq-len", "64", "--row", "1",
               "--heldout-fraction", "0"])
    shown = capsys.readouterr().out
    pair = int(rows._perm(0, 0)[0])
    assert f"=== pair 0 of epoch 0 ({src}:{pair + 1}): the rejected sequence (row 1)" in shown
    assert "\u27e6" + ["", " "][pair == 0] + "the answer is 42<|im_end|>\u27e7" in shown
    for r in range(4):
        row = rows.row(r)
        pair = int(rows._perm(0, 0)[r // 2])
        ids, w = store.doc(pair), store.doc(pair, weights=True)
        seq = ids[(w == 0) | (w == 1 + r % 2)]
        n = len(seq)
        assert list(row["tokens"][:n]) == list(seq) and not row["segment_ids"][n:].any()
        supervised = row["loss_mask"] > 0
        assert list(row["targets"][supervised]) == list(ids[w == 1 + r % 2])


@pytest.mark.parametrize("record,match", [
    ({"prompt": "a", "chosen": "b"}, r"pairs.jsonl:1: a preference record needs the fields "
                                     r"prompt, chosen, rejected; missing rejected"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"},
     r"pairs.jsonl:1: prompt, chosen and rejected must all be text or all be message lists"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant",
      "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]},
     r"pairs.jsonl:1: a conversational pair \(message lists\) needs a chat template"),
    ({"prompt": "", "chosen": "b", "rejected": "c"}, r"the prompt encodes to no token"),
])
def test_prepare_refuses_bad_records_by_name_or_drops_them(tmp_path, record, match):
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    src = _jsonl(tmp_path / "pairs.jsonl", [record, good])
    with pytest.raises(ValueError, match=match + ".*--drop-bad-pairs"):
        prepare_lib.prepare([src], str(tmp_path / "store"), None, preference=True,
                            progress=False)
    assert not os.path.exists(tmp_path / "store")
    manifest, _ = prepare_lib.prepare([src], str(tmp_path / "store"), None, preference=True,
                                      progress=False, drop_bad=True)
    assert manifest["num_pairs"] == 1 and manifest["dropped"]["pairs"] == 1
    assert re.search(match, manifest["dropped"]["named"][0])
    assert "1 record(s) that are not pairs dropped" in prepare_lib.describe(manifest)


def test_long_pairs_are_refused_by_name_or_dropped(tmp_path):
    src = _jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "p" * 10, "chosen": "c" * 5, "rejected": "r" * 30},
        {"prompt": "p" * 10, "chosen": "c" * 5, "rejected": "r" * 5}])
    prepare_lib.prepare([src], str(tmp_path / "store"), None, preference=True, progress=False)
    with pytest.raises(ValueError, match=r"1 preference pair\(s\) are longer than seq_len 32 "
                                         r".*pairs.jsonl:1 \(41 tokens\).*never truncated"):
        store_rows(str(tmp_path / "store"), 32, 0.0, 0)
    rows, _, notes = store_rows(str(tmp_path / "store"), 32, 0.0, 0, overflow="drop")
    assert rows.num_pairs == 1 and "1 longer than seq_len were dropped" in notes[0]


@pytest.mark.parametrize("over,match", [
    (["objective=dpo", "dpo.reference=base"], "dpo.reference=base .* needs model.lora.rank"),
    (["objective=dpo", "model.lora.rank=4", "model.lora.trainable=[norms]"],
     "model.lora.trainable .* use dpo.reference=precompute"),
    (["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "applies to dpo.loss_type sigmoid"),
    (["dpo.loss_type=kto"], "dpo.loss_type must be one of sigmoid, ipo, hinge"),
    (["dpo.beta=0"], "dpo.beta must be positive"),
    (["objective=ppo"], "objective must be one of sft, dpo"),
])
def test_config_errors(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, over)


# ---- the loss against transformers + peft + TRL's formulas ---------------------------------

def _trl_losses(pi, ref, n, d: DPOConfig):
    """TRL's DPOTrainer losses from [B, 2] torch log-probabilities and completion counts."""
    F = torch.nn.functional
    ratio = pi - ref
    delta = ratio[:, 0] - ratio[:, 1]
    if d.loss_type == "sigmoid":
        return (-(1 - d.label_smoothing) * F.logsigmoid(d.beta * delta)
                - d.label_smoothing * F.logsigmoid(-d.beta * delta)).mean()
    if d.loss_type == "hinge":
        return torch.relu(1 - d.beta * delta).mean()
    avg = ratio / n.clamp(min=1.0)
    return ((avg[:, 0] - avg[:, 1] - 1 / (2 * d.beta)) ** 2).mean()


def _pairs_batch(rng, prompt_lens, completion_lens):
    """Rows [c0, r0, c1, r1, ...]: each a random prompt then a random completion, padded."""
    rows = {k: [] for k in ("tokens", "targets", "loss_mask", "segment_ids", "positions")}
    for p, (lc, lr) in zip(prompt_lens, completion_lens):
        prompt = rng.integers(0, V, p)
        for n in (lc, lr):
            seq = np.concatenate([prompt, rng.integers(0, V, n)])
            tok = np.zeros(S, np.int32)
            tok[:len(seq)] = seq
            tgt, mask = np.zeros(S, np.int32), np.zeros(S, np.float32)
            tgt[p - 1:len(seq) - 1] = seq[p:]
            mask[p - 1:len(seq) - 1] = 1
            rows["tokens"].append(tok)
            rows["targets"].append(tgt)
            rows["loss_mask"].append(mask)
            rows["segment_ids"].append((np.arange(S) < len(seq)).astype(np.int32))
            rows["positions"].append(np.where(np.arange(S) < len(seq), np.arange(S), 0))
    return {k: np.stack(v).astype(np.float32 if k == "loss_mask" else np.int32)
            for k, v in rows.items()}


def _torch_logps(model, batch):
    """TRL's per-sequence sums of completion log-probabilities, [2B] -> [B, 2]."""
    logits = model(torch.from_numpy(batch["tokens"]).long()).logits.float()    # [2B, S, V]
    logp = torch.log_softmax(logits, -1).gather(
        -1, torch.from_numpy(batch["targets"]).long()[..., None])[..., 0]
    mask = torch.from_numpy(batch["loss_mask"])
    return (logp * mask).sum(-1).reshape(-1, 2), mask.sum(-1).reshape(-1, 2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random tiny Llama checkpoint and its peft wrapper with random adapters."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, head_dim=16, tie_word_embeddings=True),
        attn_implementation="eager")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if p.ndim == 1 else 0.08 * noise)
    path = str(tmp_path_factory.mktemp("llama"))
    model.save_pretrained(path, safe_serialization=True)
    ours = LoraConfig(rank=4, alpha=8.0)
    cfg = dataclasses.replace(config_from_hf(read_config(path)), lora=ours)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8.0, lora_dropout=0.0, **peft_targets(cfg))).eval()
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return path, wrapped


def peft_policy(path: str, adapters: dict, p: int, batch: dict):
    """``llama``'s checkpoint with peft's ``adapters`` as our LoRA model on mesh.seq ``p``:
    (mesh, model config, graphdef, params, ``batch`` sharded, the trained adapters)."""
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    base_cfg, base = load_params(path, mesh, attn_impl="xla")
    mcfg = dataclasses.replace(base_cfg, lora=LoraConfig(rank=4, alpha=8.0))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(mcfg, mesh=mesh,
                                                               rngs=nnx.Rngs(0))))
    params = jax.tree.map(jnp.asarray, lora.overlay(
        with_adapters(mcfg, nnx.to_pure_dict(state), adapters), base))
    sh = batch_shardings(mesh)
    sharded = {k: jax.device_put(v, sh[k]) for k, v in batch.items()}
    return mesh, mcfg, graphdef, params, sharded, lora.trainable_params(params, mcfg.lora)


def assert_adapter_grads(mcfg, grads, want: dict, where) -> None:
    """Our adapter gradients ``grads`` (the trained pure dict) are peft's ``want`` (its
    parameter names): the same adapters, each within 1e-4 of its largest entry."""
    got = adapter_tensors(mcfg, grads)
    assert sorted(got) == sorted(want), where
    for k, g in got.items():
        err = np.max(np.abs(g - want[k])) / np.max(np.abs(want[k]))
        assert err <= 1e-4, (where, k, err)


def test_loss_and_gradients_match_trl(llama):
    path, wrapped = llama
    rng = np.random.default_rng(0)
    # prompts of 2 and 20 tokens; completions of 3 to 11
    batch = _pairs_batch(rng, [2, 20], [(9, 3), (11, 4)])
    d = DPOConfig(beta=0.1)
    wrapped.zero_grad()
    pi, n = _torch_logps(wrapped, batch)
    with torch.no_grad(), wrapped.disable_adapter():
        ref, _ = _torch_logps(wrapped, batch)
    want = _trl_losses(pi, ref, n, d)
    want.backward()
    want_grads = {k.replace(".default", ""): p.grad.numpy().copy()
                  for k, p in wrapped.named_parameters() if "lora_" in k}
    theirs = {k.replace(".default", ""): p.detach().numpy()
              for k, p in wrapped.named_parameters() if "lora_" in k}
    # the other formulas on the same log-probabilities
    others = [DPOConfig(beta=0.1, label_smoothing=0.2), DPOConfig(beta=0.5, loss_type="hinge"),
              DPOConfig(beta=0.3, loss_type="ipo")]
    want_other = [float(_trl_losses(pi.detach(), ref, n, o)) for o in others]
    for p in (1, 2, 4):
        mesh, mcfg, graphdef, params, sharded, trained = peft_policy(path, theirs, p, batch)
        cfg = load_config(None, ["objective=dpo", "model.lora.rank=4", "batch_size=2"])
        cfg = dataclasses.replace(cfg, model=mcfg, dpo=d)

        @jax.jit
        def run(trained, batch):
            def f(t):
                return dpo.objective(cfg, graphdef, lora.overlay(params, t), batch, mesh)
            (obj, (loss, metrics)), grads = jax.value_and_grad(f, has_aux=True)(trained)
            logps, counts, _ = dpo.sequence_logps(graphdef, lora.overlay(params, trained),
                                                  batch, mesh)
            ref = dpo.reference_logps(cfg, graphdef, params, batch, mesh)
            # the other formulas on our log-probabilities, in the same program
            got_other = [jnp.mean(dpo.pair_losses(logps, ref, counts, o)[0]) for o in others]
            return loss, metrics, grads, logps, ref, got_other

        loss, metrics, grads, logps, ref_ours, got_other = run(trained, sharded)
        assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want)), (p, loss, want)
        assert_adapter_grads(mcfg, grads, want_grads, p)
        np.testing.assert_allclose(np.asarray(logps).reshape(-1, 2), pi.detach().numpy(),
                                   rtol=1e-5)
        np.testing.assert_allclose(np.asarray(ref_ours).reshape(-1, 2), ref.numpy(), rtol=1e-5)
        rewards = 0.1 * (pi.detach() - ref).numpy()
        assert float(metrics["rewards/margins"]) == pytest.approx(
            float(np.mean(rewards[:, 0] - rewards[:, 1])), rel=1e-4, abs=1e-6)
        assert float(metrics["rewards/accuracies"]) == np.mean(rewards[:, 0] > rewards[:, 1])
        for o, w, got_o in zip(others, want_other, got_other):
            assert float(got_o) == pytest.approx(w, rel=1e-5), (p, o)
        # Packed (dpo.packing): the 4 sequences (11, 5, 31, 24 tokens) fill 3 rows of 32, the
        # first two in one row; with the base reference and with TRL's reference values
        # recorded (precompute): the same loss, gradients, log-probabilities and metrics.
        packed = pack_rows(batch, 1, sequence_ids=True)
        assert packed["tokens"].shape == (3, S) and packed["segment_ids"][0].max() == 2
        packed = {k: jax.device_put(v, batch_shardings(mesh)["tokens"]) for k, v in
                  packed.items()}
        packed["ref_logps"] = jax.device_put(ref.numpy().reshape(-1),
                                             NamedSharding(mesh, P("data")))
        precomputed = dataclasses.replace(cfg, dpo=dataclasses.replace(d, reference="precompute"))

        @jax.jit
        def run_packed(trained, batch):
            out = [jax.value_and_grad(lambda t, c=c: dpo.objective(
                c, graphdef, lora.overlay(params, t), batch, mesh), has_aux=True)(trained)
                for c in (cfg, precomputed)]
            logps, counts, _ = dpo.sequence_logps(graphdef, lora.overlay(params, trained),
                                                  batch, mesh, 4)
            return [(loss, m, g) for (_, (loss, m)), g in out], logps, counts

        results, logps_p, counts_p = run_packed(trained, packed)
        np.testing.assert_allclose(np.asarray(logps_p).reshape(-1, 2), pi.detach().numpy(),
                                   rtol=1e-5)
        assert (np.asarray(counts_p).reshape(-1, 2) == n.numpy()).all()
        for name, (loss_p, metrics_p, grads_p) in zip(("base", "precompute"), results):
            assert abs(float(loss_p) - float(want)) <= 1e-5 * abs(float(want)), (p, name)
            assert_adapter_grads(mcfg, grads_p, want_grads, (p, name))
            for k in dpo.METRICS:
                assert float(metrics_p[k]) == pytest.approx(float(metrics[k]), rel=1e-5,
                                                            abs=1e-6), (p, name, k)


def test_packing_fills_the_rows_first_fit_gives_in_each_micro_batch():
    """dpo.packing with 2 micro-batches on 2 data replicas: accumulate.py's split of the 16
    rows of 8 pairs gives micro-batch 0 pairs 0, 1, 4, 5 and micro-batch 1 pairs 2, 3, 6, 7;
    each micro-batch's sequences (114 and 101 tokens) go first fit in order into 4 rows of
    32 (the rows their tokens fill, worked out by hand), so the batch has 8 rows, not 16.
    Split again by accumulate.micro_batches, each micro-batch's rows hold exactly its
    sequences, whole, from position 0, numbered in its order as its ``ref_logps`` are; the
    segment bound counts those rows' segments; and dpo.packing=false keeps one sequence per
    row."""
    from ulysses_jax.data.row_packing import SEQUENCE_IDS, packed_segments
    from ulysses_jax.training.accumulate import micro_batches
    rng = np.random.default_rng(1)
    prompts = [2, 20, 3, 5, 9, 4, 1, 6]
    completions = [(9, 3), (11, 4), (5, 5), (10, 3), (7, 2), (4, 4), (2, 30), (6, 10)]
    rows = _pairs_batch(rng, prompts, completions)               # 16 rows of S = 32
    rows["ref_logps"] = -np.arange(1, 17, dtype=np.float32)      # a value per sequence
    lengths = rows["segment_ids"].sum(1)
    over = ["objective=dpo", f"seq_len={S}", "batch_size=8", "grad_accum_steps=2",
            "mesh.data=2", "mesh.seq=1", "dpo.reference=precompute"]
    cfg = load_config(None, over)
    mesh = make_mesh(seq=1, data=2, devices=need_devices(2))
    sharded = dpo.shard_pairs(cfg, mesh, rows, micro=2)
    assert sharded["tokens"].shape == (8, S) and sharded["ref_logps"].shape == (16,)
    split = {k: np.asarray(v) for k, v in micro_batches(
        sharded, 2, mesh, batch_shardings(mesh, cfg)).items()}
    checked = 0
    for m, pairs in enumerate(([0, 1, 4, 5], [2, 3, 6, 7])):
        members = [2 * p + w for p in pairs for w in (0, 1)]
        assert sum(lengths[members]) == (114, 101)[m]
        ids = split[SEQUENCE_IDS][m]                             # [4 rows, S]
        assert ids.shape == (4, S) and (ids > 0).any(1).all()    # every row used
        for i, g in enumerate(members, 1):
            r, at = np.nonzero(ids == i)
            assert len(set(r)) == 1 and list(at) == list(range(at[0], at[0] + lengths[g]))
            for k in ("tokens", "targets", "loss_mask"):
                assert (split[k][m][r, at] == rows[k][g, :lengths[g]]).all(), (m, i, k)
            assert (split["positions"][m][r, at] == np.arange(lengths[g])).all()
            assert split["ref_logps"][m][i - 1] == rows["ref_logps"][g]
            checked += 1
        assert (split["segment_ids"][m] > 0).sum() == sum(lengths[members])
    assert checked == 16
    # the attention's segment bound reads the same rows: each one's segments, + 1 if padded
    seg = np.asarray(sharded["segment_ids"])
    fill = (seg > 0).sum(1)
    assert sorted(packed_segments(lengths, S, 16, 2, 2)) == sorted(seg.max(1) + (fill < S))
    padded = dpo.shard_pairs(load_config(None, over + ["dpo.packing=false"]), mesh, rows,
                             micro=2)
    assert SEQUENCE_IDS not in padded and padded["tokens"].shape == (16, S)
    for k in ("tokens", "segment_ids", "positions", "ref_logps"):
        assert (np.asarray(padded[k]) == rows[k]).all(), k
    assert [f.name for f in dpo.DPO(cfg).fields()] == ["ref_logps", SEQUENCE_IDS]


# ---- training --------------------------------------------------------------------------------

TRAIN = ["objective=dpo", "seq_len=64", "batch_size=4", "steps=4", "log_every=1",
         "eval_every=2", "eval_batches=1", "model.vocab_size=257", "model.d_model=32",
         "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8",
         "model.ffn_dim=64", "model.loss_chunk=8", "optimizer.warmup_steps=0",
         "optimizer.lr=0.003", "optimizer.schedule_steps=4", "log_tensorboard=false",
         "checkpoint_every=0"]


@pytest.fixture(scope="module")
def pair_store(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "the", "cat", "dog", "runs", "sleeps"]
    records = []
    for _ in range(40):
        prompt = " ".join(rng.choice(words, rng.integers(1, 8)))
        records.append({"prompt": prompt,
                        "chosen": " " + " ".join(rng.choice(words[:3], rng.integers(1, 3))),
                        "rejected": " " + " ".join(rng.choice(words[3:], rng.integers(1, 3)))})
    tmp = tmp_path_factory.mktemp("pairs")
    src = _jsonl(tmp / "pairs.jsonl", records)
    prepare_lib.prepare([src], str(tmp / "store"), None, preference=True, progress=False)
    return str(tmp / "store")


def _run(store, workdir, *over):
    from ulysses_jax.training.trainer import train
    cfg = load_config(None, TRAIN + [f"data.source={store}", "data.heldout_fraction=0.1",
                                     *over])
    train(cfg, str(workdir), progress=False)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def seq1(pair_store, tmp_path_factory):
    """A full fine-tuning DPO run at mesh.seq 1 (dpo.reference=precompute): (workdir,
    metrics records)."""
    workdir = tmp_path_factory.mktemp("seq1")
    return workdir, _run(pair_store, workdir, "mesh.seq=1")


def test_full_fine_tuning_with_a_precomputed_reference(pair_store, seq1, tmp_path):
    """Step 1 is ln 2 (policy = reference); the curve at mesh.seq 4 (padded) and with two
    data replicas x 2 sequence devices and 2 accumulated micro-batches (packed and padded)
    equals mesh.seq 1's (packed)."""
    workdir, one = seq1
    assert one[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert one[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert one[-1]["loss"] < 0.6  # falls from ln 2 in 4 steps
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
            "logps/rejected", "eval_rewards/accuracies"} <= set(one[-1])
    assert os.path.exists(workdir / "reference_logps.npy")
    accum = ["mesh.seq=2", "mesh.data=2", "grad_accum_steps=2"]
    runs = {}
    for name, over in (("seq4_padded", ["mesh.seq=4", "dpo.packing=false"]),
                       ("data2_accum2", accum),
                       ("data2_accum2_padded", accum + ["dpo.packing=false"])):
        runs[name] = other = _run(pair_store, tmp_path / name, *over)
        for a, b in zip(one, other):
            assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=1e-6), (name, a, b)
            if "eval_loss" in a:
                assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=2e-5), name
    # Packed (the default) and padded (dpo.packing=false) at the same mesh and micro-batches:
    # the same losses and gradient norms. Packed steps read the rows the pairs fill: on one
    # device fewer than 2 per pair over the run (here each micro-batch's 3 or 4 rows round
    # up to the 2 replicas' 4).
    checked = 0
    for a, b in zip(runs["data2_accum2"], runs["data2_accum2_padded"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
        checked += 1
    assert checked == 4
    assert [r["step_tokens"] for r in runs["seq4_padded"]] == [2 * 4 * 64] * 4
    assert all(r["step_tokens"] % 64 == 0 for r in one)
    assert sum(r["step_tokens"] for r in one) < 4 * 2 * 4 * 64


@pytest.mark.parametrize("over", [
    # hybrid Ulysses x Ring (zigzag token order, also in the reference pass)
    ["mesh.ring=2", "mesh.seq=2"],
    # ZeRO-3, full remat with the layer checkpoints and the optimizer in host memory
    ["mesh.seq=2", "param_sharding=zero3", "model.remat=full", "model.offload_checkpoints=true",
     "optimizer.offload=true"],
], ids=["ring", "zero3_offload"])
def test_other_meshes_and_memory_options_train_the_same(pair_store, seq1, tmp_path, over):
    _, one = seq1
    other = _run(pair_store, tmp_path, *over)
    for a, b in zip(one, other):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=1e-6), (over, a, b)


def test_moe_model_adds_its_router_loss(pair_store, tmp_path):
    """Experts split over the sequence devices: step 1 is still ln 2 (the reported loss is
    the DPO loss), the router loss is reported beside it, and the loss falls."""
    run = _run(pair_store, tmp_path, "mesh.seq=2", "model.num_experts=4",
               "model.num_experts_per_tok=2", "model.moe_ffn_dim=32",
               "model.router_aux_loss_coef=0.01")
    assert run[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert run[0]["moe_aux_loss"] > 0 and len(run[0]["moe_load"]) == 4
    assert run[-1]["loss"] < run[0]["loss"]


def test_qwen3_next_trains_the_same_on_one_and_two_devices(pair_store, tmp_path):
    """Qwen3-Next (a Gated DeltaNet layer, an attention layer, experts): step 1 is ln 2, and
    mesh.seq 2 (DeltaNet heads and experts split over the devices) gives mesh.seq 1's curve."""
    from ulysses_jax.training.trainer import train
    preset = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "configs", "tiny-qwen3-next.yaml")
    runs = []
    for seq in (1, 2):
        cfg = load_config(preset, [
            "objective=dpo", "seq_len=64", "batch_size=4", "steps=2", "log_every=1",
            "eval_batches=0", "checkpoint_every=0", "log_tensorboard=false",
            "optimizer.warmup_steps=0", "model.n_layers=2", "model.mixer_pattern=DA",
            "model.d_model=32", "model.moe_ffn_dim=16", "model.moe_shared_ffn_dim=16",
            "model.loss_chunk=8", f"data.source={pair_store}", "data.heldout_fraction=0.1",
            f"mesh.seq={seq}", "mesh.data=1"])
        train(cfg, str(tmp_path / f"seq{seq}"), progress=False)
        with open(tmp_path / f"seq{seq}" / "metrics.jsonl") as f:
            runs.append([json.loads(line) for line in f])
    one, two = runs
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    assert one[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert one[1]["loss"] < one[0]["loss"]
    for a, b in zip(one, two):
        for key in ("loss", "rewards/margins", "moe_aux_loss"):
            assert b[key] == pytest.approx(a[key], rel=2e-5, abs=1e-6), (key, a, b)


def test_two_processes_train_as_one(pair_store, seq1, tmp_path):
    """train.py in 2 processes x 2 CPU devices (gloo; mesh.data 2 x mesh.seq 2, a data
    replica per process): the reference pass over the store and the curve of the
    one-device run."""
    import socket
    import subprocess
    import sys
    from tests.utils.devices import cli_env
    from ulysses_jax.training.checkpoint import Checkpointer
    _, one = seq1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = cli_env(devices=2)
    procs = [subprocess.Popen(
        [sys.executable, "train.py", "--workdir", str(tmp_path / "two"), "--no-progress",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         *TRAIN, f"data.source={pair_store}", "data.heldout_fraction=0.1", "mesh.seq=2",
         "mesh.data=2", "checkpoint_every=4"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    with open(tmp_path / "two" / "metrics.jsonl") as f:
        two = [json.loads(line) for line in f]
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=1e-6), (a, b)
        if "eval_loss" in a:
            assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=2e-5)
    assert os.path.exists(tmp_path / "two" / "reference_logps.npy")
    assert Checkpointer(str(tmp_path / "two" / "checkpoints")).latest_step() == 4


def test_resume_reads_the_recorded_reference_and_continues_exactly(pair_store, seq1,
                                                                    tmp_path, capsys):
    _, one = seq1
    first = _run(pair_store, tmp_path, "mesh.seq=1", "steps=2")
    assert "reference log-probabilities of" in capsys.readouterr().out
    both = _run(pair_store, tmp_path, "mesh.seq=1")
    assert "read from" in capsys.readouterr().out
    assert [r["loss"] for r in both] == [r["loss"] for r in first + both[2:]]
    for a, b in zip(one, both):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), (a, b)
    # A run that has trained cannot make its reference again: a missing record is refused.
    os.remove(tmp_path / "reference_logps.npy")
    with pytest.raises(ConfigError, match="resumes at step 4, but .* can only be computed "
                                          "from the step-0 model"):
        _run(pair_store, tmp_path, "mesh.seq=1", "steps=6")


def test_evaluate_gives_the_held_out_dpo_loss(seq1, tmp_path):
    """python -m ulysses_jax.evaluate on the run (its recorded reference, its held-out
    pairs) at mesh.seq 3 and seq_len 128 (the run's 64 is below the passkey's shortest
    prompt; padded inside to 129) gives the trainer's last held-out loss. Both read the same
    held-out pairs: the first batch of 4 in the split's order (how many pairs the split holds
    depends on the records' names, which hold the temporary path)."""
    from ulysses_jax.evaluate import main
    workdir, one = seq1
    assert main([str(workdir), "--mesh-seq", "3", "--seq-len", "128", "--out", str(tmp_path),
                 "--batches", "1", "--batch-size", "4", "--no-generation", "--no-progress",
                 "--trials", "1", "--depths", "0.5", "--lengths", "120"]) == 0
    with open(tmp_path / "eval.json") as f:
        got = json.load(f)["dpo"]
    assert got["pairs"] == one[-1]["eval_pairs"]
    assert got["loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)
    assert got["rewards/accuracies"] == pytest.approx(one[-1]["eval_rewards/accuracies"])


def test_lora_run_uses_the_base_as_reference(pair_store, tmp_path):
    run = _run(pair_store, tmp_path / "lora", "mesh.seq=2", "model.lora.rank=4",
               "model.lora.alpha=8", "optimizer.lr=0.01")
    assert run[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert run[-1]["loss"] < run[0]["loss"]
    assert not os.path.exists(tmp_path / "lora" / "reference_logps.npy")
