"""Compare ``ulysses_attention`` with other implementations on the same inputs and cotangent.

    python -m ulysses_jax.compare deepspeed --p 4 --heads 8 --kv-heads 2 --seq-len 256 \
        --head-dim 32 --batch 1 --dtype float32 --causal --repeats 5

``deepspeed``: DeepSpeed's own ``DistributedAttention`` (deepspeed.sequence.layer) with torch
SDPA as its local attention, one gloo process per rank on CPU (see ``_ds_worker.py``), against
``ulysses_attention`` on P CPU devices of this process and the dense ``reference_attention``.
JAX and torch never share a process. It prints max abs / relative errors of out, dq, dk, dv for
each pair, the median wall time of one forward+backward of each side, and exits non-zero when
an error is over the tolerance.

``hf``: a local Hugging Face checkpoint run by transformers (torch, fp32) and by
``ulysses_jax.hf.from_pretrained`` on (data=1, seq=P) CPU meshes; prints the logits' max abs /
relative errors and each side's next-token loss on the same random tokens (a Qwen2.5-VL
checkpoint: with a random image and video in the first row). Both run in this process (no
collectives on the torch side):

    python -m ulysses_jax.compare hf --model-path DIR --seq 1,2,4 --seq-len 64

Each subcommand is one ``_add_<name>`` parser function plus one ``cmd_<name>`` function; the
case, error and table helpers are meant to be shared by later subcommands.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import statistics
import sys
import time

import numpy as np

from ._ds_worker import TENSORS, DeepSpeedUnavailable, DeepSpeedWorkers
from ..mesh import request_cpu_devices

# dtype -> (max abs error of out, max relative error of dq/dk/dv); relative = max|a-b| / max|b|.
TOLERANCES = {"float32": (1e-5, 1e-4)}
EXIT_OK, EXIT_OVER_TOLERANCE, EXIT_BAD_ARGS, EXIT_CANNOT_RUN = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: shapes, masking, dtype, seed and timing repeats."""
    p: int = 4
    heads: int = 8
    kv_heads: int = 2
    seq_len: int = 256
    head_dim: int = 32
    batch: int = 1
    dtype: str = "float32"
    causal: bool = True
    seed: int = 0
    repeats: int = 5
    warmup: int = 2
    kv_repeat: bool = True  # repeat kv heads for DeepSpeed when it refuses kv_heads < P
    impl: str = "auto"      # ulysses_attention's local kernel

    def __post_init__(self):
        for name in ("p", "heads", "kv_heads", "seq_len", "head_dim", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, "
                             f"{self.warmup}")
        if self.seq_len % self.p:
            raise ValueError(f"sequence length {self.seq_len} is not divisible by P={self.p}")
        if self.heads % self.kv_heads:
            raise ValueError(f"query heads {self.heads} not divisible by kv heads {self.kv_heads}")
        if self.dtype not in TOLERANCES:
            raise ValueError(f"dtype {self.dtype!r} not supported; expected one of "
                             f"{list(TOLERANCES)}")


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Standard-normal q [B, S, N, H], k, v [B, S, K, H] and cotangent do [B, S, N, H] (float32)."""
    rng = np.random.default_rng(case.seed)
    q_shape = (case.batch, case.seq_len, case.heads, case.head_dim)
    kv_shape = (case.batch, case.seq_len, case.kv_heads, case.head_dim)
    shapes = {"q": q_shape, "k": kv_shape, "v": kv_shape, "do": q_shape}
    return {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}


def max_errors(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max|a - b|, max|a - b| / max|b|), computed in float64; b is the side compared against."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {b.shape}")
    diff = float(np.max(np.abs(a - b)))
    return diff, diff / float(np.max(np.abs(b)))


# ----------------------------------------------------------------------------- JAX side

def _jax_fwd_bwd(attn):
    import jax

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out, *vjp(do))
    return jax.jit(fwd_bwd)


def _timed(fn, args, warmup: int, repeats: int) -> tuple[tuple, list[float]]:
    import jax
    result = jax.block_until_ready(fn(*args))  # compiles
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return result, times


def cpu_devices(n: int):
    """The first n JAX CPU devices; the comparison runs on CPU whatever else is visible."""
    import jax
    devs = jax.devices("cpu")
    if len(devs) < n:
        raise ValueError(
            f"needs {n} JAX CPU devices, only {len(devs)} exist: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts")
    return devs[:n]


def run_jax(case: Case, inputs: dict[str, np.ndarray], devices
            ) -> tuple[dict | None, list[float], str | None]:
    """``ulysses_attention`` forward + vjp on a (data=1, seq=P) mesh of ``devices``.

    Returns (out/dq/dk/dv as float32 numpy, fwd+bwd seconds per repeat, None), or
    (None, [], message) when ulysses_attention rejects the shapes.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from ..mesh import act_spec, make_mesh
    from ..attention import ulysses_attention

    mesh = make_mesh(seq=case.p, data=1, devices=devices)
    sharding = NamedSharding(mesh, act_spec(mesh))
    args = [jax.device_put(jnp.asarray(inputs[n], case.dtype), sharding)
            for n in ("q", "k", "v", "do")]
    fn = _jax_fwd_bwd(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=case.causal,
                                                         impl=case.impl))
    try:
        result, times = _timed(fn, args, case.warmup, case.repeats)
    except ValueError as e:  # a validator's rule; the CLI reports it instead of comparing
        return None, [], str(e)
    return {n: np.asarray(x, np.float32) for n, x in zip(TENSORS, result)}, times, None


def run_reference(case: Case, inputs: dict[str, np.ndarray], device) -> dict[str, np.ndarray]:
    """Dense ``reference_attention`` forward + vjp on one device."""
    import jax
    import jax.numpy as jnp
    from ..attention.kernels import reference_attention

    args = [jax.device_put(jnp.asarray(inputs[n], case.dtype), device)
            for n in ("q", "k", "v", "do")]
    fn = _jax_fwd_bwd(lambda q, k, v: reference_attention(q, k, v, causal=case.causal))
    return {n: np.asarray(x, np.float32) for n, x in zip(TENSORS, fn(*args))}


# ----------------------------------------------------------------------------- comparison

@dataclasses.dataclass
class Report:
    """Errors per (pair, tensor) as (max abs, max rel); median seconds per side; notes."""
    case: Case
    errors: dict[tuple[str, str], tuple[float, float]]
    median_s: dict[str, float | None]
    notes: list[str]
    failures: list[str]       # over-tolerance entries, one line each
    cannot_run: list[str]     # sides that rejected the case, with their reason
    versions: dict[str, str]

    @property
    def passed(self) -> bool:
        return not self.failures and not self.cannot_run


def compare_results(sides: dict[str, dict[str, np.ndarray]], tolerances: tuple[float, float]):
    """Errors of every ordered pair of ``sides`` (later keys are the "b" of max_errors).

    Returns ({(pair, tensor): (abs, rel)}, failures), where out fails on abs > tolerances[0]
    and dq/dk/dv on rel > tolerances[1].
    """
    names = list(sides)
    errors, failures = {}, []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pair = f"{a} vs {b}"
            for t in TENSORS:
                err = max_errors(sides[a][t], sides[b][t])
                errors[(pair, t)] = err
                if t == "out":
                    kind, value, tol = "abs", err[0], tolerances[0]
                else:
                    kind, value, tol = "rel", err[1], tolerances[1]
                if not value <= tol:
                    failures.append(f"{pair}: {t} max {kind} error {value:.2e} > {tol:.0e}")
    return errors, failures


def compare_deepspeed(case: Case, workers: DeepSpeedWorkers, devices=None) -> Report:
    """Runs one case on DeepSpeed (``workers``), ulysses_jax (``devices``, default the first P
    CPU devices) and the dense reference, and compares out, dq, dk, dv."""
    import jax
    devices = cpu_devices(case.p) if devices is None else devices
    inputs = make_inputs(case)
    ds = workers.run(case, inputs)  # first, so the JAX timings do not overlap worker start-up
    ours, our_times, our_error = run_jax(case, inputs, devices)
    sides = {"ulysses_jax": ours, "deepspeed": ds.results,
             "reference": run_reference(case, inputs, devices[0])}
    notes, cannot_run = [], []
    if ds.native_error and ds.results is not None:
        notes.append(f"DeepSpeed's DistributedAttention refuses kv_heads={case.kv_heads} < "
                     f"P={case.p} (AssertionError: {ds.native_error!r}). Here it got each kv head "
                     f"repeated {ds.kv_repeat}x by the caller, the replication ulysses_jax does "
                     f"inside; on both sides dk and dv are summed back onto the {case.kv_heads} "
                     f"original heads.")
    if ds.unsupported:
        cannot_run.append(f"deepspeed: {ds.unsupported}")
    if our_error:
        cannot_run.append(f"ulysses_jax: {our_error}")
    errors, failures = compare_results({k: v for k, v in sides.items() if v is not None},
                                       TOLERANCES[case.dtype])
    median = lambda ts: statistics.median(ts) if ts else None
    versions = dict(workers.versions, jax=jax.__version__, kernel="n/a")
    if our_error is None:
        from ..attention.kernels import resolve_impl
        versions["kernel"] = resolve_impl(case.impl, case.dtype, case.head_dim, backend="cpu")
    return Report(case, errors, {"ulysses_jax": median(our_times), "deepspeed": median(ds.times)},
                  notes, failures, cannot_run, versions)


def format_report(r: Report) -> str:
    c = r.case
    abs_tol, rel_tol = TOLERANCES[c.dtype]
    lines = [
        f"ulysses_jax vs DeepSpeed DistributedAttention: P={c.p} B={c.batch} S={c.seq_len} "
        f"heads={c.heads} kv_heads={c.kv_heads} head_dim={c.head_dim} {c.dtype} "
        f"{'causal' if c.causal else 'not causal'} seed={c.seed}",
        f"jax {r.versions.get('jax')} on {c.p} CPU devices, impl={c.impl} "
        f"({r.versions.get('kernel')}) | torch {r.versions.get('torch')}, "
        f"deepspeed {r.versions.get('deepspeed')} on {c.p} gloo CPU processes, "
        f"local attention = torch SDPA",
    ]
    lines += [f"note: {n}" for n in r.notes]
    lines += [f"CANNOT RUN: {m}" for m in r.cannot_run]
    pairs = list(dict.fromkeys(p for p, _ in r.errors))
    if pairs:
        lines += ["", f"errors: abs = max|a-b|, rel = max|a-b| / max|b| for 'a vs b' "
                      f"(tolerance: out abs <= {abs_tol:.0e}, dq/dk/dv rel <= {rel_tol:.0e})",
                  f"{'':7}" + "".join(f"{p:>26}" for p in pairs),
                  f"{'':7}" + "".join(f"{'abs':>14}{'rel':>12}" for _ in pairs)]
        for t in TENSORS:
            cells = (r.errors[(p, t)] for p in pairs)
            lines.append(f"{t:7}" + "".join(f"{a:>14.2e}{b:>12.2e}" for a, b in cells))
    lines += ["", f"median wall time of one forward+backward, {c.repeats} runs after {c.warmup} "
                  f"warm-up (CPU, {os.cpu_count()} cores shared by all ranks; noisy, not a "
                  f"benchmark):"]
    for side, s in r.median_s.items():
        lines.append(f"  {side:12} " + (f"{s * 1e3:9.2f} ms" if s is not None else "      n/a"))
    lines.append("")
    if r.failures:
        lines += ["FAIL: " + f for f in r.failures]
    elif r.cannot_run:
        lines.append("INCOMPLETE: a side could not run this case (see above)")
    else:
        lines.append("PASS: all errors within tolerance")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI

def _add_shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--p", type=int, default=4, help="Ulysses degree: ranks / devices (default 4)")
    p.add_argument("--heads", type=int, default=8, help="query heads N")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads K (N %% K == 0)")
    p.add_argument("--seq-len", type=int, default=256, help="global sequence length S")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=sorted(TOLERANCES))
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0, help="numpy seed of q, k, v and the cotangent")
    p.add_argument("--repeats", type=int, default=5, help="timed forward+backward runs per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before them")
    p.add_argument("--impl", default="auto", help="ulysses_attention's local kernel (default auto)")


def _add_deepspeed(sub) -> None:
    p = sub.add_parser("deepspeed", help="against deepspeed.sequence.layer.DistributedAttention",
                       description="Compare ulysses_attention with DeepSpeed's DistributedAttention"
                                   " (gloo, CPU, one process per rank) and the dense reference.")
    _add_shape_args(p)
    p.add_argument("--ds-kv-repeat", action=argparse.BooleanOptionalAction, default=True,
                   help="when DeepSpeed refuses kv heads < P, repeat each kv head P/K times "
                        "before calling it (default); --no-ds-kv-repeat reports the refusal")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the ranks")
    p.set_defaults(func=cmd_deepspeed)


def cmd_deepspeed(args: argparse.Namespace) -> int:
    request_cpu_devices(args.p)
    try:
        case = Case(p=args.p, heads=args.heads, kv_heads=args.kv_heads, seq_len=args.seq_len,
                    head_dim=args.head_dim, batch=args.batch, dtype=args.dtype, causal=args.causal,
                    seed=args.seed, repeats=args.repeats, warmup=args.warmup,
                    kv_repeat=args.ds_kv_repeat, impl=args.impl)
        cpu_devices(case.p)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    try:
        with DeepSpeedWorkers(case.p, timeout=args.timeout) as workers:
            report = compare_deepspeed(case, workers)
    except DeepSpeedUnavailable as e:
        print(f"error: the DeepSpeed workers cannot import torch/deepspeed ({e}); install them "
              f"with the commands in requirements-baseline.txt", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except (RuntimeError, TimeoutError) as e:  # a rank crashed or hung; e carries its log
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    print(format_report(report))
    if report.failures:
        return EXIT_OVER_TOLERANCE
    return EXIT_CANNOT_RUN if report.cannot_run else EXIT_OK


# ----------------------------------------------------------------------------- Hugging Face

HF_TOLERANCE = 1e-4  # max|ours - transformers| / max|transformers| of float32 logits


def next_token_loss(logits: np.ndarray, tokens: np.ndarray) -> float:
    """Mean cross-entropy of tokens[:, 1:] under logits[:, :-1] ([B, S, V] and [B, S]), float64."""
    z = np.asarray(logits, np.float64)[:, :-1]                                   # [B, S-1, V]
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, tokens[:, 1:, None], -1).mean())


def vision_inputs(cfg, tokens: np.ndarray, rng: np.random.Generator) -> tuple[dict, str]:
    """Random media for a multimodal model (``cfg.vision``), written into row 0 of ``tokens``
    [B, S] in place: an image of a x (a + 1) merged units straddling the middle of the row
    (hence the shard boundaries of P = 2 and 4), and after it, where the row has room, a video
    of two temporal patches of 2 x 2 units, 0.5 s apart; the other rows stay text. The pixel values are random
    normal patches (what the tower takes; no image file is needed).

    Returns:
      (the keywords of transformers' forward and of ``multimodal.prepare``, a description).
    Raises:
      ValueError: the row is too short for an image (S < 16).
    """
    v = cfg.vision
    m, s = v.spatial_merge_size, tokens.shape[1]
    k = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    if s < 16:
        raise ValueError(f"a multimodal comparison puts an image into a row of --seq-len "
                         f"tokens; {s} is too short (at least 16)")
    a = 1
    while (a + 1) * (a + 2) + 2 <= s // 2:
        a += 1
    start = max(1, s // 2 - (a * (a + 1) + 2) // 2)

    def place(at, token, n):
        tokens[0, at] = cfg.vision_start_token_id
        tokens[0, at + 1:at + 1 + n] = token
        tokens[0, at + 1 + n] = cfg.vision_end_token_id
        return at + 2 + n

    grid = np.array([[1, a * m, (a + 1) * m]], np.int64)
    end = place(start, cfg.image_token_id, a * (a + 1))
    images = {"pixel_values": rng.standard_normal((int(grid.prod()), k)).astype(np.float32),
              "image_grid_thw": grid}
    what = (f"row 0: an image of {a} x {a + 1} tokens ({grid[0, 1]} x {grid[0, 2]} patches) "
            f"at {start}..{end - 1}")
    if end + 10 <= s:
        vgrid = np.array([[2, 2 * m, 2 * m]], np.int64)
        place(end, cfg.video_token_id, 8)
        images.update(pixel_values_videos=rng.standard_normal(
            (int(vgrid.prod()), k)).astype(np.float32), video_grid_thw=vgrid,
            second_per_grid_ts=np.array([0.5]))
        what += f", a video of two temporal patches of 2 x 2 tokens at {end}..{end + 9}"
    return images, what + ("; other rows text" if tokens.shape[0] > 1 else "")


def compare_hf(model_path: str, seqs=(1, 2, 4), seq_len: int = 64, batch: int = 1, seed: int = 0,
               attn: str = "eager", impl: str = "auto") -> tuple[list[str], bool]:
    """transformers' CausalLM (torch, fp32) against ``ulysses_jax.hf.from_pretrained`` on
    (data=1, seq=P) CPU meshes for each P in ``seqs``, on the same random tokens [B, S].
    A multimodal checkpoint (Qwen2.5-VL) runs as transformers' image-text-to-text model, and
    row 0 carries an image and a video (``vision_inputs``).

    Returns:
      (report lines, passed): logits max abs / rel error per P, transformers' own loss (labels =
      tokens) and ours from our logits (same shift);
      passed is False when a relative error exceeds HF_TOLERANCE.
    Raises:
      ValueError: the checkpoint is refused by ulysses_jax.hf, or S is not divisible by a P.
    """
    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from flax import nnx
    from .hf import config_from_hf, from_pretrained
    from ..mesh import make_mesh
    from ..families import family
    from ..models.multimodal import prepare

    for p in seqs:
        if seq_len % p:
            raise ValueError(f"sequence length {seq_len} is not divisible by the seq axis size {p}")
    # Refuse what ulysses_jax cannot express before spending time on the torch side.
    config_path = os.path.join(model_path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{model_path} has no config.json")
    with open(config_path) as f:
        cfg = config_from_hf(json.load(f), max_seq_len=seq_len)
    multimodal = family(cfg.family).vision
    # transformers 5 renamed torch_dtype to dtype; the GPU machine may have either version.
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    auto = (transformers.AutoModelForImageTextToText if multimodal else
            transformers.AutoModelForCausalLM)
    ref = auto.from_pretrained(model_path, attn_implementation=attn,
                               **{dtype_kw: torch.float32}).eval()
    rng = np.random.default_rng(seed)
    specials = ([cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                 cfg.vision_end_token_id] if multimodal else [])
    vocab = ref.config.get_text_config().vocab_size
    tokens = (rng.choice(np.setdiff1d(np.arange(vocab), specials), (batch, seq_len)) if
              multimodal else rng.integers(0, vocab, (batch, seq_len))).astype(np.int32)
    images, what = vision_inputs(cfg, tokens, rng) if multimodal else ({}, "")
    kwargs = {k: torch.from_numpy(np.asarray(x)) for k, x in images.items()}
    if multimodal and "mm_token_type_ids" in inspect.signature(ref.forward).parameters:
        kwargs["mm_token_type_ids"] = torch.from_numpy(np.where(
            tokens == cfg.image_token_id, 1, np.where(tokens == cfg.video_token_id, 2, 0)))
    with torch.no_grad():
        out = ref(torch.from_numpy(tokens).long(), labels=torch.from_numpy(tokens).long(),
                  **kwargs)
    want = out.logits.float().numpy()
    lines = [f"ulysses_jax vs transformers {type(ref).__name__}: {model_path}",
             f"B={batch} S={seq_len} float32 seed={seed} | torch {torch.__version__}, transformers "
             f"{transformers.__version__} ({attn} attention) | jax {jax.__version__} on CPU, impl={impl}",
             *([what] if what else []),
             "", f"{'side':22}{'max abs':>12}{'max rel':>12}{'loss':>12}",
             f"{'transformers':22}{'-':>12}{'-':>12}{float(out.loss):>12.6f}"]
    passed = True
    for p in seqs:
        mesh = make_mesh(seq=p, data=1, devices=cpu_devices(p))
        model = from_pretrained(model_path, mesh=mesh, dtype=jnp.float32, max_seq_len=seq_len,
                                attn_impl=impl)
        if multimodal:  # M-RoPE positions and the tower's inputs, on the host (per mesh)
            positions, vision = prepare(tokens, model.cfg, shards=model.visual.shards(),
                                        **images)
            got = np.asarray(nnx.jit(lambda m, t, pos, vis: m(t, positions=pos, vision=vis))(
                model, jnp.asarray(tokens), positions, vision))
        else:
            got = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
        err_abs, err_rel = max_errors(got, want)
        passed &= err_rel <= HF_TOLERANCE
        lines.append(f"{f'ulysses_jax seq={p}':22}{err_abs:>12.2e}{err_rel:>12.2e}"
                     f"{next_token_loss(got, tokens):>12.6f}")
    lines += ["", f"PASS: logits max rel error <= {HF_TOLERANCE:.0e}" if passed else
              f"FAIL: logits max rel error > {HF_TOLERANCE:.0e} (see above)"]
    return lines, passed


def _add_hf(sub) -> None:
    p = sub.add_parser("hf", help="against a transformers CausalLM loaded from the same checkpoint",
                       description="Load a local Hugging Face checkpoint with transformers (torch, "
                                   "fp32) and with ulysses_jax.hf on seq-parallel CPU meshes; "
                                   "compare logits and loss on the same random tokens.")
    p.add_argument("--model-path", required=True, help="dir with config.json + *.safetensors")
    p.add_argument("--seq", default="1,2,4", help="comma-separated seq axis sizes (default 1,2,4)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="numpy seed of the tokens")
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                   help="transformers' attention implementation")
    p.add_argument("--impl", default="auto", help="ulysses_attention's local kernel (default auto)")
    p.set_defaults(func=cmd_hf)


def cmd_hf(args: argparse.Namespace) -> int:
    try:
        seqs = [int(s) for s in args.seq.split(",")]
        if min(seqs) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --seq must be comma-separated positive integers, got {args.seq!r}",
              file=sys.stderr)
        return EXIT_BAD_ARGS
    request_cpu_devices(max(seqs))
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"error: the hf comparison needs torch and transformers ({e})", file=sys.stderr)
        return EXIT_CANNOT_RUN
    try:
        lines, passed = compare_hf(args.model_path, seqs, args.seq_len, args.batch, args.seed,
                                   args.attn, args.impl)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except OSError as e:  # transformers cannot read the checkpoint
        print(f"error: transformers could not load {args.model_path}: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    print("\n".join(lines))
    return EXIT_OK if passed else EXIT_OVER_TOLERANCE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ulysses_jax.compare",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_deepspeed(sub)
    _add_hf(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
