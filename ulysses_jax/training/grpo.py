"""The batches of a GRPO run (``objective: grpo``): sample, score, build the rows.

Each generation batch takes ``batch_size`` prompts (``data/prompts.py``'s seeded order),
samples ``grpo.num_generations`` completions of each with the generator on the current
parameters (``generation/``: the prompts' prefill split over the seq axis, the KV cache split
by head), decodes them, calls the reward functions (``objectives/rewards.py``) and computes
the advantages; then ``grpo.num_iterations`` optimizer steps train on it. A row holds one
prompt + completion sequence: the loss mask marks the completion's tokens (the stop token
included when one was sampled), and the batch brings each token's advantage and weight
(``objectives/grpo.py``), with ``num_iterations`` > 1 also the old policy's
log-probabilities, computed once before the batch's first update.

The sampling key of generation batch n is the run's seed and n: the same completions at every
mesh and on resume. With ``num_iterations`` > 1 the batch (rows and old log-probabilities) is
kept in ``WORKDIR/grpo_batch.npz`` so a run resumed in its middle trains on the same batch.
``WORKDIR/completions.jsonl`` gets every completion of every generation batch.

``grpo.sft_warmup_steps`` first steps train on each prompt's reference completion with the
next-token loss (the same compiled step: advantage 1 on every token, token weights 1 / the
step's tokens, ratio 1, so the gradient is the mean next-token loss's), before sampling.
"""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from ..config import Config
from ..data import text as data_lib
from ..data.run_data import is_main
from .objectives import grpo as grpo_loss, rewards as rewards_lib

COMPLETIONS = "completions.jsonl"
BATCH_FILE = "grpo_batch.npz"


def reward_functions(cfg: Config) -> list[tuple[str, object]]:
    """(name, function) of ``grpo.reward_funcs``; RewardError for one that cannot load."""
    g = cfg.grpo
    return [(spec.rpartition(":")[2], rewards_lib.load(spec, g.max_completion_length))
            for spec in g.reward_funcs]


def sequence_rows(prompts: list, completions: list, seq_len: int) -> dict:
    """numpy FIELDS [N, seq_len] of prompt + completion sequences, one per row, the loss
    mask on the completion's tokens."""
    n = len(prompts)
    rows = {k: np.zeros((n, seq_len), np.float32 if k == "loss_mask" else np.int32)
            for k in data_lib.FIELDS}
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq = np.concatenate([np.asarray(p, np.int32), np.asarray(c, np.int32)])
        length = len(seq)
        rows["tokens"][i, :length] = seq
        rows["targets"][i, :length - 1] = seq[1:]
        rows["loss_mask"][i, len(p) - 1:length - 1] = 1.0
        rows["segment_ids"][i, :length] = 1
        rows["positions"][i, :length] = np.arange(length)
    return rows


class GRPOBatches:
    """The batch of each optimizer step of a GRPO run, the trainer's ``batches``.

    ``next_global(mesh, order, params=..., step=...)`` returns step ``step``'s batch (sampling
    with ``params`` when a generation batch starts); ``last`` holds the host metrics of the
    latest generation batch (rewards, lengths, sampling time) for the step's record.
    """

    def __init__(self, cfg: Config, prompts, held, tokenizer, order, mesh, workdir: str,
                 stop_ids, funcs):
        self.cfg, self.prompts, self.held, self.order = cfg, prompts, held, order
        self.tokenizer, self.mesh, self.workdir = tokenizer, mesh, workdir
        self.stop_ids, self.funcs = frozenset(stop_ids), funcs
        self.graphdef = self.shardings = None  # attach(): known once the state is built
        self.loss = grpo_loss.settings(cfg)
        self.fields = grpo_loss.token_fields(cfg)
        self.batch_step = None     # the step whose generation batch ``current`` is
        self.current = None        # numpy rows of the current generation batch
        self.last: dict = {}
        self._generator = None
        self._old_logps = None

    def attach(self, graphdef, shardings) -> None:
        """The train state's graphdef and layout (the old policy's program reads them)."""
        self.graphdef, self.shardings = graphdef, shardings

    # -- position ---------------------------------------------------------------------------

    def get_state(self) -> dict:
        return {**self.order.get_state(), "batch_step": self.batch_step}

    def set_state(self, state: dict) -> None:
        self.order.set_state(state)
        self.batch_step = state.get("batch_step")

    # -- the steps --------------------------------------------------------------------------

    def is_warmup(self, step: int) -> bool:
        return step <= self.cfg.grpo.sft_warmup_steps

    def generation_step(self, step: int) -> int:
        """The step that starts the generation batch step ``step`` trains on."""
        w, n = self.cfg.grpo.sft_warmup_steps, self.cfg.grpo.num_iterations
        return w + 1 + (step - w - 1) // n * n

    def next_global(self, mesh, order=None, *, params, step: int) -> dict:
        g = self.cfg.grpo
        if self.is_warmup(step):
            rows = self._warmup_rows()
            self.last = {}
        else:
            first = self.generation_step(step)
            if self.current is None or self.batch_step != first:
                if first != step:  # resumed in the middle of a generation batch
                    self.current = self._load_batch(first)
                else:
                    self.current = self._generate(params, step)
                    if g.num_iterations > 1:
                        self.current[grpo_loss.OLD_LOGPS] = self._old_policy(params,
                                                                             self.current)
                        self._save_batch(step, self.current)
                self.batch_step = first
            elif first != step:
                self.last = {}  # the batch's metrics were logged at its first step
            rows = self.current
        return data_lib.shard_batch(rows, mesh, order=order, token_fields=self.fields)

    def _warmup_rows(self) -> dict:
        n = self.cfg.batch_size * self.cfg.grpo.num_generations
        idx = self.order.take(n)
        refs = [self.prompts.references[i] for i in idx]
        missing = [self.prompts.names[i] for i, r in zip(idx, refs) if r is None]
        if missing:
            raise rewards_lib.RewardError(
                f"grpo.sft_warmup_steps trains on each prompt's reference completion, but "
                f"{missing[0]} has neither \"completion\" nor \"answer\"")
        room = self.cfg.seq_len
        seqs = [(self.prompts.ids[i], r) for i, r in zip(idx, refs)]
        for (p, r), i in zip(seqs, idx):
            if len(p) + len(r) > room:
                raise rewards_lib.RewardError(
                    f"{self.prompts.names[i]}: its prompt ({len(p)} tokens) and reference "
                    f"completion ({len(r)} tokens with EOS) exceed seq_len {room}")
        rows = sequence_rows([p for p, _ in seqs], [r for _, r in seqs], room)
        mask = rows["loss_mask"]
        rows["advantages"] = mask.copy()
        rows["loss_weights"] = (mask / max(mask.sum(), 1.0)).astype(np.float32)
        if grpo_loss.OLD_LOGPS in self.fields:
            rows[grpo_loss.OLD_LOGPS] = np.full_like(mask, np.nan)  # NaN: the policy itself
        return rows

    def _sampler(self, params):
        from ..generation import Generator
        if self._generator is None:
            self._generator = Generator(params, self.cfg.model, self.mesh)
        else:  # the same programs, the new parameters (a no-op transfer when laid out alike)
            self._generator.params = jax.device_put(params, self._generator.shardings)
        return self._generator

    def _generate(self, params, step: int) -> dict:
        from ..generation import Sampling
        cfg, g = self.cfg, self.cfg.grpo
        t0 = time.time()
        idx = self.order.take(cfg.batch_size)
        prompt_ids = [list(map(int, self.prompts.ids[i])) for i in idx
                      for _ in range(g.num_generations)]
        n = len(prompt_ids)
        gen = self._sampler(params)
        seed = int(np.random.default_rng((cfg.seed, step)).integers(0, 2**32))
        done = gen.generate(prompt_ids, max_new_tokens=g.max_completion_length,
                            eos_ids=self.stop_ids,
                            sampling=Sampling(g.temperature, g.top_k, g.top_p), seed=seed,
                            rows=list(range(n)))
        sampled = time.time()
        ids = [c.ids for c in done]
        texts = [self.tokenizer.decode([t for t in c if t not in self.stop_ids]) for c in ids]
        rows_in = [self.prompts.rows[i] for i in idx for _ in range(g.num_generations)]
        conversational = isinstance(rows_in[0].get("prompt"), list)
        completions = ([[{"role": "assistant", "content": t}] for t in texts]
                       if conversational else texts)
        columns = {k: [r.get(k) for r in rows_in] for k in rows_in[0]
                   if k not in ("prompt", "completion", "completion_ids")}
        try:
            per_func = rewards_lib.score(self.funcs, [r["prompt"] for r in rows_in],
                                         completions, ids, columns)
        except rewards_lib.RewardError as e:
            names = ", ".join(self.prompts.names[i] for i in idx)
            raise rewards_lib.RewardError(f"step {step}: {e} (the prompts: {names})") from None
        weights = cfg.grpo.reward_weights or [1.0] * len(self.funcs)
        adv, total = rewards_lib.advantages(per_func, weights, g.num_generations,
                                            g.scale_rewards)
        rows = sequence_rows(prompt_ids, ids, cfg.seq_len)
        mask = rows["loss_mask"]
        rows["advantages"] = (mask * adv[:, None]).astype(np.float32)
        rows["loss_weights"] = grpo_loss.token_weights(mask, self.loss, cfg.grad_accum_steps)
        self.last = self._metrics(per_func, total, ids, [c.finish_reason for c in done],
                                  sampled - t0, time.time() - sampled)
        self._log_completions(step, idx, prompt_ids, ids, texts, per_func, total, adv,
                              [c.finish_reason for c in done])
        return rows

    def evaluate(self, params, max_prompts: int) -> dict:
        """Greedy completions of up to ``max_prompts`` held-out prompts, scored:
        ``eval_reward`` (the mean weighted reward) and ``eval_rewards/NAME/mean``; {} without
        held-out prompts."""
        if self.held is None or max_prompts < 1:
            return {}
        n = min(len(self.held), max_prompts)
        prompt_ids = [list(map(int, ids)) for ids in self.held.ids[:n]]
        done = self._sampler(params).generate(prompt_ids,
                                              max_new_tokens=self.cfg.grpo.max_completion_length,
                                              eos_ids=self.stop_ids)
        ids = [c.ids for c in done]
        texts = [self.tokenizer.decode([t for t in c if t not in self.stop_ids]) for c in ids]
        rows = self.held.rows[:n]
        if isinstance(rows[0].get("prompt"), list):
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        columns = {k: [r.get(k) for r in rows] for k in rows[0]
                   if k not in ("prompt", "completion", "completion_ids")}
        per_func = rewards_lib.score(self.funcs, [r["prompt"] for r in rows], texts, ids,
                                     columns)
        weights = np.asarray(self.cfg.grpo.reward_weights or [1.0] * len(self.funcs))
        total = np.nansum(per_func * weights[None], axis=1)
        out = {"eval_reward": float(total.mean()), "eval_prompts": n}
        for f, (name, _) in enumerate(self.funcs):
            col = per_func[:, f]
            out[f"eval_rewards/{name}/mean"] = (float(np.nanmean(col)) if np.isfinite(col).any()
                                                else None)
        return out

    def _metrics(self, per_func, total, ids, reasons, sampling_s, scoring_s) -> dict:
        """TRL's names: reward, reward_std (the mean of the groups' stds), rewards/NAME/mean
        and /std, completions/mean_length, min_length, max_length, clipped_ratio (the share
        that reached max_completion_length), frac_reward_zero_std; and the times."""
        g = self.cfg.grpo
        lengths = np.array([len(c) for c in ids], np.float64)
        groups = total.reshape(-1, g.num_generations)
        with np.errstate(invalid="ignore"):
            stds = np.nanstd(groups, axis=1, ddof=1)
        out = {"reward": float(np.nanmean(total)) if np.isfinite(total).any() else None,
               "reward_std": float(np.nanmean(stds)) if np.isfinite(stds).any() else None,
               "frac_reward_zero_std": float(np.mean(np.nan_to_num(stds, nan=0.0) == 0.0)),
               "completions/mean_length": float(lengths.mean()),
               "completions/min_length": float(lengths.min()),
               "completions/max_length": float(lengths.max()),
               "completions/clipped_ratio": float(np.mean([r == "length" for r in reasons])),
               "sampling_s": sampling_s, "scoring_s": scoring_s}
        for f, (name, _) in enumerate(self.funcs):
            col = per_func[:, f]
            ok = np.isfinite(col)
            out[f"rewards/{name}/mean"] = float(col[ok].mean()) if ok.any() else None
            out[f"rewards/{name}/std"] = float(col[ok].std(ddof=1)) if ok.sum() > 1 else None
        return out

    def _log_completions(self, step, idx, prompt_ids, ids, texts, per_func, total, adv,
                         reasons) -> None:
        if not is_main():
            return
        g = self.cfg.grpo
        with open(os.path.join(self.workdir, COMPLETIONS), "a", encoding="utf-8") as f:
            for j in range(len(ids)):
                f.write(json.dumps({
                    "step": step, "prompt": self.prompts.names[idx[j // g.num_generations]],
                    "prompt_ids": prompt_ids[j], "completion_ids": list(map(int, ids[j])),
                    "completion": texts[j], "finish_reason": reasons[j],
                    "rewards": {name: (None if np.isnan(per_func[j, f]) else
                                       float(per_func[j, f]))
                                for f, (name, _) in enumerate(self.funcs)},
                    "reward": None if np.isnan(total[j]) else float(total[j]),
                    "advantage": float(adv[j])}) + "\n")

    def _old_policy(self, params, rows: dict) -> np.ndarray:
        """The sampling policy's token log-probabilities [N, S] (num_iterations > 1)."""
        from .train_step import batch_shardings
        if self._old_logps is None:
            graphdef, mesh = self.graphdef, self.mesh
            fields = batch_shardings(mesh)
            self._old_logps = jax.jit(
                lambda p, b: grpo_loss.token_logps(graphdef, p, b, mesh),
                in_shardings=(self.shardings["params"], fields))
        sharded = data_lib.shard_batch({k: rows[k] for k in data_lib.FIELDS}, self.mesh)
        return np.asarray(jax.device_get(self._old_logps(params, sharded)), np.float32)

    def _save_batch(self, step: int, rows: dict) -> None:
        if is_main():
            path = os.path.join(self.workdir, BATCH_FILE)
            np.savez(path + ".tmp.npz", step=np.int64(step), **rows)
            os.replace(path + ".tmp.npz", path)

    def _load_batch(self, step: int) -> dict:
        path = os.path.join(self.workdir, BATCH_FILE)
        try:
            with np.load(path) as data:
                saved = int(data["step"])
                rows = {k: data[k] for k in data.files if k != "step"}
        except (OSError, KeyError, ValueError) as e:
            raise rewards_lib.RewardError(
                f"the run resumes inside the generation batch of step {step} "
                f"(grpo.num_iterations={self.cfg.grpo.num_iterations}), but {path} cannot be "
                f"read: {e}") from None
        if saved != step:
            raise rewards_lib.RewardError(
                f"the run resumes inside the generation batch of step {step}, but {path} holds "
                f"the batch of step {saved}")
        return rows


def truncate_completions(workdir: str, start: int) -> None:
    """Drops the completions of steps after ``start`` from completions.jsonl (a resumed run
    samples them again, the same ones)."""
    path = os.path.join(workdir, COMPLETIONS)
    if not is_main() or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= start:
                kept.append(line)
        except (ValueError, KeyError):
            break  # an unfinished last line
    if len(kept) != len(lines):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
