"""Where a run's weights come from: its own newest good checkpoint, a Hugging Face checkpoint
(``init_from``, with a peft adapter to continue: ``init_adapter``), or a fresh initialisation.

Resuming restores the newest checkpoint that restores (damaged newer ones are moved aside, see
``checkpoint.Checkpointer.restore_newest``) and refuses, with a ``ConfigError`` that names the
settings that differ, a checkpoint saved for other data (seed, seq_len, corpus, tokenizer) or
with another model shape. A refusal leaves the run's checkpoints, metrics and config.yaml alone.
"""
from __future__ import annotations

import dataclasses
import json
import os

from safetensors import SafetensorError

from ..interop.hf import config_from_hf, load_params, read_config
from ..interop.hf_variants import _ROPE_FIELDS
from ..interop.peft_adapter import load_adapter
from .checkpoint import Checkpointer, IncompatibleCheckpoint, NoCheckpointRestores
from .run_dir import RunError
from .train_step import init_state, state_layout
from ..models import lora
from ..config import (Config, ConfigError, ModelConfig, RopeScalingConfig, to_dict,
                      validate)

# The run's own model options, kept when the model's shape comes from a checkpoint.
RUNTIME_FIELDS = ("dtype", "remat", "attn_impl", "loss_chunk", "vocab_parallel", "mlp_chunk",
                  "init_std", "max_segments", "offload_checkpoints", "moe_capacity_factor",
                  "rope_exact_from")
# Settings a checkpoint depends on, named in a refusal when they differ from the saved config:
# the data iterator's position, and the arrays' shapes.
DATA_KEYS = ("seed", "seq_len", "data.source", "data.tokenizer", "data.heldout_fraction",
             "data.chat_overflow")
SHAPE_KEYS = tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig)
                   if f.name not in RUNTIME_FIELDS) + (
    # LoRA's adapters, and which parameters carry optimizer state (model.lora)
    "model.lora.rank", "model.lora.targets", "model.lora.trainable")


def _runtime_options(cfg: Config) -> dict:
    return {k: getattr(cfg.model, k) for k in RUNTIME_FIELDS} | {"max_seq_len": cfg.seq_len}


def resolve_init_from(cfg: Config, notes: list[str] | None = None, *,
                      missing_ok: bool = False) -> Config:
    """With ``init_from``, the model's shape comes from the checkpoint's config.json (the
    run's model options in ``RUNTIME_FIELDS`` are kept) and its tokenizer.json is used unless
    ``data.tokenizer`` names another.

    A ``model.rope_scaling`` or ``model.rope_theta`` that the config sets (differs from the
    ModelConfig default) replaces the checkpoint's: that is how a model's context is
    extended (``rope_overrides``).

    Args:
      cfg: the run's config.
      notes: lines for the startup log are appended here (the RoPE overrides, a missing
        checkpoint under ``missing_ok``).
      missing_ok: a dry run plans a preset before its checkpoint is downloaded: an
        ``init_from`` directory without config.json then leaves the config's own model.
    """
    if not cfg.init_from:
        return cfg
    notes = [] if notes is None else notes
    if missing_ok and not os.path.exists(os.path.join(cfg.init_from, "config.json")):
        notes.append(f"init_from {cfg.init_from!r} has no config.json (not downloaded yet?): "
                     f"planned with the config's own model section")
        return cfg
    try:
        hf = read_config(cfg.init_from)
        if not isinstance(hf, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        model = config_from_hf(hf, **_runtime_options(cfg))
    except json.JSONDecodeError as e:
        raise ConfigError(f"init_from {cfg.init_from!r}: config.json is not valid JSON "
                          f"({e})") from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # TypeError: a value of a wrong type
        hint = ("; download the checkpoint there first (e.g. huggingface-cli download ORG/NAME "
                "--local-dir DIR), or point init_from at it" if not os.path.exists(
                    os.path.join(cfg.init_from, "config.json")) else "")
        raise ConfigError(f"init_from {cfg.init_from!r}: {e}{hint}") from None
    model, changed = rope_overrides(cfg.model, model)
    # The checkpoint is the base; adapters (model.lora) are the run's own.
    model = dataclasses.replace(model, lora=cfg.model.lora)
    notes.extend(f"init_from: {line}" for line in changed)
    data = cfg.data
    tokenizer_json = os.path.join(cfg.init_from, "tokenizer.json")
    if data.tokenizer is None and os.path.exists(tokenizer_json):
        data = dataclasses.replace(data, tokenizer=tokenizer_json)
    cfg = dataclasses.replace(cfg, model=model, data=data)
    try:
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"init_from {cfg.init_from!r}: the model of its config.json: "
                          f"{e}") from None
    return cfg


def rope_overrides(ours: ModelConfig, imported: ModelConfig) -> tuple[ModelConfig, list[str]]:
    """``imported`` with the run's ``rope_scaling`` / ``rope_theta`` where the run sets them
    (differs from the ModelConfig default), and one line per setting that changed the
    checkpoint's. An unscaled checkpoint is extended by setting ``model.rope_scaling``; the
    default itself (type default, theta 10,000) cannot override a checkpoint's."""
    default = ModelConfig()
    changes, lines = {}, []
    for name in ("rope_theta", "rope_scaling"):
        mine, theirs = getattr(ours, name), getattr(imported, name)
        if mine != getattr(default, name) and mine != theirs:
            changes[name] = mine
            lines.append(f"model.{name} {_show(mine)} from the config replaces the "
                         f"checkpoint's {_show(theirs)}")
    return dataclasses.replace(imported, **changes), lines


def _show(value) -> str:
    """A theta as is; a scaling as its type and the fields that type reads."""
    if not isinstance(value, RopeScalingConfig):
        return repr(value)
    return "{" + ", ".join([f"type: {value.type}"] + [f"{k}: {getattr(value, k)}"
                                                     for k in _ROPE_FIELDS[value.type]]) + "}"


def initial_params(cfg: Config, mesh):
    """The ``init_from`` checkpoint's parameters laid out on ``mesh``, or None."""
    if not cfg.init_from:
        return None
    try:
        return load_params(cfg.init_from, mesh, cfg.param_sharding, **_runtime_options(cfg))[1]
    except SafetensorError as e:
        raise ConfigError(f"init_from {cfg.init_from!r}: its weights are not a readable "
                          f"safetensors file ({e})") from None
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"init_from {cfg.init_from!r}: {e}") from None


def initial_adapters(cfg: Config, params: dict) -> tuple[dict | None, list[str]]:
    """The ``init_adapter`` directory's LoRA matrices in our layout (host float32), checked
    against the run's ``model.lora`` and the shapes of ``params``; (None, []) without one.

    Returns:
      (the adapter leaves, to overlay on ``initial_params``; lines for the start-up log).
    Raises:
      ConfigError: the adapter does not fit, naming the rule and the numbers.
    """
    if not cfg.init_adapter:
        return None, []
    return load_adapter(cfg, params)


def start_state(cfg: Config, mesh, ckpt: Checkpointer, batches) -> tuple[int, tuple, str]:
    """Resumes from the newest checkpoint that restores and fits, or initialises.

    Args:
      batches: the run's BatchIterator; a resume sets its position.

    Returns:
      (start step, (graphdef, state, state shardings, optimizer), a line to log).

    Raises:
      ConfigError: the checkpoint was saved for other data or another model shape.
      RunError: every checkpoint is damaged (none is moved).
    """
    graphdef, abstract, shardings, tx = state_layout(cfg, mesh)

    def check(step, extra):
        try:
            batches.set_state(extra["data"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(_refusal(cfg, ckpt, step, extra, "for other data", DATA_KEYS,
                                       str(e))) from None

    try:
        found = ckpt.restore_newest(abstract, check)
    except IncompatibleCheckpoint as e:
        raise ConfigError(_refusal(cfg, ckpt, e.step, e.extra, "with another model shape",
                                   SHAPE_KEYS, "; ".join(e.diffs[:2]))) from None
    except NoCheckpointRestores as e:
        raise RunError(f"{e}. Nothing was moved or deleted: move the damaged step "
                       f"directories out of {ckpt.directory} (or pass another --workdir) to "
                       f"start afresh") from None
    if found is None:
        adapters, lines = initial_adapters(cfg, abstract["params"])  # checked before the base
        params = initial_params(cfg, mesh)
        if adapters:
            params = lora.overlay(params, adapters)
        note = (f"initialised from Hugging Face checkpoint {cfg.init_from}" if cfg.init_from
                else "initialised from scratch")
        return 0, init_state(cfg, mesh, params), "\n".join([note] + lines)
    step, state, _, moved = found
    note = (f"warning: checkpoint {'; '.join(moved)} did not restore and was moved aside "
            f"(kept, not deleted); resumed from step {step}" if moved else
            f"resumed from step {step} ({ckpt.directory})")
    if cfg.init_adapter:
        note += (f"; init_adapter {cfg.init_adapter!r} not read: the checkpoint holds the "
                 f"adapters trained since")
    if step >= cfg.steps:
        note += (f"\nthis run already reached step {step} (steps={cfg.steps}); pass a larger "
                 f"steps=N to train further")
    return step, (graphdef, state, shardings, tx), note


def _refusal(cfg: Config, ckpt: Checkpointer, step: int, extra: dict, what: str,
             keys: tuple[str, ...], detail: str) -> str:
    """One paragraph: which checkpoint, the settings that differ (or ``detail``), what to do."""
    saved, now = _flat(extra.get("config") or {}), _flat(to_dict(cfg))
    changed = [f"{k} {saved[k]!r} there, {now[k]!r} now" for k in keys
               if k in saved and saved[k] != now.get(k)]
    return (f"cannot resume from checkpoint step {step} in {ckpt.directory}: it was saved "
            f"{what} ({'; '.join(changed) or detail}). Run with the settings in the run's "
            f"config.yaml, or pass another --workdir to start a new run; its checkpoints, "
            f"metrics.jsonl and config.yaml were left as they were")


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; tuples become lists, as config.yaml stores them."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out
