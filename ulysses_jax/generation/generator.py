"""Generation of token ids from token ids: batches of prompts, prefill, then one decode step
per new token until every row has stopped or reached its limit.

``Generator(params, cfg, mesh)`` keeps the compiled programs of each (batch,
prompt length, cache slots) it has seen; ``generate(prompts, ...)`` returns each row's new
ids and why it stopped. A prompt with several samples (``num_samples``) is prefilled once and
its samples decode against one copy of its cache. The timings it gathers (compile, prefill,
decode) are the CLI's summary.
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ..config import ModelConfig
from ..families import family
from ..mesh import DATA, RING, SEQ, act_spec, axis_size
from .blocks import GenerationError, block_functions
from .cache import cache_layout
from .decode import decode_program
from .prefill import prefill_program
from .sampling import Sampling


@dataclasses.dataclass
class Completion:
    """A row's new token ids (the stop token included when one was chosen) and why it
    ended: "stop" (an end-of-sequence id) or "length" (``max_new_tokens``)."""
    ids: list[int]
    finish_reason: str
    logits: list[np.ndarray] | None = None    # [V] fp32 per new token, when asked for


def generation_config(cfg: ModelConfig) -> ModelConfig:
    """The model config the generation programs are built with. They keep nothing for a
    backward pass and split no tokens into chunks: remat, tiled MLP and checkpoint offload do
    not apply; experts drop no assignment (transformers' never do)."""
    return dataclasses.replace(cfg, remat="none", mlp_chunk=0, offload_checkpoints=False,
                               moe_capacity_factor=0.0)


def few_sizes(n: int, unit: int) -> int:
    """``n`` rounded up to a multiple of ``unit``, then to one of 8 steps per power of two of
    units (at most 1/8 more): nearby sizes share one compiled program."""
    units = -(-n // unit)
    step = 1 << max((units - 1).bit_length() - 3, 0)
    return unit * -(-units // step) * step


def prompt_slots(longest: int, seq: int) -> int:
    """The padded prompt length S: at least ``longest``, a multiple of unit = lcm(P, 16),
    rounded as ``few_sizes`` rounds, so that prompts of nearby lengths share one compiled
    program."""
    return few_sizes(longest, seq * 16 // math.gcd(seq, 16))


def shrink_plan(going: np.ndarray, prompts: int, replicas: int):
    """Whether a decode batch of ``prompts`` x G rows (``going`` [prompts G]: the rows whose
    answers go on) should go on smaller: None, or (the prompts kept [Bp'], the rows kept
    [Bp' G'], which of those the answers' tokens come from [Bp' G']).

    The smaller batch keeps the prompts with a row going on (Bp', a multiple of the data
    replicas) and G' rows for each (G' the most any of them has going), both rounded as
    ``few_sizes`` rounds; a prompt's rows beyond its own, and the rows of the prompts added
    for the rounding, repeat one of its rows, marked as no answer's. It is taken when it is
    at most half the batch: a batch halves at most log2(prompts G) times, each new size one
    program compiled."""
    g = len(going) // prompts
    per = going.reshape(prompts, g)
    counts = per.sum(axis=1)
    if not counts.any():
        return None
    live = np.flatnonzero(counts)
    bp = min(few_sizes(len(live), replicas), prompts)
    g2 = min(few_sizes(int(counts.max()), 1), g)
    if bp * g2 > prompts * g // 2:
        return None
    kept = np.concatenate([live, np.full(bp - len(live), live[-1])])
    rows, writes = [], []
    for j, p in enumerate(kept):
        mine = p * g + np.flatnonzero(per[p])
        fresh = mine if j < len(live) else mine[:0]
        rows.extend(list(fresh) + [mine[0]] * (g2 - len(fresh)))
        writes.extend([True] * len(fresh) + [False] * (g2 - len(fresh)))
    return kept, np.asarray(rows), np.asarray(writes)


MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
              "second_per_grid_ts")


def _joined(media: list[dict | None]) -> dict:
    """The rows' media (``multimodal.prepare``'s keywords per row, or None) as one request's:
    each kind's pixels, grids and seconds concatenated in row order (the order the
    placeholders take them in)."""
    shapes = {"image_grid_thw": (-1, 3), "video_grid_thw": (-1, 3), "second_per_grid_ts": (-1,)}
    out = {}
    for key in MEDIA_KEYS:
        parts = [np.asarray(m[key]) for m in media if m and m.get(key) is not None]
        if parts:
            out[key] = np.concatenate([p.reshape(shapes[key]) if key in shapes else p
                                       for p in parts])
    return out


def vision_inputs(cfg: ModelConfig, shards: int, tokens, segments, lengths,
                  media: list[dict | None]):
    """A multimodal model's prompts on the host: (M-RoPE positions [B, S, 3], the tower's
    inputs or None when no row has media, deltas [B]: each row's next position after its
    prompt minus its token count).

    The positions are transformers' ``get_rope_index`` of each row's own tokens (the left
    padding at 0); the tower's slots per group are rounded as ``few_sizes`` rounds, so that
    requests of nearby sizes share a compiled prefill."""
    from ..models import multimodal
    joined = _joined(media)
    try:
        positions, vision = multimodal.prepare(tokens, cfg, segment_ids=segments,
                                               shards=shards, **joined)
        if vision is not None:
            m2 = cfg.vision.spatial_merge_size ** 2
            fullest = len(vision["pixels"]) // shards
            if few_sizes(fullest, m2) != fullest:
                positions, vision = multimodal.prepare(
                    tokens, cfg, segment_ids=segments, shards=shards,
                    capacity=few_sizes(fullest, m2), **joined)
    except ValueError as e:
        raise GenerationError(f"the prompts and their images: {e}") from None
    deltas = positions.max(axis=(1, 2)).astype(np.int64) + 1 - np.asarray(lengths)
    return positions, vision, deltas.astype(np.int32)


class Generator:
    """Greedy or sampled generation with ``cfg``'s model on ``mesh`` (axes data, seq): the
    rows split over the data replicas, each row's prompt over ``seq`` in prefill and its
    cache by head over ``seq``. On a mesh with a ring axis the ring x seq devices of each
    replica form the seq axis (Ulysses over all of them, heads padded where they are fewer)."""

    def __init__(self, params, cfg: ModelConfig, mesh: Mesh):
        """params: the Decoder's pure dict (``nnx.to_pure_dict``) on ``mesh``."""
        self.cfg = generation_config(cfg)
        block_functions(self.cfg)  # GenerationError now, not after a compile
        if axis_size(mesh, RING) > 1:
            # A ring mesh (ring x seq devices per sequence, hybrid or pure ring) generates
            # with Ulysses over all R x U of them: one seq axis of the same devices, each data
            # replica's row of the mesh kept (no ring attention in the cached decode).
            mesh = Mesh(mesh.devices.reshape(axis_size(mesh, DATA), -1), (DATA, SEQ),
                        axis_types=(AxisType.Auto, AxisType.Auto))
        if self.cfg.family == "qwen3_next":
            from ..attention.linear import key_copies
            try:  # each device advances the state of whole value heads
                key_copies(self.cfg.linear_key_heads, self.cfg.linear_value_heads,
                           axis_size(mesh, SEQ))
            except ValueError as e:
                raise GenerationError(f"Gated DeltaNet generation: {e}") from None
        from ..models.decoder import Decoder
        from ..models.param_layout import param_shardings
        abstract = nnx.eval_shape(lambda: Decoder(self.cfg, mesh=mesh, rngs=nnx.Rngs(0)))
        self.graphdef = nnx.split(abstract)[0]
        # Every weight but the experts' on every device (a ZeRO-3 run's are split): a decode
        # step then gathers no weight.
        self.shardings = param_shardings(params, mesh, "replicated")
        self.params = jax.device_put(params, self.shardings)
        self.mesh = mesh
        # the vision tower's frame groups (``VisionTower.shards``): every device when split
        self.vision_shards = (mesh.devices.size if family(self.cfg.family).vision
                              and self.cfg.vision.split else 1)
        self.seq = axis_size(mesh, SEQ)
        self.replicas = axis_size(mesh, DATA)
        self._programs: dict = {}
        # The two parts of each decode program's cache, (the prompts', the new tokens'), by
        # its key (their bytes: ``CacheLayout.bytes_per_device``).
        self.cache_layouts: dict = {}
        # Called with each program when it is compiled, before it first runs: (key, compiled)
        # -> None, or raises (the CLI's memory check; key[0] "prefill" or "decode").
        self.on_compile = None
        # False: a decode batch keeps every row to the end (benchmarks/rollout.py's
        # reference), not going on smaller as its rows finish (``shrink_plan``).
        self.shrink = True
        # decode_tokens: the new tokens decoded; decode_rows: the rows the decode steps ran
        # (finished rows included until a smaller batch takes the rest, ``shrink_plan``)
        self.timings = {"compile_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0,
                        "decode_tokens": 0, "decode_rows": 0}

    def _compiled(self, key, build, *args):
        """The compiled program of ``key``, built and compiled (timed) on first use."""
        if key not in self._programs:
            t = time.perf_counter()
            self._programs[key] = build().lower(*args).compile()
            self.timings["compile_s"] += time.perf_counter() - t
            if self.on_compile is not None:
                self.on_compile(key, self._programs[key])
        return self._programs[key]

    def _gathered(self, key, prompt_caches, caches, row_args, prompts_kept, kept_rows):
        """The prompts' caches at rows ``prompts_kept``, and the rows' caches and per-row
        arguments (tokens, logits, pad, deltas, sampling rows) at ``kept_rows``, laid out as
        they were (one compiled program per pair of sizes)."""
        take = lambda axis: lambda idx: lambda a: jnp.take(a, idx, axis=axis)  # noqa: E731

        def run(prompt, caches, row_args, pi, ri):
            return (jax.tree.map(take(1)(pi), prompt), jax.tree.map(take(1)(ri), caches),
                    jax.tree.map(take(0)(ri), row_args))

        args = (prompt_caches, caches, row_args)
        laid_out = jax.tree.map(lambda a: a.sharding, args)
        rep = NamedSharding(self.mesh, P())
        idx = [jax.device_put(np.asarray(i, np.int32), rep) for i in (prompts_kept, kept_rows)]
        program = self._compiled(key, lambda: jax.jit(run, out_shardings=laid_out), *args,
                                 *idx)
        return program(*args, *idx)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int,
                 eos_ids: set[int] | frozenset = frozenset(),
                 sampling: Sampling = Sampling(), seed: int = 0,
                 rows: list[int] | None = None, keep_logits: bool = False,
                 on_token=None, media: list[dict | None] | None = None,
                 num_samples: int = 1) -> list[Completion]:
        """New tokens for each prompt (lists of token ids, of any lengths), one batch:
        ``num_samples`` completions G per prompt, prompt i's at i G .. i G + G - 1.

        Args:
          rows: each prompt's index in the whole request; sample g of prompt i draws its
            tokens with row r = rows[i] G + g (the sampling keys), the row a request with
            each prompt written G times gives it. Default 0..B-1.
          num_samples: G; each prompt is prefilled once and its samples share its cache.
          media: a multimodal model's images and videos per prompt: None, or a dict of
            transformers' inputs (``pixel_values`` [N, K] with ``image_grid_thw`` [n, 3],
            ``pixel_values_videos`` with ``video_grid_thw``, ``second_per_grid_ts``), for
            the prompt's placeholder tokens (one per merged unit, as the processor expands
            them) in order.
          keep_logits: also return each new token's fp32 logits (tests).
          on_token: called once per new token of the batch (progress).
        """
        if not prompts or min(len(p) for p in prompts) < 1:
            raise GenerationError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if num_samples < 1:
            raise GenerationError(f"num_samples must be >= 1, got {num_samples}")
        sampling.check()
        rows = list(range(len(prompts))) if rows is None else list(rows)
        if len(rows) != len(prompts):
            raise GenerationError(f"rows names {len(rows)} rows for {len(prompts)} prompts")
        vision_model = family(self.cfg.family).vision
        media = [None] * len(prompts) if media is None else list(media)
        if len(media) != len(prompts):
            raise GenerationError(f"media names {len(media)} rows for {len(prompts)} prompts")
        if any(media) and not vision_model:
            raise GenerationError(f"model.family={self.cfg.family} has no vision tower: its "
                                  f"prompts cannot hold images or videos")
        # Each data replica generates B/D rows: B made a multiple of D with copies of the
        # last row (done from the start, dropped at the end).
        n = len(prompts)
        extra = -n % self.replicas
        prompts, rows = list(prompts) + [prompts[-1]] * extra, rows + [rows[-1]] * extra
        media += [media[-1]] * extra
        g, mesh = num_samples, self.mesh
        bp = len(prompts)
        b = bp * g
        s = prompt_slots(max(len(p) for p in prompts), self.seq)
        layout = cache_layout(self.cfg, mesh, bp, s)
        new = cache_layout(self.cfg, mesh, b, max_new_tokens)
        pad = np.array([s - len(p) for p in prompts], np.int32)
        j = np.arange(s, dtype=np.int32)[None, :]
        tokens = np.zeros((bp, s), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, pad[i]:] = p
        segments = (j >= pad[:, None]).astype(np.int32)
        put = lambda a: jax.device_put(a, NamedSharding(mesh, act_spec(mesh)))  # noqa: E731
        vision, deltas = None, np.zeros(bp, np.int32)
        if vision_model:
            from ..models.vision import vision_shardings
            positions, vision, deltas = vision_inputs(
                self.cfg, self.vision_shards, tokens, segments, [len(p) for p in prompts],
                media)
            shardings = vision_shardings(mesh, self.cfg.vision.split)
            positions = jax.device_put(positions, shardings["positions"])
            if vision is not None:
                vision = jax.device_put(vision, shardings["vision"])
        else:
            positions = put(np.maximum(j - pad[:, None], 0).astype(np.int32))
        batch = [put(tokens), positions, put(segments)]
        rep = lambda a: jax.device_put(a, NamedSharding(mesh, P()))  # noqa: E731
        rows_a = rep(np.asarray([r * g + k for r in rows for k in range(g)], np.int32))
        pad_a, deltas_a = rep(np.repeat(pad, g)), rep(np.repeat(deltas, g))
        seed_a = rep(np.uint32(seed))

        patches = None if vision is None else vision["pixels"].shape[0]
        prefill = self._compiled(("prefill", bp, s, max_new_tokens, g, sampling, patches),
                                 lambda: prefill_program(self.graphdef, layout, new, mesh,
                                                         sampling, g),
                                 self.params, *batch, rows_a, seed_a, vision)
        t = time.perf_counter()
        tok, out, prompt_caches, caches = prefill(self.params, *batch, rows_a, seed_a, vision)
        tok_host = np.asarray(tok)
        self.timings["prefill_s"] += time.perf_counter() - t

        ids = [[] for _ in range(b)]
        kept = [[] for _ in range(b)] if keep_logits else None
        done = np.arange(b) >= n * g  # the copies made for the replicas
        reason = ["length"] * b
        # The decode batch's rows: each one's answer (an index into ids) and whether it
        # brings that answer's next token (not the copies padding a batch, nor a row whose
        # answer has stopped).
        answer, going = np.arange(b), ~done
        row_args = (tok, out, pad_a, deltas_a, rows_a)
        decode = None
        t, compiling = time.perf_counter(), self.timings["compile_s"]
        for step in range(max_new_tokens):
            tok_host = np.asarray(row_args[0])
            for i in np.flatnonzero(going):
                r = answer[i]
                ids[r].append(int(tok_host[i]))
                if keep_logits:
                    kept[r].append(np.asarray(row_args[1][i]))
                if int(tok_host[i]) in eos_ids:
                    done[r], reason[r] = True, "stop"
                    going[i] = False
            if on_token is not None:
                on_token()
            if done.all() or step == max_new_tokens - 1:
                break
            plan = shrink_plan(going, bp, self.replicas) if self.shrink else None
            if plan is not None:  # finished rows stop costing: the rest in a smaller batch
                prompts_kept, kept_rows, going = plan
                prompt_caches, caches, row_args = self._gathered(
                    ("gather", b, bp, s, max_new_tokens, len(prompts_kept), len(kept_rows)),
                    prompt_caches, caches, row_args, prompts_kept, kept_rows)
                answer, b, bp = answer[kept_rows], len(kept_rows), len(prompts_kept)
                layout = cache_layout(self.cfg, mesh, bp, s)
                new = cache_layout(self.cfg, mesh, b, max_new_tokens)
                decode = None
            tok, out, pad_now, deltas_now, rows_now = row_args
            args = (self.params, prompt_caches, caches, tok, jnp.int32(s + step), pad_now,
                    deltas_now, rows_now, jnp.int32(step + 1), seed_a)
            if decode is None:
                laid_out = jax.tree.map(lambda a: a.sharding, caches)
                key = ("decode", b, bp, s, max_new_tokens, sampling)
                self.cache_layouts[key] = (layout, new)
                decode = self._compiled(key, lambda: decode_program(self.graphdef, layout, mesh,
                                                                    sampling, laid_out), *args)
            tok, out, caches = decode(*args)
            row_args = (tok, out, pad_now, deltas_now, rows_now)
            self.timings["decode_tokens"] += int(going.sum())
            self.timings["decode_rows"] += b
        # compiling is not decoding
        self.timings["decode_s"] += (time.perf_counter() - t
                                     - (self.timings["compile_s"] - compiling))
        return [Completion(ids[i], reason[i], kept[i] if keep_logits else None)
                for i in range(n * g)]
