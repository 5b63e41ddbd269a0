"""Training-curve baseline: the same tiny model, init, batches and optimizer in ulysses_jax
(mesh seq=1 and seq=4) and in PyTorch (transformers' LlamaForCausalLM, fp32, eager attention).

    python benchmarks/train_curve_baseline.py [--steps 50] [--seq-len 128] [--batch 8]
        [--seqs 1,4] [--out-dir benchmarks/results] [--export-dir DIR]

Model: a Llama-shaped Decoder (d_model 64, 2 layers, 4 heads, 2 kv heads, head_dim 16, ffn 128,
byte vocabulary 257, tied embeddings), initialised once by ``init_state`` on the seq=1 mesh and
exported with ``save_pretrained``; the seq=P runs start from the same arrays and transformers
loads the export. Batches: ``build_rows`` + ``BatchIterator`` on the stdlib corpus, the very
rows ``train.py`` would see. Rows are packed, so the torch side gets the batch's ``positions``
as ``position_ids`` and a 4-D additive mask [B, 1, S, S] that allows key j for query i iff
j <= i and segment_ids[i] == segment_ids[j], which is what ``ulysses_attention`` applies; its
loss is sum(CE(logits, targets) * loss_mask) / sum(loss_mask), our ``chunked_cross_entropy``.

Optimizer: ours is ``make_train_step`` with ``make_optimizer`` (clip by global norm, AdamW,
warmup + cosine). Torch: ``clip_grad_norm_`` with the same max norm, then ``torch.optim.AdamW``
with the same betas and eps (optax and torch both default to 1e-8), the learning rate of each
step taken from ``make_schedule``, and weight decay on exactly the tensors ``make_optimizer``
decays. Those are found by probing it (one update with zero gradients and a constant
learning rate moves only decayed parameters), not by restating its rule.

Step k (1-based, as in metrics.jsonl) is the loss of batch k before the k-th update.
Results: OUT_DIR/train_curve_baseline.{json,png}.
"""
from __future__ import annotations

import os


import argparse
import dataclasses
import datetime
import json
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

from _common import ROOT  # noqa: E402  (first: repo path, fake devices)

MODEL = dict(vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
             ffn_dim=128, tie_embeddings=True, dtype="float32", attn_impl="xla")


def make_config(args, seq: int):
    from ulysses_jax.config import Config, MeshConfig, ModelConfig, validate
    cfg = Config(seed=args.seed, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch,
                 mesh=MeshConfig(data=1, seq=seq), model=ModelConfig(**MODEL))
    validate(cfg)
    return cfg


def load_batches(cfg, steps: int) -> list[dict]:
    """The first ``steps`` training batches, numpy [B, S] per field, as train.py builds them."""
    from ulysses_jax.data import text as data_lib
    tokenizer = data_lib.load_tokenizer(cfg.data.tokenizer)
    rows, _ = data_lib.build_rows(cfg.data.source, tokenizer, cfg.seq_len,
                                  cfg.data.heldout_fraction, cfg.seed)
    it = data_lib.BatchIterator(rows, cfg.batch_size, cfg.seed)
    return [next(it) for _ in range(steps)]


def decayed_hf_names(cfg, params) -> set[str]:
    """HF tensor names of the parameters ``make_optimizer`` applies weight decay to.

    One update with zero gradients and a constant learning rate (warmup 0, no decay of the
    schedule at count 0) changes a parameter only through decoupled weight decay.
    """
    import jax
    import jax.numpy as jnp
    from ulysses_jax.hf import to_hf_tensors
    from ulysses_jax.training.optimizer import make_optimizer

    opt = dataclasses.replace(cfg.optimizer, warmup_steps=0)
    tx = make_optimizer(opt, cfg.steps)
    ones = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, ones), tx.init(ones), ones)
    moved = jax.tree.map(lambda u: np.full(u.shape, float(np.any(np.asarray(u) != 0))), updates)
    return {name for name, m in to_hf_tensors(cfg.model, moved).items() if m.all()}


def run_jax(cfg, seq: int, params, batches) -> dict:
    """Trains on a (data=1, seq) CPU mesh from ``params``; per-step loss, grad norm, lr."""
    import jax
    from ulysses_jax.data.text import shard_batch
    from ulysses_jax.mesh import make_mesh
    from ulysses_jax.training.train_step import init_state, make_train_step

    mesh = make_mesh(seq=seq, data=1, devices=jax.devices("cpu")[:seq])
    graphdef, state, shardings, tx = init_state(cfg, mesh, params=params)
    step = make_train_step(cfg, mesh, graphdef, tx, shardings)
    out = {"loss": [], "grad_norm": [], "lr": []}
    t0 = time.time()
    for batch in batches:
        state, metrics = step(state, shard_batch(batch, mesh))
        for k in out:
            out[k].append(float(metrics[k]))
    out["seconds"] = time.time() - t0
    return out


def segment_mask(segment_ids: np.ndarray):
    """Additive float mask [B, 1, S, S]: 0 where key j <= query i in the same segment."""
    import torch
    seg = torch.from_numpy(segment_ids)
    s = seg.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal                      # [B, S, S]
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return mask[:, None]                                                         # [B, 1, S, S]


def torch_loss(model, batch, packed: bool = True):
    """Token-weighted next-token loss of one batch: our ``loss_fn`` in torch."""
    import torch
    import torch.nn.functional as F
    tokens = torch.from_numpy(batch["tokens"]).long()
    kw = {}
    if packed:
        kw = dict(position_ids=torch.from_numpy(batch["positions"]).long(),
                  attention_mask=segment_mask(batch["segment_ids"]))
    logits = model(input_ids=tokens, **kw).logits                                # [B, S, V]
    losses = F.cross_entropy(logits.flatten(0, 1).float(),
                             torch.from_numpy(batch["targets"]).long().flatten(),
                             reduction="none")                                   # [B*S]
    mask = torch.from_numpy(batch["loss_mask"]).float().flatten()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def run_torch(cfg, export_dir: str, batches, decayed: set[str]) -> dict:
    """transformers' LlamaForCausalLM from the export, trained like ``make_train_step``."""
    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from ulysses_jax.training.optimizer import make_schedule

    transformers.logging.disable_progress_bar()
    kind = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.LlamaForCausalLM.from_pretrained(
        export_dir, attn_implementation="eager", **{kind: torch.float32})
    model.train()  # no dropout in Llama; train() only for the record
    named = dict(model.named_parameters())  # the tied lm_head appears once, as the embedding
    unknown = decayed - set(named)
    if unknown:
        raise ValueError(f"decayed tensors missing from the torch model: {sorted(unknown)}")
    opt = cfg.optimizer
    groups = [{"params": [p for n, p in named.items() if n in decayed],
               "weight_decay": opt.weight_decay},
              {"params": [p for n, p in named.items() if n not in decayed], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=0.0, betas=(opt.b1, opt.b2), eps=1e-8)
    # optax evaluates the schedule in float32 at the update count before the update (0, 1, ..).
    lrs = np.asarray(jax.jit(jax.vmap(make_schedule(opt, cfg.steps)))(
        jnp.arange(len(batches), dtype=jnp.int32)), np.float64)
    out = {"loss": [], "grad_norm": [], "lr": []}
    t0 = time.time()
    for k, batch in enumerate(batches):
        lr = float(lrs[k])
        adamw.zero_grad(set_to_none=True)
        loss = torch_loss(model, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip_norm)
        for g in adamw.param_groups:
            g["lr"] = lr
        adamw.step()
        out["loss"].append(loss.item())
        out["grad_norm"].append(norm.item())
        out["lr"].append(lr)
    out["seconds"] = time.time() - t0
    # What the segment mask changes: the first batch whose rows hold several documents, with
    # the trained model, run as if each row were one document (plain causal, positions 0..S-1).
    several = [k for k, b in enumerate(batches) if (b["segment_ids"].max(-1) > 1).any()]
    if several:
        with torch.no_grad():
            b = batches[several[0]]
            out["mask_check"] = {"batch": several[0] + 1,
                                 "with_segment_mask": torch_loss(model, b).item(),
                                 "plain_causal": torch_loss(model, b, packed=False).item()}
    return out


def versions() -> dict:
    import flax
    import jax
    import jaxlib
    import optax
    import torch
    import transformers
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "numpy": np.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": cpu, "cores": os.cpu_count(),
            "platform": platform.platform()}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(steps, [r["loss_torch"] for r in rows], "k-", lw=2.5, alpha=0.5, label="PyTorch")
    for s in result["seqs"]:
        a.plot(steps, [r[f"loss_jax_seq{s}"] for r in rows], "--", label=f"ulysses_jax seq={s}")
    a.set(xlabel="step", ylabel="train loss (nats/token)", title="loss curves")
    a.grid(alpha=0.3)
    a.legend()
    for s in result["seqs"]:
        b.semilogy(steps, [max(r[f"rel_seq{s}_vs_torch"], 1e-9) for r in rows],
                   label=f"seq={s} vs torch")
    # float32 losses of 2.5-5.5: one ulp is 6e-8..1.2e-7 relative; equal values sit at 1e-9.
    b.set(xlabel="step", ylabel="|loss - loss_torch| / loss_torch",
          title="relative difference (exactly equal plotted at 1e-9)")
    b.grid(alpha=0.3, which="both")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict, every: int = 5) -> str:
    seqs = result["seqs"]
    head = f"{'step':>5} {'lr':>9} {'loss_torch':>11}" + "".join(
        f" {f'loss_jax_seq{s}':>15}" for s in seqs) + "".join(
        f" {f'rel_seq{s}_vs_torch':>18}" for s in seqs) + f" {'rel_seq4_vs_seq1':>17}" * (
        {1, 4} <= set(seqs))
    lines = [head]
    for r in result["rows"]:
        if r["step"] % every and r["step"] not in (1, len(result["rows"])):
            continue
        line = f"{r['step']:>5} {r['lr']:>9.2e} {r['loss_torch']:>11.6f}" + "".join(
            f" {r[f'loss_jax_seq{s}']:>15.6f}" for s in seqs) + "".join(
            f" {r[f'rel_seq{s}_vs_torch']:>18.2e}" for s in seqs)
        if {1, 4} <= set(seqs):
            line += f" {r['rel_seq4_vs_seq1']:>17.2e}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seqs", default="1,4", help="seq axis sizes of the JAX runs (default 1,4)")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--export-dir", help="keep the exported HF checkpoint here (default: a "
                                        "temporary dir, removed at the end)")
    args = p.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]

    import jax
    import torch
    from ulysses_jax.hf import save_pretrained
    from ulysses_jax.mesh import make_mesh
    from ulysses_jax.training.train_step import init_state
    from flax import nnx

    torch.manual_seed(args.seed)
    cfg1 = make_config(args, 1)
    t0 = time.time()
    batches = load_batches(cfg1, args.steps)
    seg = np.stack([b["segment_ids"] for b in batches])                         # [N, B, S]
    data = {"rows": int(seg.shape[0] * seg.shape[1]),
            "rows_with_several_documents": int((seg.max(-1) > 1).sum()),
            "rows_with_padding": int((seg == 0).any(-1).sum()),
            "counted_tokens": int(sum(b["loss_mask"].sum() for b in batches)),
            "seconds": round(time.time() - t0, 1)}
    print(f"data: {data}", flush=True)

    # One init, on the seq=1 mesh; every run starts from these arrays.
    mesh1 = make_mesh(seq=1, data=1, devices=jax.devices("cpu")[:1])
    graphdef, state, _, _ = init_state(cfg1, mesh1)
    params = jax.device_get(state["params"])
    export_dir = args.export_dir or tempfile.mkdtemp(prefix="train_curve_baseline_")
    save_pretrained(nnx.merge(graphdef, state["params"]), export_dir, arch="llama")
    decayed = decayed_hf_names(cfg1, params)
    print(f"weight decay on: {sorted(decayed)}", flush=True)

    runs = {"torch": run_torch(cfg1, export_dir, batches, decayed)}
    print(f"torch: {runs['torch']['seconds']:.1f} s", flush=True)
    for s in seqs:
        runs[f"seq{s}"] = run_jax(make_config(args, s), s, params, batches)
        print(f"jax seq={s}: {runs[f'seq{s}']['seconds']:.1f} s", flush=True)
    if not args.export_dir:
        shutil.rmtree(export_dir)

    rows = []
    for k in range(args.steps):
        t = runs["torch"]["loss"][k]
        row = {"step": k + 1, "lr": runs["torch"]["lr"][k], "loss_torch": t,
               "grad_norm_torch": runs["torch"]["grad_norm"][k]}
        for s in seqs:
            j, gt = runs[f"seq{s}"], row["grad_norm_torch"]
            row.update({f"loss_jax_seq{s}": j["loss"][k],
                        f"grad_norm_jax_seq{s}": j["grad_norm"][k],
                        f"rel_seq{s}_vs_torch": abs(j["loss"][k] - t) / abs(t),
                        f"rel_grad_norm_seq{s}_vs_torch": abs(j["grad_norm"][k] - gt) / gt})
            if abs(j["lr"][k] - row["lr"]) > 1e-6 * row["lr"]:
                raise AssertionError(f"step {k + 1}: lr {j['lr'][k]} (jax) != {row['lr']} (torch)")
        if {1, 4} <= set(seqs):
            a, b = runs["seq1"]["loss"][k], runs["seq4"]["loss"][k]
            row["rel_seq4_vs_seq1"] = abs(b - a) / abs(a)
        rows.append(row)
    rel_keys = [k for k in rows[0] if k.startswith("rel_")]
    summary = {k: {"max": max(r[k] for r in rows), "max_first_10": max(r[k] for r in rows[:10]),
                   "at_last_step": rows[-1][k]} for k in rel_keys}
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(), "model": MODEL, "seqs": seqs,
        "config": {"seed": args.seed, "steps": args.steps, "seq_len": args.seq_len,
                   "batch_size": args.batch, "optimizer": dataclasses.asdict(cfg1.optimizer),
                   "data": dataclasses.asdict(cfg1.data)},
        "data": data, "weight_decay_on": sorted(decayed),
        "torch_mask_check": runs["torch"].get("mask_check"),
        "seconds": {k: round(v["seconds"], 1) for k, v in runs.items()},
        "summary": summary, "rows": rows}
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "train_curve_baseline.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out_dir, "train_curve_baseline.png"))
    print(table(result))
    if result["torch_mask_check"]:
        m = result["torch_mask_check"]
        print(f"torch, trained model, batch {m['batch']} (first with several documents in a row):"
              f" loss {m['with_segment_mask']:.6f} with the segment mask, "
              f"{m['plain_causal']:.6f} as plain causal rows")
    for k, v in summary.items():
        print(f"{k}: max {v['max']:.2e}, max over steps 1-10 {v['max_first_10']:.2e}, "
              f"at step {args.steps} {v['at_last_step']:.2e}")
    print(f"wrote {json_path} and train_curve_baseline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
