"""Generation from the command line (and as a function): prompts in, completions out.

    python -m ulysses_jax.generate MODEL --prompts FILE --out FILE [--max-new-tokens N]
        [--temperature T] [--top-p P] [--top-k K] [--seed S] [--mesh-seq P] [--mesh-data D]
        [--num-samples G] [--batch-size B] [--step N] [--no-progress]

MODEL: a Hugging Face directory (an export or a checkpoint) or a training run's --workdir
(its newest checkpoint, or ``--step``; its tokenizer; its LoRA adapters applied).
FILE: jsonl (or parquet) rows ``{"prompt": "text"}``, tokenized as transformers tokenizes
(the tokenizer's own BOS where it adds one), or ``{"messages": [...]}``, rendered with the
model's chat template (a run's: its chat store's) and the generation prompt. A multimodal
model's messages may hold image and video parts (as in training data; paths relative to
FILE), preprocessed as transformers' processor does.

Each input row gives ``--num-samples`` G output rows in order (default 1), the input row with
``sample`` (0 .. G - 1), ``completion`` (text, special tokens left out),
``completion_ids`` (the stop token included when one was chosen), ``prompt_tokens`` and
``finish_reason``: ``"stop"`` at an end-of-sequence id (generation_config.json's
``eos_token_id``, else config.json's, else the tokenizer's EOS), ``"length"`` at
``--max-new-tokens``. Sampling defaults come from generation_config.json where it has them
(greedy unless it sets ``do_sample``); ``--temperature 0`` is greedy. Each prompt is
prefilled once for its G samples, which share its cache; sample g of input row i draws as
row i G + g would in a file with each row written G times. The last stdout line is
a JSON summary: rows, prompt_tokens, completion_tokens, compile_s, prefill_s, decode_s,
decode_tokens_per_s.

The prompts are split over ``--mesh-seq`` devices by sequence (Ulysses attention) and each
device keeps the KV cache of its heads (``ulysses_jax/generation``, docs/GENERATION.md);
``--mesh-data`` replicas of those devices each generate their share of a batch's rows (D x P
devices in all).

Exit codes: 0 done; 2 a bad input (no model there, an empty prompts file, a row with neither
prompt nor messages, a chat row for a model without a chat template, a prompt plus new tokens
beyond the model's positions) with a one-line ``error: ...``, no traceback and no output
file.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import jax
import numpy as np
from tqdm import tqdm

from .compile_cache import fence
from .config import ConfigError
from .data import media as media_lib
from .data.chat import ChatTemplate, prompt_ids
from .data.chat_templates import stored_template
from .data.media import MediaOptions, media_parts
from .data.store import TokenStore, is_store
from .data.vision_batches import media_inputs
from .families import family
from .generation import GenerationError, Generator, Sampling
from .generation.settings import DEFAULT_MAX_NEW_TOKENS, model_settings
from .mesh import make_mesh, request_cpu_devices
from .runs import LoadError, load, run_config
from .training.fit import check_program


class GenerateError(ValueError):
    """Bad input: the CLI prints it on one line and exits 2."""


def read_rows(path: str) -> list[dict]:
    """The rows of a jsonl or parquet prompts file; GenerateError names a bad row."""
    if not os.path.isfile(path):
        raise GenerateError(f"prompts file {path} does not exist")
    rows = []
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq  # here, not at the top: slow to import, parquet only
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 (pyarrow raises many kinds)
            raise GenerateError(f"{path} is not a readable parquet file: {e}") from None
    else:
        with open(path, encoding="utf-8", errors="strict") as f:
            lines = _lines(f, path)
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise GenerateError(f"{path}:{n} is not JSON: {e}") from None
                if not isinstance(row, dict):
                    raise GenerateError(f"{path}:{n} is not a JSON object")
                rows.append(row)
    if not rows:
        raise GenerateError(f"prompts file {path} has no rows")
    for n, row in enumerate(rows, 1):
        has_prompt = isinstance(row.get("prompt"), str)
        has_messages = isinstance(row.get("messages"), list) and row["messages"]
        if not has_prompt and not has_messages:
            raise GenerateError(f"{path} row {n} has neither \"prompt\" (text) nor "
                                f"\"messages\" (a list of messages)")
    return rows


def _lines(f, path: str) -> list[str]:
    try:
        return f.readlines()
    except UnicodeDecodeError as e:
        raise GenerateError(f"{path} is not UTF-8 text: {e}") from None


def _template_of(loaded, path: str):
    """The chat template of MODEL: a run's chat store's, else its tokenizer directory's;
    a Hugging Face directory's own. None when there is none."""
    try:
        if loaded.run_data and is_store(loaded.source):
            store = TokenStore(loaded.source)
            found = stored_template(loaded.source, store.manifest)
            if found is not None:
                return found
        directory = path if not loaded.run_data else (
            os.path.dirname(loaded.tokenizer_file) if loaded.tokenizer_file else None)
        return ChatTemplate.from_dir(directory) if directory else None
    except ValueError:
        return None


def _init_from(run: str) -> str | None:
    """A run's init_from: the Hugging Face directory whose generation_config.json (stop ids,
    sampling defaults) and positions the run's model keeps; None for a run from scratch."""
    try:
        source = run_config(run).init_from
    except LoadError:
        return None
    return source if source and os.path.isfile(os.path.join(source, "config.json")) else None


def media_options(loaded, path: str):
    """A multimodal model's image and video preprocessing (``data.media.MediaOptions``): its
    tower's patching, and the pixel bounds and video rate of the run's chat store, or of the
    Hugging Face directory's preprocessor_config.json (``min_pixels`` / ``max_pixels`` or
    ``size``), else the processor's defaults. None for a text model."""
    cfg = loaded.model
    if not family(cfg.family).vision:
        return None
    v = cfg.vision
    opts = {"patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
            "merge_size": v.spatial_merge_size}
    fields = set(MediaOptions.__dataclass_fields__) - set(opts)
    if loaded.run_data and is_store(loaded.source):
        media = TokenStore(loaded.source).manifest.get("media") or {}
        opts.update({k: media[k] for k in fields if k in media})
    elif not loaded.run_data:
        config = os.path.join(path, "preprocessor_config.json")
        if os.path.isfile(config):
            try:
                with open(config, encoding="utf-8") as f:
                    pre = json.load(f)
            except ValueError as e:
                raise GenerateError(f"{config} is not JSON: {e}") from None
            size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
            low = pre.get("min_pixels", size.get("shortest_edge"))
            high = pre.get("max_pixels", size.get("longest_edge"))
            if low is not None:
                opts["image_min_pixels"] = int(low)
            if high is not None:
                opts["image_max_pixels"] = int(high)
    try:
        return MediaOptions(**opts)
    except ValueError as e:
        raise GenerateError(f"the model's image preprocessing: {e}") from None


def _row_media(ids, messages, tokenizer, opts, base: str, name: str):
    """(the prompt ids with each <|image_pad|> / <|video_pad|> expanded to its image's or
    video's count, that row's media as ``Generator.generate`` takes them, or None)."""
    try:
        items = (media_lib.conversation_items(messages, base, opts, name)
                 if messages else ([], [], []))
        image_id, video_id = media_lib.placeholder_ids(tokenizer, bool(items[0]),
                                                       bool(items[1]), name)
        expand = media_lib.Expander(items[0], items[1], image_id, video_id, opts.merge_size)
        ids = [int(i) for i in expand(np.asarray(ids))]
        expand.check(name)
        if not expand.placed:
            return ids, None
        sizes = {k: getattr(opts, k) for k in ("patch_size", "temporal_patch_size",
                                               "merge_size", "image_min_pixels",
                                               "image_max_pixels", "video_min_pixels",
                                               "video_max_pixels")}
        loaded = [(item, *media_lib.load_item(item, **sizes)) for item in expand.placed]
    except ValueError as e:
        raise GenerateError(str(e)) from None
    return ids, media_inputs([loaded])


def encode_rows(rows: list[dict], tokenizer, template, where: str, media_opts=None,
                base: str = ".") -> tuple[list[list[int]], list[dict | None]]:
    """Each row's prompt ids: text with the tokenizer's own special tokens, or the messages
    rendered with the generation prompt (the template writes any BOS itself); and each row's
    images and videos (a multimodal model's ``media_opts``; their paths relative to
    ``base``), None for a row without."""
    out, media = [], []
    for n, row in enumerate(rows, 1):
        messages = row.get("messages") if not isinstance(row.get("prompt"), str) else None
        if messages is None:
            ids = [int(i) for i in tokenizer.encode_prompt(row["prompt"])]
        else:
            if media_opts is None and media_parts(messages):
                raise GenerateError(f"{where} row {n} holds images or videos, but the model "
                                    f"has no vision tower (a multimodal family: qwen2_5_vl)")
            if template is None:
                raise GenerateError(f"{where} row {n} is a chat (\"messages\"), but the model "
                                    f"has no chat template (tokenizer_config.json "
                                    f"\"chat_template\" or chat_template.jinja)")
            try:
                ids = prompt_ids(tokenizer, template, messages)
            except ValueError as e:
                raise GenerateError(f"{where} row {n}: {e}") from None
        found = None
        if media_opts is not None:
            ids, found = _row_media(ids, messages, tokenizer, media_opts, base,
                                    f"{where} row {n}")
        out.append(ids)
        media.append(found)
    return out, media


def generate(path: str, rows: list[dict], *, max_new_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, seed: int = 0, mesh_seq: int = 1, mesh_data: int = 1,
             batch_size: int = 8, num_samples: int = 1, step: int | None = None,
             progress: bool = False,
             where: str = "prompts", media_base: str = ".",
             devices=None) -> tuple[list[dict], dict]:
    """Completions of ``rows`` (dicts with "prompt" or "messages") by the model at ``path``.
    A multimodal model's messages may hold image and video parts, their paths relative to
    ``media_base``.

    Returns (``num_samples`` rows per input row, each with sample, completion,
    completion_ids, prompt_tokens, finish_reason; the summary). Raises GenerateError on bad
    input, before anything is compiled.
    """
    devices = list(devices or jax.devices())
    if mesh_seq < 1 or mesh_data < 1 or mesh_seq * mesh_data > len(devices):
        raise GenerateError(f"--mesh-seq x --mesh-data must be between 1 and the "
                            f"{len(devices)} devices there are (each at least 1), got "
                            f"{mesh_seq} x {mesh_data}")
    if batch_size < 1:
        raise GenerateError(f"--batch-size must be >= 1, got {batch_size}")
    if num_samples < 1:
        raise GenerateError(f"--num-samples must be >= 1 (completions per prompt), got "
                            f"{num_samples}")
    if not 0 <= seed < 2 ** 32:
        raise GenerateError(f"--seed must be in [0, 2**32), got {seed}")
    mesh = make_mesh(seq=mesh_seq, data=mesh_data, devices=devices[:mesh_seq * mesh_data])
    try:
        loaded = load(path, mesh, step)
    except LoadError as e:
        raise GenerateError(str(e)) from None
    hf_dir = path if not loaded.run_data else _init_from(path)
    try:
        defaults = model_settings(hf_dir, getattr(loaded.tokenizer, "eos_id", None))
    except ValueError as e:
        raise GenerateError(str(e)) from None
    sampling = Sampling(defaults.temperature if temperature is None else temperature,
                        defaults.top_k if top_k is None else top_k,
                        defaults.top_p if top_p is None else top_p)
    new = defaults.max_new_tokens if max_new_tokens is None else max_new_tokens
    try:
        sampling.check()
    except ValueError as e:
        raise GenerateError(str(e)) from None
    if new < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {new}")
    prompts, media = encode_rows(rows, loaded.tokenizer, _template_of(loaded, path), where,
                                 media_options(loaded, path), base=media_base)
    for n, ids in enumerate(prompts, 1):
        if not ids:
            raise GenerateError(f"{where} row {n} has an empty prompt (no tokens)")
        if defaults.max_positions and len(ids) + new > defaults.max_positions:
            raise GenerateError(f"{where} row {n}: its {len(ids)} prompt tokens plus "
                                f"{new} new tokens exceed the model's "
                                f"{defaults.max_positions} positions "
                                f"(max_position_embeddings); lower --max-new-tokens")
    try:
        gen = Generator(loaded.params, loaded.model, mesh)
    except GenerationError as e:
        raise GenerateError(str(e)) from None
    gen.on_compile = lambda key, compiled: _check_memory(key, compiled, mesh)
    bar = tqdm(total=len(rows), desc="generate", unit="row", dynamic_ncols=True,
               disable=not progress)
    out = []
    eos = frozenset(defaults.eos_ids)
    for start in range(0, len(rows), batch_size):
        stop = min(start + batch_size, len(rows))
        try:
            done = gen.generate(prompts[start:stop], max_new_tokens=new, eos_ids=eos,
                                sampling=sampling, seed=seed, rows=list(range(start, stop)),
                                media=media[start:stop], num_samples=num_samples)
        except GenerationError as e:
            raise GenerateError(f"{where} rows {start + 1}-{stop}: {e}") from None
        for k, c in enumerate(done):
            i = start + k // num_samples
            text_ids = [t for t in c.ids if t not in eos]
            out.append({**rows[i], "sample": k % num_samples,
                        "completion": loaded.tokenizer.decode(text_ids),
                        "completion_ids": c.ids, "prompt_tokens": len(prompts[i]),
                        "finish_reason": c.finish_reason})
        bar.update(stop - start)
    bar.close()
    t = gen.timings
    summary = {"rows": len(out), "prompt_tokens": sum(map(len, prompts)),
               "completion_tokens": sum(len(r["completion_ids"]) for r in out),
               "compile_s": round(t["compile_s"], 3), "prefill_s": round(t["prefill_s"], 3),
               "decode_s": round(t["decode_s"], 3),
               "decode_tokens_per_s": round(t["decode_tokens"] / t["decode_s"], 2)
               if t["decode_s"] > 0 else None}
    return out, summary


def _check_memory(key, compiled, mesh) -> None:
    """GenerateError before a prefill or decode program runs when what it allocates (the
    batch's cache and logits, XLA's analysis) exceeds the free memory (training/fit.py)."""
    try:
        check_program(compiled, mesh, f"the {key[0]} program of a batch of {key[1]} rows",
                      "Lower --batch-size, --max-new-tokens or the prompts' length, or use "
                      "more --mesh-seq devices")
    except ConfigError as e:
        raise GenerateError(str(e)) from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ulysses_jax.generate",
                                description="Completions of prompts, sequence-parallel.")
    p.add_argument("path", metavar="MODEL",
                   help="a Hugging Face model directory, or a run's --workdir")
    p.add_argument("--prompts", required=True, help="jsonl or parquet: prompt or messages")
    p.add_argument("--out", required=True, help="jsonl of the rows with their completions")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"new tokens per row at most (default: generation_config.json's, "
                        f"else {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--temperature", type=float, help="0 is greedy (default: "
                   "generation_config.json's when it samples, else 0)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest (default 0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--mesh-seq", type=int, default=1, help="devices per sequence (Ulysses)")
    p.add_argument("--mesh-data", type=int, default=1,
                   help="data replicas, each generating its share of the rows (default 1)")
    p.add_argument("--num-samples", type=int, default=1,
                   help="completions per prompt, the prompt prefilled once (default 1)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts per batch, each with its samples (default 8)")
    p.add_argument("--step", type=int, help="a run's checkpoint step (default: the newest)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    request_cpu_devices(max(args.mesh_seq, 1) * max(args.mesh_data, 1))
    fence()
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        if os.path.isdir(args.out):
            raise GenerateError(f"--out {args.out} is a directory; give a file name")
        rows = read_rows(args.prompts)
        out, summary = generate(args.path, rows, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, mesh_seq=args.mesh_seq,
                                mesh_data=args.mesh_data, batch_size=args.batch_size,
                                num_samples=args.num_samples, step=args.step,
                                progress=not args.no_progress, where=args.prompts,
                                media_base=os.path.dirname(os.path.abspath(args.prompts)))
    except GenerateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in out]
    except (TypeError, ValueError) as e:  # a parquet column JSON cannot hold
        print(f"error: a row of {args.prompts} cannot be written as JSON: {e}", file=sys.stderr)
        return 2
    tmp = args.out + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, args.out)  # never a half file at --out
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {len(out)} rows to {args.out}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
