"""GRPO on the real SmolLM2-135M-Instruct (test_real_checkpoint.py's converted checkpoint) at
mesh.seq 3 (its 9 / 3 heads, 3 per device), with a user reward function imported by path
beside the built-in answer_match: a text prompt and a chat prompt (the model's chat
template), two sampled completions each. The first step's loss and gradient norm equal what
transformers gives with TRL's formula (dapo) on the completions and advantages that the run
logged in completions.jsonl: the sampler, the rows, the advantages and the loss tie up.
(Measured: grad norm 10.713214 ours in float32, 10.712154 transformers in float64
as published (padding_idx on), 10.713211 with padding_idx off: see below.)
"""
import json

import numpy as np
import pytest

from tests.test_real_checkpoint import llvm_optimised, smollm2  # noqa: F401 (fixtures)
from tests.utils.devices import DEVICES, need_devices

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="the run uses fake CPU devices")
PROMPTS = [{"prompt": "Two plus three is", "answer": "5"},
           {"prompt": [{"role": "user", "content": "Name a color."}], "answer": "red"}]


def letters(completions, **_):
    """A user reward: the share of letters in the completion's text."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


def test_first_step_matches_transformers_and_trl(smollm2, tmp_path):  # noqa: F811
    import torch
    import transformers
    from ulysses_jax.config import load_config
    from ulysses_jax.training.trainer import train
    need_devices(3)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for row in PROMPTS:
            f.write(json.dumps(row) + "\n")
    cfg = load_config(None, [
        "objective=grpo", f"init_from={smollm2.path}", f"data.source={tmp_path}/prompts.jsonl",
        "data.heldout_fraction=0", "seq_len=48", "batch_size=2", "grpo.num_generations=2",
        "grpo.max_completion_length=8", "grpo.loss_type=dapo",
        "grpo.reward_funcs=[answer_match,tests.test_real_grpo:letters]",
        "grpo.reward_weights=[1.0,0.5]", "mesh.seq=3", "steps=1", "log_every=1",
        "eval_batches=0", "checkpoint_every=0", "optimizer.lr=1e-5",
        "optimizer.warmup_steps=0", "log_tensorboard=false"])
    workdir = tmp_path / "run"
    train(cfg, str(workdir), progress=False)
    with open(workdir / "metrics.jsonl") as f:
        record = json.loads(f.readline())
    with open(workdir / "completions.jsonl") as f:
        done = [json.loads(line) for line in f]
    assert len(done) == 4 and {d["step"] for d in done} == {1}
    assert set(done[0]["rewards"]) == {"answer_match", "letters"}
    advantages = np.array([d["advantage"] for d in done])
    assert np.abs(advantages).max() > 0  # the completions were rewarded differently

    # float64: the function's exact gradient. transformers' embedding has padding_idx =
    # pad_token_id (2, <|im_end|>, which the chat prompt holds), whose backward zeroes that
    # row's input-lookup gradient; ours is the function's whole gradient, so the padding
    # row is switched off here (with it on, the embedding's gradient norm differs by 4e-4).
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.path, dtype=torch.float64, attn_implementation="eager")
    model.model.embed_tokens.padding_idx = None
    total, tokens = 0.0, sum(len(d["completion_ids"]) for d in done)
    for d in done:
        ids = torch.tensor([d["prompt_ids"] + d["completion_ids"]])
        logits = model(ids).logits[0, :-1]
        n = len(d["completion_ids"])
        logp = torch.log_softmax(logits[-n:], -1).gather(
            -1, torch.tensor(d["completion_ids"])[:, None])[:, 0]
        ratio = torch.exp(logp - logp.detach())
        total = total + (-ratio * d["advantage"]).sum() / tokens  # dapo: the step's tokens
    total.backward()
    norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()
                                if p.grad is not None)))
    assert record["loss"] == pytest.approx(total.item(), abs=1e-6)
    assert record["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert record["reward"] == pytest.approx(np.mean([d["reward"] for d in done]), abs=1e-9)
    assert record["completions/mean_length"] == pytest.approx(tokens / 4)
