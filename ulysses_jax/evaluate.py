"""Long-context evaluation, sequence-parallel: loss by token position and passkey retrieval.

    python -m ulysses_jax.evaluate RUN_DIR_or_HF_DIR [--seq-len S] [--mesh-seq P] [--out DIR]
        [--step N] [--batches N] [--batch-size B] [--data SOURCE] [--heldout-fraction F]
        [--lengths L ...] [--depths F ...] [--trials N] [--seed N] [--no-generation]
        [--reference DIR] [--beta B]

The model runs on a ("data"=1, "seq"=P) mesh, each sequence of S tokens split over P devices
as in training (Ulysses attention); nothing ever holds [B, S, V] logits: the loss and the
greedy prediction of every token come from chunks of each device's tokens
(``training.position_loss.token_losses``).

(a) Held-out loss by position: the mean next-token loss of the tokens whose position in their
    document falls in each bucket [0, 1), [1, 2), [2, 4), ..., [S/2, S) (log-spaced), over
    ``--batches`` batches of held-out rows: the run's own (its data.source, tokenizer, seed
    and held-out fraction at length S; from a token store the documents training held out,
    packed as training packs them), or for a Hugging Face directory the held-out split
    (``--heldout-fraction``, default 0.02) of ``--data`` (default the stdlib corpus).
    ``--data`` may be text files or a token store (one prepared with the model's tokenizer);
    ``--heldout-fraction 1`` holds out all of it (not allowed for a run's own data.source).
    The tokenizer: a run's data.tokenizer, or for a run from a token store the tokenizer its
    manifest records (the file must still have the recorded hash); a Hugging Face
    directory's tokenizer.json, or the byte tokenizer when it has none and its vocab_size is
    257 (an export of a byte-level run).
(b) Passkey retrieval: a random 5-digit number stated once at a depth (fraction of the
    filler before it) in filler text, the whole prompt of L tokens followed by the question
    and the number again as the answer. A prompt counts as retrieved when the model's greedy
    prediction of every answer token is right under teacher forcing (one forward pass, no
    generation loop). Accuracy per (length, depth) over ``--trials`` numbers; the mean loss
    of the answer tokens beside it; and ``generated_accuracy``: the share whose greedy
    answer, generated after the question (``ulysses_jax.generation``), contains the number
    (None for a model family generation does not serve yet; ``--no-generation`` skips it).
(d) A preference store as the held-out data (``--data STORE``, or a DPO run's own): a ``dpo``
    section with the DPO loss of the held-out pairs (``--batch-size`` pairs a batch), their
    ``rewards/accuracies`` and ``rewards/margins`` (TRL's names) and ``pairs``, against the
    reference ``--reference`` (a run or Hugging Face directory; default: a run's init_from)
    with ``--beta`` (default: the run's dpo.beta, else 0.1) and the run's dpo.loss_type and
    label_smoothing (sigmoid, 0 for a Hugging Face directory). (a) is then the loss of the
    completion tokens by position.
(c) ``DIR/eval.json`` and ``DIR/eval.png`` (the loss-by-position curve and the passkey
    heatmap); DIR defaults to the run or model directory.

Exit codes: 0 done; 2 a bad input (no model there, a length the mesh cannot split, ...) with
a one-line ``error: ...`` and no traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

import jax
import numpy as np
from tqdm import tqdm

from .compile_cache import fence
from .config import ConfigError, DPOConfig
from .data import text as data_lib
from .data.packing import heldout_store_rows
from .data.prepare import file_hash
from .data.store import TokenStore, is_store
from .generation import GenerationError, Generator
from .mesh import make_mesh, request_cpu_devices
from .runs import LoadError, Loaded, load
from .training.objectives import dpo, reference as precomputed
from .training.fit import check_program
from .training.position_loss import bucket_bounds, bucket_sums, token_losses

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
ANSWER = " {key}."
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


class EvalError(ValueError):
    """An input the evaluation cannot use; the message says which and why."""


def passkey_batch(tokenizer, length: int, depth: float, key: int, seq_len: int) -> dict:
    """One passkey prompt of ``length`` tokens in a row of ``seq_len`` (the rest padding):
    filler with the needle after ``depth`` of it, the question, the answer.

    Returns:
      The data.text.FIELDS of one row [S] (numpy); loss_mask marks the positions whose target is
      an answer token.
    """
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question, answer = tokenizer.encode(QUESTION), tokenizer.encode(ANSWER.format(key=key))
    room = length - len(needle) - len(question) - len(answer)
    if room < 0:
        raise EvalError(f"passkey length {length} is shorter than the needle, question and "
                        f"answer ({length - room} tokens)")
    filler = tokenizer.encode(FILLER)
    filler = np.resize(filler, room)                                         # repeats, cut
    before = int(round(depth * room))
    ids = np.concatenate([filler[:before], needle, filler[before:], question, answer])
    row = np.zeros(seq_len, np.int32)
    row[:length] = ids
    targets = np.zeros(seq_len, np.int32)
    targets[:length - 1] = ids[1:]
    mask = np.zeros(seq_len, np.float32)
    mask[length - len(answer) - 1:length - 1] = 1.0     # predicting each answer token
    positions = np.zeros(seq_len, np.int32)
    positions[:length] = np.arange(length)
    segments = (np.arange(seq_len) < length).astype(np.int32)                # 0 = padding
    return {"tokens": row, "targets": targets, "loss_mask": mask, "segment_ids": segments,
            "positions": positions}


def pad_rows(batch: dict, multiple: int) -> dict:
    """``batch``'s rows [B, S, ...] padded at the end to a length ``multiple`` divides (the
    sequence devices split it evenly): tokens and targets 0, loss_mask 0, segment 0 (padding,
    attended by no real token) and position 0. Everything is causal, so the first S positions
    give what the unpadded rows give; the caller drops the rest."""
    s = batch["tokens"].shape[1]
    extra = -s % multiple
    if not extra:
        return batch
    return {f: np.pad(v, [(0, 0), (0, extra)] + [(0, 0)] * (v.ndim - 2))
            if f in data_lib.FIELDS else v
            for f, v in batch.items()}


def prompt_overhead(tokenizer, key: int) -> int:
    """Tokens of a passkey prompt that are not filler: needle, question and answer."""
    return sum(len(tokenizer.encode(t.format(key=key))) for t in (NEEDLE, QUESTION, ANSWER))


def default_lengths(seq_len: int, shortest: int) -> list[int]:
    """seq_len / 8, / 4, / 2 and seq_len: those with at least as much filler as
    ``shortest`` (the prompt's other tokens), else seq_len alone."""
    return [n for n in (seq_len // 8, seq_len // 4, seq_len // 2, seq_len)
            if n >= 2 * shortest] or [seq_len]


def _load(path: str, mesh, step: int | None = None) -> Loaded:
    """``runs.load``, a directory it cannot open raised as an EvalError."""
    try:
        return load(path, mesh, step)
    except LoadError as e:
        raise EvalError(str(e)) from None


def heldout_rows(loaded: Loaded, source: str, seq_len: int, fraction: float):
    """The held-out rows of ``source`` at ``seq_len`` (None when none are held out).

    A token store gives the rows training holds out (the same split of its documents by
    ``loaded.seed`` and ``fraction``, packed the same way, ``packing.py``), and must have
    been prepared with the tokenizer in use; text files and "stdlib" are split, tokenized
    and packed as training does (``data.build_rows``). A fraction of 1 holds out every
    document. Raises EvalError naming the source.
    """
    try:
        if is_store(source):
            want = TokenStore(source).manifest["tokenizer"]
            have = file_hash(loaded.tokenizer_file) if loaded.tokenizer_file else "bytes"
            if have != want["sha256"]:
                raise ValueError(f"the store was prepared with the tokenizer "
                                 f"{want['path'] or 'bytes'} (sha256 {want['sha256']}...), "
                                 f"but the model's is {loaded.tokenizer_note}"
                                 + (f" (sha256 {have}...)" if loaded.tokenizer_file else ""))
            return heldout_store_rows(source, seq_len, fraction, loaded.seed,
                                      loaded.chat_overflow)
        if fraction < 1:
            return data_lib.build_rows(source, loaded.tokenizer, seq_len, fraction,
                                       loaded.seed)[1]
        docs = data_lib.load_documents(source)
        return data_lib.PackedRows(data_lib.tokenize(docs, loaded.tokenizer), seq_len,
                                   loaded.tokenizer.eos_id, shuffle=False)
    except (OSError, ValueError) as e:
        raise EvalError(f"held-out data {source!r}: {e}") from None


def evaluate(path: str, *, seq_len: int | None = None, mesh_seq: int = 1,
             step: int | None = None, batches: int = 4, batch_size: int = 1,
             data: str | None = None, heldout_fraction: float | None = None,
             lengths: list[int] | None = None,
             depths: list[float] | None = None, trials: int = 2, seed: int = 0,
             progress: bool = True, generate: bool = True, devices=None,
             reference: str | None = None, beta: float | None = None) -> dict:
    """Runs (a), (b) and for a preference store (d) of the module docstring; returns the
    dict written to eval.json. ``generate``: also (b) by generation (``generated_accuracy``);
    ``reference``, ``beta``: (d)'s reference model and beta.

    ``data`` / ``heldout_fraction`` replace the held-out source and fraction (default: the
    run's; for a Hugging Face directory the stdlib corpus and 0.02); a fraction of 0 leaves
    (a) without rows (its losses None), one of 1 holds out all of ``data`` (``heldout_rows``)."""
    devices = list(devices or jax.devices())
    if batches < 0 or batch_size < 1:
        raise EvalError(f"--batches must be >= 0 and --batch-size >= 1, got {batches} and "
                        f"{batch_size}")
    if mesh_seq < 1 or mesh_seq > len(devices):
        raise EvalError(f"--mesh-seq must be between 1 and the {len(devices)} devices there "
                        f"are, got {mesh_seq}")
    mesh = make_mesh(seq=mesh_seq, data=1, devices=devices[:mesh_seq])
    loaded = _load(path, mesh, step)
    source = data or loaded.source
    fraction = loaded.heldout_fraction if heldout_fraction is None else heldout_fraction
    if not 0 <= fraction <= 1:
        raise EvalError(f"the held-out fraction must be in [0, 1], got {fraction}")
    if fraction == 1 and loaded.run_data and not data:
        raise EvalError("--heldout-fraction 1 holds out every document, but the run trained "
                        f"on its data.source {source!r}: pass --data with documents the run "
                        f"did not train on (a fraction of 1 is for those), or a fraction < 1")
    seq_len = seq_len or loaded.default_seq_len
    if not seq_len:
        raise EvalError("--seq-len is needed for a Hugging Face directory")
    depths = list(DEPTHS if depths is None else depths)
    if any(not 0 <= d <= 1 for d in depths):
        raise EvalError(f"depths are fractions in [0, 1], got {depths}")
    if trials < 1:
        raise EvalError(f"--trials must be positive, got {trials}")
    # One key per prompt, drawn before the lengths are known (at most 4 by default).
    keys = np.random.default_rng(seed).integers(
        10000, 100000, (len(lengths) if lengths else 4) * len(depths) * trials)
    overhead = max(prompt_overhead(loaded.tokenizer, int(k)) for k in keys)
    lengths = lengths or default_lengths(seq_len, overhead)
    if max(lengths) > seq_len or min(lengths) < overhead:
        raise EvalError(f"passkey lengths must be in [{overhead}, {seq_len}]: at least the "
                        f"{overhead} tokens of needle, question and answer, at most --seq-len; "
                        f"got {lengths}")
    if loaded.tokenizer.vocab_size > loaded.model.vocab_size:
        raise EvalError(f"the tokenizer has {loaded.tokenizer.vocab_size} ids but the model's "
                        f"vocabulary is {loaded.model.vocab_size}")
    fn = token_losses(mesh, loaded.graphdef, loaded.model.loss_chunk)
    compiled = {}

    def run(batch):
        sharded = data_lib.shard_batch(pad_rows(batch, mesh_seq), mesh)
        rows = sharded["tokens"].shape[0]
        if rows not in compiled:  # compiled, and checked against the free memory, once
            compiled[rows] = fn.lower(loaded.params, sharded).compile()
            _check_memory(compiled[rows], mesh, f"the loss program of {rows} rows of "
                                                f"{seq_len} tokens")
        losses, preds = compiled[rows](loaded.params, sharded)
        return np.asarray(losses)[:, :seq_len], np.asarray(preds)[:, :seq_len]

    held = heldout_rows(loaded, source, seq_len, fraction)
    cells = [(L, d) for L in lengths for d in depths for _ in range(trials)]
    cells = [(L, d, int(k)) for (L, d), k in zip(cells, keys[:len(cells)])]
    held_batches = list(data_lib.eval_batches(held, batch_size, batches)) if held else []
    bar = _bar(len(held_batches) + -(-len(cells) // batch_size), progress)

    bounds = bucket_bounds(seq_len)
    sums, counts = np.zeros(len(bounds) - 1), np.zeros(len(bounds) - 1)
    for batch in held_batches:
        losses, _ = run(batch)
        s, c = bucket_sums(losses, batch["positions"], batch["loss_mask"], bounds)
        sums, counts = sums + s, counts + c
        bar.update(1)

    hits, answer_loss = {}, {}
    for start in range(0, len(cells), batch_size):
        group = cells[start:start + batch_size]
        rows = [passkey_batch(loaded.tokenizer, L, d, key, seq_len) for L, d, key in group]
        rows += [rows[-1]] * (batch_size - len(rows))                        # a full batch
        batch = {f: np.stack([r[f] for r in rows]) for f in rows[0]}
        losses, preds = run(batch)
        for i, (L, d, _) in enumerate(group):
            answer = batch["loss_mask"][i] > 0
            hits.setdefault((L, d), []).append(bool(np.all(
                preds[i][answer] == batch["targets"][i][answer])))
            answer_loss.setdefault((L, d), []).append(float(losses[i][answer].mean()))
        bar.update(1)
    bar.close()
    written = _passkeys_by_generation(loaded, mesh, cells, seq_len, batch_size) \
        if generate else None
    preference = held is not None and getattr(getattr(held, "store", None), "preference",
                                              False)
    extra = {"dpo": _dpo_section(loaded, path, mesh, held, seq_len, batch_size, batches,
                                 reference, beta, progress)} if preference else {}
    return extra | {
        "model": os.path.abspath(path), "seq_len": seq_len, "mesh_seq": mesh_seq,
        "tokenizer": loaded.tokenizer_note,
        "loss_by_position": {
            "bounds": bounds, "tokens": counts.astype(int).tolist(),
            "loss": [float(s / c) if c else None for s, c in zip(sums, counts)],
            "source": source, "heldout_fraction": fraction, "batches": len(held_batches)},
        "passkey": {
            "lengths": lengths, "depths": depths, "trials": trials,
            "accuracy": [[float(np.mean(hits[(L, d)])) for d in depths] for L in lengths],
            "answer_loss": [[float(np.mean(answer_loss[(L, d)])) for d in depths]
                            for L in lengths],
            "generated_accuracy": None if written is None else [
                [float(np.mean(written[(L, d)])) for d in depths] for L in lengths]},
    }


def _dpo_section(loaded: Loaded, path: str, mesh, held, seq_len: int, batch_size: int,
                 batches: int, reference: str | None, beta: float | None,
                 progress: bool) -> dict:
    """(d): the DPO loss, reward accuracy and margin of ``held``'s pairs against the
    reference model, ``batch_size`` pairs a batch, at most ``batches`` batches."""
    run = loaded.run
    reference = reference or (run.init_from if run is not None else None)
    recorded = None if reference is not None else _recorded_reference(path, held)
    if reference is None and recorded is None:
        raise EvalError(f"the held-out data is a preference store: its DPO loss needs the "
                        f"reference model, --reference DIR (a run's init_from is the default, "
                        f"or the reference log-probabilities a dpo.reference=precompute run "
                        f"recorded for this store; {path} has neither)")
    if recorded is not None:
        held.attach_reference(recorded)
    ref = _load(reference, mesh) if reference is not None else None
    if ref is not None and ref.model.vocab_size != loaded.model.vocab_size:
        raise EvalError(f"--reference {reference} has vocab_size {ref.model.vocab_size}, the "
                        f"model {loaded.model.vocab_size}: not the same vocabulary")
    d = run.dpo if run is not None else DPOConfig()
    if beta is not None:
        if not beta > 0:
            raise EvalError(f"--beta must be positive, got {beta}")
        d = dataclasses.replace(d, beta=beta)

    def logps_fn(graphdef):  # (each row's completion log-probability, its token count)
        return jax.jit(lambda params, batch: dpo.sequence_logps(graphdef, params, batch,
                                                                mesh)[:2])

    policy = logps_fn(loaded.graphdef)
    frozen = logps_fn(ref.graphdef) if ref is not None else None
    multiple = mesh.shape["seq"]
    losses, won, margins = [], [], []
    for batch in _bar_iter(data_lib.eval_batches(held, 2 * batch_size, batches), progress):
        sharded = data_lib.shard_batch(pad_rows({f: batch[f] for f in data_lib.FIELDS},
                                                multiple), mesh)
        pi, counts = policy(loaded.params, sharded)
        r = frozen(ref.params, sharded)[0] if ref is not None else batch["ref_logps"]
        per_pair, terms = dpo.pair_losses(pi, r, counts, d)
        real = np.asarray(counts).reshape(-1, 2)[:, 0] > 0   # padding pairs have no token
        losses += np.asarray(per_pair)[real].tolist()
        won += np.asarray(terms["rewards/accuracies"])[real].tolist()
        margins += np.asarray(terms["rewards/margins"])[real].tolist()
    mean = lambda v: float(np.mean(v)) if v else None  # noqa: E731
    return {"loss": mean(losses), "rewards/accuracies": mean(won),
            "rewards/margins": mean(margins), "pairs": len(losses),
            "reference": os.path.abspath(reference) if reference else
            os.path.join(os.path.abspath(path), "reference_logps.npy"), "beta": d.beta,
            "loss_type": d.loss_type, "label_smoothing": d.label_smoothing}


def _recorded_reference(path: str, held) -> np.ndarray | None:
    """The reference log-probabilities a run at ``path`` recorded (dpo.reference=precompute)
    when they are of ``held``'s store and cover its pairs, else None."""
    try:
        with open(os.path.join(path, precomputed.META)) as f:
            meta = json.load(f)
        values = np.load(os.path.join(path, precomputed.FILE))
    except (OSError, ValueError):
        return None
    if meta["identity"]["store"] != held.store.manifest["fingerprint"] or \
            len(values) != held.store.num_docs or np.isnan(values[held.ids]).any():
        return None
    return values


def _check_memory(compiled, mesh, what: str) -> None:
    """EvalError before a program runs when what it allocates exceeds the free memory
    (training/fit.py)."""
    try:
        check_program(compiled, mesh, what, "Lower --batch-size or --seq-len, or use more "
                                            "--mesh-seq devices")
    except ConfigError as e:
        raise EvalError(str(e)) from None


def _bar_iter(items, enabled: bool):
    return tqdm(items, desc="dpo", unit="batch", dynamic_ncols=True, disable=not enabled)


def _passkeys_by_generation(loaded: Loaded, mesh, cells, seq_len: int, batch_size: int):
    """{(length, depth): [retrieved]}: whether the greedy answer to each passkey prompt (the
    prompt up to the question, ``ulysses_jax.generation``) contains its key; None for a
    model that generation does not serve yet."""
    try:
        gen = Generator(loaded.params, loaded.model, mesh)
    except GenerationError:
        return None
    gen.on_compile = lambda key, program: _check_memory(
        program, mesh, f"the passkey generation's {key[0]} program ({key[1]} rows)")
    tok = loaded.tokenizer
    out = {}
    for start in range(0, len(cells), batch_size):
        group = cells[start:start + batch_size]
        answers = [len(tok.encode(ANSWER.format(key=key))) for _, _, key in group]
        prompts = [[int(t) for t in passkey_batch(tok, length, depth, key, seq_len)["tokens"][
            :length - answer]] for (length, depth, key), answer in zip(group, answers)]
        done = gen.generate(prompts, max_new_tokens=max(answers) + 2, eos_ids={tok.eos_id})
        for (length, depth, key), c in zip(group, done):
            out.setdefault((length, depth), []).append(str(key) in tok.decode(c.ids))
    return out


def plot(result: dict, path: str) -> None:
    """eval.png: loss by position (log x) beside the passkey accuracy heatmap."""
    # matplotlib here, not at the top: it is slow to import and only eval.png needs it; the
    # Agg backend must be chosen before pyplot is imported.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    lp = result["loss_by_position"]
    pts = [((lo + hi) / 2, v) for lo, hi, v in zip(lp["bounds"], lp["bounds"][1:], lp["loss"])
           if v is not None]
    if pts:
        left.plot(*zip(*pts), marker="o")
    left.set(xscale="log", xlabel="position in document", ylabel="held-out loss",
             title=f"loss by position (S={result['seq_len']})")
    pk = result["passkey"]
    image = right.imshow(np.array(pk["accuracy"]), vmin=0, vmax=1, cmap="viridis",
                         aspect="auto", origin="lower")
    right.set(xticks=range(len(pk["depths"])), xticklabels=[f"{d:g}" for d in pk["depths"]],
              yticks=range(len(pk["lengths"])), yticklabels=pk["lengths"],
              xlabel="needle depth", ylabel="prompt length (tokens)", title="passkey accuracy")
    fig.colorbar(image, ax=right)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bar(total: int, enabled: bool):
    return tqdm(total=total, desc="evaluate", unit="batch", dynamic_ncols=True,
                disable=not enabled)  # disabled: update and close do nothing


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ulysses_jax.evaluate",
                                description=__doc__.splitlines()[0])
    p.add_argument("path", help="a run's --workdir, or a Hugging Face model directory")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the run's)")
    p.add_argument("--mesh-seq", type=int, default=1,
                   help="devices per sequence (Ulysses); any --seq-len: padded inside to a multiple")
    p.add_argument("--out", help="directory for eval.json and eval.png (default: PATH)")
    p.add_argument("--step", type=int, help="a run's checkpoint step (default: the newest)")
    p.add_argument("--batches", type=int, default=4, help="held-out batches (default 4)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per batch")
    p.add_argument("--data", help="held-out source: text files or a token store (default: "
                                  "the run's; stdlib for HF dirs)")
    p.add_argument("--heldout-fraction", type=float,
                   help="documents held out, in [0, 1]; 1 = all of --data (default: the "
                        "run's; 0.02 for HF dirs)")
    p.add_argument("--lengths", type=int, nargs="+", help="passkey prompt lengths")
    p.add_argument("--depths", type=float, nargs="+", help="needle depths in [0, 1]")
    p.add_argument("--trials", type=int, default=2, help="passkeys per (length, depth)")
    p.add_argument("--seed", type=int, default=0, help="seed of the passkeys")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-generation", action="store_true",
                   help="no passkey accuracy by generation")
    p.add_argument("--reference", help="a preference store's DPO loss: the reference model "
                   "(run or Hugging Face directory; default: the run's init_from)")
    p.add_argument("--beta", type=float, help="a preference store's DPO loss: beta (default: "
                   "the run's dpo.beta, else 0.1)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    request_cpu_devices(max(args.mesh_seq, 1))  # a CPU machine: as many devices as asked
    fence()  # CPU programs the persistent cache cannot read back safely stay out of it
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        result = evaluate(args.path, seq_len=args.seq_len, mesh_seq=args.mesh_seq,
                          step=args.step, batches=args.batches, batch_size=args.batch_size,
                          data=args.data, heldout_fraction=args.heldout_fraction,
                          lengths=args.lengths, depths=args.depths,
                          trials=args.trials, seed=args.seed, progress=not args.no_progress,
                          generate=not args.no_generation, reference=args.reference,
                          beta=args.beta)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or args.path
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(out, "eval.png"))
    lp, pk = result["loss_by_position"], result["passkey"]
    print(f"tokenizer: {result['tokenizer']}")
    print("held-out loss by position (bucket start: loss): " + ", ".join(
        f"{lo}: {v:.3f}" for lo, v in zip(lp["bounds"], lp["loss"]) if v is not None))
    print(f"passkey accuracy, lengths {pk['lengths']} x depths {pk['depths']}: "
          f"{pk['accuracy']}")
    if pk["generated_accuracy"] is not None:
        print(f"passkey accuracy by generation: {pk['generated_accuracy']}")
    if "dpo" in result:
        d = result["dpo"]
        print(f"dpo ({d['pairs']} pairs, beta {d['beta']}, against {d['reference']}): loss "
              f"{d['loss']}, rewards/accuracies {d['rewards/accuracies']}, rewards/margins "
              f"{d['rewards/margins']}")
    print(f"wrote {os.path.join(out, 'eval.json')} and {os.path.join(out, 'eval.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
