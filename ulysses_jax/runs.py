"""Opening a model directory: a training run's or a Hugging Face one.

    RUN_DIR/config.yaml                    the run's resolved Config (``run_config``)
    RUN_DIR/checkpoints/<step>/state       its committed checkpoints (``checkpoint_steps``,
                                           ``pick_step``), whose parameters ``read_params``
                                           reads one at a time into host numpy arrays
    HF_DIR/config.json, *.safetensors      a Hugging Face directory (``interop.hf``)

``load`` opens either kind on a mesh, with its tokenizer and where its held-out data come
from. The command-line tools (evaluate, generate, export) share this module and import none
of one another; each turns a ``LoadError`` into its own error with the same message.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import nnx
from jax.sharding import NamedSharding

from .config import ConfigError, load_config
from .data import text as data_lib
from .data.run_data import store_tokenizer
from .data.store import is_store
from .interop.hf import load_params
from .models.decoder import Decoder
from .models.param_layout import leaf_spec


class LoadError(ValueError):
    """A directory, step or tokenizer that cannot be opened; the message says which and why."""


def run_config(run_dir: str):
    """The run's resolved Config from RUN_DIR/config.yaml.

    Raises:
      LoadError: no such directory, no config.yaml, or a config that no longer loads.
    """
    if not os.path.isdir(run_dir):
        raise LoadError(f"run directory {run_dir} does not exist")
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise LoadError(f"{run_dir} is not a training run: it has no config.yaml "
                        f"(train.py writes one at the start of a run)")
    try:
        return load_config(path)
    except ConfigError as e:
        raise LoadError(f"{path}: {e}") from None


def checkpoint_steps(run_dir: str) -> list[int]:
    """The committed checkpoint steps of a run, oldest first (Orbax renames a step directory
    to its number only once it is complete, so unfinished saves are not listed)."""
    directory = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory)
                  if d.isdigit() and os.path.isdir(os.path.join(directory, d, "state")))


def pick_step(run_dir: str, step: int | None) -> int:
    """``step``, or the newest; LoadError naming the steps there are when it is absent."""
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise LoadError(f"{run_dir} has no checkpoint (no step directory in "
                        f"{os.path.join(run_dir, 'checkpoints')})")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise LoadError(f"step {step} is not a checkpoint of {run_dir}; its checkpoints are "
                        f"steps {', '.join(map(str, steps))}")
    return step


def param_shapes(run_dir: str, step: int) -> dict[tuple, tuple[int, ...]]:
    """Parameter path (as in ``nnx.to_pure_dict``) -> shape, from the checkpoint's metadata."""
    with ocp.PyTreeCheckpointer() as c:
        meta = c.metadata(_state_dir(run_dir, step))
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return {_keys(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree["params"])}


def read_params(run_dir: str, step: int, *, by_layer: bool = False,
                only=None) -> Iterator[tuple]:
    """Yields (path, parameter) for each parameter, one at a time.

    Args:
      only: ``f(path) -> bool``: read only the parameters it picks (default all).
      by_layer: yield a ``LayerReader`` (``x[i]`` reads layer i of a stacked parameter) where
        the checkpoint's storage allows it, so that only one layer is in host memory;
        otherwise, and for every parameter without it, a float32 numpy array read by an
        Orbax partial restore (neither the optimizer state nor other parameters are read).
    """
    with ocp.PyTreeCheckpointer() as c:
        for keys in param_shapes(run_dir, step):
            if only is not None and not only(keys):
                continue
            reader = open_param(run_dir, step, keys) if by_layer else None
            if reader is not None:
                yield keys, reader
                continue
            item, args = {}, {}
            node_i, node_a = item, args
            for k in ("params",) + keys[:-1]:
                node_i, node_a = node_i.setdefault(k, {}), node_a.setdefault(k, {})
            node_i[keys[-1]] = 0
            node_a[keys[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)
            out = c.restore(_state_dir(run_dir, step), args=ocp.args.PyTreeRestore(
                item=item, restore_args=args, partial_restore=True))
            for k in ("params",) + keys:
                out = out[k]
            yield keys, np.asarray(out, np.float32)


class LayerReader:
    """A stored parameter read slice by slice: ``x[i]`` is layer i (float32 numpy),
    ``np.asarray(x)`` all of it."""

    def __init__(self, store):
        self._store, self.shape = store, tuple(store.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i) -> np.ndarray:
        if isinstance(i, int) and not -len(self) <= i < len(self):
            raise IndexError(i)
        return np.asarray(self._store[i].read().result(), np.float32)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._store.read().result(), dtype or np.float32)


def open_param(run_dir: str, step: int, keys: tuple) -> LayerReader | None:
    """The parameter's array in the checkpoint opened with TensorStore (nothing read yet),
    or None where that fails. Orbax (0.12) stores each array as a zarr array named by its
    dotted path in the step's OCDBT database; another layout falls back to a restore."""
    try:
        spec = {"driver": "zarr", "kvstore": {
            "driver": "ocdbt", "base": f"file://{_state_dir(run_dir, step)}",
            "path": ".".join(("params",) + keys)}}
        store = ts.open(spec, open=True, read=True).result()
        # Reading a slice decodes every stored chunk that holds part of it, and Orbax's chunks
        # span all layers (a replicated array is one chunk; a ZeRO-3 one a chunk per device,
        # split along another axis): without a cache each layer's read would decompress every
        # layer again (SmolLM2-135M's export: 270 reads, 48 s of a 58 s export). A cache of
        # the chunks one layer's read touches keeps them while the layers are read; the host
        # held them during each read already.
        shape, chunk = tuple(store.shape), tuple(store.chunk_layout.read_chunk.shape)
        touched = math.prod(-(-n // c) * c for n, c in zip(shape[1:], chunk[1:]))
        size = (chunk[0] if chunk else 1) * touched * store.dtype.numpy_dtype.itemsize
        store = ts.open(spec, open=True, read=True, context=ts.Context(
            {"cache_pool": {"total_bytes_limit": size + (1 << 20)}})).result()
    except Exception:  # noqa: BLE001 - any failure means "not this layout": use Orbax
        return None
    return LayerReader(store)


def _state_dir(run_dir: str, step: int) -> str:
    return os.path.abspath(os.path.join(run_dir, "checkpoints", str(step), "state"))


def _keys(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


@dataclasses.dataclass
class Loaded:
    """A model on the mesh: its graphdef and params, its ModelConfig, tokenizer (and the
    tokenizer.json it was read from, None for bytes; ``tokenizer_note`` says which), and where
    its held-out data come from (``run_data``: the run's own data.source, whose training
    split must be left out)."""
    graphdef: object
    params: dict
    model: object
    tokenizer: object
    tokenizer_file: str | None
    tokenizer_note: str
    source: str
    heldout_fraction: float
    seed: int
    default_seq_len: int | None
    chat_overflow: str = "truncate"
    run_data: bool = False
    run: object = None  # a run directory's Config (None for a Hugging Face directory)


def load(path: str, mesh, step: int | None = None) -> Loaded:
    """A run directory (config.yaml + checkpoints) or a Hugging Face directory, on ``mesh``.

    Raises:
      LoadError: neither kind of directory, no such step, or a tokenizer or weights that
        cannot be read.
    """
    if os.path.isfile(os.path.join(path, "config.yaml")):
        cfg = run_config(path)
        step = pick_step(path, step)
        tok_file = cfg.data.tokenizer
        if is_store(cfg.data.source):  # the store knows its tokenizer (training needs none)
            try:
                tok_file = store_tokenizer(cfg.data.source, cfg.data.tokenizer)
            except ValueError as e:
                raise LoadError(f"the run's data.source: {e}") from None
        tokenizer = _tokenizer(tok_file)
        note = (tok_file or "bytes") + (f" (the tokenizer of the store {cfg.data.source})"
                                         if is_store(cfg.data.source) else "")
        model = cfg.model
        params = {}
        for keys, x in read_params(path, step):  # one parameter at a time onto the mesh
            node = params
            for k in keys[:-1]:
                node = node.setdefault(int(k) if k.isdigit() else k, {})
            spec = leaf_spec(keys, x.shape, mesh, cfg.param_sharding)
            node[keys[-1]] = jax.device_put(x, NamedSharding(mesh, spec))
        source, fraction, seed = cfg.data.source, cfg.data.heldout_fraction, cfg.seed
        seq_len, overflow, run_data, run = cfg.seq_len, cfg.data.chat_overflow, True, cfg
    elif os.path.isfile(os.path.join(path, "config.json")):
        tok_file = note = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):  # checked before the (maybe large) weights load
            tok_file, note = None, _byte_export(path)
        try:
            model, params = load_params(path, mesh)
        except ValueError as e:
            raise LoadError(f"{path}: {e}") from None
        tokenizer = _tokenizer(tok_file)
        source, fraction, seed, seq_len = "stdlib", 0.02, 0, None
        overflow, run_data, run = "truncate", False, None
    else:
        raise LoadError(f"{path} is neither a training run (config.yaml) nor a Hugging Face "
                        f"model directory (config.json)")
    abstract = nnx.eval_shape(lambda: Decoder(model, mesh=mesh, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return Loaded(graphdef, nnx.to_pure_dict(state), model, tokenizer, tok_file, note, source,
                  fraction, seed, seq_len, overflow, run_data, run)


def _byte_export(path: str) -> str:
    """Why a Hugging Face directory without tokenizer.json is read with the byte tokenizer
    (an export of a byte-level run: config.json's vocab_size is the byte vocabulary's 257);
    LoadError for any other vocabulary."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        vocab = hf.get("vocab_size", (hf.get("text_config") or {}).get("vocab_size"))
    except (OSError, ValueError, AttributeError) as e:
        raise LoadError(f"{path}/config.json is not readable: {e}") from None
    if vocab != data_lib.ByteTokenizer.vocab_size:
        raise LoadError(f"{path} has no tokenizer.json (needed for held-out text and the "
                        f"passkey prompts), and its vocab_size {vocab} is not the byte "
                        f"tokenizer's {data_lib.ByteTokenizer.vocab_size}: copy the model's "
                        f"tokenizer.json into it")
    return (f"bytes ({path} has no tokenizer.json and vocab_size {vocab}: an export of a "
            f"byte-level run)")


def _tokenizer(path: str | None):
    try:
        return data_lib.load_tokenizer(path)
    except (OSError, ValueError, ImportError) as e:
        raise LoadError(f"tokenizer {path!r}: {e}") from None
