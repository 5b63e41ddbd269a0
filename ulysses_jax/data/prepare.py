"""``prepare``: raw corpora -> a token store (``store.py``), in bounded memory, in parallel.

The main process streams records (``sources.py``) in chunks of about 1 MB of text; worker
processes (multiprocessing, spawned) tokenize chunks (and render chat templates); the main
process writes results in input order, so the store does not depend on the number of workers.
At most two chunks per worker are in flight, so memory stays flat however large the corpus.

The store is built in ``OUT.tmp-PID`` beside OUT and renamed to OUT at the end: a killed
prepare leaves no half store (a later prepare removes leftovers of dead processes). Running
again with the same inputs (paths, sizes, mtimes, options, tokenizer, chat template and where
a ``--chat-template`` came from) does nothing. A chat store keeps a copy of its template
(``chat_templates.py``).

Chat data may hold images and videos (``media.py``): workers find their grids from file
headers and expand the placeholders; the store then gets a media sidecar, and "the same
inputs" also means the same pixel options and unchanged media files (sizes and mtimes).
"""
from __future__ import annotations

import collections
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import time
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from . import chat_templates
from . import media as media_lib
from . import sources as sources_lib
from .chat import ChatTemplate, NoSupervision
from .preference import encode_pair
from .store import MEDIA_INPUTS, StoreWriter, TokenStore, is_store, name_hash, token_dtype
from .text import load_tokenizer

CHUNK_CHARS = 1 << 20  # text per work item: big enough to amortise pickling, small in memory
MAX_NAMED = 5  # bad conversations named in an error, of all counted

_worker: dict = {}  # per-process tokenizer and template (set by _init_worker)


def _load(tokenizer_path: str | None, chat: bool, chat_template: str | None = None,
          preference: bool = False):
    """(tokenizer, chat template or None, the template's origin or None). Preference data
    takes the tokenizer directory's template when it has one (its conversational pairs need
    it; text pairs do not)."""
    if chat and preference:
        raise ValueError("--chat and --preference exclude each other: --chat reads "
                         "conversations (assistant-only loss), --preference reads prompt / "
                         "chosen / rejected pairs, text or conversational")
    if chat_template is not None and not (chat or preference):
        raise ValueError(f"--chat-template {chat_template} needs --chat: a chat template "
                         f"renders conversations (records with a messages list), and without "
                         f"--chat the records are text documents")
    tokenizer = load_tokenizer(tokenizer_path)
    if not (chat or preference):
        return tokenizer, None, None
    if tokenizer_path is None:
        if preference and chat_template is None:
            return tokenizer, None, None  # text pairs in bytes
        raise ValueError(f"{'--chat' if chat else '--chat-template'} needs --tokenizer: a "
                         f"Hugging Face tokenizer directory (with a chat_template, or give "
                         f"--chat-template)")
    directory = tokenizer_path if os.path.isdir(tokenizer_path) else \
        os.path.dirname(tokenizer_path)
    try:
        template, origin = chat_templates.load(directory, chat_template, tokenizer)
    except ValueError:
        if chat or chat_template is not None:
            raise
        return tokenizer, None, None  # text pairs need no template
    return tokenizer, template, origin


def _init_worker(tokenizer_path, template_args, media_options, preference=False):
    """``template_args``: (source, special values) of the chat template, None for text."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker["tokenizer"] = load_tokenizer(tokenizer_path)
    _worker["template"] = ChatTemplate(*template_args) if template_args else None
    _worker["media"] = media_lib.MediaOptions(**media_options)
    _worker["pads"] = media_lib.placeholder_ids(_worker["tokenizer"], False, False, "")
    _worker["preference"] = preference


def _encode_chunk(chunk: list[tuple[str, object]]):
    """Worker: [(name, text, messages or pair)] -> ([(name hash, tokens, weights|None, media
    items, media input paths, name)], [messages naming the conversations without a supervised
    token or the pairs that cannot be encoded], [the text documents holding image / video
    placeholder tokens, named])."""
    tok, template = _worker["tokenizer"], _worker["template"]
    out, bad, padded = [], [], []
    if _worker["preference"]:
        for name, pair in chunk:
            try:
                ids, weights = encode_pair(tok, template, pair, name)
            except ValueError as e:  # BadPair, NotPrefixStable, a template's refusal
                bad.append(str(e))
                continue
            out.append((name_hash(name), ids, weights, None, [], name))
        return out, bad, padded
    if template is None:
        for (name, _), ids in zip(chunk, tok.encode_batch([t for _, t in chunk])):
            held = media_lib.text_placeholders(ids, *_worker["pads"])
            if held:
                padded.append(f"{name}: {held}")
            if len(ids):  # an empty document holds no next-token pair
                out.append((name_hash(name), np.append(ids, tok.eos_id), None, None, [], name))
        return out, bad, padded
    for name, messages in chunk:
        try:
            ids, weights, items, inputs = media_lib.encode_conversation(
                tok, template, messages, media_lib.base_dir(name), _worker["media"], name)
        except NoSupervision as e:
            bad.append(str(e))
            continue
        out.append((name_hash(name), ids, weights, items, inputs, name))
    return out, bad, padded


def _chunks(records: Iterator[tuple[str, object]]) -> Iterator[list]:
    chunk, size = [], 0
    for name, payload in records:
        chunk.append((name, payload))
        if isinstance(payload, dict):  # a preference pair
            payload = [m for v in payload.values()
                       for m in (v if isinstance(v, list) else [{"content": v}])]
        size += len(payload) if isinstance(payload, str) else sum(
            len(str(m.get("content") or "")) for m in payload)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _remove_dead_leftovers(out: str) -> None:
    """Deletes ``OUT.tmp-PID`` and ``OUT.old-PID`` directories (a half store; a store that
    --force was replacing) whose process is gone (a killed prepare)."""
    for leftover in glob.glob(f"{out}.tmp-*") + glob.glob(f"{out}.old-*"):
        pid = leftover.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):  # no such process (or no such pid at all)
        return False
    except PermissionError:
        return True  # exists, under another user: leave its directory alone
    return True


def _stat_inputs(paths) -> list[list]:
    """[[path, size, mtime_ns], ...] of media files and frame folders, sorted."""
    out = []
    for p in sorted(paths):
        st = os.stat(p)
        out.append([p, st.st_size, st.st_mtime_ns])
    return out


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


def _media_change(out: str, old: dict, fp: str, options: dict) -> str | None:
    """Why a media store ``old`` is not this prepare's result (None if it is)."""
    m = old["media"]
    if m.get("sources_fingerprint") != fp:
        return "other sources or options"
    changed = [f"{k} {m.get(k)} -> {v}" for k, v in options.items() if m.get(k) != v]
    if changed:
        return "other pixel options: " + ", ".join(changed)
    try:
        with open(os.path.join(out, MEDIA_INPUTS)) as f:
            recorded = json.load(f)
    except (OSError, json.JSONDecodeError):
        return f"its {MEDIA_INPUTS} is unreadable"
    for path, size, mtime in recorded:
        try:
            st = os.stat(path)
        except OSError:
            return f"media file {path} is gone"
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            return f"media file {path} changed (size or modification time)"
    return None


def _template_change(old: dict, template, origin) -> str | None:
    """Why a store ``old`` is not this prepare's, if its chat template is what changed."""
    if template is None or old.get("kind") != "chat":
        return None
    if old.get("template_sha256") != template.hash:
        return (f"another chat template: template_sha256 {old.get('template_sha256')} -> "
                f"{template.hash}")
    was = chat_templates.describe_origin(old.get("chat_template") or {})
    now = chat_templates.describe_origin(origin)
    return f"the same chat template from elsewhere: {was} -> {now}" if was != now else None


def prepare(srcs: Sequence[str], out: str, tokenizer: str | None = None, chat: bool = False,
            text_key: str = "text", messages_key: str = "messages", workers: int = 1,
            force: bool = False, progress: bool = True,
            shard_tokens: int = 1 << 30, *, chat_template: str | None = None,
            image_min_pixels: int = media_lib.images_lib.IMAGE_MIN_PIXELS,
            image_max_pixels: int = media_lib.images_lib.IMAGE_MAX_PIXELS,
            video_min_pixels: int = media_lib.images_lib.VIDEO_MIN_PIXELS,
            video_max_pixels: int = media_lib.images_lib.VIDEO_MAX_PIXELS,
            video_fps: float = 2.0, preference: bool = False,
            drop_bad: bool = False) -> tuple[dict, bool]:
    """Builds the token store ``out`` from ``srcs`` (files, directories, globs).

    Args:
      tokenizer: None for bytes, or a tokenizer.json / Hugging Face tokenizer directory
        (with ``chat``, the directory's tokenizer_config.json gives the chat template and
        the special values it renders).
      chat_template: with ``chat``, a jinja file or a format name (``chat_templates.FORMATS``)
        to render with instead of the directory's template (``chat_templates.load``).
      workers: tokenizer processes; 1 tokenizes in this process.
      force: replace ``out`` when it holds a store of other inputs.
      shard_tokens: tokens per shard file (tests use small ones).
      image_min_pixels, image_max_pixels, video_min_pixels, video_max_pixels: smart_resize's
        area bounds for images and video frames (chat data with media only).
      video_fps: the rate videos with a known "fps" are sampled down to.
      preference: records are TRL's preference pairs (``prompt``, ``chosen``, ``rejected``;
        ``preference.py``): a store of kind "preference".
      drop_bad: preference only: a record that cannot be a pair (not JSON, a field missing or
        of the wrong type, an empty prompt or completion, ...) is left out and counted in the
        manifest's ``dropped`` (the first ``MAX_NAMED`` named), not an error.

    Returns:
      (manifest, built): built is False when ``out`` already held these inputs' store.

    Raises:
      ValueError: a bad source or record, ``out`` holds something else, a template that is
        not prefix-stable, conversations without a supervised token (counted and named), a
        media file that cannot be read, or a conversation whose text holds <|image_pad|> /
        <|video_pad|> tokens without the image / video parts they stand for (named). Text
        documents holding them are stored (a text model reads them as any token) and counted
        in the manifest (``text_placeholders``), which a multimodal model refuses.
    """
    out = os.path.abspath(out.rstrip("/"))
    media_opts = media_lib.MediaOptions(image_min_pixels, image_max_pixels, video_min_pixels,
                                        video_max_pixels, float(video_fps))
    pixel_options = media_opts.as_dict()
    tok, template, origin = _load(tokenizer, chat, chat_template, preference)
    paths = sources_lib.expand_sources(srcs)
    if tokenizer is not None:
        tok_file = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) \
            else tokenizer
        tok_info = {"path": os.path.abspath(tokenizer), "sha256": file_hash(tok_file)}
    else:
        tok_info = {"path": None, "sha256": "bytes"}
    options = {"chat": chat, "key": messages_key if chat else text_key,
               "tokenizer": tok_info["sha256"], "eos_id": tok.eos_id,
               "template": template.hash if template else None}
    if drop_bad and not preference:
        raise ValueError("--drop-bad-pairs applies to --preference data only")
    if preference:  # absent otherwise: older stores stay current
        options["preference"] = True
        options["drop_bad"] = drop_bad
    if origin and origin["origin"] != "tokenizer":  # absent otherwise: older stores stay current
        options["template_origin"] = origin
    fp = sources_lib.fingerprint(paths, options)
    if os.path.exists(out):
        if not is_store(out):  # --force replaces stores only: a typo must not delete a corpus
            raise ValueError(f"--out {out} already exists and holds something else (not a "
                             f"token store: no manifest.json); prepare does not replace it, "
                             f"even with --force: choose another --out")
        try:
            old = TokenStore(out).manifest
        except ValueError:  # a damaged or older store: other inputs, --force replaces it
            old = {}
        # Pixel options count only for a store with media: they change nothing else.
        if "media" in old:
            why = _media_change(out, old, fp, pixel_options)
            same = why is None
        else:
            same = old.get("fingerprint") == fp
            why = _template_change(old, template, origin) if not same else None
        if same:
            return old, False
        if not force:
            raise ValueError(f"--out {out} already exists and holds a token store of other "
                             f"inputs{f' ({why})' if why else ''}; pass --force to replace "
                             f"it, or choose another --out")
    _remove_dead_leftovers(out)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    writer = StoreWriter(tmp, token_dtype(tok.vocab_size), chat, shard_tokens, preference)
    bad: list[str] = []
    padded: list[str] = []
    media_inputs: set[str] = set()
    bar = _bar(progress)
    t0 = time.time()
    try:
        if template is not None:  # the store keeps the template it is rendered with (export)
            chat_templates.write_stored(tmp, template)
        unreadable: list[str] = []  # preference records that are not pairs (drop_bad)
        records = (sources_lib.iter_pairs(paths, unreadable if drop_bad else None)
                   if preference else
                   sources_lib.iter_records(paths, text_key, messages_key, chat))
        template_args = (template.source, template.special) if template else None
        for docs, bad_names, padded_names in _encoded(_chunks(records), tokenizer,
                                                      template_args, workers, pixel_options,
                                                      preference):
            for h, ids, weights, items, inputs, name in docs:
                writer.add(ids, h, weights, items, name)
                media_inputs.update(inputs)
                bar.update(len(ids))
            bad += bad_names
            padded += padded_names
        if preference and drop_bad:
            bad = unreadable + bad
        if bad and preference and not drop_bad:
            raise ValueError(
                f"{len(bad)} preference record(s) cannot be encoded: "
                f"{'; '.join(bad[:MAX_NAMED])}{'; ...' if len(bad) > MAX_NAMED else ''}. "
                f"Remove them from the input or fix them, or pass --drop-bad-pairs to leave "
                f"them out (counted)")
        if bad and not preference:
            raise NoSupervision(
                f"{len(bad)} conversation(s) have no supervised token (assistant-only loss "
                f"needs at least one assistant answer with text): "
                f"{'; '.join(bad[:MAX_NAMED])}{'; ...' if len(bad) > MAX_NAMED else ''}. "
                f"Remove them from the input or fix their messages")
        if writer.num_docs == 0:
            raise ValueError(f"the sources {list(srcs)} hold no non-empty document")
        extra = {}
        if preference and drop_bad:
            extra["dropped"] = {"pairs": len(bad), "named": bad[:MAX_NAMED]}
        if template is not None:
            extra["chat_template"] = chat_templates.manifest_entry(template, origin)
        if padded:  # fine for a text model; check_store refuses the store for a multimodal one
            extra["text_placeholders"] = {"documents": len(padded), "named": padded[:MAX_NAMED]}
        if writer.has_media:
            stats = _stat_inputs(media_inputs)
            with open(os.path.join(tmp, MEDIA_INPUTS), "w") as f:
                json.dump(stats, f)
            image_id, video_id = media_lib.placeholder_ids(tok, False, False, "")
            extra["media"] = {
                **pixel_options, "num_images": writer.num_images,
                "num_videos": writer.num_videos, "max_frame_patches": writer.max_frame_patches,
                "image_token_id": image_id, "video_token_id": video_id,
                "sources_fingerprint": fp, "files_fingerprint": _hash(stats)}
            # The store's identity (checkpoints compare it) covers the media and options too.
            fp = _hash([fp, extra["media"]])
        manifest = writer.finish({
            **extra, "fingerprint": fp, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "eos_appended": not (chat or preference), "tokenizer": tok_info,
            "template_sha256": template.hash if template else None,
            "text_key": None if preference else text_key,
            "messages_key": messages_key if chat else None,
            "sources": [os.path.abspath(p) for p in paths],
            "seconds": round(time.time() - t0, 3)})
        if os.path.exists(out):  # --force: the old store goes only once the new one is whole
            old = f"{out}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
        return manifest, True
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()


def _encoded(chunks, tokenizer: str | None, template_args, workers: int, media_options: dict,
             preference: bool = False):
    """Encoded chunks in input order, ``workers`` processes, at most 2 chunks each in flight."""
    if workers <= 1:
        _init_worker(tokenizer, template_args, media_options, preference)
        for chunk in chunks:
            yield _encode_chunk(chunk)
        return
    # spawn, not fork: the parent may have started JAX's threads (forking them can deadlock)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, _init_worker,
                  (tokenizer, template_args, media_options, preference)) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            while len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _bar(enabled: bool):
    return tqdm(desc="prepare", unit="tok", unit_scale=True, dynamic_ncols=True,
                disable=not enabled)  # disabled: update and close do nothing


def describe(manifest: dict) -> str:
    """One line about a store's manifest."""
    line = (f"{manifest['kind']} store: {manifest['num_docs']} documents, "
            f"{manifest['num_tokens']} tokens ({manifest['dtype']}), "
            f"{len(manifest['shards'])} shard(s)")
    if manifest["kind"] == "preference":
        line = (f"preference store: {manifest['num_pairs']} pairs, {manifest['num_tokens']} "
                f"tokens ({manifest['dtype']}; each prompt once), "
                f"{manifest['num_supervised']} completion tokens, "
                f"{len(manifest['shards'])} shard(s)")
        if "chat_template" in manifest:
            line += (f", chat template from "
                     f"{chat_templates.describe_origin(manifest['chat_template'])}")
        if manifest.get("dropped", {}).get("pairs"):
            d = manifest["dropped"]
            line += (f"; {d['pairs']} record(s) that are not pairs dropped (first: "
                     f"{d['named'][0]})")
    if manifest["kind"] == "chat":
        line += f", {manifest['num_supervised']} supervised tokens"
        if "chat_template" in manifest:
            line += (f", chat template from "
                     f"{chat_templates.describe_origin(manifest['chat_template'])}")
    if "media" in manifest:
        line += (f", {manifest['media']['num_images']} images, "
                 f"{manifest['media']['num_videos']} videos")
    if "text_placeholders" in manifest:
        line += (f", {manifest['text_placeholders']['documents']} text document(s) holding "
                 f"image / video placeholder tokens (a multimodal model refuses the store)")
    return line
