"""GRPO runs (objective: grpo; training/grpo.py): sampling with the generator, rewards,
the batches, the loop, resume and bad input, on a tiny model and the retrieval task of
configs/tiny-grpo.yaml.

- mesh.seq=1, mesh.seq=4 and mesh.seq=2 with 2 accumulated micro-batches sample the same
  completions and log the same first steps (2 data x 2 seq: the same completions and
  warm-up step) (a warm-up step, then a generation batch of
  num_iterations=2 updates), and a run stopped in the middle of a generation batch resumes
  to the same completions and numbers as the uninterrupted one;
- packing the sequences into rows changes the rows, not the numbers; full fine-tuning with a
  KL term keeps the initial weights as its reference, also across a resume; two processes
  train as one;
- bad input is refused before anything is compiled (an unimportable reward function, a
  prompt too long for seq_len - max_completion_length, num_generations 1, answer_match
  without answers, a warm-up without reference completions), and a reward
  function that raises mid-run stops the run with the rows named and its checkpoint kept.
"""
import json
import os
import sys

import numpy as np
import pytest

from tests.utils.devices import need_devices
from ulysses_jax.config import ConfigError, load_config
from ulysses_jax.training.grpo import COMPLETIONS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
from make_retrieval import rows as retrieval_rows  # noqa: E402

TINY = ["objective=grpo", "grpo.loss_type=bnpo", "seq_len=64",
        "grpo.reward_funcs=[answer_match,tests.test_grpo_train:varied]", "batch_size=2", "grpo.num_generations=4",
        "grpo.max_completion_length=4", "grpo.sft_warmup_steps=1", "grpo.num_iterations=2",
        "log_every=1", "eval_every=0", "eval_batches=1", "checkpoint_every=1",
        "model.vocab_size=257", "model.d_model=64", "model.n_layers=1", "model.n_heads=4",
        "model.n_kv_heads=2", "model.head_dim=16", "model.ffn_dim=128",
        "model.dtype=float32", "model.loss_chunk=16", "optimizer.lr=0.001",
        "optimizer.warmup_steps=0", "optimizer.schedule_steps=5", "log_tensorboard=false"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "retrieval.jsonl"
    with open(path, "w") as f:
        for row in retrieval_rows(24, seed=1):  # prompts of 30 to 50 bytes
            f.write(json.dumps(row) + "\n")
    return str(path)


def varied(completion_ids, **_):
    """A reward that differs between completions (a tiny random model never answers right):
    the advantages, the loss and the gradients of the GRPO steps are not zero."""
    return [(sum(ids) % 7) / 7 for ids in completion_ids]


def _run(prompts, workdir, *over):
    from ulysses_jax.training.trainer import train
    cfg = load_config(None, TINY + [f"data.source={prompts}", "data.heldout_fraction=0.2",
                                    *over])
    summary = train(cfg, str(workdir), progress=False)
    return summary, _lines(workdir, "metrics.jsonl"), _lines(workdir, "completions.jsonl")


def _lines(workdir, name):
    with open(os.path.join(workdir, name)) as f:
        return [json.loads(line) for line in f]


def test_every_mesh_samples_the_same_and_a_resume_continues_the_batch(prompts, tmp_path):
    need_devices(4)
    _, one, done_one = _run(prompts, tmp_path / "seq1", "mesh.seq=1", "steps=5",
                            "eval_every=5")
    assert [r["phase"] for r in one] == ["sft_warmup"] + ["grpo"] * 4
    assert len(done_one) == 2 * 2 * 4  # two generation batches of 2 prompts x 4
    assert [r["step"] for r in done_one] == [2] * 8 + [4] * 8
    first = done_one[0]
    assert set(first) >= {"step", "prompt_ids", "completion_ids", "completion", "rewards",
                          "reward", "advantage", "finish_reason"}
    assert set(first["rewards"]) == {"answer_match", "varied"}
    assert all(r["grad_norm"] > 0 for r in one)
    assert {"reward", "reward_std", "rewards/varied/mean", "completions/mean_length",
            "completions/clipped_ratio", "clip_ratio", "nll", "entropy",
            "sampling_s"} <= set(one[1])
    assert "eval_reward" in one[-1]
    # The first update of a generation batch has ratio 1 by construction (nothing clipped).
    assert one[1]["clip_ratio"] == 0.0
    # mesh.seq=4: the same completions of the first generation batch, the same first steps.
    # (Later batches are sampled after updates that differ by float rounding between the
    # meshes, and a sampled token can then flip where two cumulative probabilities meet.)
    # And mesh.seq=2 with the 8 sequences in 2 accumulated micro-batches, and a hybrid mesh
    # (ring 2 x seq 2: ring attention in training, the generator's Ulysses over its 4
    # devices): the same steps.
    for name, over in (("seq4", ["mesh.seq=4"]),
                       ("accum2", ["mesh.seq=2", "grad_accum_steps=2"]),
                       ("hybrid", ["mesh.ring=2", "mesh.seq=2"])):
        _, four, done_four = _run(prompts, tmp_path / name, *over, "steps=3")
        assert [r["completion_ids"] for r in done_four] == [r["completion_ids"]
                                                            for r in done_one[:8]], name
        assert [r["advantage"] for r in done_four] == pytest.approx(
            [r["advantage"] for r in done_one[:8]], abs=1e-6)
        for a, b in zip(one[:3], four):
            for key in ("loss", "grad_norm", "nll", "entropy", "clip_ratio"):
                assert b[key] == pytest.approx(a[key], rel=2e-4, abs=1e-6), (name, key,
                                                                             a["step"])
    # Two data replicas x 2 sequence devices (each replica samples half the completions): the
    # same warm-up step and completions; bnpo's loss is each replica's own (TRL's DDP), so
    # the GRPO steps' numbers are those of 2 processes, not compared.
    _, data2, done_data2 = _run(prompts, tmp_path / "data2", "mesh.seq=2", "mesh.data=2",
                                "steps=2")
    assert [r["completion_ids"] for r in done_data2] == [r["completion_ids"]
                                                         for r in done_one[:8]]
    for key in ("loss", "grad_norm"):
        assert data2[0][key] == pytest.approx(one[0][key], rel=2e-4), key
    assert data2[1]["reward"] == pytest.approx(one[1]["reward"]) and data2[1]["grad_norm"] > 0
    # Stopped after step 2, in the middle of a generation batch, then resumed: the same run.
    _run(prompts, tmp_path / "resumed", "mesh.seq=1", "steps=2")
    with np.load(tmp_path / "resumed" / "grpo_batch_2.npz") as kept:  # the old policy's
        mask = kept["loss_mask"] > 0
        assert np.isfinite(kept["old_logps"][mask]).all() and (kept["old_logps"][mask] < 0).all()
    _, again, done_again = _run(prompts, tmp_path / "resumed", "mesh.seq=1", "steps=5",
                                "eval_every=5")
    assert done_again == done_one
    assert len(again) == 5
    for a, b in zip(one, again):
        for key in ("loss", "grad_norm", "nll", "clip_ratio", "reward"):
            if a.get(key) is None:
                assert b.get(key) is None, (key, a["step"])
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (key, a["step"])


def failing_reward(completions, **_):
    raise RuntimeError("the grader is down")


def test_bad_input_is_refused_and_a_failing_reward_keeps_the_checkpoint(prompts, tmp_path):
    from ulysses_jax.training.run_dir import RunError
    from ulysses_jax.training.trainer import train
    with pytest.raises(ConfigError, match="num_generations must be at least 2"):
        load_config(None, TINY + ["grpo.num_generations=1"])
    cases = (("grpo.reward_funcs=[no_such_module:f]", "cannot be imported"),
             ("seq_len=32", "more than seq_len - grpo.max_completion_length = 28"))
    unanswered = tmp_path / "unanswered.jsonl"
    unanswered.write_text('{"prompt": "say a word"}\n{"prompt": "say two words"}\n')
    cases += (
        (f"data.source={unanswered}", 'answer_match, but no prompt row has an "answer"'),
        (f"data.source={unanswered} grpo.reward_funcs=[soft_overlong]",
         r'unanswered.jsonl:\d has neither "completion" nor "answer"'))
    for over, match in cases:
        cfg = load_config(None, TINY + [f"data.source={prompts}", *over.split()])
        with pytest.raises(ConfigError, match=match):
            train(cfg, str(tmp_path / "refused"), progress=False)
        assert not os.path.exists(tmp_path / "refused" / "checkpoints" / "1")
    with pytest.raises(RunError, match=r"step 2: reward function failing_reward raised .*"
                                       r"RuntimeError: the grader is down \(the prompts: "
                                       r".*retrieval.jsonl:\d+.*checkpoint of step 1 is kept"):
        _run(prompts, tmp_path / "fails", "mesh.seq=2", "steps=3",
             "grpo.reward_funcs=[tests.test_grpo_train:failing_reward]")


def test_packing_changes_the_rows_not_the_numbers(prompts, tmp_path):
    """grpo.packing (the default) against one sequence per row, with rows of 128 tokens
    (two or three 35-55 token sequences each), 2 accumulated micro-batches, the per-sequence
    mean (loss_type grpo) and old log-probabilities: the same completions, losses,
    gradient norms and metrics (token means over the whole step, whichever rows share a
    micro-batch), from fewer rows."""
    need_devices(2)
    over = ["mesh.seq=2", "seq_len=128", "grad_accum_steps=2", "grpo.loss_type=grpo",
            "steps=3"]
    _, packed, done = _run(prompts, tmp_path / "packed", *over)
    _, plain, plain_done = _run(prompts, tmp_path / "plain", *over, "grpo.packing=false")
    assert [r["completion_ids"] for r in done] == [r["completion_ids"] for r in plain_done]
    for a, b in zip(packed, plain, strict=True):
        assert a["step_tokens"] < b["step_tokens"] == 8 * 128, (a["step_tokens"], a["step"])
        # (A batch's first update has ratio 1 and advantages of mean 0 in each group: a loss
        # of 0 up to float rounding of its O(1) terms, hence the absolute 1e-7.)
        for key in ("loss", "grad_norm", "nll", "entropy", "clip_ratio"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a["step"])


def test_full_fine_tuning_with_a_kl_term_keeps_the_initial_weights_as_reference(prompts,
                                                                               tmp_path):
    """grpo.beta > 0 without LoRA: the reference is a frozen copy of the initial weights. The
    warm-up step's KL is 0 (the policy is still the reference), the GRPO steps' is positive
    (the warm-up moved the policy), and a run stopped after step 2 makes the reference again
    on resume: its step 3 is the uninterrupted run's (the loss holds beta x KL)."""
    need_devices(2)
    over = ["mesh.seq=2", "grpo.beta=0.5", "grpo.num_iterations=1"]
    _, records, _ = _run(prompts, tmp_path / "whole", *over, "steps=3")
    assert [r["phase"] for r in records] == ["sft_warmup", "grpo", "grpo"]
    assert abs(records[0]["kl"]) < 1e-7, records[0]
    assert all(0 < r["kl"] < 10 for r in records[1:]), records
    _run(prompts, tmp_path / "resumed", *over, "steps=2")
    _, again, _ = _run(prompts, tmp_path / "resumed", *over, "steps=3")
    for key in ("loss", "grad_norm", "kl", "reward"):
        assert again[-1][key] == pytest.approx(records[-1][key], rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("over", [
    ["model.lora.rank=4", "model.lora.alpha=8", "grpo.beta=0.04", "param_sharding=zero3"],
    ["model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_ffn_dim=32"],
    ["optimizer.offload=true", "grpo.num_iterations=2"],
    ["model.family=qwen3_next", "model.n_layers=2", "model.mixer_pattern=DA",
     "model.linear_key_heads=2", "model.linear_value_heads=4", "model.linear_key_dim=8",
     "model.linear_value_dim=8", "model.partial_rotary_factor=0.25", "model.qk_norm=true"]],
    ids=["lora_kl_zero3", "moe", "offload", "qwen3_next"])
def test_lora_with_a_kl_term_zero3_and_experts_train(prompts, tmp_path, over):
    """LoRA with the KL to the base (adapters off) on ZeRO-3 parameters (the sampler gathers
    them), an MoE model (its router loss beside; the sampler's tokens stay replicated
    however the experts split the head's input), and the parameters in host memory
    (optimizer.offload: the sampler and the old policy's pass read them from there), and
    Qwen3-Next (the sampler keeps its DeltaNet states)."""
    need_devices(2)
    summary, records, done = _run(prompts, tmp_path, "mesh.seq=2", "steps=3",
                                  "grpo.num_iterations=1", *over)
    generation_batches = 1 if "grpo.num_iterations=2" in over else 2  # steps 2 and 3
    assert summary["status"] == "done" and len(done) == generation_batches * 2 * 4
    grpo_steps = [r for r in records if r["phase"] == "grpo"]
    assert len(grpo_steps) == 2 and all(r["grad_norm"] > 0 for r in grpo_steps)
    if "optimizer.offload=true" in over:  # the same run with the parameters on the device
        _, plain, plain_done = _run(prompts, tmp_path / "plain", "mesh.seq=2", "steps=3",
                                    "grpo.num_iterations=2")
        assert [r["completion_ids"] for r in done] == [r["completion_ids"] for r in plain_done]
        for a, b in zip(records, plain):
            for key in ("loss", "grad_norm", "clip_ratio", "entropy"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (key, a["step"])
    elif "grpo.beta=0.04" in over:
        # the warm-up step trained the adapters away from the base: a positive KL
        assert all(0 < r["kl"] < 10 for r in grpo_steps)
    elif "model.num_experts=4" in over:
        assert all("moe_aux_loss" in r for r in grpo_steps)


def test_two_processes_train_as_one(prompts, tmp_path, monkeypatch):
    """train.py in 2 processes x 2 CPU devices (gloo; mesh.data 2 x mesh.seq 2, a data
    replica per process, each sampling its half of the completions) against one process on
    the same 2 x 2 mesh: the same completions, rewards, losses and gradient norms (a warm-up
    step, then a GRPO step), completions.jsonl written once, the checkpoint of step 2."""
    import socket
    import subprocess
    from tests.utils.devices import cli_env
    from ulysses_jax.training.checkpoint import Checkpointer
    need_devices(4)
    (tmp_path / "two_rewards.py").write_text(
        "def varied(completion_ids, **_):\n"
        "    return [(sum(ids) % 7) / 7 for ids in completion_ids]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    over = ["mesh.seq=2", "mesh.data=2", "steps=2", "grpo.num_iterations=1",
            "grpo.reward_funcs=[answer_match,two_rewards:varied]"]
    _, one, done_one = _run(prompts, tmp_path / "one", *over)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = cli_env(devices=2, PYTHONPATH=os.pathsep.join([str(tmp_path), root]))
    args = [a for a in TINY if not a.startswith("grpo.reward_funcs=")]
    procs = [subprocess.Popen(
        [sys.executable, "train.py", "--workdir", str(tmp_path / "two"), "--no-progress",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         *args, f"data.source={prompts}", "data.heldout_fraction=0.2", *over],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[-3000:] for o in outs]
    two, done_two = _lines(tmp_path / "two", "metrics.jsonl"), _lines(tmp_path / "two",
                                                                       COMPLETIONS)
    assert [r["completion_ids"] for r in done_two] == [r["completion_ids"] for r in done_one]
    assert [r["reward"] for r in done_two] == [r["reward"] for r in done_one]
    assert [r["phase"] for r in two] == [r["phase"] for r in one] == ["sft_warmup", "grpo"]
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "reward"):
            if a.get(key) is None:
                assert b.get(key) is None, key
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a["step"])
    assert Checkpointer(str(tmp_path / "two" / "checkpoints")).latest_step() == 2
