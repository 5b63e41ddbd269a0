"""Rotary position embedding (RoPE) and its context-extension scalings: the one
implementation every path uses (the decoder's attention, hence the ring, the train step, the
dry run and the planner). Imports no model block.

Letters as in decoder.py; R is the rotary dim (the head dim H, or its first R dims with
partial RoPE), R/2 the number of frequencies.

Frequencies (``inv_freq``) follow transformers' ``ROPE_INIT_FUNCTIONS`` (modeling_rope_utils,
checked against 5.24) operation by operation in float32, so a checkpoint sees the numbers it
was trained with:
  default  inv_i = 1 / theta ** (2i / R), the exponent rounded to fp32 first, as torch does;
  linear   inv_i / factor (position interpolation);
  llama3   wavelengths 2 pi / inv_i longer than original / low_freq_factor are divided by
           factor, shorter than original / high_freq_factor kept, those between blended;
  yarn     a blend of inv_i / factor and inv_i over a linear ramp between the dims that make
           beta_fast and beta_slow turns within original_max_position_embeddings (rounded
           outwards with truncate), and cos / sin multiplied by an attention factor
           (0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio, or attention_factor).

Angles. transformers forms fp32(position x inv_freq) and takes its cos / sin; that rounding
costs up to half an ulp of the angle (2e-3 rad at 60k, 0.12-0.25 rad around 4M for the
fastest frequency). At positions from ``model.rope_exact_from`` (default 2^17 = 131,072) the product
is instead reduced modulo one turn before any rounding: the position is split into three
12-bit pieces and each frequency, in turns, into a part on a 2^-12 grid plus a small rest
(computed in float64 on the host), so every piece times grid part is an exact fp32 product
whose whole turns drop out exactly; only the small rests round. Those angles are accurate to
~1e-6 rad at any int32 position, for the same fp32 frequencies. Below the threshold the
angles are formed as transformers forms them (the same fp32 product of frequencies that
agree to an ulp): exact angles there would move the logits from its by 1.6e-4 to 1.8e-3
(relative) at 60k-120k, more than the 1e-4 parity we keep. benchmarks/rope_precision.py
measures both (docs/CONTEXT.md).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ROPE_EXACT_FROM, ROPE_TYPES, RopeScalingConfig

_PIECE = 12  # bits per position piece: piece x (2^-12 grid value) is exact in fp32 (24 bits)


def _powers(dim: int, theta: float, f=np.float32) -> np.ndarray:
    """[R/2] theta ** (2i / R) in dtype ``f``; in fp32 the exponent is rounded to fp32 first
    as torch does, the power then correctly rounded (torch's fp32 pow is within an ulp)."""
    exponent = np.arange(0, dim, 2).astype(f) / f(dim)                              # [R/2]
    return f(np.float64(theta) ** exponent.astype(np.float64))


def _yarn_range(s: RopeScalingConfig, dim: int, theta: float) -> tuple[float, float]:
    """The dims (in frequency index) where the ramp from interpolation to extrapolation
    starts and ends: where a frequency makes beta_fast, resp. beta_slow, turns over
    original_max_position_embeddings."""
    def dim_of(turns):
        return dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inv_freq(dim: int, theta: float, scaling: RopeScalingConfig | None = None,
             dtype=np.float32) -> np.ndarray:
    """Inverse frequencies of RoPE with a scaling.

    Args:
      dim: the rotary dim R (even; the head dim unless RoPE is partial).
      theta: the RoPE base.
      scaling: the scaling (None or type "default": unscaled).
      dtype: float32 (the model's, as transformers rounds each step) or float64 (the same
        formula evaluated in float64: the reference of benchmarks/rope_precision.py).
    Returns:
      [R/2] numpy array of ``dtype``, as transformers' init function for the type returns it.
    Raises:
      ValueError: an unknown scaling type.
    """
    s, f = scaling or RopeScalingConfig(), np.dtype(dtype).type
    power = _powers(dim, theta, f)                                                   # [R/2]
    base = f(1.0) / power
    if s.type == "default":
        return base
    factor = f(s.factor)
    if s.type == "linear":
        return base / factor
    if s.type == "llama3":
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = f(old / s.low_freq_factor), f(old / s.high_freq_factor)
        # torch's scalar / tensor is reciprocal(tensor) x scalar, in fp32
        wavelen = (f(1) / base) * f(2 * math.pi)                                     # [R/2]
        scaled = np.where(wavelen > low_wavelen, base / factor, base)
        span = f(s.high_freq_factor - s.low_freq_factor)
        smooth = ((f(1) / wavelen) * f(old) - f(s.low_freq_factor)) / span          # [R/2]
        smoothed = (f(1) - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(f)
    if s.type == "yarn":
        extrapolation = f(1.0) / power
        interpolation = f(1.0) / (factor * power)
        low, high = _yarn_range(s, dim, theta)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        ramp = np.clip((np.arange(dim // 2).astype(f) - f(low)) / f(high - low), 0, 1)  # [R/2]
        keep = f(1) - ramp                               # 1 = extrapolate (fast dims kept)
        return (interpolation * (f(1) - keep) + extrapolation * keep).astype(f)
    raise ValueError(f"RoPE scaling type {s.type!r} is not implemented; supported: "
                     f"{', '.join(ROPE_TYPES)}")


def attention_factor(scaling: RopeScalingConfig | None) -> float:
    """The factor cos and sin are multiplied by: 1, except for yarn (attention_factor, else
    0.1 mscale ln(factor) + 1 over the same with mscale_all_dim when both are set, else
    0.1 ln(factor) + 1; 1 when factor <= 1)."""
    s = scaling or RopeScalingConfig()
    if s.type != "yarn":
        return 1.0
    if s.attention_factor:
        return float(s.attention_factor)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)


def _turn_tables(freqs: np.ndarray) -> np.ndarray:
    """[3, 2, R/2] float32: for position piece k (weight 2^(12k)), the frequency in turns per
    unit of that piece, frac(2^(12k) x inv / 2 pi) (float64), as a value on a 2^-12 grid
    (row 0) plus the rest (row 1, |rest| <= 2^-13)."""
    turns = freqs.astype(np.float64) / (2 * np.pi)                                  # [R/2]
    out = []
    for k in range(3):
        per_piece = np.mod(turns * 2.0 ** (_PIECE * k), 1.0)
        grid = np.round(per_piece * 2 ** _PIECE) / 2 ** _PIECE
        out.append([grid, per_piece - grid])
    return np.asarray(out, np.float32)


def _exact_angles(positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """position x inv_freq reduced to [-pi, pi] before rounding (module docstring).

    Args:
      positions: [B, S] ints (int32 range); freqs: [R/2] float32.
    Returns:
      [B, S, R/2] float32, within ~1e-6 rad of the exact product modulo 2 pi.
    """
    table = jnp.asarray(_turn_tables(freqs))                                          # [3, 2, R/2]
    p = positions.astype(jnp.int32)
    mask = (1 << _PIECE) - 1
    pieces = [p & mask, (p >> _PIECE) & mask, p >> (2 * _PIECE)]                      # [B, S] each
    whole = jnp.zeros((), jnp.float32)
    rest = jnp.zeros((), jnp.float32)
    for k, piece in enumerate(pieces):
        x = piece.astype(jnp.float32)[..., None]                                      # [B, S, 1]
        grid_turns = x * table[k, 0]                 # exact: 12-bit piece x 12-bit grid value
        whole = whole + (grid_turns - jnp.floor(grid_turns))   # fractions on the grid: exact
        rest = rest + x * table[k, 1]                                                 # |.| < 1.5
    t = (whole - jnp.floor(whole)) + rest                                             # [B, S, R/2]
    t = t - jnp.round(t)                                                              # [-1/2, 1/2]
    return t * jnp.float32(2 * np.pi)


def angles(positions: jax.Array, freqs: np.ndarray,
           exact_from: int | None = ROPE_EXACT_FROM) -> jax.Array:
    """RoPE angles position x inv_freq (cos and sin of them are what RoPE needs).

    Args:
      positions: [B, S] ints (int32 range).
      freqs: [R/2] float32 inverse frequencies (``inv_freq``).
      exact_from: positions at or above it get the angle reduced modulo a turn before any
        rounding (module docstring); those below, and all with None, transformers'
        fp32(position x inv_freq). 0 = exact everywhere.
    Returns:
      [B, S, R/2] float32 (an angle modulo 2 pi where exact).
    """
    rounded = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)          # [B, S, R/2]
    if exact_from is None:
        return rounded
    exact = _exact_angles(positions, freqs)                                           # [B, S, R/2]
    if exact_from <= 0:
        return exact
    return jnp.where((positions >= exact_from)[..., None], exact, rounded)


def rotate(x: jax.Array, a: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotates x by angles ``a``, half-split convention: dims (i, i + R/2) turn by a_i.

    Args:
      x: [B, S, N, R] (any float dtype); a: [B, S, R/2] float32 angles.
      scale: cos and sin are multiplied by it (``attention_factor``).
    Returns:
      [B, S, N, R] in x's dtype, computed in float32.
    """
    r = x.shape[-1]
    cos = jnp.concatenate([jnp.cos(a)] * 2, axis=-1)[:, :, None, :] * jnp.float32(scale)
    sin = jnp.concatenate([jnp.sin(a)] * 2, axis=-1)[:, :, None, :] * jnp.float32(scale)
    x32 = x.astype(jnp.float32)                                                       # [B, S, N, R]
    x1, x2 = x32[..., : r // 2], x32[..., r // 2:]
    return (x32 * cos + jnp.concatenate([-x2, x1], axis=-1) * sin).astype(x.dtype)


def sectioned_angles(positions: jax.Array, freqs: np.ndarray, sections: tuple[int, ...],
                     exact_from: int | None = ROPE_EXACT_FROM) -> jax.Array:
    """Angles where each run of frequencies reads its own position component (M-RoPE).

    Args:
      positions: [B, S, C] ints, C components (Qwen2.5-VL: temporal, height, width).
      freqs: [R/2] inverse frequencies.
      sections: frequencies per run, summing to R/2; run i reads component i % C (as
        transformers' ``mrope_section``).
    Returns:
      [B, S, R/2] float32.
    """
    if sum(sections) != len(freqs):
        raise ValueError(f"M-RoPE sections {tuple(sections)} must sum to the {len(freqs)} "
                         f"frequencies (half the rotary dim), got {sum(sections)}")
    bounds = np.cumsum((0, *sections))
    c = positions.shape[-1]
    return jnp.concatenate([angles(positions[..., i % c], freqs[lo:hi], exact_from)
                            for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))],
                           axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0,
               scaling: RopeScalingConfig | None = None, rotary_dim: int | None = None,
               exact_from: int | None = ROPE_EXACT_FROM,
               sections: tuple[int, ...] = ()) -> jax.Array:
    """Rotary embedding, half-split convention (Llama / Qwen / Gemma in transformers).

    Args:
      x: [B, S, N, H] (any float dtype).
      positions: [B, S] ints; or [B, S, C] with ``sections`` (M-RoPE, Qwen2.5-VL: each run
        of frequencies reads one component; a text token has equal components, which gives
        plain RoPE).
      theta: the RoPE base; scaling: its scaling (None = unscaled).
      rotary_dim: rotate only x[..., :rotary_dim] (even), pass the rest through unchanged
        (partial RoPE, e.g. Qwen3-Next); None = all H dims.
      exact_from: see ``angles`` (``model.rope_exact_from``).
      sections: M-RoPE frequency runs (``model.mrope_section``); used with [B, S, C]
        positions only.
    Returns:
      [B, S, N, H] in x's dtype.
    """
    h = x.shape[-1]
    r = h if rotary_dim is None else rotary_dim
    if r % 2 or not 0 < r <= h:
        raise ValueError(f"rotary_dim must be even and in (0, head dim {h}], got {r}")
    freqs = inv_freq(r, theta, scaling)
    if positions.ndim == 3:
        if not sections:
            raise ValueError(f"positions of shape {tuple(positions.shape)} have a component "
                             f"axis, which needs M-RoPE sections (model.mrope_section)")
        a = sectioned_angles(positions, freqs, sections, exact_from)                # [B, S, R/2]
    else:
        a = angles(positions, freqs, exact_from)                                      # [B, S, R/2]
    rotated = rotate(x[..., :r], a, attention_factor(scaling))
    return rotated if r == h else jnp.concatenate([rotated, x[..., r:]], axis=-1)
