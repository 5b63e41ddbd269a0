"""The batches of a GRPO run (``objective: grpo``): sample, score, build the rows.

Each generation batch takes ``batch_size`` prompts (``data/prompts.py``'s seeded order),
samples ``grpo.num_generations`` completions of each with the generator on the current
parameters (``generation/``: the prompts' prefill split over the seq axis, the KV cache split
by head, the completions split over the data replicas), decodes them, calls the reward
functions (``objectives/rewards.py``) and computes
the advantages; then ``grpo.num_iterations`` optimizer steps train on it. Each prompt +
completion sequence starts at position 0: the loss mask marks the completion's tokens (the
stop token included when one was sampled), and the batch brings each token's advantage and
weight (``objectives/grpo.py``; the weights made per sequence, as TRL's processes and
micro-batches split sequences), with ``num_iterations`` > 1 also the old policy's
log-probabilities, computed once before the batch's first update. With ``grpo.packing`` (the
default) the sequences are then packed into rows of seq_len, each its own segment
(``data/row_packing.py``): the batch has as many rows as they fill (rounded up to a few
sizes, each a train step compiled once), not one per sequence, and the same loss.

The sampling key of generation batch n is the run's seed and n: the same completions at every
mesh and on resume. With ``num_iterations`` > 1 the batch (rows and old log-probabilities) is
kept in ``WORKDIR/grpo_batch_STEP.npz`` (STEP its first step; those no kept checkpoint
can resume into are deleted) so a run resumed in its middle trains on the same batch.
``WORKDIR/completions.jsonl`` gets every completion of every generation batch.

``grpo.sft_warmup_steps`` first steps train on each prompt's reference completion with the
next-token loss (the same compiled step: advantage 1 on every token, token weights 1 / the
step's tokens, ratio 1, so the gradient is the mean next-token loss's; with ``beta`` > 0 the
KL term to the reference is added as in every step), before sampling.

The reference of the KL term (``beta`` > 0): with LoRA the base, the adapters off (in the
step); in full fine-tuning a frozen copy of the initial weights (``init_from``'s, or the
seeded initialisation; made again the same way on resume), laid out as the parameters
(split with ZeRO-3, in host memory with ``optimizer.offload``: one more copy of the
parameters, no optimizer state), whose token log-probabilities each batch brings, computed
once per generation batch as TRL computes them. The reference ends with the
sampler's first stop id, the token that ends a sampled completion.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any

import jax
import numpy as np

from ..config import Config, ConfigError
from ..data import run_data, text as data_lib
from ..data.prompts import PromptOrder
from ..data.row_packing import pack_rows
from ..data.run_data import is_main, log
from ..generation import Generator, Sampling
from ..generation.cache import cache_layout
from ..generation.generator import generation_config, prompt_slots
from ..generation.settings import model_settings
from ..mesh import SEQ, axis_size
from .objectives import grpo as grpo_loss, rewards as rewards_lib
from .objectives.base import Field, Objective
from ..models.param_layout import param_shardings
from .host_memory import shard_bytes
from .resume import initial_params
from .run_dir import RunError
from .train_step import batch_shardings, model_params, params_for_compute, token_order

COMPLETIONS = "completions.jsonl"
BATCH_FILES = "grpo_batch_{step}.npz"  # a generation batch of num_iterations > 1


def reward_functions(cfg: Config) -> list[tuple[str, object]]:
    """(name, function) of ``grpo.reward_funcs``; RewardError for one that cannot load.
    A name is the function's (after the colon), or the whole spec where two would share it."""
    g = cfg.grpo
    short = [spec.rpartition(":")[2] for spec in g.reward_funcs]
    names = [n if short.count(n) == 1 else spec for n, spec in zip(short, g.reward_funcs)]
    return [(name, rewards_lib.load(spec, g.max_completion_length))
            for name, spec in zip(names, g.reward_funcs)]


def reference_params(cfg: Config, mesh, shardings: dict, params, start: int):
    """The frozen reference of full fine-tuning with beta > 0, laid out as the state's
    parameters; None otherwise (``objectives.grpo.frozen_reference``).

    Args:
      params: the state's parameters; at ``start`` 0 the initial ones, copied (the train
        step donates them). A resumed run makes the initial parameters again: ``init_from``'s,
        or the seeded initialisation (the same values).
    """
    if not grpo_loss.frozen_reference(cfg):
        return None
    layout = shardings["params"]
    if start == 0:
        return jax.device_put(params, layout, may_alias=False)
    loaded = initial_params(cfg, mesh)
    if loaded is not None:
        return jax.device_put(loaded, layout)
    return jax.jit(lambda: model_params(cfg, mesh), out_shardings=layout)()


def check_prompts(cfg: Config, prompts) -> None:
    """ValueError, naming the rule, the row and the numbers, for prompts the run could not
    train on: with ``grpo.sft_warmup_steps`` a prompt without a reference completion or one
    whose prompt + reference + stop token exceed seq_len; the built-in ``answer_match`` with
    no row holding an ``answer`` (every reward would be None, every advantage 0)."""
    g = cfg.grpo
    if "answer_match" in g.reward_funcs and not any("answer" in r for r in prompts.rows):
        raise ValueError("grpo.reward_funcs has answer_match, but no prompt row has an "
                         "\"answer\" column: every reward would be None and nothing learned")
    if not g.sft_warmup_steps:
        return
    for name, ids, ref in zip(prompts.names, prompts.ids, prompts.references):
        if ref is None:
            raise ValueError(f"grpo.sft_warmup_steps={g.sft_warmup_steps} trains on each "
                             f"prompt's reference completion, but {name} has neither "
                             f"\"completion\" nor \"answer\"")
        if len(ids) + len(ref) + 1 > cfg.seq_len:
            raise ValueError(f"{name}: its prompt ({len(ids)} tokens), reference completion "
                             f"({len(ref)}) and stop token exceed seq_len {cfg.seq_len} "
                             f"(grpo.sft_warmup_steps trains on them)")


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


@dataclasses.dataclass
class PromptSource:
    """A GRPO run's prompts before the train state exists: the train and held-out prompts
    (``data/prompts.py``), their seeded order (its position is the checkpoint's data
    state), the tokenizer, the sampler's stop ids in order (the first ends the warm-up's
    reference completions: what the model should write to stop) and the reward functions."""
    prompts: Any
    held: Any
    tokenizer: Any
    order: Any
    stop_ids: tuple
    funcs: list

    def get_state(self) -> dict:
        return self.order.get_state()

    def set_state(self, state: dict) -> None:
        self.order.set_state(state)


class Rollout:
    """The batch of each optimizer step of a GRPO run (its ``StepBatches``), built once the
    train state exists.

    ``next(step, params)`` returns step ``step``'s batch (sampling with ``params`` when a
    generation batch starts); ``last`` holds the host metrics of the latest generation batch
    (rewards, lengths, sampling time) for the step's record.

    Args:
      layout: the train state's (graphdef, shardings): the old policy's and the reference's
        programs read them.
      reference: in full fine-tuning with beta > 0 the frozen initial parameters (laid out
        as the state's) whose log-probabilities each batch brings; else None.
    """

    def __init__(self, cfg: Config, source: PromptSource, mesh, workdir: str, layout: tuple,
                 reference=None):
        self.cfg, self.prompts, self.held = cfg, source.prompts, source.held
        self.order, self.tokenizer = source.order, source.tokenizer
        self.mesh, self.workdir, self.funcs = mesh, workdir, source.funcs
        self.stop_ids, self.stop = frozenset(source.stop_ids), int(source.stop_ids[0])
        self.graphdef, self.shardings = layout
        self.reference = reference
        self.loss = grpo_loss.settings(cfg)
        self.fields = grpo_loss.token_fields(cfg)
        self.token_order = token_order(cfg)
        self.batch_step = None     # the first step of the generation batch ``current``
        self.current = None        # numpy rows of the current generation batch
        self.last: dict = {}
        self._generator = None
        self._logps = None

    # -- the steps --------------------------------------------------------------------------

    def is_warmup(self, step: int) -> bool:
        return step <= self.cfg.grpo.sft_warmup_steps

    def generation_step(self, step: int) -> int:
        """The step that starts the generation batch step ``step`` trains on."""
        w, n = self.cfg.grpo.sft_warmup_steps, self.cfg.grpo.num_iterations
        return w + 1 + (step - w - 1) // n * n

    def next(self, step: int, params) -> dict:
        g, mesh, order = self.cfg.grpo, self.mesh, self.token_order
        if self.is_warmup(step):
            rows = self._warmup_rows()
            if grpo_loss.REF_LOGPS in self.fields:
                rows[grpo_loss.REF_LOGPS] = self._token_logps(self.reference, rows, order)
            self.last = {}
        else:
            first = self.generation_step(step)
            if self.current is None or self.batch_step != first:
                if first != step:  # resumed in the middle of a generation batch
                    self.current = self._load_batch(first)
                else:
                    self.current = self._generate(params, step)
                    if grpo_loss.REF_LOGPS in self.fields:
                        self.current[grpo_loss.REF_LOGPS] = self._token_logps(
                            self.reference, self.current, order)
                    if g.num_iterations > 1:
                        self.current[grpo_loss.OLD_LOGPS] = self._token_logps(
                            params, self.current, order)
                        self._save_batch(step, self.current)
                self.batch_step = first
            elif first != step:
                self.last = {}  # the batch's metrics were logged at its first step
            rows = self.current
        return data_lib.shard_batch(rows, mesh, order=order, token_fields=self.fields)

    def _warmup_rows(self) -> dict:
        n = self.cfg.batch_size * self.cfg.grpo.num_generations
        idx = self.order.take(n)  # every reference was checked at start (check_prompts)
        rows = sequence_rows([self.prompts.ids[i] for i in idx],
                             [np.append(self.prompts.references[i], self.stop) for i in idx],
                             self.cfg.seq_len)
        mask = rows["loss_mask"]
        rows["advantages"] = mask.copy()
        rows["loss_weights"] = (mask / max(mask.sum(), 1.0)).astype(np.float32)
        rows = self._packed(rows)
        if grpo_loss.OLD_LOGPS in self.fields:
            # NaN: the policy itself
            rows[grpo_loss.OLD_LOGPS] = np.full_like(rows["loss_mask"], np.nan)
        return rows

    def _packed(self, rows: dict) -> dict:
        """``rows`` packed (``grpo.packing``), or as they are."""
        if not self.cfg.grpo.packing:
            return rows
        return pack_rows(rows, self.cfg.mesh.data * self.cfg.grad_accum_steps)

    def _sampler(self, params):
        """The generator on the run's (data, seq) mesh: each data replica samples its share
        of the completions."""
        if self._generator is None:
            self._generator = Generator(params, self.cfg.model, self.mesh)
        else:  # the same programs, the new parameters (a no-op transfer when laid out alike)
            self._generator.params = jax.device_put(params, self._generator.shardings)
        return self._generator

    def _generate(self, params, step: int) -> dict:
        cfg, g = self.cfg, self.cfg.grpo
        t0 = time.time()
        idx = self.order.take(cfg.batch_size)
        prompts = [list(map(int, self.prompts.ids[i])) for i in idx]
        prompt_ids = [ids for ids in prompts for _ in range(g.num_generations)]
        gen = self._sampler(params)
        seed = int(np.random.default_rng((cfg.seed, step)).integers(0, 2**32))
        # each prompt prefilled once, its group's samples reading its cache
        done = gen.generate(prompts, max_new_tokens=g.max_completion_length,
                            eos_ids=self.stop_ids, num_samples=g.num_generations,
                            sampling=Sampling(g.temperature, g.top_k, g.top_p), seed=seed)
        sampled = time.time()
        ids = [c.ids for c in done]
        rows_in = [self.prompts.rows[i] for i in idx for _ in range(g.num_generations)]
        try:
            texts, per_func = self._score(rows_in, ids)
        except rewards_lib.RewardError as e:
            names = ", ".join(self.prompts.names[i] for i in idx)
            raise rewards_lib.RewardError(f"step {step}: {e} (the prompts: {names})") from None
        adv, total = rewards_lib.advantages(per_func, self._weights(), g.num_generations,
                                            g.scale_rewards)
        rows = sequence_rows(prompt_ids, ids, cfg.seq_len)
        mask = rows["loss_mask"]
        rows["advantages"] = (mask * adv[:, None]).astype(np.float32)
        rows["loss_weights"] = grpo_loss.token_weights(mask, self.loss, cfg.grad_accum_steps,
                                                       cfg.mesh.data)
        rows = self._packed(rows)
        self.last = self._metrics(per_func, total, ids, [c.finish_reason for c in done],
                                  sampled - t0, time.time() - sampled)
        self._log_completions(step, idx, prompt_ids, ids, texts, per_func, total, adv,
                              [c.finish_reason for c in done])
        return rows

    def record(self, step: int, times: dict) -> dict:
        """The latest generation batch's metrics (at its first step), the step's phase and
        the times of its batch (sampling, scoring) and of its update."""
        return {**self.last, "phase": "sft_warmup" if self.is_warmup(step) else "grpo",
                "batch_s": times["batch_s"], "train_s": times["train_s"]}

    def evaluate(self, params) -> dict:
        """Greedy completions of up to ``eval_batches`` x ``batch_size`` held-out prompts,
        scored: ``eval_reward`` (the mean weighted reward) and ``eval_rewards/NAME/mean``;
        {} without held-out prompts."""
        max_prompts = self.cfg.eval_batches * self.cfg.batch_size
        if self.held is None or max_prompts < 1:
            return {}
        n = min(len(self.held), max_prompts)
        prompt_ids = [list(map(int, ids)) for ids in self.held.ids[:n]]
        done = self._sampler(params).generate(prompt_ids,
                                              max_new_tokens=self.cfg.grpo.max_completion_length,
                                              eos_ids=self.stop_ids)
        try:
            _, per_func = self._score(self.held.rows[:n], [c.ids for c in done])
        except rewards_lib.RewardError as e:
            raise rewards_lib.RewardError(f"held-out evaluation: {e}") from None
        total = rewards_lib.total(per_func, self._weights())
        out = {"eval_reward": (float(np.nanmean(total)) if np.isfinite(total).any() else None),
               "eval_prompts": n}
        for f, (name, _) in enumerate(self.funcs):
            col = per_func[:, f]
            out[f"eval_rewards/{name}/mean"] = (float(np.nanmean(col)) if np.isfinite(col).any()
                                                else None)
        return out

    def _weights(self) -> list[float]:
        return list(self.cfg.grpo.reward_weights or [1.0] * len(self.funcs))

    def _score(self, rows: list[dict], ids: list[list[int]]):
        """(texts, ``rewards.score``'s [N, F]) of completions ``ids`` of prompt ``rows``
        (one row per completion): decoded without stop ids; a chat prompt's completion as
        TRL passes it, [{"role": "assistant", "content": text}]."""
        texts = [self.tokenizer.decode([t for t in c if t not in self.stop_ids]) for c in ids]
        completions = [[{"role": "assistant", "content": t}]
                       if isinstance(r.get("prompt"), list) else t
                       for r, t in zip(rows, texts)]
        names = sorted({k for r in rows for k in r} - {"prompt", "completion",
                                                         "completion_ids"})
        columns = {k: [r.get(k) for r in rows] for k in names}
        return texts, rewards_lib.score(self.funcs, [r["prompt"] for r in rows], completions,
                                        ids, columns)

    def _metrics(self, per_func, total, ids, reasons, sampling_s, scoring_s) -> dict:
        """TRL's names: reward, reward_std (the std of the batch's rewards),
        rewards/NAME/mean and /std, completions/mean_length, min_length, max_length,
        clipped_ratio (the share that reached max_completion_length), frac_reward_zero_std
        (the share of completions whose advantage's std is 0); and the times."""
        g = self.cfg.grpo
        lengths = np.array([len(c) for c in ids], np.float64)
        ok = np.isfinite(total)
        stds = rewards_lib.scales(total, g.num_generations, g.scale_rewards)
        out = {"reward": float(total[ok].mean()) if ok.any() else None,
               "reward_std": float(total[ok].std(ddof=1)) if ok.sum() > 1 else None,
               "frac_reward_zero_std": float(np.mean(np.isclose(stds, 0.0))),
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

    def _token_logps(self, params, rows: dict, order: np.ndarray | None) -> np.ndarray:
        """The token log-probabilities [N, S] of ``params`` (laid out as the state's): the
        sampling policy's (num_iterations > 1) or the frozen reference's, in the rows' own
        token order; ``order`` is the one the model reads rows in (the zigzag of a ring
        mesh, ``trainer.token_order``; None: their own)."""
        if self._logps is None:
            graphdef, mesh = self.graphdef, self.mesh
            fields = batch_shardings(mesh)
            prepare = params_for_compute(self.cfg, self.shardings)  # optimizer.offload
            self._logps = jax.jit(
                lambda p, b: grpo_loss.token_logps(graphdef, prepare(p), b, mesh),
                in_shardings=(self.shardings["params"], fields))
        sharded = data_lib.shard_batch({k: rows[k] for k in data_lib.FIELDS}, self.mesh,
                                       order=order)
        got = np.asarray(jax.device_get(self._logps(params, sharded)), np.float32)
        return got if order is None else got[:, np.argsort(order)]

    def _batch_path(self, step: int) -> str:
        return os.path.join(self.workdir, BATCH_FILES.format(step=step))

    def _save_batch(self, step: int, rows: dict) -> None:
        """Writes the generation batch of ``step`` and deletes those no kept checkpoint can
        resume into (the batches that ended at or before the oldest checkpoint)."""
        if not is_main():
            return
        path = self._batch_path(step)
        np.savez(path + ".tmp.npz", step=np.int64(step), **rows)
        os.replace(path + ".tmp.npz", path)
        ckpts = os.path.join(self.workdir, "checkpoints")
        kept = sorted(int(d) for d in (os.listdir(ckpts) if os.path.isdir(ckpts) else ())
                      if d.isdigit())
        n = self.cfg.grpo.num_iterations
        for name in os.listdir(self.workdir):
            m = re.fullmatch(BATCH_FILES.format(step=r"(\d+)").replace(".", r"\."), name)
            if m and int(m.group(1)) != step and kept and int(m.group(1)) + n - 1 <= kept[0]:
                os.remove(os.path.join(self.workdir, name))

    def _load_batch(self, step: int) -> dict:
        path = self._batch_path(step)
        try:
            with np.load(path) as data:
                rows = {k: data[k] for k in data.files if k != "step"}
        except (OSError, KeyError, ValueError) as e:
            raise RunError(
                f"the run resumes inside the generation batch that started at step {step} "
                f"(grpo.num_iterations={self.cfg.grpo.num_iterations}), but {path} cannot be "
                f"read ({type(e).__name__}: {e}); the batch's old log-probabilities are lost. "
                f"Move the checkpoints after step {step - 1} out of "
                f"{os.path.join(self.workdir, 'checkpoints')} to resume from an earlier one, "
                f"or start a new --workdir") from None
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


class GRPO(Objective):
    """``objective: grpo``: the policy loss of completions sampled from prompts and rewarded
    (``objectives/grpo.py``), the batches made by a ``Rollout``."""

    name = "grpo"
    weighting = "sum"  # the batches weigh every token themselves (token_weights)
    heldout = "eval_reward"

    def fields(self):
        return tuple(Field(name) for name in grpo_loss.token_fields(self.cfg))

    def metrics(self):
        return tuple(m for m in grpo_loss.METRICS if m != "kl" or self.cfg.grpo.beta)

    def loss(self, graphdef, params, batch, mesh, weights=None):
        return grpo_loss.objective(self.cfg, graphdef, params, batch, mesh, weights)

    def resident_bytes(self, mesh, abstract_state):
        """The sampler's weights (every weight on every device: a copy where the state's
        are split or offloaded), its KV cache (alive while sampling; counted as if beside
        the step): the prompts' part at ``batch_size`` rows of up to ``seq_len`` slots and
        their samples' at ``max_completion_length``, and the frozen reference of full
        fine-tuning with beta > 0."""
        cfg, params = self.cfg, abstract_state["params"]
        out = {}
        if cfg.param_sharding != "replicated" or cfg.optimizer.offload:
            out["the sampler's weights"] = shard_bytes(jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params,
                param_shardings(params, mesh, "replicated")))
        gen = generation_config(cfg.model)
        prompts = cfg.batch_size + -cfg.batch_size % mesh.shape["data"]
        slots = prompt_slots(cfg.seq_len, axis_size(mesh, SEQ))
        parts = (cache_layout(gen, mesh, prompts, slots),
                 cache_layout(gen, mesh, prompts * cfg.grpo.num_generations,
                              cfg.grpo.max_completion_length))
        attention = [k for k, mixer in zip(gen.layer_kinds(), gen.layer_mixers())
                     if mixer == "A"]
        out["the sampler's KV cache"] = sum(part.bytes_per_device(mesh, attention)
                                            for part in parts)
        if grpo_loss.frozen_reference(cfg):
            out["the frozen reference"] = shard_bytes(params)
        return out

    def reported_loss(self, step: int, metrics: dict):
        """A warm-up step reports its next-token loss."""
        return metrics["nll"] if step <= self.cfg.grpo.sft_warmup_steps else metrics["loss"]

    def batch_line(self) -> str:
        """``batch_size`` counts prompts, each ``num_generations`` sequences."""
        cfg, g = self.cfg, self.cfg.grpo
        k, b = cfg.grad_accum_steps, cfg.batch_size
        micro = "" if k == 1 else f" in grad_accum_steps={k} micro-batches"
        return (f"batch: {b} prompt{'s' * (b != 1)} x {g.num_generations} completions = "
                f"{b * g.num_generations} sequences of up to {cfg.seq_len} tokens (completions "
                f"up to {g.max_completion_length}) per generation batch, {g.num_iterations} "
                f"optimizer step{'s' * (g.num_iterations != 1)} each{micro}")

    def line(self, record: dict) -> str:
        out = ""
        if record.get("reward") is not None:
            out += (f", reward {record['reward']:.3f}, completion length "
                    f"{record['completions/mean_length']:.1f}")
        if record.get("eval_reward") is not None:
            out += f", held-out reward {record['eval_reward']:.3f}"
        return out

    def done_line(self, summary: dict) -> str:
        return (f"done: step {summary['step']}, loss {summary['loss']}, held-out reward "
                f"{summary.get('eval_reward')}")

    def open(self, mesh, workdir: str):
        """The prompts, reward functions and stop ids, all checked before anything is
        compiled."""
        cfg = self.cfg
        prompts, held, tokenizer, fingerprint = run_data.load_prompt_data(cfg)
        try:
            funcs = reward_functions(cfg)
            stop = model_settings(cfg.init_from, tokenizer.eos_id).eos_ids or (tokenizer.eos_id,)
            check_prompts(cfg, prompts)
        except (rewards_lib.RewardError, ValueError) as e:
            raise ConfigError(str(e)) from None
        log(f"data: {len(prompts)} prompts{'' if held is None else f', {len(held)} held out'}; "
            f"rewards {', '.join(name for name, _ in funcs)}; stop ids {sorted(stop)}; mesh "
            f"data={cfg.mesh.data} x seq={cfg.mesh.seq} on {mesh.devices.size} "
            f"{mesh.devices.flat[0].platform} devices")
        order = PromptOrder(len(prompts), cfg.seed, fingerprint)
        return cfg, PromptSource(prompts, held, tokenizer, order, tuple(stop), funcs)

    def batches(self, source, mesh, layout, state, start, workdir, progress):
        """The rollout, with the frozen reference of full fine-tuning with beta > 0; the
        completions a resume samples again are dropped from completions.jsonl."""
        graphdef, shardings = layout
        reference = reference_params(self.cfg, mesh, shardings, state["params"], start)
        truncate_completions(workdir, start)
        return Rollout(self.cfg, source, mesh, workdir, layout, reference)


OBJECTIVE = GRPO
