"""The jitted sequence-parallel train step (the parameter layout: models/param_layout.py; the
optimizer: optimizer.py).

The train state is a plain pytree ``{"step", "params", "opt_state"}`` (params as a nested
dict of float32 arrays), so Orbax saves it and optax updates it with no wrappers. Parameters
are either replicated or, with ``param_sharding="zero3"``, each split along one axis over all
data x seq devices (ZeRO-3 as DeepSpeed-Ulysses runs); the optimizer state follows the
parameters. The model gathers each weight where it is used. With ``optimizer.offload`` the
parameters and optimizer state are kept in host memory and updated there (optimizer.py).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental import multihost_utils
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..config import Config, rows_per_batch
from ..data.text import FIELDS
from ..data.vision_batches import abstract_vision
from . import objectives
from .accumulate import accumulated_grads
from .objectives.base import SEQUENCE, Objective
from .optimizer import compute_copy_mask, make_optimizer, make_schedule, offloaded_update
from . import host_compute
from ..models.vision import vision_shardings
from ..mesh import act_spec, axis_size, RING
from ..attention.ring import zigzag_permutation
from ..models.decoder import Decoder
from ..interop.peft import model_targets
from ..families import family
from .. import gpu_target
from ..models import lora
from ..models.param_layout import param_shardings


def build_model(cfg: Config, mesh: Mesh, seed: int | None = None) -> Decoder:
    """The training model: on a ring mesh it expects batches in zigzag order (the loader's)."""
    layout = "zigzag" if axis_size(mesh, RING) > 1 else "natural"
    return Decoder(cfg.model, mesh=mesh, rngs=nnx.Rngs(cfg.seed if seed is None else seed),
                   layout=layout, head_chunks=cfg.ulysses.chunks,
                   stream_layers=cfg.optimizer.offload)


def model_params(cfg: Config, mesh: Mesh) -> dict:
    """The seeded initialisation's parameters (a pure dict); inside jit, laid out there."""
    return nnx.to_pure_dict(nnx.split(build_model(cfg, mesh))[1])


def state_layout(cfg: Config, mesh: Mesh):
    """Returns (graphdef, abstract state, state shardings, optimizer) without allocating.

    A run asks for it several times (the resume, the init, the host-memory check), and each
    answer traces the model's construction and the optimizer's init: the last few answers
    are kept (by config and mesh, both immutable), and each caller gets its own containers.
    """
    graphdef, abstract, shardings, tx = _state_layout(cfg, mesh)
    same = lambda x: x  # noqa: E731  (new dicts and tuples, the same leaves)
    return graphdef, jax.tree.map(same, abstract), jax.tree.map(same, shardings), tx


@functools.lru_cache(maxsize=8)
def _state_layout(cfg: Config, mesh: Mesh):
    tx = make_optimizer(cfg.optimizer, cfg.steps)

    lo = cfg.model.lora

    def init():
        graphdef, params = nnx.split(build_model(cfg, mesh))
        params = lora.store_base(nnx.to_pure_dict(params), lo)
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": tx.init(lora.trainable_params(params, lo))}

    abstract = jax.eval_shape(init)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(cfg, mesh)))
    # optimizer.offload: parameters and moments live in host memory (optimizer.py).
    kind = "pinned_host" if cfg.optimizer.offload else None
    params_sh = param_shardings(abstract["params"], mesh, cfg.param_sharding, memory_kind=kind)
    replicated = NamedSharding(mesh, P())
    # The optimizer state covers the trained parameters only (all of them without LoRA).
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract["opt_state"],
                                   lora.trainable_params(params_sh, lo),
                                   transform_non_params=lambda _: replicated.with_memory_kind(
                                       kind) if kind else replicated)
    shardings = {"step": replicated, "params": params_sh, "opt_state": opt_sh}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    return graphdef, abstract, shardings, tx


def init_state(cfg: Config, mesh: Mesh, params: dict | None = None):
    """Creates the train state directly in its sharded layout.

    Args:
      params: optional initial parameters (e.g. imported from Hugging Face) to start from;
        with LoRA (``model.lora``) the base model's, the adapters are initialised here.
    Returns:
      (graphdef, state, state shardings, optimizer).
    """
    graphdef, _, shardings, tx = state_layout(cfg, mesh)
    lo = cfg.model.lora

    def init(params):
        if params is None:
            params = model_params(cfg, mesh)
        elif lo.rank:  # the loaded base, and fresh adapters (B = 0: the base's function)
            fresh = model_params(cfg, mesh)
            params = lora.overlay(fresh, params)
        params = lora.store_base(params, lo)
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": tx.init(lora.trainable_params(params, lo))}

    state = jax.jit(init, out_shardings=shardings)(params)
    return graphdef, state, shardings, tx


def batch_shardings(mesh: Mesh, cfg: Config | None = None) -> dict:
    """One layout for every batch field (data.text.FIELDS): P("data", seq axes); for a
    multimodal family (``cfg``) also M-RoPE positions [B, S, 3] and the ``vision`` arrays
    (``vision_batches.vision_shardings``); and the fields ``cfg``'s objective declares
    (``Objective.fields``): one value per sequence P("data"), per token as the token
    fields."""
    out = {k: NamedSharding(mesh, act_spec(mesh)) for k in FIELDS}
    if cfg is None:
        return out
    if family(cfg.model.family).vision:
        out.update(vision_shardings(mesh, cfg.model.vision.split))
    for f in objectives.get(cfg).fields():
        out[f.name] = NamedSharding(mesh, P(act_spec(mesh)[0]) if f.per == SEQUENCE
                                    else act_spec(mesh))
    return out


def abstract_batch(cfg: Config, mesh: Mesh, rows: int | None = None) -> dict:
    """The batch the train step is compiled for: ``rows`` rows (default: the config's, fewer
    when packed), with the fields of ``batch_shardings`` (a value per sequence: the
    config's rows)."""
    rows = rows or rows_per_batch(cfg)
    shape = (rows, cfg.seq_len)
    shardings = batch_shardings(mesh, cfg)
    tokens = NamedSharding(mesh, act_spec(mesh))
    out = {k: jax.ShapeDtypeStruct(shape, np.float32 if k == "loss_mask" else np.int32,
                                   sharding=tokens) for k in FIELDS}
    if family(cfg.model.family).vision:  # M-RoPE positions [B, S, 3] and the vision arrays
        out.update(abstract_vision(cfg, mesh))
    for f in objectives.get(cfg).fields():
        per = (rows_per_batch(cfg),) if f.per == SEQUENCE else shape
        out[f.name] = jax.ShapeDtypeStruct(per, f.dtype, sharding=shardings[f.name])
    return out


def token_order(cfg: Config) -> np.ndarray | None:
    """The order batches are loaded in: zigzag on a ring mesh (balanced causal work), else
    natural (None). The loss is a sum over tokens, so the order does not change it."""
    if cfg.mesh.ring == 1:
        return None
    return zigzag_permutation(cfg.seq_len, cfg.mesh.ring)


def scalar(x) -> float:
    """A float from a replicated global array (works when it spans several processes)."""
    return float(np.asarray(x.addressable_data(0)))


def host(x) -> np.ndarray:
    """A global array on the host (all of it, also when it spans several processes)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def make_train_step(cfg: Config, mesh: Mesh, graphdef, tx, shardings) -> Callable:
    """Jitted ``step(state, batch) -> (state, metrics)``; the old state is donated. With
    ``grad_accum_steps`` k > 1 the batch's k micro-batches run one at a time in a scan
    (accumulate.py) and the optimizer updates once, with their accumulated gradient."""
    schedule = make_schedule(cfg.optimizer, cfg.steps)

    offload = cfg.optimizer.offload
    host_update = offloaded_update(cfg.optimizer, cfg.steps)
    dtype = jnp.dtype(cfg.model.dtype)
    on_device = _device_shardings(shardings)
    replicated = NamedSharding(mesh, P())

    def update(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    accum = cfg.grad_accum_steps
    in_batch = batch_shardings(mesh, cfg)
    objective = objectives.get(cfg)
    minimised = objective.loss

    # With LoRA only the adapters (and model.lora.trainable) are differentiated and updated;
    # the frozen parameters pass through the step untouched (models/lora.py).
    lo = cfg.model.lora
    # optimizer.offload: the host layout of the trained leaves (all of them without LoRA),
    # where their gradients go and AdamW updates them. LoRA's adapters are updated on the
    # host like every offloaded parameter, not on the device: they are a few MB, so the host
    # update costs little, the state keeps one memory kind (the layout checkpoints,
    # evaluation and the dry run know), and each layer's adapters stream to the device with
    # that layer's frozen weights anyway.
    trained_shardings = lora.trainable_params(shardings["params"], lo)
    on_host = trained_shardings if offload else None

    def step(state, batch):
        params = state["params"]
        if offload:
            params = _offloaded_params_for_compute(params, dtype, on_device)
        trained = lora.trainable_params(params, lo)  # params itself without LoRA
        full = (lambda t: lora.overlay(params, t)) if lo.rank else (lambda t: t)

        def micro_grads(trained, micro, ce_weight, aux_weight):
            (_, reported), grads = jax.value_and_grad(
                lambda t: minimised(graphdef, full(t), micro, mesh, (ce_weight, aux_weight)),
                has_aux=True)(trained)
            return reported, grads

        if accum == 1:
            (_, (loss, extra)), grads = jax.value_and_grad(
                lambda t: minimised(graphdef, full(t), batch, mesh), has_aux=True)(trained)
        else:  # grad_accum_steps micro-batches in a scan (accumulate.py)
            loss, extra, grads = accumulated_grads(
                micro_grads, trained, batch, accum, mesh, in_batch,
                on_host if offload else lora.trainable_params(on_device, lo), on_host=offload,
                weighting=objective.weighting)
        with jax.named_scope("optimizer"):
            if offload:  # gradients to the host (the layers' are there already), update there
                grads = jax.device_put(grads, on_host)
                # optax.tree.norm on the host would reduce over split axes there
                # (host_compute.py): each device's share is summed on the host, the shares
                # on the devices
                grad_norm = host_compute.global_norm(grads, on_host, mesh)

                # LoRA: the fp32 master copies of the trained leaves only; the frozen
                # leaves of the state are passed through (overlay) as they came in.
                trained_specs = host_compute.specs(on_host)
                opt_specs = host_compute.specs(shardings["opt_state"])
                master, opt_state = host_compute.by_shard(
                    host_update, mesh, (trained_specs, opt_specs, trained_specs, P()),
                    (trained_specs, opt_specs))(
                    grads, state["opt_state"], lora.trainable_params(state["params"], lo),
                    jax.device_put(grad_norm, replicated.with_memory_kind("pinned_host")))
                params = lora.overlay(state["params"], master)
            else:
                trained, opt_state, grad_norm = update(grads, state["opt_state"], trained)
                params = full(trained)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]), **extra}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return jax.jit(step, in_shardings=(shardings, in_batch),
                   out_shardings=(shardings, None), donate_argnums=0,
                   compiler_options=gpu_target.step_options(cfg.gpu_overlap))


def _device_shardings(shardings):
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings["params"])


def _offloaded_params_for_compute(params, dtype, on_device):
    """optimizer.offload: the layer weights cast to the compute dtype on the host (the
    model streams them to the device per layer); every other parameter moved to the device.

    Only narrowing casts happen on the host: a weight stored narrower than the compute dtype
    (LoRA's frozen base in ``model.lora.base_dtype=bfloat16`` under fp32 compute) streams as
    it is stored, half the bytes, and the layer widens it on the device (``gathered``), the
    same values."""
    cast = compute_copy_mask(params)
    width = jnp.dtype(dtype).itemsize
    param_specs = host_compute.specs(on_device)
    mesh = jax.tree.leaves(on_device)[0].mesh
    with jax.named_scope("optimizer"):
        copy = host_compute.by_shard(lambda params: jax.tree.map(
            lambda p, c: p.astype(dtype) if c and p.dtype.itemsize > width else p,
            params, cast), mesh, (param_specs,), param_specs)(params)
    return jax.tree.map(lambda p, c, s: p if c else jax.device_put(p, s), copy, cast, on_device)


def params_for_compute(cfg: Config | None, shardings) -> Callable:
    """``f(params) -> params`` to apply inside a jitted program that reads the train state's
    parameters outside the train step (evaluation): with ``optimizer.offload`` they live in
    host memory and are prepared as the train step prepares them; otherwise the identity."""
    if cfg is None or not cfg.optimizer.offload:
        return lambda params: params
    dtype, on_device = jnp.dtype(cfg.model.dtype), _device_shardings(shardings)
    return lambda params: _offloaded_params_for_compute(params, dtype, on_device)


def make_eval_step(mesh: Mesh, graphdef, shardings, objective: Objective) -> Callable:
    """Jitted ``eval(params, batch)``: the objective's held-out sums of a batch
    (``Objective.eval_sums``), with the parameters prepared as the train step prepares them
    (``params_for_compute``: host-resident with optimizer.offload)."""
    prepare = params_for_compute(objective.cfg, shardings)

    def evaluate(params, batch):
        return objective.eval_sums(graphdef, prepare(params), batch, mesh)

    return jax.jit(evaluate, in_shardings=(shardings["params"],
                                           batch_shardings(mesh, objective.cfg)))


def param_count(params: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def trainable_count(cfg: Config, params: Any) -> int:
    """Parameters the run trains: all of them, or with LoRA the adapters and the groups
    ``model.lora.trainable`` names."""
    return param_count(lora.trainable_params(params, cfg.model.lora))


def param_line(cfg: Config, params) -> str:
    """The start-up line on the parameters: how many, and with LoRA how many are trained."""
    total = param_count(params)
    lo = cfg.model.lora
    if not lo.rank:
        return f"model: {total / 1e6:.2f}M parameters"
    trained = trainable_count(cfg, params)
    extra = f" and {', '.join(lo.trainable)}" if lo.trainable else ""
    return (f"model: {total / 1e6:.2f}M parameters, {trained / 1e6:.4f}M trained "
            f"({100 * trained / total:.3f}%: LoRA rank {lo.rank} on "
            f"{', '.join(model_targets(cfg.model))}{extra}); the frozen layer matrices "
            f"stored in {lo.base_dtype}")
