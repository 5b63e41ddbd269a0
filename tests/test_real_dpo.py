"""DPO on the real SmolLM2-135M-Instruct (test_real_checkpoint.py's converted checkpoint): a
conversational preference store made with its tokenizer and chat template, a LoRA run
(reference: the base with the adapters off) and a full fine-tuning run (reference:
precomputed) at mesh.seq 3 (its 9 / 3 heads, 3 per device), two steps each on both pairs:
step 1 is ln 2 and step 2 lower. The LoRA run's merged export, evaluated with ``--reference``
the converted base over every pair, gives the loss that transformers and TRL's formula give on
the same tokens. (The full run's export is written by the same code; evaluating it too would
cost another minute of this 2-core suite for no other code path.)
"""
import json
import math
import os

import pytest

from tests.test_real_checkpoint import CONVERSATIONS, llvm_optimised, smollm2  # noqa: F401 (fixtures)
from tests.utils.devices import DEVICES, need_devices
from ulysses_jax.evaluate import main as evaluate_main
from ulysses_jax.export import main as export_main

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="the runs use fake CPU devices")
BETA = 0.1
RUNS = {"lora": ["model.lora.rank=8", "model.lora.alpha=16", "optimizer.lr=2e-3"],
        "full": ["optimizer.lr=2e-5", "optimizer.moment_dtype=bfloat16"]}


# (conversation, the conversation whose answer is the rejected one): the two shortest
# conversations, so both pairs fit 42 tokens and each step is cheap on 2 cores.
PAIRS = ((0, 2), (2, 3))
SEQ_LEN = 42


def _pairs(path) -> None:
    """A pair per PAIRS entry: a conversation's prompt, its own last answer (chosen) and
    another conversation's last answer (rejected, off topic)."""
    with open(path, "w") as f:
        for i, j in PAIRS:
            conv = CONVERSATIONS[i]
            f.write(json.dumps({"prompt": conv[:-1], "chosen": [conv[-1]],
                                "rejected": [CONVERSATIONS[j][-1]]}) + "\n")


@pytest.fixture(scope="module")
def runs(smollm2, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """The store, and per run kind (workdir, metrics records, export directory)."""
    from ulysses_jax.config import load_config
    from ulysses_jax.data.prepare import prepare
    from ulysses_jax.training.trainer import train
    need_devices(3)
    out = tmp_path_factory.mktemp("dpo")
    _pairs(out / "pairs.jsonl")
    store = str(out / "store")
    prepare([str(out / "pairs.jsonl")], store, smollm2.path, preference=True, progress=False)
    done = {}
    for name, over in RUNS.items():
        cfg = load_config(None, [
            "objective=dpo", f"dpo.beta={BETA}", f"init_from={smollm2.path}",
            f"data.source={store}", "data.heldout_fraction=0", f"seq_len={SEQ_LEN}",
            f"batch_size={len(PAIRS)}",
            "mesh.seq=3", "steps=2", "log_every=1", "eval_batches=0", "checkpoint_every=2",
            "optimizer.warmup_steps=0", "log_tensorboard=false", *over])
        workdir = str(out / name)
        train(cfg, workdir, progress=False)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        export = None
        if name == "lora":
            export = str(out / f"{name}-export")
            assert export_main([workdir, "--out", export, "--no-progress", "--merge"]) == 0
        done[name] = (workdir, records, export)
    return store, done


def _trl_loss(policy_dir: str, reference_dir: str, store: str) -> float:
    """TRL's sigmoid DPO loss over every pair of ``store``, in transformers (fp32, eager):
    each row's completion log-probability summed, chosen and rejected rows paired."""
    import torch
    import transformers
    from ulysses_jax.data.packing import heldout_store_rows
    rows = heldout_store_rows(store, SEQ_LEN, 1.0)
    batch = rows.rows(range(rows.num_rows))
    logps = {}
    for key, path in (("policy", policy_dir), ("reference", reference_dir)):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(batch["tokens"]).long()).logits
            lp = torch.log_softmax(logits, -1).gather(
                -1, torch.from_numpy(batch["targets"]).long()[..., None])[..., 0]
        logps[key] = (lp * torch.from_numpy(batch["loss_mask"])).sum(-1).reshape(-1, 2)
    ratio = logps["policy"] - logps["reference"]
    delta = ratio[:, 0] - ratio[:, 1]
    return float(-torch.nn.functional.logsigmoid(BETA * delta).mean())


@pytest.mark.parametrize("name", list(RUNS))
def test_real_dpo_trains(runs, name):
    _, done = runs
    workdir, records, _ = done[name]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference
    assert records[1]["loss"] < records[0]["loss"], records
    assert records[1]["rewards/margins"] > 0
    assert os.path.exists(os.path.join(workdir, "reference_logps.npy")) == (name == "full")


def test_lora_export_evaluates_as_trl(smollm2, runs, tmp_path):  # noqa: F811
    store, done = runs
    export = done["lora"][2]
    # (--seq-len 48: the passkey rows need 43 tokens; the pairs' log-probabilities do not
    # depend on the padding after them)
    assert evaluate_main([export, "--data", store, "--heldout-fraction", "1", "--reference",
                          smollm2.path, "--mesh-seq", "3", "--seq-len", "48",
                          "--batch-size", "2", "--batches", "2", "--beta", str(BETA),
                          "--lengths", "48", "--depths", "0.5", "--trials", "1",
                          "--no-generation", "--no-progress", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "eval.json") as f:
        got = json.load(f)["dpo"]
    assert got["pairs"] == len(PAIRS)
    want = _trl_loss(export, smollm2.path, store)
    assert got["loss"] == pytest.approx(want, rel=1e-4), (got, want)
    assert got["loss"] < math.log(2)
