"""A peft LoRA adapter directory as the adapters a run starts from (``init_adapter``).

peft's ``save_pretrained`` writes adapter_config.json (r, lora_alpha, use_rslora,
target_modules, ...) and adapter_model.safetensors (names and layout: interop/peft.py). The
run's ``model.lora`` must describe the same adapters: r, lora_alpha, use_rslora and the
targets are compared, not adopted, so the run's config.yaml (what a resume and an export read)
says what was trained. Features our adapters do not have (DoRA, biases, modules_to_save,
per-layer ranks or alphas, a subset of layers, ...) are refused by their peft key; so are
adapters of an initialisation that also changes the base (PiSSA, OLoRA, CorDA, LoftQ), which
belong to that changed base and not to ``init_from``'s. Only safetensors files are read.
"""
from __future__ import annotations

import json
import os
import re

import ml_dtypes  # noqa: F401  registers numpy's "bfloat16" so safetensors can read bf16 files
import numpy as np
from safetensors import safe_open

from ..config import LORA_TARGETS, Config, ConfigError, LoraConfig, ModelConfig
from ..models import lora
from .hf import _from_hf, _hf_names, _hf_shape, stacked
from .peft import (EXPERT_PARAMETERS, PEFT_PREFIX, SHARED_PARAMETERS, _leaves, adapter_leaves,
                   layers_path, model_targets, peft_shape, target_layers, with_adapters)

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# peft LoraConfig keys of features our adapters lack: refused when set (true or non-empty).
UNSUPPORTED = ("use_dora", "lora_bias", "rank_pattern", "alpha_pattern",
               "fan_in_fan_out", "layers_to_transform", "exclude_modules",
               "trainable_token_indices", "layer_replication", "use_qalora",
               "alora_invocation_tokens", "megatron_config", "arrow_config", "use_bdlora")
# init_lora_weights methods that rewrite the base weights too (W - B A, or a quantised W).
BASE_CHANGING = ("pissa", "olora", "corda", "loftq")
_EXAMPLES = 3  # names quoted in a message about many tensors


def read_adapter_config(path: str) -> dict:
    """The directory's adapter_config.json.

    Raises:
      ConfigError: no such directory or file, a .bin-only adapter, or not a JSON object.
    """
    where = f"init_adapter {path!r}"
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: not a directory (a peft adapter directory holds "
                          f"{CONFIG_FILE} and {WEIGHTS_FILE}, as save_pretrained writes them)")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ConfigError(f"{where}: has no {CONFIG_FILE}; is it a peft adapter directory?")
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        bin_only = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise ConfigError(f"{where}: has no {WEIGHTS_FILE}" + (
            " (only adapter_model.bin, a pickle, which is not read: save it again with peft, "
            "PeftModel.from_pretrained(base, DIR).save_pretrained(OUT, "
            "safe_serialization=True))" if bin_only else ""))
    try:
        with open(file) as f:
            conf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {CONFIG_FILE} cannot be read ({e})") from None
    if not isinstance(conf, dict):
        raise ConfigError(f"{where}: {CONFIG_FILE} must hold a JSON object, got "
                          f"{type(conf).__name__}")
    return conf


def adapter_targets(conf: dict, n_layers: int,
                    model: ModelConfig | None = None) -> tuple[list[str], list[str]]:
    """Our targets (models/lora.py) that peft's ``target_modules`` selects in every layer
    that has the projection (and "experts" / the shared expert's gate, up, down when its
    ``target_parameters`` names them), and the problems: entries that name no projection of
    ours, or a regular expression that selects a projection in some of those layers only.

    ``target_modules`` is a list of module names, each matching a module whose dotted name
    ends with it (``q_proj``, ``self_attn.q_proj``); "all-linear"; or a regular expression
    matched against the whole name (``model.layers.0.self_attn.q_proj``), as peft matches.
    ``model``: the projections and layers are that model's (``target_layers``); without it,
    every layer has attention and a dense MLP (no DeltaNet).
    """
    if model is None:
        layers = {t: list(range(n_layers)) for t in lora.HF_MODULES if t not in lora.LINEAR}
    else:
        layers = {t: ls for t, ls in target_layers(model).items()
                  if ls and t in lora.HF_MODULES and not (model.num_experts and t in lora.MLP)}
    parameters, problems = _parameter_targets(conf.get("target_parameters"))
    if not conf.get("target_modules") and parameters:  # adapters on parameters only
        return parameters, problems
    modules, more = _module_targets(conf.get("target_modules"), layers,
                                    "model.layers" if model is None else layers_path(model))
    if model is not None and model.num_experts:
        named = [e for e in (conf.get("target_modules") if isinstance(
            conf.get("target_modules"), list) else []) if str(e).split(".")[-1] in
            ("gate_proj", "up_proj", "down_proj")]
        if named:  # peft's transformers-5 conversion (interop/peft.py)
            more.append(f"target_modules {named}: on a mixture-of-experts model peft reads "
                        f"gate_proj / up_proj / down_proj as the routed experts' fused weights; "
                        f"the shared expert's adapters are named by target_parameters "
                        f"{list(SHARED_PARAMETERS.values())}, the experts' by "
                        f"{list(EXPERT_PARAMETERS)}")
    return ([t for t in LORA_TARGETS if t in modules + parameters], more + problems)


def _parameter_targets(given) -> tuple[list[str], list[str]]:
    """Targets of peft's ``target_parameters``: "experts" for the routed experts'
    gate_up_proj and down_proj (both, as our exports write them), gate / up / down for the
    shared expert's ``mlp.shared_expert.*_proj.weight``; else a problem."""
    if not given:
        return [], []
    rest = [str(p) for p in given] if isinstance(given, list) else [given]
    out = []
    experts = [p for p in rest if p.split(".")[-1] in ("gate_up_proj", "down_proj")]
    if sorted(p.split(".")[-1] for p in experts) == ["down_proj", "gate_up_proj"]:
        out, rest = ["experts"], [p for p in rest if p not in experts]
    for t, full in SHARED_PARAMETERS.items():  # peft matches a whole dotted suffix
        hits = [p for p in rest if full == p or full.endswith("." + p)]
        if hits:
            out, rest = out + [t], [p for p in rest if p not in hits]
    if rest:
        return [], [f"target_parameters {given!r} is not supported: adapters on parameters are "
                    f"read for the routed experts, as {list(EXPERT_PARAMETERS)} (both), and "
                    f"the shared expert, as {list(SHARED_PARAMETERS.values())}"]
    return out, []


def _module_targets(given, layers: dict, path: str) -> tuple[list[str], list[str]]:
    """``adapter_targets`` for peft's ``target_modules`` (``given``), over the projections
    ``layers`` (target -> the layers that have it) under ``path`` (``peft.layers_path``)."""
    modules = {t: lora.HF_MODULES[t] for t in layers}
    if given == "all-linear":
        return list(modules), []
    if isinstance(given, str):
        out, problems = [], []
        for t, module in modules.items():
            hits = [i for i in layers[t] if re.fullmatch(given, f"{path}.{i}.{module}")]
            if len(hits) == len(layers[t]):
                out.append(t)
            elif hits:
                problems.append(f"target_modules {given!r} selects {module} in layers "
                                f"{hits} of {len(layers[t])} only (of the layers that have it, "
                                f"{layers[t]}; layer-specific adapters are not supported)")
        return out, problems
    if not isinstance(given, list) or not given:
        return [], [f"target_modules must be a non-empty list or a string, got {given!r}"]
    out, unknown = [], []
    for entry in given:
        parts = str(entry).split(".")
        hits = [t for t, m in modules.items() if m.split(".")[-len(parts):] == parts]
        out += [t for t in hits if t not in out]
        if not hits:
            unknown.append(entry)
    problems = [f"target_modules {unknown} are not projections our adapters cover "
                f"({', '.join(m.split('.')[-1] for m in modules.values())})"] \
        if unknown else []
    return [t for t in modules if t in out], problems


def config_errors(conf: dict, lo: LoraConfig, n_layers: int,
                  model: ModelConfig | None = None, modules: frozenset = frozenset()) -> list[str]:
    """What in adapter_config.json differs from ``model.lora`` or cannot be expressed
    (``model``: the run's model, whose projections ``model.lora.targets`` are compared;
    ``modules``: the modules_to_save that ``model.lora.trainable`` makes, ``saved_modules``)."""
    if conf.get("peft_type") != "LORA":
        return [f"peft_type is {conf.get('peft_type')!r}; only LORA adapters are read"]
    errors = [f"{key} {conf[key]!r} is not supported (our adapters have no such feature)"
              for key in UNSUPPORTED if conf.get(key)]
    if conf.get("bias", "none") != "none":
        errors.append(f"bias {conf['bias']!r} is not supported (adapters without biases "
                      f"only: bias 'none')")
    init = conf.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING):
        errors.append(f"init_lora_weights {init!r} also rewrote the base weights, so the "
                      f"adapter belongs to that rewritten base, not to init_from's (save it "
                      f"converted with peft's path_initial_model_for_weight_conversion)")
    given = set(conf.get("modules_to_save") or ())
    if given != set(modules):
        errors.append(f"modules_to_save {sorted(given)} there, but model.lora.trainable "
                      f"{list(lo.trainable)} trains {sorted(modules)} in full here (embed: "
                      f"embed_tokens; head: lm_head; norms: every norm of the decoder)")
    targets, problems = adapter_targets(conf, n_layers, model)
    wanted = model_targets(model) if model is not None else list(lo.targets)
    errors += problems
    fixes = []
    for key, theirs, ours, fix in (
            ("r", conf.get("r"), lo.rank, f"model.lora.rank={conf.get('r')}"),
            ("lora_alpha", conf.get("lora_alpha"), lo.alpha,
             f"model.lora.alpha={conf.get('lora_alpha')}"),
            ("use_rslora", bool(conf.get("use_rslora", False)), lo.rslora,
             f"model.lora.rslora={str(bool(conf.get('use_rslora'))).lower()}")):
        if not isinstance(theirs, (int, float)) or float(theirs) != float(ours):
            ours_key = {"r": "rank", "lora_alpha": "alpha", "use_rslora": "rslora"}[key]
            errors.append(f"{key} {theirs!r} there, model.lora.{ours_key} {ours!r} here")
            fixes.append(fix)
    if targets and set(targets) != set(wanted):
        errors.append(f"target_modules {conf.get('target_modules')!r} (our targets "
                      f"{targets}) there, model.lora.targets {list(lo.targets)} here")
        fixes.append(f"model.lora.targets=[{','.join(targets)}]")
    if fixes:
        errors.append(f"run with {' '.join(fixes)} to continue this adapter")
    return errors


def expected_shapes(cfg: ModelConfig, params: dict) -> dict[str, tuple[int, ...]]:
    """peft name -> shape of every adapter matrix the parameter tree ``params`` (arrays or
    ShapeDtypeStructs) holds: lora_A [R, in], lora_B [out, R] (``adapter_tensors``' layout)."""
    out = {}
    for x, target, which, names in adapter_leaves(cfg, params):
        shape = peft_shape(target, which, tuple(x.shape[1:]))  # of A [in..., R] or B [R, out...]
        out.update({name: shape for name in names})
    return out


def tensor_errors(expected: dict[str, tuple], given: dict[str, tuple]) -> list[str]:
    """Missing, extra and misshapen tensors (names and shapes both ways)."""
    def some(names):
        names = sorted(names)
        return ", ".join(names[:_EXAMPLES]) + (f", ... ({len(names)} in all)"
                                                if len(names) > _EXAMPLES else "")
    errors = []
    missing, extra = set(expected) - set(given), set(given) - set(expected)
    if missing:
        errors.append(f"{WEIGHTS_FILE} lacks {len(missing)} of the {len(expected)} tensors "
                      f"model.lora needs: {some(missing)}")
    if extra:
        errors.append(f"{WEIGHTS_FILE} holds {len(extra)} tensors model.lora has no place "
                      f"for: {some(extra)}")
    bad = sorted(n for n in set(expected) & set(given) if tuple(given[n]) != expected[n])
    errors += [f"tensor {n} is {list(given[n])} there, {list(expected[n])} expected (an "
               f"adapter of another base model?)" for n in bad[:_EXAMPLES]]
    if len(bad) > _EXAMPLES:
        errors.append(f"{len(bad) - _EXAMPLES} more tensors of other shapes")
    return errors


def group_tensors(cfg: ModelConfig, params: dict) -> dict[str, tuple]:
    """The groups ``model.lora.trainable`` trains in full, as peft's modules_to_save saves
    them: peft name -> (our path, index in its layer stack or None, n_in, our shape of one
    tensor, transformers' shape)."""
    out = {}
    for keys, x in _leaves(params):
        if lora.is_adapter(keys) or not lora.is_trainable(keys, cfg.lora):
            continue
        names, n_in = _hf_names(keys, cfg)
        shape = tuple(x.shape[1:]) if stacked(keys) else tuple(x.shape)
        for i, name in enumerate(names):
            out[PEFT_PREFIX + name] = (keys, i if stacked(keys) else None, n_in, shape,
                                       _hf_shape(shape, n_in))
    return out


def saved_modules(groups: dict) -> frozenset:
    """modules_to_save of ``group_tensors``: each tensor's module (``model.norm.weight`` ->
    ``norm``)."""
    return frozenset(name.rsplit(".", 2)[-2] for name in groups)


def _group_leaves(groups: dict, tensors: dict) -> dict:
    """``group_tensors``' leaves from peft's tensors, in our layout (host float32)."""
    rows: dict[tuple, list] = {}
    for name, (keys, i, n_in, shape, _) in groups.items():
        rows.setdefault(keys, []).append((i, _from_hf(tensors[name], shape, n_in)))
    out = {}
    for keys, parts in rows.items():
        x = parts[0][1] if parts[0][0] is None else np.stack([w for _, w in sorted(
            parts, key=lambda p: p[0])])
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = x
    return out


def load_adapter(cfg: Config, params: dict) -> tuple[dict, list[str]]:
    """The adapters of ``cfg.init_adapter``, checked against ``cfg.model`` and the parameter
    tree ``params`` (its shapes are enough: ``state_layout``'s abstract parameters).

    Returns:
      (the adapter leaves only, as a nested dict of host float32 arrays in our layout, to
      ``lora.overlay`` on the base; lines for the start-up log).
    Raises:
      ConfigError: naming the rule and the numbers (see ``config_errors``,
        ``tensor_errors``).
    """
    path = cfg.init_adapter
    where = f"init_adapter {path!r}"
    conf = read_adapter_config(path)
    groups = group_tensors(cfg.model, params)
    errors = config_errors(conf, cfg.model.lora, cfg.model.n_layers, cfg.model,
                           saved_modules(groups))
    if errors:
        raise ConfigError(f"{where}: its {CONFIG_FILE} does not fit model.lora: "
                          f"{'; '.join(errors)}")
    expected = expected_shapes(cfg.model, params)
    expected.update({n: g[4] for n, g in groups.items()})
    # peft's copy of a tied head (ensure_weight_tying) is the embedding: not read.
    tied_copy = PEFT_PREFIX + "lm_head.weight" if cfg.model.tie_embeddings else None
    file = os.path.join(path, WEIGHTS_FILE)
    try:
        with safe_open(file, framework="np") as f:
            given = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if n != tied_copy}
            errors = tensor_errors(expected, given)
            if errors:
                raise ConfigError(f"{where}: {'; '.join(errors)}")
            tensors = {n: np.asarray(f.get_tensor(n), np.float32) for n in expected}
    except ConfigError:
        raise
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ConfigError(f"{where}: {WEIGHTS_FILE} is not a readable safetensors file "
                          f"({e})") from None
    loaded = with_adapters(cfg.model, params, tensors)
    notes = [f"init_adapter: {len(tensors)} LoRA tensors from {path} (r {conf['r']}, "
             f"lora_alpha {conf['lora_alpha']} on {', '.join(cfg.model.lora.targets)})"]
    base = conf.get("base_model_name_or_path")
    if base and _name(base) != _name(cfg.init_from):
        notes.append(f"warning: init_adapter {path!r} was saved for base model {base!r}, "
                     f"but init_from is {cfg.init_from!r}; the shapes fit, so it is loaded "
                     f"(check that this is the same model)")
    if conf.get("lora_dropout"):
        notes.append(f"init_adapter: trained with lora_dropout {conf['lora_dropout']}; this "
                     f"run trains without adapter dropout (model.lora.dropout 0.0)")
    return _merged(_adapters_only(loaded), _group_leaves(groups, tensors)), notes


def _merged(a: dict, b: dict) -> dict:
    """Two nested dicts of leaves in one (their leaves are disjoint)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and k in out else v
    return out


def _name(path: str) -> str:
    """A checkpoint's name: the last part of a local path or a hub id."""
    return os.path.basename(os.path.normpath(path))


def _adapters_only(params: dict) -> dict:
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            sub = _adapters_only(v)
            if sub:
                out[k] = sub
        elif lora.is_adapter((k,)):
            out[k] = v
    return out
