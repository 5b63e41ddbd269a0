"""AdamW, its schedule, and where its state lives (device or host memory, moment precision).

``make_optimizer`` is optax's AdamW behind global-norm clipping, with weight decay on the
weight matrices and embeddings only. Two options trade precision or placement for memory
(optimizer.moment_dtype, optimizer.offload):

- moments in bfloat16: AdamW's first and second moments stored in bf16 (half the bytes of
  the optimizer state), updated in fp32 (``scale_by_adam_stored``); with fp32 storage it is
  optax's own ``scale_by_adam``.
- offload: the fp32 parameters (master weights) and both moments live in host memory
  (``pinned_host``) and the update is computed there (``host_compute.py``). The
  device gets a copy of each layer weight in the compute dtype (cast on the host, so half
  the bytes cross the link in bf16; a weight stored narrower, LoRA's bf16 frozen base,
  crosses as stored) and returns its gradient in that dtype, which the host turns back into
  fp32. Norm scales, biases, the embedding and the output head stay fp32 on both sides: they
  are small, and the vocabulary ones accumulate gradients over many tokens.
  ``compute_copy_mask`` says which leaves are cast. With LoRA only the trained leaves have
  moments and gradients, and only they are updated; the frozen ones pass through.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ..config import OptimizerConfig


def make_schedule(opt: OptimizerConfig, steps: int) -> optax.Schedule:
    """Linear warmup to ``lr`` then cosine decay to ``lr * min_lr_ratio`` at schedule_steps."""
    total = opt.schedule_steps or steps
    warmup = min(opt.warmup_steps, max(total - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opt.lr, warmup_steps=warmup,
        decay_steps=max(total, warmup + 1), end_value=opt.lr * opt.min_lr_ratio)


def _names(path) -> list[str]:
    return [str(getattr(k, "key", k)) for k in path]


def _decays(path, _) -> bool:
    """Weight decay for weight matrices and embeddings only: norm scales and biases are
    spared. Decided by name, since stacked layers give a norm scale [L, D] two dims."""
    return not any("norm" in n or n in ("bq", "bk", "bv") for n in _names(path))


def compute_copy_mask(params) -> dict:
    """True for the leaves the device gets in the compute dtype when the optimizer is
    offloaded: the layer weight matrices (not norm scales, biases, embedding or head)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: "layers" in _names(path) and _decays(path, x), params)


def scale_by_adam_stored(b1: float, b2: float, eps: float,
                         dtype) -> optax.GradientTransformation:
    """Adam's moment scaling with both moments stored in ``dtype``, computed in fp32.

    Same update as ``optax.scale_by_adam(b1, b2, eps)`` (bias-corrected mu / (sqrt(nu) +
    eps)), and the same state type, so the state's sharding follows the parameters.
    """
    f32 = lambda x: x.astype(jnp.float32)

    def init(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros,
                                      nu=jax.tree.map(jnp.copy, zeros))

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * f32(m) + (1 - b1) * f32(g), state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * f32(v) + (1 - b2) * jnp.square(f32(g)),
                          state.nu, updates)
        count = optax.safe_increment(state.count)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)
        out = jax.tree.map(lambda m, v, g: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype),
                           mu, nu, updates)
        store = lambda t: jax.tree.map(lambda x: x.astype(dtype), t)
        return out, optax.ScaleByAdamState(count=count, mu=store(mu), nu=store(nu))

    return optax.GradientTransformation(init, update)


def make_optimizer(opt: OptimizerConfig, steps: int,
                   clip: bool = True) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; no weight decay on norm scales and biases.

    ``clip=False`` gives the AdamW part alone: the second element of the chain's state
    (the offloaded step clips itself, see train_step)."""
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(_decays, params)
    schedule = make_schedule(opt, steps)
    if opt.moment_dtype == "float32":
        adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                            mask=decay_mask)
    else:  # optax.adamw's chain with the moments stored in moment_dtype
        adamw = optax.chain(
            scale_by_adam_stored(opt.b1, opt.b2, 1e-8, jnp.dtype(opt.moment_dtype)),
            optax.add_decayed_weights(opt.weight_decay, decay_mask),
            optax.scale_by_learning_rate(schedule))
    return optax.chain(optax.clip_by_global_norm(opt.clip_norm), adamw) if clip else adamw


def offloaded_update(opt: OptimizerConfig, steps: int):
    """The update ``optimizer.offload`` computes in host memory: ``update(grads, opt_state,
    params, grad_norm) -> (params, opt_state)``, ``make_optimizer``'s step with the global
    gradient norm given (the offloaded step sums it from each device's share:
    host_compute.global_norm) instead of taken by optax's clip; gradients in any float dtype
    (the layers' come in the compute dtype), turned into fp32 first. ``opt_state`` is
    ``make_optimizer``'s (the clip's empty state, then AdamW's)."""
    tx_adamw = make_optimizer(opt, steps, clip=False)

    def update(grads, opt_state, params, grad_norm):
        clip_state, adamw_state = opt_state
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        grads = jax.tree.map(lambda g: jax.lax.select(
            grad_norm < opt.clip_norm, g, (g / grad_norm) * opt.clip_norm), grads)
        updates, adamw_state = tx_adamw.update(grads, adamw_state, params)
        return optax.apply_updates(params, updates), (clip_state, adamw_state)
    return update
