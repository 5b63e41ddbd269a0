"""GRPO's loss, token weights and rewards, against TRL's GRPOTrainer formulas
(the runs: test_grpo_train.py; the real checkpoint: test_real_grpo.py):

- the policy loss (training/objectives/grpo.py) on given completions, computed with
  transformers + peft (test_dpo.py's tiny random Llama with random adapters): token
  log-probabilities, the clipped-ratio loss with the k3 KL term and every token aggregation,
  and the adapter gradients, at mesh.seq 1, 2 and 4 (2 and 4 split the vocabulary too), with
  prompts and completions of different lengths in one batch; the train step's objective
  (token weights from the host, the reference the base with the adapters off, the old
  policy from the batch) for every loss_type at the same meshes, and its entropy metric; the token weights over
  1, 2 and 4 micro-batches;
- rewards and advantages (training/objectives/rewards.py): TRL's group / batch / none
  scaling with skipped (None) rewards, reward functions called with TRL's arguments, the
  built-ins, and the refusals of a function that cannot be loaded, raises or miscounts.
"""

import jax
import numpy as np
import pytest

from tests.test_dpo import V, assert_adapter_grads, llama, peft_policy  # noqa: F401 (llama: fixture)
from ulysses_jax.models import lora
from ulysses_jax.training.objectives.grpo import GRPOLoss, grpo_loss, token_logps

torch = pytest.importorskip("torch", reason="torch is needed for the reference")

S = 32
_jit_grpo_loss = jax.jit(grpo_loss, static_argnums=4)  # one program per loss and shapes


def _trl(logp, old, ref, adv, mask, g: GRPOLoss):
    """TRL's GRPOTrainer._compute_loss on token log-probabilities [B, T] (torch)."""
    coef_1 = torch.exp(logp - old)
    high = g.epsilon if g.epsilon_high is None else g.epsilon_high
    coef_2 = torch.clamp(coef_1, 1 - g.epsilon, 1 + high)
    a = adv[:, None]
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    if g.beta:
        per_token = per_token + g.beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if g.loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if g.loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if g.loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * g.max_completion_length)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)  # dapo, one process


def _rows(rng):
    """Two prompts (3 and 15 tokens) with two completions each (4 to 13 tokens)."""
    rows = {k: np.zeros((4, S), np.float32 if k == "loss_mask" else np.int32)
            for k in ("tokens", "targets", "loss_mask", "segment_ids", "positions")}
    for i, (p, c) in enumerate([(3, 9), (3, 13), (15, 4), (15, 11)]):
        prompt = np.random.default_rng(p).integers(0, V, p)  # shared by its two rows
        seq = np.concatenate([prompt, rng.integers(0, V, c)])
        n = len(seq)
        rows["tokens"][i, :n] = seq
        rows["targets"][i, p - 1:n - 1] = seq[p:]
        rows["loss_mask"][i, p - 1:n - 1] = 1
        rows["segment_ids"][i, :n] = 1
        rows["positions"][i, :n] = np.arange(n)
    return rows


def test_loss_and_gradients_match_trl(llama):  # noqa: F811
    path, wrapped = llama
    rng = np.random.default_rng(0)
    batch = _rows(rng)
    mask = torch.from_numpy(batch["loss_mask"])
    wrapped.zero_grad()
    logits = wrapped(torch.from_numpy(batch["tokens"]).long()).logits.float()
    logp = torch.log_softmax(logits, -1).gather(
        -1, torch.from_numpy(batch["targets"]).long()[..., None])[..., 0] * mask
    # The old and reference policies: the policy's log-probabilities moved by up to 0.4, so
    # ratios fall on both sides of the clip range; advantages of both signs.
    old = (logp.detach() + torch.from_numpy(rng.uniform(-0.4, 0.4, (4, S)).astype(np.float32))
           ) * mask
    ref = (logp.detach() + torch.from_numpy(rng.uniform(-0.4, 0.4, (4, S)).astype(np.float32))
           ) * mask
    adv = torch.from_numpy(np.array([1.2, -0.7, 0.4, -1.1], np.float32))
    g = GRPOLoss(beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type="grpo")
    want = _trl(logp, old, ref, adv, mask, g)
    want.backward()
    want_grads = {k.replace(".default", ""): p.grad.numpy().copy()
                  for k, p in wrapped.named_parameters() if "lora_" in k}
    theirs = {k.replace(".default", ""): p.detach().numpy()
              for k, p in wrapped.named_parameters() if "lora_" in k}
    others = [GRPOLoss(loss_type=t, epsilon_high=0.28, max_completion_length=16)
              for t in ("bnpo", "dr_grpo", "dapo")]
    want_other = [float(_trl(logp.detach(), old, ref, adv, mask, o)) for o in others]
    np_old, np_ref, np_adv = old.numpy(), ref.numpy(), adv.numpy()
    for p in (1, 2, 4):
        mesh, mcfg, graphdef, params, sharded, trained = peft_policy(path, theirs, p, batch)

        @jax.jit
        def run(trained, batch):
            def f(t):
                lp = token_logps(graphdef, lora.overlay(params, t), batch, mesh)
                return grpo_loss(lp, np_old, np_adv, batch["loss_mask"], g, np_ref)
            (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(trained)
            return loss, metrics, grads, token_logps(graphdef, lora.overlay(params, trained),
                                                     batch, mesh)

        loss, metrics, grads, lp = run(trained, sharded)
        np.testing.assert_allclose(np.asarray(lp), logp.detach().numpy(), rtol=1e-5,
                                   atol=1e-5)
        assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want)), (p, loss, want)
        assert_adapter_grads(mcfg, grads, want_grads, p)
        ratio = np.exp(logp.detach().numpy() - np_old)
        clipped = (((ratio < 0.8) & (np_adv[:, None] < 0)) | ((ratio > 1.28) & (np_adv[:, None] > 0)))
        m = batch["loss_mask"]
        assert 0 < float(metrics["clip_ratio"]) < 1
        assert float(metrics["clip_ratio"]) == pytest.approx((clipped * m).sum() / m.sum())
        for o, w in zip(others, want_other):
            got_o, _ = _jit_grpo_loss(np.asarray(lp), np_old, np_adv, batch["loss_mask"], o)
            assert float(got_o) == pytest.approx(w, rel=1e-5), (p, o.loss_type)


def test_the_training_objective_is_trls_loss(llama):  # noqa: F811
    """The train step's objective (grpo.objective: token weights made on the host, the
    reference the LoRA base with the adapters off, the old policy from the batch) gives TRL's
    loss and adapter gradients for every loss_type at mesh.seq 1, 2 and 4, against
    transformers + peft with the adapters disabled as the reference."""
    import dataclasses
    from jax.sharding import NamedSharding
    from ulysses_jax.config import GRPOConfig, load_config
    from ulysses_jax.mesh import act_spec
    from ulysses_jax.training.objectives import grpo
    path, wrapped = llama
    rng = np.random.default_rng(3)
    batch = _rows(rng)
    mask = torch.from_numpy(batch["loss_mask"])
    targets = torch.from_numpy(batch["targets"]).long()[..., None]

    def logps():
        logits = wrapped(torch.from_numpy(batch["tokens"]).long()).logits.float()
        return torch.log_softmax(logits, -1).gather(-1, targets)[..., 0] * mask

    with torch.no_grad(), wrapped.disable_adapter():
        ref = logps()
    with torch.no_grad():  # TRL's entropy metric: the policy's, at the completion tokens
        logits = wrapped(torch.from_numpy(batch["tokens"]).long()).logits.double()
        h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        want_entropy = float((h * mask).sum() / mask.sum())
    old = (logps().detach() + torch.from_numpy(
        rng.uniform(-0.4, 0.4, (4, S)).astype(np.float32))) * mask
    adv = torch.from_numpy(np.array([0.9, -0.9, 1.3, -0.2], np.float32))
    want = {}
    for t in grpo.LOSS_TYPES:
        g = GRPOLoss(beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type=t,
                     max_completion_length=16)
        wrapped.zero_grad()
        loss = _trl(logps(), old, ref, adv, mask, g)
        loss.backward()
        # The advantages' signs differ, so the loss is a difference of terms of size ~1 that
        # float32 log-probabilities give to ~1e-6: its tolerance is 1e-5 of the size of its
        # terms (the loss with |A| in place of A), not of the difference.
        with torch.no_grad():
            size = abs(float(_trl(logps(), old, ref, adv.abs(), mask, g)))
        want[t] = (float(loss.detach()), size,
                   {k.replace(".default", ""): q.grad.numpy().copy()
                    for k, q in wrapped.named_parameters() if "lora_" in k})
    theirs = {k.replace(".default", ""): q.detach().numpy()
              for k, q in wrapped.named_parameters() if "lora_" in k}
    fields = {"advantages": batch["loss_mask"] * adv.numpy()[:, None],
              grpo.OLD_LOGPS: old.numpy()}
    for p in (1, 2, 4):
        mesh, mcfg, graphdef, params, sharded, trained = peft_policy(path, theirs, p, batch)
        cfg = load_config(None, ["objective=grpo", "model.lora.rank=4",
                                 "grpo.max_completion_length=16"])
        cfg = dataclasses.replace(cfg, model=mcfg, grpo=GRPOConfig(
            beta=0.04, epsilon=0.2, epsilon_high=0.28, max_completion_length=16,
            num_iterations=2))
        put = lambda a: jax.device_put(a, NamedSharding(mesh, act_spec(mesh)))  # noqa: E731
        extra = {k: put(v) for k, v in fields.items()}

        @jax.jit
        def run(trained, b):
            f = lambda t: grpo.objective(cfg, graphdef, lora.overlay(params, t), b, mesh)  # noqa: E731
            (_, (loss, metrics)), grads = jax.value_and_grad(f, has_aux=True)(trained)
            return loss, metrics, grads

        for t, (want_loss, size, want_grads) in want.items():
            weights = grpo.token_weights(batch["loss_mask"], dataclasses.replace(
                grpo.settings(cfg), loss_type=t))
            loss, metrics, grads = run(trained, {**sharded, **extra,
                                                 "loss_weights": put(weights)})
            assert abs(float(loss) - want_loss) <= 1e-5 * size, (p, t, float(loss), want_loss)
            assert_adapter_grads(mcfg, grads, want_grads, (p, t))
        m = batch["loss_mask"]
        assert float(metrics["tokens"]) == m.sum()
        k3 = np.exp(ref.numpy() - logps().detach().numpy())
        k3 = k3 - np.log(k3) - 1
        assert float(metrics["kl"]) == pytest.approx((k3 * m).sum() / m.sum(), rel=1e-4)
        assert float(metrics["entropy"]) == pytest.approx(want_entropy, rel=1e-5), p


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_token_weights_are_trls_aggregation_over_micro_batches(loss_type):
    """sum(w l) with grpo.token_weights is TRL's loss of the step: with k micro-batches on
    each of d processes, each micro-batch's loss (TRL's formula) divided by k
    (gradient_accumulation_steps) and averaged over the processes, for dapo each
    micro-batch's sum over the step's tokens (num_items_in_batch / num_processes, summed)."""
    from ulysses_jax.training.objectives.grpo import token_terms, token_weights
    rng = np.random.default_rng(4)
    logp, old = rng.normal(size=(8, 12)) * 0.3, rng.normal(size=(8, 12)) * 0.3
    adv = rng.normal(size=8)
    mask = (rng.random((8, 12)) < 0.6).astype(np.float32)
    mask[3] = 0  # a row without completion tokens
    g = GRPOLoss(loss_type=loss_type, max_completion_length=12)
    terms, _ = token_terms(logp, old, adv[:, None], mask, g)
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    for k, d in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)):
        # d processes (data replicas) of 8 / d consecutive rows, each in k micro-batches of
        # consecutive rows: TRL's loss of each, / k (accumulation), averaged over d (DDP)
        want, n = 0.0, 8 // (k * d)
        for i in range(k * d):
            r = slice(i * n, (i + 1) * n)
            micro = float(_trl(t(logp[r]), t(old[r]), None, t(adv[r]), t(mask[r]), g))
            want += (micro * mask[r].sum() / max(mask.sum(), 1) if loss_type == "dapo"
                     else micro / (k * d))
        got = float(np.sum(token_weights(mask, g, k, d) * np.asarray(terms)))
        assert got == pytest.approx(want, rel=1e-6), (k, d)


def test_dapo_normalises_by_the_global_batch_tokens():
    """A micro-batch of a larger global batch divides by the global token count it is
    given (TRL's num_items_in_batch), so the micro-batches' losses add up to the batch's."""
    rng = np.random.default_rng(1)
    lp, old = rng.normal(size=(4, 8)), rng.normal(size=(4, 8))
    mask = (rng.random((4, 8)) < 0.7).astype(np.float32)
    adv = rng.normal(size=4)
    g = GRPOLoss(loss_type="dapo")
    whole, _ = _jit_grpo_loss(lp, old, adv, mask, g)
    parts = [_jit_grpo_loss(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], g,
                            num_items=mask.sum())[0] for i in (0, 2)]
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-6)
    with pytest.raises(ValueError, match="loss_type must be one of grpo, bnpo, dr_grpo, dapo"):
        grpo_loss(lp, old, adv, mask, GRPOLoss(loss_type="ppo"))


# ---- rewards and advantages (training/objectives/rewards.py) ---------------------------------

def _trl_advantages(per_func, weights, num_generations, scale):
    """TRL's GRPOTrainer "sum_then_normalize" advantages (torch, NaN for a None)."""
    def nanstd(t, dim=None):
        mean = torch.nanmean(t, dim=dim, keepdim=True)
        var = torch.nanmean((t - mean) ** 2, dim=dim)
        count = torch.sum(~torch.isnan(t), dim=dim)
        return torch.sqrt(var * count / (count - 1))
    per_func = torch.tensor(per_func, dtype=torch.float64)
    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * torch.tensor(weights, dtype=torch.float64)[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean = mean.repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0).numpy()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    from ulysses_jax.training.objectives.rewards import advantages
    rng = np.random.default_rng(2)
    per_func = rng.uniform(0, 1, (12, 2))      # 3 prompts x 4 completions, 2 functions
    per_func[1, 0] = np.nan                     # one function skipped a completion
    per_func[5] = np.nan                        # every function skipped one
    got, rewards = advantages(per_func, [1.0, 0.5], 4, scale)
    np.testing.assert_allclose(got, _trl_advantages(per_func, [1.0, 0.5], 4, scale),
                               rtol=1e-12, atol=1e-12)
    assert got[5] == 0.0 and np.isnan(rewards[5]) and rewards[1] == 0.5 * per_func[1, 1]


def columns_reward(prompts, completions, completion_ids, difficulty, **_):
    """A user reward for the test (imported by path): the row's difficulty, None for 0."""
    return [None if d == 0 else float(d) * len(c) for c, d in zip(completions, difficulty)]


def test_reward_functions_are_called_as_trl_calls_them():
    from ulysses_jax.training.objectives import rewards as R
    fn = R.load("tests.test_grpo:columns_reward")
    got = R.score([("columns_reward", fn), ("answer_match", R.load("answer_match"))],
                  ["p", "p"], ["ab", "the answer is \\boxed{\\frac{1}{2}}"], [[1, 2], [3]],
                  {"difficulty": [2, 0], "answer": ["7", "\\frac{1}{2}"]})
    np.testing.assert_array_equal(got, [[4.0, 0.0], [np.nan, 1.0]])
    assert R.final_answer("so 3 apples and 1,250 pears") == "1250"
    assert R.final_answer("no digits") is None
    assert R.answer_match(["It is 42.0", "42", "x"], answer=["42", None, "1"]) == [1.0, None, 0.0]
    assert R.load("soft_overlong", 8)(completion_ids=[[0] * 6, [0] * 7, [0] * 9]) == [
        0.0, -0.5, -1.0]
    for spec, match in (("no_such_module:f", "cannot be imported"),
                        ("answer", "neither a built-in")):
        with pytest.raises(R.RewardError, match=match):
            R.load(spec)
    bad = [("short", lambda **_: [1.0]), ("raises", lambda **_: 1 / 0),
           ("text", lambda **_: ["a", "b"])]
    for (name, fn), match in zip(bad, ("must return one value per completion \\(2\\), got 1",
                                       "raised on the completions of prompt rows 4 to 5",
                                       "returned 'a' for completion 0")):
        with pytest.raises(R.RewardError, match=match):
            R.score([(name, fn)], ["p", "q"], ["a", "b"], [[1], [2]], {}, first_row=4)


def test_packed_rows_hold_every_sequence_as_its_own_segment():
    """pack_rows: 7 sequences of 3 to 9 tokens in rows of 12, first fit in order: fewer
    rows (padded to a multiple of 2), each sequence's tokens, positions and per-token
    fields moved whole into one row, a new segment id for each sequence in a row, nothing
    else non-zero; packed_row_count rounds up to a few sizes and never above the whole."""
    from ulysses_jax.data.row_packing import pack_rows, packed_row_count
    from ulysses_jax.training.grpo import sequence_rows
    rng = np.random.default_rng(0)
    lengths = [(2, 1), (4, 5), (3, 3), (1, 2), (5, 4), (2, 2), (3, 1)]
    prompts = [list(rng.integers(1, 50, p)) for p, _ in lengths]
    completions = [list(rng.integers(1, 50, c)) for _, c in lengths]
    rows = sequence_rows(prompts, completions, 12)
    rows["advantages"] = rows["loss_mask"] * rng.normal(size=(7, 1)).astype(np.float32)
    packed = pack_rows(rows, 2)
    n = packed["tokens"].shape[0]
    assert n == 4 and packed["tokens"].shape[1] == 12       # 3 rows needed, padded to 4
    found = 0
    for r in range(n):
        seg = packed["segment_ids"][r]
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            assert (np.diff(at) == 1).all()                 # one contiguous run
            i = next(i for i in range(7) if len(prompts[i]) + len(completions[i]) == len(at)
                     and (rows["tokens"][i, :len(at)] == packed["tokens"][r, at]).all())
            for k in rows:
                if k != "segment_ids":
                    np.testing.assert_array_equal(packed[k][r, at], rows[k][i, :len(at)], k)
            found += 1
        rest = seg == 0
        assert all((packed[k][r, rest] == 0).all() for k in packed)
    assert found == 7
    assert packed["loss_mask"].sum() == rows["loss_mask"].sum()
    assert [packed_row_count(r, 2, 64) for r in (1, 3, 16, 17, 18, 19, 40)] == \
        [2, 4, 16, 20, 20, 20, 40]
    assert packed_row_count(63, 1, 60) == 60
