"""Typed run configuration: frozen dataclasses, YAML presets, dotted key=value overrides.

OmegaConf does the parsing: it rejects unknown keys and values of the wrong type. ``validate``
then checks the combinations that only make sense together (heads vs ``mesh.seq``, batch vs
``mesh.data``, ...) and raises ``ConfigError`` with the keys and numbers involved.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .families import FAMILIES as _FAMILY_REGISTRY, traits
from .head_layout import head_layout
# The model section lives in model_config.py; its names are re-exported here.
from .model_config import (LAYER_KINDS, MIXERS, ROPE_EXACT_FROM, ROPE_TYPES,  # noqa: F401
                           LORA_GROUPS, LORA_TARGETS, LoraConfig, ModelConfig, RopeScalingConfig, VisionConfig, model_errors,
                           moe_errors, rope_scaling_errors)

DTYPES = ("float32", "bfloat16")
REMAT = ("auto", "none", "full", "save_dots", "save_attention", "offload")
ATTN_IMPLS = ("auto", "xla", "cudnn", "chunked")  # kernels.IMPLS (config stays import-light)
PARAM_SHARDING = ("replicated", "zero3")
# The objectives a run can train, each by the module that implements it (its ``OBJECTIVE``,
# a ``training.objectives.base.Objective``): the registry ``objectives.get`` reads.
OBJECTIVES = {"sft": "ulysses_jax.training.objectives.sft",
              "dpo": "ulysses_jax.training.objectives.dpo",
              "grpo": "ulysses_jax.training.grpo"}
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
DPO_REFERENCES = ("base", "precompute")
GRPO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")  # objectives/grpo.py LOSS_TYPES
GRPO_SCALES = ("group", "batch", "none")            # objectives/rewards.py SCALES
FAMILIES = tuple(_FAMILY_REGISTRY)  # families.py (a leaf module: imports nothing)
MOMENT_DTYPES = ("float32", "bfloat16")
INT32_MAX = 2**31 - 1  # integer settings reach jitted code (step counter, positions) as int32


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the keys and numbers."""


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: data-parallel replicas x ring x seq (Ulysses) devices per sequence."""
    data: int = 1
    seq: int = 1
    ring: int = 1                   # ring-attention degree; the sequence splits over ring x seq


@dataclass(frozen=True)
class UlyssesConfig:
    """Ulysses exchange options."""
    # Split each device's heads into this many groups, each exchanged and attended on its own,
    # so the all-to-all of one group can overlap the attention of another (GPU).
    chunks: int = 1


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping, linear warmup then cosine decay."""
    lr: float = 3e-3
    warmup_steps: int = 20
    schedule_steps: Optional[int] = None  # length of the cosine schedule; None = steps
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    # Keep fp32 parameters and AdamW moments in host memory and compute the update there;
    # the device holds compute-dtype copies of the weights and the gradients.
    offload: bool = False
    moment_dtype: str = "float32"   # float32 | bfloat16: storage of AdamW's two moments


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and held-out split."""
    source: str = "stdlib"          # a token store dir (python -m ulysses_jax.data prepare),
    #                                 "stdlib", or comma-separated .txt/.md/.jsonl files/dirs/globs
    tokenizer: Optional[str] = None  # None = bytes (a store: the one it was prepared with);
    #                                  a tokenizer.json (or a dir holding one)
    heldout_fraction: float = 0.02
    chat_overflow: str = "truncate"  # chat store: a conversation longer than seq_len is
    #                                  "truncate"d to its first seq_len tokens or "drop"ped
    # Multimodal models: image patch slots per device (per group of the vision tower); 0 =
    # enough for any batch (data/vision_batches.py).
    vision_patches: int = 0


@dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimisation (``objective: dpo``; training/objectives/dpo.py)."""
    beta: float = 0.1
    loss_type: str = "sigmoid"      # sigmoid | ipo | hinge, as TRL's DPOTrainer defines them
    label_smoothing: float = 0.0    # sigmoid only: the conservative DPO of TRL (cDPO)
    # The frozen reference policy: "base" (the LoRA base with the adapters off: no second
    # copy of the weights) or "precompute" (one pass over the store before step 1 records
    # every completion's log-probability under the initial model). None: "base" for a LoRA
    # run, "precompute" for full fine-tuning.
    reference: Optional[str] = None
    # A step's chosen and rejected sequences packed into rows of seq_len (each its own
    # segment, first fit in order, within each micro-batch); false: one sequence per row.
    # The loss, metrics and gradients are the same either way.
    packing: bool = True


@dataclass(frozen=True)
class GRPOConfig:
    """Group relative policy optimisation (``objective: grpo``; training/grpo.py), its
    options named as TRL's GRPOConfig names them."""
    num_generations: int = 8        # completions sampled per prompt (a group)
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0: no top-k filter
    beta: float = 0.0               # KL to the reference (k3): the LoRA base, else the initial weights
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None  # the clip above 1 (DAPO); None: epsilon
    loss_type: str = "dapo"         # grpo | bnpo | dr_grpo | dapo (token aggregation)
    scale_rewards: str = "group"    # group | batch | none (the advantage's divisor)
    num_iterations: int = 1         # optimizer steps per generation batch
    reward_funcs: tuple[str, ...] = ("answer_match",)  # built-ins or module:function
    reward_weights: Optional[tuple[float, ...]] = None  # None: 1 each
    # Steps of supervised warm-up before sampling starts: each prompt's reference answer
    # (the row's "completion", else its "answer") trained on with the next-token loss.
    sft_warmup_steps: int = 0
    # Prompt + completion sequences packed into rows of seq_len as SFT packs documents (each
    # its own segment); false: one sequence per row. The loss is the same either way.
    packing: bool = True


@dataclass(frozen=True)
class Config:
    """One training run; keys are addressed as dotted paths (``mesh.seq=4``)."""
    seed: int = 0
    steps: int = 100
    seq_len: int = 256
    batch_size: int = 8             # global batch per optimizer step, in sequences
    grad_accum_steps: int = 1       # micro-batches per optimizer step (batch_size / this each)
    log_every: int = 10
    eval_every: int = 0             # 0 = only at the end
    eval_batches: int = 2
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    param_sharding: str = "replicated"  # replicated | zero3 (over data x seq devices)
    init_from: Optional[str] = None     # Hugging Face checkpoint dir
    init_adapter: Optional[str] = None  # peft LoRA adapter dir to continue (on init_from's
    #                                     base; model.lora must match its adapter_config.json)
    gpu_overlap: bool = True        # GPU: XLA latency-hiding scheduler (see train.py)
    log_tensorboard: bool = True    # TensorBoard event files beside metrics.jsonl
    objective: str = "sft"          # sft (next-token loss) | dpo (a preference store's pairs)
    #                                 | grpo (sampled completions of prompts, rewarded)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    ulysses: UlyssesConfig = field(default_factory=UlyssesConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


def dpo_reference(cfg: Config) -> str:
    """``dpo.reference`` resolved: as set, else "base" for a LoRA run, "precompute" for
    full fine-tuning."""
    return cfg.dpo.reference or ("base" if cfg.model.lora.rank else "precompute")


def rows_per_batch(cfg: Config) -> int:
    """Rows of a global batch: ``batch_size``, for DPO two per pair (chosen, rejected), for
    GRPO ``num_generations`` per prompt (a prompt + completion sequence each)."""
    per = {"dpo": 2, "grpo": cfg.grpo.num_generations}.get(cfg.objective, 1)
    return cfg.batch_size * per


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Builds a Config from defaults, an optional YAML preset and ``key=value`` overrides.

    Raises:
      ConfigError: an unreadable or malformed file, unknown keys, wrong types, malformed
        overrides or impossible combinations.
    """
    try:  # one merge of everything (OmegaConf copies the whole config on every merge)
        cfg = _merge_at_once(path, overrides)
    except (ConfigError, OmegaConfBaseException):  # again one at a time, for the message
        cfg = _defaults()
        if path is not None:
            cfg = _merge(cfg, _load_yaml(path), f"--config {path}: ")
        for item in overrides:
            cfg = _merge(cfg, _parse_override(item), "")
    try:
        result = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e)) from None
    validate(result)
    return result


# Top-level keys that hold a group of keys (mesh, model, ...), not a value.
_SECTIONS = tuple(f.name for f in dataclasses.fields(Config)
                  if f.default_factory is not dataclasses.MISSING)


# Keys inside model that hold a group of keys (model.rope_scaling, ...).
_MODEL_SECTIONS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                        if f.default_factory is not dataclasses.MISSING)


def _merge_at_once(path: str | None, overrides) -> DictConfig:
    """The preset and the overrides merged into the defaults in one OmegaConf.merge: what
    ``_merge`` one at a time gives, a tenth of the time for a dozen overrides. Any problem
    raises, and ``load_config`` then merges one at a time to name it."""
    updates = [_load_yaml(path)] if path is not None else []
    updates += [_parse_override(item) for item in overrides]
    for update in updates:
        _check_sections(update, "")
    return OmegaConf.merge(_defaults(), *updates)


@functools.cache
def _defaults() -> DictConfig:
    """The defaults as OmegaConf's typed config, built once (20 ms each time): every merge
    copies its first config and leaves it as it was."""
    return OmegaConf.structured(Config)


def _check_sections(update: DictConfig, where: str) -> None:
    """A section (mesh, model, model.lora, ...) must be given as keys, not one value."""
    groups = [(name, update) for name in _SECTIONS]
    if isinstance(update.get("model"), DictConfig):
        groups += [(f"model.{name}", update.model) for name in _MODEL_SECTIONS]
    for name, parent in groups:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in parent and not isinstance(parent[leaf], DictConfig):
            raise ConfigError(f"{where}config key {name!r}: must hold keys such as "
                              f"{name}.<key>, not one value; got {parent[leaf]!r}")


def _merge(cfg: DictConfig, update: DictConfig, where: str) -> DictConfig:
    _check_sections(update, where)
    try:
        return OmegaConf.merge(cfg, update)
    except OmegaConfBaseException as e:
        raise ConfigError(where + _describe(e)) from None


def _parse_override(item: str) -> DictConfig:
    key, eq, _ = item.partition("=")
    if not eq:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    if not key or "" in key.split("."):
        raise ConfigError(f"override {item!r}: the key before '=' must be a dotted name such "
                          f"as mesh.seq")
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem})") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"override {item!r}: {_describe(e)}") from None


def _load_yaml(path: str) -> DictConfig:
    """The preset at ``path`` as a mapping; any problem with the file is a ConfigError."""
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path}: is a directory; pass a YAML file such as "
                          f"configs/tiny.yaml") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path}: invalid YAML{where}: {problem}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"--config {path}: the top level must be a mapping of keys to values "
                          f"(e.g. 'seq_len: 512'), got a list")
    return loaded


def _describe(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    return f"config key {key!r}: {msg}" if key else msg


def validate(cfg: Config, num_devices: int | None = None) -> None:
    """Checks combinations; ``num_devices`` (if known) bounds the mesh size."""
    m, mesh = cfg.model, cfg.mesh
    errors = []
    positive = {"steps": cfg.steps, "seq_len": cfg.seq_len, "batch_size": cfg.batch_size,
                "grad_accum_steps": cfg.grad_accum_steps,
                "log_every": cfg.log_every, "mesh.data": mesh.data, "mesh.seq": mesh.seq, "mesh.ring": mesh.ring,
                "ulysses.chunks": cfg.ulysses.chunks,
                "model.n_layers": m.n_layers, "model.n_heads": m.n_heads,
                "model.n_kv_heads": m.n_kv_heads, "model.head_dim": m.head_dim,
                "model.d_model": m.d_model, "model.ffn_dim": m.ffn_dim,
                "model.vocab_size": m.vocab_size, "model.loss_chunk": m.loss_chunk,
                "keep_checkpoints": cfg.keep_checkpoints}
    errors += [f"{k} must be positive, got {v}" for k, v in positive.items() if v < 1]
    if m.max_segments < 0:
        errors.append(f"model.max_segments must be 0 (from the data) or positive, got "
                      f"{m.max_segments}")
    errors += _number_errors(cfg)
    if m.rope_exact_from < 0:
        errors.append(f"model.rope_exact_from must be 0 (exact angles everywhere) or positive, "
                      f"got {m.rope_exact_from}")
    if m.mlp_chunk < 0:
        errors.append(f"model.mlp_chunk must be 0 (untiled) or positive, got {m.mlp_chunk}")
    errors += model_errors(m)
    if cfg.init_adapter and not (cfg.init_from and m.lora.rank):
        errors.append(f"init_adapter {cfg.init_adapter!r} needs the base model it adapts "
                      f"(init_from, got {cfg.init_from!r}) and adapters to load it into "
                      f"(model.lora.rank > 0 as the adapter's r, got {m.lora.rank})")
    if m.offload_checkpoints and m.remat != "full":
        errors.append(f"model.offload_checkpoints=true needs model.remat=full (the layer "
                      f"inputs are then the only checkpoints), got model.remat={m.remat!r}")
    for key, value, allowed in (("model.dtype", m.dtype, DTYPES), ("model.remat", m.remat, REMAT),
                                ("optimizer.moment_dtype", cfg.optimizer.moment_dtype,
                                 MOMENT_DTYPES),
                                ("model.attn_impl", m.attn_impl, ATTN_IMPLS),
                                ("model.family", m.family, FAMILIES),
                                ("param_sharding", cfg.param_sharding, PARAM_SHARDING)):
        if value not in allowed:
            errors.append(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
    if errors:
        raise ConfigError("; ".join(errors))
    if mesh.ring > 1:
        # Zigzag load balance cuts each sequence into 2 x ring x seq equal chunks.
        split = 2 * mesh.ring * mesh.seq
        if cfg.seq_len % split:
            errors.append(f"seq_len {cfg.seq_len} is not divisible by 2 x mesh.ring x mesh.seq "
                          f"= 2 x {mesh.ring} x {mesh.seq} = {split} (zigzag chunks)")
    elif cfg.seq_len % mesh.seq:
        errors.append(f"seq_len {cfg.seq_len} is not divisible by mesh.seq {mesh.seq}")
    accum = cfg.grad_accum_steps
    if cfg.objective == "grpo":  # micro-batches of sequences: G per prompt
        rows = cfg.batch_size * cfg.grpo.num_generations
        if rows % (accum * mesh.data):
            errors.append(f"batch_size x grpo.num_generations = {cfg.batch_size} x "
                          f"{cfg.grpo.num_generations} = {rows} sequences must split into "
                          f"grad_accum_steps x mesh.data = {accum} x {mesh.data} equal parts")
    elif accum > 1 and cfg.batch_size % (accum * mesh.data):
        errors.append(f"batch_size {cfg.batch_size} must split into grad_accum_steps {accum} "
                      f"micro-batches of whole rows for each of mesh.data {mesh.data} replicas: "
                      f"it must be divisible by grad_accum_steps x mesh.data = {accum} x "
                      f"{mesh.data} = {accum * mesh.data}")
    elif cfg.batch_size % mesh.data:
        errors.append(f"batch_size {cfg.batch_size} is not divisible by mesh.data {mesh.data}")
    if accum > 1 and traits(m.family).vision:
        errors.append(f"grad_accum_steps {accum} > 1 is not supported for model.family "
                      f"{m.family!r} yet (its vision batches are built per global batch); "
                      f"use grad_accum_steps=1")
    # Heads that mesh.seq does not divide are padded (head_layout.py); only a GQA
    # grouping that does not exist is an error.
    if m.n_heads % m.n_kv_heads:
        errors.append(f"model.n_heads {m.n_heads} is not divisible by model.n_kv_heads "
                      f"{m.n_kv_heads}")
    chunks = cfg.ulysses.chunks
    if chunks > 1:
        kv_local = (head_layout(m.n_heads, m.n_kv_heads, mesh.seq).k_local
                    if not m.n_heads % m.n_kv_heads else chunks)
        if mesh.ring > 1:
            errors.append(f"ulysses.chunks {chunks} > 1 is not supported with mesh.ring "
                          f"{mesh.ring} > 1")
        elif mesh.seq > 1 and kv_local % chunks:
            errors.append(f"ulysses.chunks {chunks} must divide the kv heads per device, "
                          f"{kv_local} (model.n_kv_heads {m.n_kv_heads}, mesh.seq {mesh.seq})")
    if "D" in m.layer_mixers():
        if m.linear_value_heads % mesh.seq:
            errors.append(f"model.linear_value_heads {m.linear_value_heads} is not divisible by "
                          f"mesh.seq {mesh.seq} (each device runs the delta rule for whole "
                          f"value heads)")
        if mesh.ring > 1:
            errors.append(f"Gated DeltaNet layers (model.mixer_pattern "
                          f"{m.mixer_pattern!r}) need mesh.ring 1, got {mesh.ring}")
    need = mesh.data * mesh.ring * mesh.seq
    errors += moe_errors(m, need)
    if num_devices is not None and need > num_devices:
        ring = f" x mesh.ring {mesh.ring}" if mesh.ring > 1 else ""
        errors.append(f"mesh.data {mesh.data}{ring} x mesh.seq {mesh.seq} = {need} "
                      f"devices, but only {num_devices} are available")
    if cfg.optimizer.schedule_steps is not None and cfg.optimizer.schedule_steps < 1:
        errors.append(f"optimizer.schedule_steps must be positive, got "
                      f"{cfg.optimizer.schedule_steps}")
    if not 0.0 <= cfg.data.heldout_fraction < 1.0:
        errors.append(f"data.heldout_fraction must be in [0, 1), got {cfg.data.heldout_fraction}")
    if cfg.data.vision_patches < 0:
        errors.append(f"data.vision_patches must be 0 (enough for any batch) or positive, got "
                      f"{cfg.data.vision_patches}")
    if traits(m.family).vision and mesh.ring > 1:
        errors.append(f"model.family={m.family} needs mesh.ring 1 (its batches are not laid "
                      f"out in the ring's zigzag order), got {mesh.ring}")
    if cfg.data.chat_overflow not in ("truncate", "drop"):
        errors.append(f"data.chat_overflow must be 'truncate' or 'drop', got "
                      f"{cfg.data.chat_overflow!r}")
    errors += _dpo_errors(cfg)
    errors += _grpo_errors(cfg)
    if errors:
        raise ConfigError("; ".join(errors))


def _dpo_errors(cfg: Config) -> list[str]:
    """The objective and the dpo section."""
    if cfg.objective not in OBJECTIVES:
        return [f"objective must be one of {', '.join(OBJECTIVES)}, got {cfg.objective!r}"]
    d, errors = cfg.dpo, []
    if d.loss_type not in DPO_LOSSES:
        errors.append(f"dpo.loss_type must be one of {', '.join(DPO_LOSSES)}, got "
                      f"{d.loss_type!r}")
    if d.reference is not None and d.reference not in DPO_REFERENCES:
        errors.append(f"dpo.reference must be one of {', '.join(DPO_REFERENCES)} (or unset: "
                      f"base with LoRA, precompute without), got {d.reference!r}")
    if not d.beta > 0:
        errors.append(f"dpo.beta must be positive, got {d.beta}")
    if not 0.0 <= d.label_smoothing < 0.5:
        errors.append(f"dpo.label_smoothing must be in [0, 0.5), got {d.label_smoothing}")
    elif d.label_smoothing and d.loss_type != "sigmoid":
        errors.append(f"dpo.label_smoothing {d.label_smoothing} applies to dpo.loss_type "
                      f"sigmoid only (TRL's conservative DPO), got loss_type {d.loss_type!r}")
    if cfg.objective != "dpo":
        return errors
    if d.reference == "base" and not cfg.model.lora.rank:
        errors.append("dpo.reference=base is the LoRA base with the adapters off, so it needs "
                      "model.lora.rank > 0; full fine-tuning uses dpo.reference=precompute")
    elif dpo_reference(cfg) == "base" and cfg.model.lora.trainable:
        errors.append(f"dpo.reference=base (the default with LoRA) is the model with the "
                      f"adapters off, but model.lora.trainable {list(cfg.model.lora.trainable)} "
                      f"also trains those groups, so it would move with them; use "
                      f"dpo.reference=precompute")
    if traits(cfg.model.family).vision:
        errors.append(f"objective dpo is not supported for model.family {cfg.model.family!r} "
                      f"yet (text preference stores only)")
    return errors


def _grpo_errors(cfg: Config) -> list[str]:
    """The grpo section, checked when ``objective: grpo``."""
    if cfg.objective != "grpo":
        return []
    g, errors = cfg.grpo, []
    if g.num_generations < 2:
        errors.append(f"grpo.num_generations must be at least 2 (advantages compare the "
                      f"completions of one prompt), got {g.num_generations}")
    if g.loss_type not in GRPO_LOSSES:
        errors.append(f"grpo.loss_type must be one of {', '.join(GRPO_LOSSES)}, got "
                      f"{g.loss_type!r}")
    if g.scale_rewards not in GRPO_SCALES:
        errors.append(f"grpo.scale_rewards must be one of {', '.join(GRPO_SCALES)}, got "
                      f"{g.scale_rewards!r}")
    if g.max_completion_length < 1 or g.max_completion_length >= cfg.seq_len:
        errors.append(f"grpo.max_completion_length must be in [1, seq_len) (a row holds the "
                      f"prompt and its completion), got {g.max_completion_length} with "
                      f"seq_len {cfg.seq_len}")
    if not g.temperature > 0:
        errors.append(f"grpo.temperature must be positive (greedy completions of a prompt "
                      f"would all be the same), got {g.temperature}")
    if not 0 < g.top_p <= 1:
        errors.append(f"grpo.top_p must be in (0, 1], got {g.top_p}")
    if g.top_k < 0:
        errors.append(f"grpo.top_k must be 0 (off) or positive, got {g.top_k}")
    if g.beta < 0:
        errors.append(f"grpo.beta must be 0 or positive, got {g.beta}")
    if not g.epsilon > 0 or (g.epsilon_high is not None and not g.epsilon_high > 0):
        errors.append(f"grpo.epsilon and grpo.epsilon_high must be positive, got "
                      f"{g.epsilon} and {g.epsilon_high}")
    if g.num_iterations < 1:
        errors.append(f"grpo.num_iterations must be at least 1, got {g.num_iterations}")
    if g.sft_warmup_steps < 0:
        errors.append(f"grpo.sft_warmup_steps must be 0 or positive, got {g.sft_warmup_steps}")
    if not g.reward_funcs:
        errors.append("grpo.reward_funcs must name at least one reward function")
    if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_funcs):
        errors.append(f"grpo.reward_weights has {len(g.reward_weights)} weights for "
                      f"{len(g.reward_funcs)} reward_funcs {list(g.reward_funcs)}")
    if g.beta > 0 and cfg.model.lora.rank and cfg.model.lora.trainable:
        errors.append(f"grpo.beta > 0 uses the base with the adapters off as the reference, "
                      f"but model.lora.trainable {list(cfg.model.lora.trainable)} also trains "
                      f"those groups")
    fam = traits(cfg.model.family)
    if fam.vision:
        errors.append(f"objective grpo is not supported for model.family "
                      f"{cfg.model.family!r} yet (the generator runs it, but GRPO's prompt data "
                      f"carry no images to it or to the train step)")
    return errors


def _number_errors(cfg: Config) -> list[str]:
    """Ranges of the numeric settings: finite floats, int32 ints, signs and intervals."""
    values = _numbers(cfg)
    errors = [f"{k} must be a finite number, got {v}" for k, v in values.items()
              if isinstance(v, float) and not math.isfinite(v)]
    errors += [f"{k} must be at most {INT32_MAX} (it is an int32 in the compiled step), got {v}"
               for k, v in values.items() if isinstance(v, int) and v > INT32_MAX]
    if errors:  # the range rules below would only repeat these values
        return errors
    o, m = cfg.optimizer, cfg.model
    rules = (
        ("seed", cfg.seed >= 0, "must be 0 or positive"),
        ("checkpoint_every", cfg.checkpoint_every >= 0, "must be 0 (final step only) or positive"),
        ("eval_every", cfg.eval_every >= 0, "must be 0 (final step only) or positive"),
        ("eval_batches", cfg.eval_batches >= 0, "must be 0 (no evaluation) or positive"),
        ("optimizer.lr", o.lr > 0, "must be positive"),
        ("optimizer.warmup_steps", o.warmup_steps >= 0, "must be 0 or positive"),
        ("optimizer.min_lr_ratio", 0 <= o.min_lr_ratio <= 1, "must be in [0, 1]"),
        ("optimizer.b1", 0 <= o.b1 < 1, "must be in [0, 1)"),
        ("optimizer.b2", 0 <= o.b2 < 1, "must be in [0, 1)"),
        ("optimizer.weight_decay", o.weight_decay >= 0, "must be 0 or positive"),
        ("optimizer.clip_norm", o.clip_norm > 0, "must be positive"),
        ("model.rope_theta", m.rope_theta > 0, "must be positive"),
        ("model.norm_eps", m.norm_eps > 0, "must be positive"),
        ("model.init_std", m.init_std > 0, "must be positive"),
    )
    return [f"{key} {rule}, got {values[key]}" for key, ok, rule in rules if not ok]


def _numbers(cfg, prefix: str = "") -> dict:
    """Dotted key -> value of every int and float setting (bools excluded)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_numbers(value, f"{prefix}{f.name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{f.name}"] = value
    return out


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
