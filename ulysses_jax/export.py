"""Export a training run to a Hugging Face directory that transformers loads as is.

    python -m ulysses_jax.export RUN_DIR --out HF_DIR [--step N] [--dtype float32|bfloat16]
                                 [--max-shard-gb 5] [--arch llama|qwen3|...] [--merge]

A LoRA run (``model.lora.rank`` > 0) is written as a peft adapter directory
(adapter_config.json, adapter_model.safetensors: ``export_adapter``), or with ``--merge`` as
the full weights with the adapters merged in (W + s A B), as any run is written below.

Reads RUN_DIR/config.yaml (the run's resolved config: the model, with its RoPE scaling, as the
run trained it) and the parameters of checkpoint RUN_DIR/checkpoints/<step> (default the
newest), and writes HF_DIR/config.json (``hf.config_to_hf``: the scaling as
``rope_parameters``), the weights as safetensors shards of at most ``--max-shard-gb`` each
(``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``) and the tokenizer files of the run: ``data.tokenizer``'s
directory, for a run from a token store the directory of the tokenizer its manifest records
(checked against the recorded hash of tokenizer.json), else ``init_from``'s. A chat store's
own copy of its template (``STORE/chat_template.jinja``, checked against ``template_sha256``)
becomes HF_DIR/chat_template.jinja, with tokenizer_config.json made to agree
(``data.chat_templates.export_template``), so that ``apply_chat_template`` renders what the
run trained on, also when the template was given to prepare (``--chat-template``) rather than
the tokenizer's; a store prepared before stores kept their template needs its tokenizer
directory's template to still have that hash.

Memory: the parameters are read from the Orbax checkpoint straight into host numpy arrays
(the optimizer state is never read, no accelerator is needed), one layer of one parameter at
a time where TensorStore can open the stored array (``runs.open_param``: Orbax 0.12's layout),
else one whole parameter at a time (an Orbax partial restore: all layers of one weight, fp32,
7.5 GB for Llama-3-8B's MLP weights); each shard is written as soon as it is complete, so
the host holds one layer (or parameter) plus one shard (``--max-shard-gb``), and the stored
chunks a layer is read from: TensorStore decodes whole chunks, and Orbax's chunks span all
layers (a replicated parameter is one chunk, a ZeRO-3 one a chunk per device), in the stored
dtype; they are kept decoded while the parameter's layers are read rather than decoded again
for each.

Exit codes: 0 written; 2 a bad input (no such run, no checkpoint, step not found, bad dtype,
output directory not empty, a token store's tokenizer or chat template changed since it was
prepared), with a one-line ``error: ...`` and no traceback; nothing is written then.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import shutil
import sys
from typing import Iterator

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from .data.chat import ChatTemplate
from .data.chat_templates import describe_origin, export_template, stored_template
from .data.run_data import store_tokenizer
from .data.store import TokenStore, is_store
from .interop.hf import _flat, _hf_names, _hf_shape, _to_hf, config_to_hf, stacked
from .interop.peft import (PEFT_PREFIX, adapter_config, adapter_tensors, merge_expert_weight,
                           merge_weight)
from .models import lora
from .runs import LoadError, param_shapes, pick_step, read_params, run_config

EXPORT_DTYPES = ("float32", "bfloat16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
# config.json keys of the init_from checkpoint that name tokens; kept so that generation
# stops where the original model stops.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class ExportError(ValueError):
    """A run directory, step or option that cannot be exported; the message says which."""


def _export_errors(fn):
    """``fn`` raising a run it cannot open (``runs.LoadError``) as an ExportError."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LoadError as e:
            raise ExportError(str(e)) from None
    return wrapped


def hf_tensors(cfg, keys: tuple, x: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """The transformers tensors of one of our parameters (stacked: one per layer, and per
    expert), as ``hf.to_hf_tensors`` forms them.

    Args:
      x: a numpy array, or a ``runs.LayerReader`` (each layer is then read when it is needed).
    """
    names, n_in = _hf_names(keys, cfg)
    for name, layer in zip(names, x if stacked(keys) else [x], strict=True):
        layer = np.asarray(layer, np.float32)  # one layer read (a LayerReader reads it here)
        pairs = zip(name, layer, strict=True) if isinstance(name, list) else [(name, layer)]
        for n, w in pairs:
            yield n, np.ascontiguousarray(_to_hf(w, n_in))


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into consecutive shards of at most ``max_bytes`` each (a
    tensor larger than that is a shard of its own, as transformers does)."""
    shards, current, used = [], [], 0
    for name, size in sizes:
        if current and used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return shards + [current] if current else shards


@_export_errors
def export_adapter(run_dir: str, out_dir: str, *, step: int | None = None,
                   dtype: str = "float32") -> dict:
    """Writes a LoRA run's adapters as a peft adapter directory: adapter_config.json (its
    base_model_name_or_path is the run's init_from) and adapter_model.safetensors with peft's
    tensor names and layout (``interop/peft.py``). Only the adapters are read.

    The groups a run also trained in full (``model.lora.trainable``: embed, norms, head) are
    written as peft's ``modules_to_save``: the modules' names in adapter_config.json, their
    whole tensors under their transformers names.

    Returns:
      A summary: ``step``, ``files``, ``tensors``, ``bytes``.
    Raises:
      ExportError: not a LoRA run, or one that also trained groups an adapter cannot hold
        (the vision tower).
    """
    cfg = run_config(run_dir)
    lo = cfg.model.lora
    if not lo.rank:
        raise ExportError(f"run {run_dir} has no LoRA adapters (model.lora.rank 0)")
    if "vision" in lo.trainable:
        raise ExportError(f"run {run_dir} also trained the vision tower (model.lora.trainable "
                          f"names 'vision'), which this peft adapter export does not write; "
                          f"export merged weights with --merge")
    step = pick_step(run_dir, step)
    _need_empty(out_dir)
    params = {}
    for keys, x in read_params(run_dir, step, only=lora.is_adapter):
        if cfg.model.num_experts and "mlp" in keys:
            raise ExportError(
                f"run {run_dir} adapted the dense MLP layers of an MoE model ({keys[-1]} under "
                f"model.mlp_only_layers {list(cfg.model.mlp_only_layers)}): peft reads the "
                f"names gate_proj/up_proj/down_proj of such a model as its experts' fused "
                f"weights, so this adapter cannot be written for peft; export merged weights "
                f"with --merge")
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = x
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {k: v.astype(np_dtype) for k, v in adapter_tensors(cfg.model, params).items()}
    # The groups trained in full (model.lora.trainable) as peft's modules_to_save: each
    # module's whole tensors under their transformers names (peft saves them so).
    saved_modules = set()
    trained = lambda k: lora.is_trainable(k, lo) and not lora.is_adapter(k)  # noqa: E731
    for keys, x in read_params(run_dir, step, only=trained):
        for name, w in hf_tensors(cfg.model, keys, x):
            tensors[PEFT_PREFIX + name] = w.astype(np_dtype)
            saved_modules.add(name.rsplit(".", 2)[-2])  # model.norm.weight -> norm
    config = adapter_config(cfg.model, cfg.init_from)
    if saved_modules:
        config["modules_to_save"] = sorted(saved_modules)
        # A trained embedding that is also the head stays tied to it in peft's model, which
        # then saves (and reads) the head's copy too.
        config["ensure_weight_tying"] = bool(cfg.model.tie_embeddings)
        embed = PEFT_PREFIX + "model.embed_tokens.weight"
        if cfg.model.tie_embeddings and embed in tensors:
            tensors[PEFT_PREFIX + "lm_head.weight"] = tensors[embed]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return {"step": step, "files": ["adapter_model.safetensors"], "tensors": len(tensors),
            "bytes": sum(v.nbytes for v in tensors.values())}


def _need_empty(out_dir: str) -> None:
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ExportError(f"--out {out_dir} is not an empty directory; pass a new or empty one "
                          f"(an export never overwrites files)")


def _merged_reader(run_dir: str, step: int, cfg):
    """``read_params`` for the merged model of a LoRA run: each adapted weight comes back as
    W + s A B (float32, one whole parameter at a time), the adapters themselves not at all."""
    adapters = {keys: x for keys, x in read_params(run_dir, step, only=lora.is_adapter)}
    s = lora.scaling(cfg.model.lora)
    attrs = {attr: t for group in (lora.ATTENTION, lora.MLP, lora.SHARED, lora.LINEAR)
             for t, (attr, _) in group.items()}
    experts = {w: (t, ws.index(w), len(ws)) for t, ws in lora.EXPERTS.items() for w in ws}

    def merged(keys, x):
        if keys[-2:-1] == ("moe",) and keys[-1] in experts:  # routed experts: [L, E, in, out]
            target, part, parts = experts[keys[-1]]
            a_keys, b_keys = (keys[:-1] + (n,) for n in lora.names(target))
            if a_keys not in adapters:
                return x
            return merge_expert_weight(np.asarray(x), adapters[a_keys], adapters[b_keys], s,
                                       part, parts)
        target = attrs.get(keys[-1])
        a_keys = keys[:-1] + (lora.names(target)[0],) if target else None
        if a_keys not in adapters:
            return x
        return merge_weight(x, adapters[a_keys], adapters[keys[:-1] + (lora.names(target)[1],)],
                            s)

    for keys, x in read_params(run_dir, step, by_layer=True,
                               only=lambda k: not lora.is_adapter(k)):
        yield keys, merged(keys, x)


@_export_errors
def export_run(run_dir: str, out_dir: str, *, step: int | None = None,
               dtype: str = "float32", max_shard_gb: float = 5.0, arch: str | None = None,
               progress: bool = True, merge: bool = False) -> dict:
    """Writes a Hugging Face directory from a run's checkpoint (module docstring).

    ``merge``: a LoRA run's adapters merged into the weights (required for a LoRA run here;
    its adapters alone are ``export_adapter``'s).

    Returns:
      A summary: ``step``, ``files`` (the safetensors files), ``tensors``, ``bytes``,
      ``tokenizer_files`` (copied), ``tokenizer_source`` (``run_tokenizer``),
      ``chat_template`` (where the export's template is, or why it has none),
      ``rope_parameters``.
    Raises:
      ExportError: a bad run directory, step, dtype or output directory.
    """
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    if not max_shard_gb > 0:
        raise ExportError(f"--max-shard-gb must be positive, got {max_shard_gb}")
    cfg = run_config(run_dir)
    if cfg.model.lora.rank and not merge:
        raise ExportError(f"run {run_dir} trained LoRA adapters: write them with "
                          f"export_adapter, or merged weights with merge=True (--merge)")
    if merge and not cfg.model.lora.rank:
        raise ExportError(f"--merge needs a LoRA run; run {run_dir} has model.lora.rank 0")
    step = pick_step(run_dir, step)
    _need_empty(out_dir)
    tokenizer, tokenizer_source = run_tokenizer(cfg)  # before anything is written
    try:
        hf = config_to_hf(cfg.model, arch, max_position_embeddings=cfg.seq_len)
    except ValueError as e:
        raise ExportError(f"the run's model cannot be written as a transformers config: "
                          f"{e}") from None
    hf.update(_token_ids(cfg.init_from), torch_dtype=dtype, dtype=dtype)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    itemsize = np.dtype(np_dtype).itemsize

    shapes = param_shapes(run_dir, step)
    if merge:  # the model without adapters (their weights come back merged)
        shapes = {k: v for k, v in shapes.items() if not lora.is_adapter(k)}
    sizes = []  # (HF name, bytes) in the order the tensors are produced
    for keys, shape in shapes.items():
        names, n_in = _hf_names(keys, cfg.model)
        inner = shape[1:] if stacked(keys) else shape
        if keys[0] == "layers" and names and isinstance(names[0], list):
            inner = inner[1:]  # expert weights: [L, E, ...] -> one tensor per (layer, expert)
        size = math.prod(_hf_shape(inner, n_in)) * itemsize
        sizes += [(n, size) for n in _flat(names)]
    shards = plan_shards(sizes, int(max_shard_gb * 2 ** 30))
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    file_of = {n: f for f, names in zip(files, shards) for n in names}

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    bar = _bar(len(sizes), progress)
    pending: dict[str, dict] = {f: {} for f in files}
    reader = (_merged_reader(run_dir, step, cfg) if merge else
              read_params(run_dir, step, by_layer=True))
    for keys, x in reader:
        for name, w in hf_tensors(cfg.model, keys, x):
            file = file_of[name]
            pending[file][name] = w.astype(np_dtype)
            bar.update(1)
            if len(pending[file]) == len(shards[files.index(file)]):
                # transformers reads this metadata key as "a torch-style state dict".
                save_file(pending.pop(file), os.path.join(out_dir, file),
                          metadata={"format": "pt"})
        del x
    bar.close()
    if pending:
        raise RuntimeError(f"shards {sorted(pending)} were planned but not filled")
    total = sum(size for _, size in sizes)
    if len(files) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": file_of}, f, indent=2,
                      sort_keys=True)
    copied = _copy_tokenizer(cfg, tokenizer, out_dir)
    copied += [n for n in _store_template(cfg, out_dir) if n not in copied]
    return {"step": step, "files": files, "tensors": len(sizes), "bytes": total,
            "tokenizer_files": copied, "tokenizer_source": tokenizer_source,
            "chat_template": _template_note(out_dir),
            "rope_parameters": hf.get("rope_parameters") or
            (hf.get("text_config") or {}).get("rope_parameters")}  # multimodal: the decoder's


def _token_ids(init_from: str | None) -> dict:
    """bos/eos/pad token ids of the init_from checkpoint's config.json, where present."""
    path = os.path.join(init_from or "", "config.json")
    if not init_from or not os.path.isfile(path):
        return {}
    with open(path) as f:
        hf = json.load(f)
    return {k: hf[k] for k in TOKEN_ID_KEYS if hf.get(k) is not None}


def run_tokenizer(cfg) -> tuple[str | None, str]:
    """The run's tokenizer.json and a phrase saying where it comes from.

    ``data.tokenizer`` (a tokenizer.json or a directory with one; init_from's when the run did
    not name one, as resume.resolve_init_from sets it); for a run from a token store the one
    the store was prepared with (``run_data.store_tokenizer``: data.tokenizer or the
    manifest's, with the recorded hash). A chat store's own copy of its template must still
    have the recorded ``template_sha256`` (it is what the export writes); a store without a
    copy (prepared before stores kept one) needs its directory's template to have it. None
    for bytes.

    Raises:
      ExportError: the store's tokenizer or chat template is gone or has changed.
    """
    source = cfg.data.source
    if not is_store(source):
        tok = cfg.data.tokenizer
        if tok and os.path.isdir(tok):
            tok = os.path.join(tok, "tokenizer.json")
        if tok and os.path.isfile(tok):
            return tok, f"data.tokenizer {cfg.data.tokenizer}"
        return None, (f"data.tokenizer {cfg.data.tokenizer} has no tokenizer.json"
                      if cfg.data.tokenizer else "a byte-level run has no tokenizer file")
    try:
        tok = store_tokenizer(source, cfg.data.tokenizer)
        manifest = TokenStore(source).manifest
        want = manifest.get("template_sha256")
    except ValueError as e:
        raise ExportError(f"the run's data.source: {e}") from None
    if tok is None:
        return None, f"the store {source} is byte-level: no tokenizer file"
    if not want:
        return tok, f"the tokenizer of the store {source}"
    try:
        own = stored_template(source, manifest)
    except ValueError as e:
        raise ExportError(f"the run's data.source: {e}") from None
    if own is not None:  # the store's copy is what the run trained on: it is exported
        return tok, (f"the tokenizer of the chat store {source} and the chat template it "
                     f"keeps, from {describe_origin(manifest['chat_template'])}")
    # A store without a copy: its directory's template must do.
    directory = os.path.dirname(tok)
    try:
        got = ChatTemplate.from_dir(directory).hash
    except (OSError, ValueError) as e:
        got = f"none ({e})"
    if got != want:
        raise ExportError(f"the run's data.source {source!r} is a chat store rendered with "
                          f"the chat template of hash {want}, but {directory}'s is {got}: "
                          f"restore its tokenizer_config.json (or chat_template.jinja) or "
                          f"prepare the store again")
    return tok, f"the tokenizer and chat template of the chat store {source}"


def _copy_tokenizer(cfg, tok: str | None, out_dir: str) -> list[str]:
    """Copies the run's tokenizer.json ``tok`` (``run_tokenizer``), the other
    TOKENIZER_FILES beside it (else init_from's) and init_from's generation_config.json.
    Returns the names copied."""
    found = {"tokenizer.json": tok}
    dirs = [d for d in (os.path.dirname(tok) if tok else None, cfg.init_from) if d]
    for name in TOKENIZER_FILES[1:]:
        found[name] = next((os.path.join(d, name) for d in dirs
                            if os.path.isfile(os.path.join(d, name))), None)
    generation = os.path.join(cfg.init_from or "", "generation_config.json")
    found["generation_config.json"] = generation if cfg.init_from and os.path.isfile(
        generation) else None
    for name, path in found.items():
        if path:
            shutil.copyfile(path, os.path.join(out_dir, name))
    return [name for name, path in found.items() if path]


def _store_template(cfg, out_dir: str) -> list[str]:
    """For a run from a chat store that keeps its template: writes it (and a tokenizer_config
    .json that agrees) into ``out_dir``; returns the names written."""
    if not is_store(cfg.data.source):
        return []
    return export_template(cfg.data.source, TokenStore(cfg.data.source).manifest, out_dir)


def _template_note(out_dir: str) -> str:
    """Where the exported tokenizer's chat template is, or that it has none."""
    if os.path.isfile(os.path.join(out_dir, "chat_template.jinja")):
        return "chat_template.jinja"
    config = os.path.join(out_dir, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            if json.load(f).get("chat_template"):
                return "in tokenizer_config.json"
    return ("none: the run trained without a chat template and its tokenizer has none, so "
            "apply_chat_template refuses (docs/DATA.md, 'Bring a template')")


def _bar(total: int, enabled: bool):
    return tqdm(total=total, desc="export", unit="tensor", dynamic_ncols=True,
                disable=not enabled)  # disabled: update and close do nothing


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ulysses_jax.export",
                                description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the run's --workdir (config.yaml, checkpoints/)")
    p.add_argument("--out", required=True, help="new (or empty) Hugging Face directory")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest safetensors file, in GiB (default 5)")
    p.add_argument("--arch", help="transformers model_type (default: the one that fits)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: write the weights with the adapters merged in (default: "
                        "a peft adapter directory)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Orbax warns that a partial restore's item has no metadata file of its own; harmless.
    logging.getLogger("absl").setLevel(logging.ERROR)
    if args.dtype not in EXPORT_DTYPES:  # before the run is opened
        print(f"error: --dtype must be one of {', '.join(EXPORT_DTYPES)}, got {args.dtype!r}",
              file=sys.stderr)
        return 2
    try:
        if not args.merge and run_config(args.run_dir).model.lora.rank:
            summary = export_adapter(args.run_dir, args.out, step=args.step, dtype=args.dtype)
            print(f"exported the LoRA adapters of step {summary['step']} of {args.run_dir} to "
                  f"{args.out} (peft: adapter_config.json, adapter_model.safetensors): "
                  f"{summary['tensors']} tensors, {summary['bytes'] / 2 ** 20:.2f} MiB")
            return 0
        summary = export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype,
                             max_shard_gb=args.max_shard_gb, arch=args.arch,
                             progress=not args.no_progress, merge=args.merge)
    except (ExportError, LoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = (f"{', '.join(summary['tokenizer_files'])} ({summary['tokenizer_source']})"
           if summary["tokenizer_files"] else f"none ({summary['tokenizer_source']})")
    print(f"exported step {summary['step']} of {args.run_dir} to {args.out}: "
          f"{summary['tensors']} tensors, {summary['bytes'] / 2 ** 30:.2f} GiB in "
          f"{len(summary['files'])} file(s); RoPE {summary['rope_parameters']}; "
          f"tokenizer files: {tok}; chat template: {summary['chat_template']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
