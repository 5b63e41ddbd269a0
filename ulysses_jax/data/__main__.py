"""python -m ulysses_jax.data prepare|show: build a token store; look at a packed row.

    prepare SRC [SRC ...] --out DIR [--tokenizer PATH]
            [--chat | --preference [--drop-bad-pairs]] [--chat-template FILE|NAME]
            [--text-key text] [--messages-key messages] [--workers N] [--force]
            [--image-min-pixels N] [--image-max-pixels N] [--video-min-pixels N]
            [--video-max-pixels N] [--video-fps F]
    show DIR --seq-len S --row N [--json] [--seed 0] [--heldout-fraction 0.02]
         [--overflow truncate|drop]

Exit codes: 0 done (or nothing to do), 2 a bad input, with one ``error: ...`` paragraph.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from PIL import Image

from ulysses_jax.data import images
from ulysses_jax.data.images import placeholder_count
from ulysses_jax.data.packing import store_rows
from ulysses_jax.data.preference import store_names
from ulysses_jax.data.prepare import describe, prepare
from ulysses_jax.data.store import TokenStore, is_store
from ulysses_jax.data.text import FIELDS, load_tokenizer

MARK = ("\u27e6", "\u27e7")  # ⟦ supervised ⟧


def _parser():
    p = argparse.ArgumentParser(prog="python -m ulysses_jax.data",
                                description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("prepare", help="tokenize corpora into a token store")
    pr.add_argument("sources", nargs="+", help=".txt/.md/.jsonl/.parquet files, directories, "
                    "globs, datasets save_to_disk directories")
    pr.add_argument("--out", required=True, help="the store directory to write")
    pr.add_argument("--tokenizer", help="tokenizer.json or a Hugging Face tokenizer directory "
                    "(default: bytes)")
    pr.add_argument("--chat", action="store_true", help="records are conversations "
                    "(assistant-only loss); needs --tokenizer with a chat_template, or "
                    "--chat-template")
    pr.add_argument("--preference", action="store_true", help="records are TRL's preference "
                    "pairs: prompt, chosen and rejected, each text or a message list "
                    "(conversational: rendered with the tokenizer's chat template or "
                    "--chat-template); for objective: dpo")
    pr.add_argument("--drop-bad-pairs", action="store_true", help="with --preference: leave "
                    "out records that cannot be pairs (not JSON, a field missing or of the "
                    "wrong type, an empty prompt or completion), counted in the manifest, "
                    "instead of refusing the input")
    pr.add_argument("--chat-template", metavar="FILE|NAME", help="with --chat: render with "
                    "this jinja file, or the format chatml, llama3 or zephyr, instead of the "
                    "tokenizer's own template (special values such as eos_token still come "
                    "from the tokenizer directory); the store keeps a copy")
    pr.add_argument("--text-key", default="text", help="field of a text record (default text)")
    pr.add_argument("--messages-key", default="messages",
                    help="field of a conversation's message list (default messages)")
    pr.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="tokenizer processes (default: cores - 1); the store is the same "
                    "for any number")
    pr.add_argument("--shard-tokens", type=int, default=1 << 30, help=argparse.SUPPRESS)
    pr.add_argument("--force", action="store_true", help="replace --out if it holds a store "
                    "of other inputs")
    pr.add_argument("--no-progress", action="store_true")
    for name, default in (("image-min-pixels", images.IMAGE_MIN_PIXELS),
                          ("image-max-pixels", images.IMAGE_MAX_PIXELS),
                          ("video-min-pixels", images.VIDEO_MIN_PIXELS),
                          ("video-max-pixels", images.VIDEO_MAX_PIXELS)):
        pr.add_argument(f"--{name}", type=int, default=default,
                        help=f"chat media: smart_resize's area bound (default {default})")
    pr.add_argument("--video-fps", type=float, default=2.0, help="chat media: videos with a "
                    "known \"fps\" are sampled down to this rate (default 2.0)")
    sh = sub.add_parser("show", help="print row N of epoch 0 with supervised tokens marked "
                        "(a preference store: rows 2i and 2i+1 are pair i's chosen and "
                        "rejected sequences)")
    sh.add_argument("store")
    sh.add_argument("--seq-len", type=int, required=True)
    sh.add_argument("--row", type=int, required=True)
    sh.add_argument("--json", action="store_true", help="one JSON object of the row's lists")
    sh.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    sh.add_argument("--heldout-fraction", type=float, default=0.02,
                    help="the run's data.heldout_fraction (default 0.02)")
    sh.add_argument("--overflow", default="truncate", choices=("truncate", "drop"),
                    help="the run's data.chat_overflow (default truncate)")
    return p


def _prepare(args) -> int:
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    manifest, built = prepare(args.sources, args.out, args.tokenizer, args.chat, args.text_key,
                              args.messages_key, args.workers, args.force,
                              not args.no_progress, args.shard_tokens,
                              image_min_pixels=args.image_min_pixels,
                              image_max_pixels=args.image_max_pixels,
                              video_min_pixels=args.video_min_pixels,
                              video_max_pixels=args.video_max_pixels, video_fps=args.video_fps,
                              chat_template=args.chat_template, preference=args.preference,
                              drop_bad=args.drop_bad_pairs)
    if built:
        print(f"wrote {args.out}: {describe(manifest)} in {manifest['seconds']:.1f} s")
    else:
        print(f"nothing to do: {args.out} already holds these inputs ({describe(manifest)})")
    return 0


def _decoder(manifest):
    path = manifest["tokenizer"]["path"]
    if path is not None and not os.path.exists(path):
        raise ValueError(f"the store's tokenizer {path} is gone; cannot decode (use --json)")
    tok = load_tokenizer(path)
    if hasattr(tok, "_tok"):  # a Hugging Face tokenizer: show special tokens (end of turn)
        return lambda ids: tok._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def decode(ids):  # bytes: ByteTokenizer.decode drops EOS, show it
        cuts = np.flatnonzero(np.asarray(ids) == tok.eos_id)
        return "<eos>".join(tok.decode(part) for part in np.split(np.asarray(ids), cuts))
    return decode


def _collapse(decode, media: list[dict], pad_ids: dict, merge_size: int):
    """``decode`` that prints a run of <|image_pad|> / <|video_pad|> ids as one marker,
    ``<|image_pad|> x N (image path, grid t x h x w)``, items taken in row order."""
    items, left = iter(media), [0, None]  # pads still owed to the current item, the item

    def run_text(run: np.ndarray) -> str:
        out, n = [], len(run)
        while n:
            if left[0] == 0:
                left[1] = next(items, None)
                if left[1] is None:
                    out.append(f"{pad_ids[int(run[0])]} x {n} (no media item)")
                    break
                left[0] = placeholder_count(left[1]["grid"], merge_size)
            take = min(n, left[0])
            item = left[1]
            where = item["paths"][0] if item["kind"] == "image" else \
                f"{len(item['paths'])} frames from {item['paths'][0]}"
            out.append(f"{pad_ids[int(run[0])]} x {take} ({item['kind']} {where}, grid "
                       f"{' x '.join(map(str, item['grid']))})")
            left[0] -= take
            n -= take
        return "".join(out)

    def decode_marked(ids) -> str:
        ids = np.asarray(ids)
        is_pad = np.isin(ids, list(pad_ids))
        cuts = np.flatnonzero(np.diff(is_pad.astype(np.int8))) + 1
        return "".join(run_text(run) if is_pad[start] else decode(run)
                       for run, start in zip(np.split(ids, cuts), np.r_[0, cuts]))
    return decode_marked


def _text(row: dict, decode) -> str:
    """Each segment's text; a token whose prediction is trained on (the target of the
    token before it) is wrapped in ⟦ ⟧, runs of them together."""
    tok, seg, mask = row["tokens"], row["segment_ids"], row["loss_mask"]
    supervised = np.concatenate([[0], mask[:-1]]) > 0  # token j is the target of j-1
    lines = []
    for s in [int(x) for x in np.unique(seg) if x > 0]:
        idx = np.flatnonzero(seg == s)
        lines.append(f"--- segment {s}: {len(idx)} tokens, "
                     f"{int(supervised[idx].sum())} supervised ---")
        parts, start = [], idx[0]
        for j in range(idx[0] + 1, idx[-1] + 2):
            if j > idx[-1] or supervised[j] != supervised[start]:
                text = decode(tok[start:j])
                parts.append(f"{MARK[0]}{text}{MARK[1]}" if supervised[start] else text)
                start = j
        lines.append("".join(parts))
    pad = int((seg == 0).sum())
    if pad:
        lines.append(f"--- padding: {pad} tokens ---")
    return "\n".join(lines)


def _show(args) -> int:
    if not is_store(args.store):
        raise ValueError(f"{args.store} is not a token store (no manifest.json); build one "
                         f"with python -m ulysses_jax.data prepare")
    rows, _, _ = store_rows(args.store, args.seq_len, args.heldout_fraction, args.seed,
                            args.overflow)
    if args.row < 0:
        raise ValueError(f"row {args.row} is negative: rows are 0 to {rows.num_rows - 1} "
                         f"({rows.num_rows} rows of {args.seq_len} tokens)")
    if args.row >= rows.num_rows:
        raise ValueError(f"row {args.row} is past the last row: the store packs into "
                         f"{rows.num_rows} rows of {args.seq_len} tokens (rows 0 to "
                         f"{rows.num_rows - 1})")
    row = rows.row(args.row, epoch=0, seed=args.seed)
    manifest = TokenStore(args.store).manifest
    media = rows.row_media(args.row, epoch=0, seed=args.seed) if "media" in manifest else []
    if args.json:
        out = {f: row[f].astype(np.int64 if f != "loss_mask" else np.float64).tolist()
               for f in FIELDS}
        print(json.dumps(out | ({"media": media} if "media" in manifest else {})))
    else:
        decode = _decoder(manifest)
        if "media" in manifest:
            m = manifest["media"]
            pad_ids = {i: t for i, t in ((m["image_token_id"], "<|image_pad|>"),
                                         (m["video_token_id"], "<|video_pad|>")) if i is not None}
            decode = _collapse(decode, media, pad_ids, m["merge_size"])
        if manifest["kind"] == "preference":
            pair = int(rows._perm(args.seed, 0)[args.row // 2])
            name = store_names(rows.store, [rows.ids[pair]])[0]
            print(f"=== pair {args.row // 2} of epoch 0 ({name}): the "
                  f"{('chosen', 'rejected')[args.row % 2]} sequence (row {args.row}) ===")
        print(_text(row, decode))
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _prepare(args) if args.command == "prepare" else _show(args)
    except (ValueError, OSError, ImportError, Image.DecompressionBombError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted" + (": no store was written (prepare leaves no half store)"
                               if args.command == "prepare" else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
