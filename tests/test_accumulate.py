"""Gradient accumulation (training/accumulate.py, ``grad_accum_steps``): k micro-batches give
the plain step's loss, gradient norm and parameters within 1e-6 on a chat store whose
micro-batches hold very different supervised counts, on every kind of mesh and with zero3 and
optimizer.offload (a per-micro-batch mean fails there); the micro-batch split keeps rows on
their devices; MoE's router loss is the mean of the micro-batches' own; the compiled peak is
one micro-batch's plus the accumulator; a split that does not divide is refused."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from tests.test_chat import CHATML, write_tokenizer_dir
from tests.utils.configs import ROOT, tiny_config
from tests.utils.devices import DEVICES
from ulysses_jax.config import ConfigError, load_config
from ulysses_jax.data import run_data, text as data_lib
from ulysses_jax.data.prepare import prepare
from ulysses_jax.hlo import collective_counts
from ulysses_jax.training.accumulate import micro_batches
from ulysses_jax.training.dry_run import compile_step, peak_bytes_per_device
from ulysses_jax.training.objectives.sft import objective
from ulysses_jax.training.train_step import (batch_shardings, init_state, make_train_step,
                                             state_layout)
from ulysses_jax.training.trainer import build_mesh, token_order

SMALL = ["seq_len=64", "batch_size=8", "model.d_model=32", "model.n_layers=1",
         "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.ffn_dim=64",
         "model.loss_chunk=8", "model.vocab_size=384", "optimizer.warmup_steps=1",
         "optimizer.lr=0.01"]
STEPS = 3

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="trainer tests run on fake CPU devices")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A chat store of two kinds of conversation, about a row each: a long answer to a short
    question, or a one-word answer to a long question; so micro-batches of a few rows hold
    very different numbers of supervised tokens."""
    tmp = tmp_path_factory.mktemp("accum")
    tok_dir = write_tokenizer_dir(tmp / "tok", CHATML)
    rng = np.random.default_rng(0)
    words = ["Say", " hi", " again", " the", " answer", " is", " 42", " user"]
    say = lambda n: "".join(rng.choice(words, n))  # noqa: E731
    with open(tmp / "chat.jsonl", "w") as f:
        for i in range(64):
            q, a = (2, 24) if i % 2 else (24, 1)
            f.write(json.dumps({"messages": [{"role": "user", "content": say(q)},
                                             {"role": "assistant", "content": say(a)}]}) + "\n")
    prepare([str(tmp / "chat.jsonl")], str(tmp / "store"), tok_dir, chat=True, progress=False)
    return str(tmp / "store")


def _cfg(store, *over):
    return tiny_config(*SMALL, f"data.source={store}", *over)


def _batches(cfg, mesh, n):
    rows, _ = run_data.load_data(cfg)
    it = data_lib.BatchIterator(rows, cfg.batch_size, cfg.seed)
    return [it.next_global(mesh, token_order(cfg)) for _ in range(n)]


def _train(cfg, start=None):
    """STEPS optimizer steps from the seed's initial state (or a copy of ``start``, the
    ``init_state`` of a config with the same model, mesh and optimizer): per-step metrics,
    final params."""
    mesh = build_mesh(cfg)
    if start is None:
        start = init_state(cfg, mesh)
    graphdef, state, shardings, tx = start
    state = jax.device_put(state, may_alias=False)  # the step donates its state
    step = make_train_step(cfg, mesh, graphdef, tx, shardings)
    out = []
    for batch in _batches(cfg, mesh, STEPS):
        state, m = step(state, batch)
        out.append({k: float(m[k]) for k in ("loss", "grad_norm", "tokens")})
    return out, jax.tree.map(np.asarray, state["params"])


def _steps_from_the_same_states(cfg, other):
    """STEPS steps of ``cfg``; at each, ``other``'s step from the same state (a copy): the
    metrics of both. For optimizers that round their moments to bfloat16, where a 1-ulp
    difference in one gradient element can flip that rounding, so that two runs' parameters
    part by far more than the gradients did after an update (2e-6 in the grad norm of step 3
    on one CI draw of the data): what is compared is then each step's loss and gradients."""
    mesh = build_mesh(cfg)
    graphdef, state, shardings, tx = init_state(cfg, mesh)
    step, step_other = (make_train_step(c, mesh, graphdef, tx, shardings) for c in (cfg, other))
    out, out_other = [], []
    for batch in _batches(cfg, mesh, STEPS):
        _, m = step_other(jax.device_put(state, may_alias=False), batch)
        out_other.append({k: float(m[k]) for k in ("loss", "grad_norm", "tokens")})
        state, m = step(state, batch)
        out.append({k: float(m[k]) for k in ("loss", "grad_norm", "tokens")})
    return out, out_other


def _rel(a, b):
    return abs(a - b) / abs(a)


def _micro_rows(b, k, d):
    """Rows of each micro-batch, written out: the i-th block of B/(kD) rows of each replica."""
    m = b // (k * d)
    return [[r * (b // d) + i * m + j for r in range(d) for j in range(m)] for i in range(k)]


MESHES = {
    "seq1": ["mesh.seq=1", "mesh.data=1"],
    "data2_seq2": ["mesh.seq=2", "mesh.data=2"],
    "ring": ["mesh.ring=2", "mesh.seq=2", "mesh.data=1"],
    "zero3": ["mesh.seq=2", "mesh.data=2", "param_sharding=zero3"],
    "offload": ["mesh.seq=2", "mesh.data=1", "optimizer.offload=true"],
}


@pytest.mark.parametrize("mesh", MESHES)
def test_accumulation_equals_one_global_batch(store, mesh):
    """grad_accum_steps 2 and 4 against 1 on the same global batches: loss, gradient norm and
    every parameter after STEPS steps within 1e-6 (parameters: relative to each tensor's
    norm, since Adam turns float noise in a near-zero gradient into a full-size step)."""
    over = MESHES[mesh]
    cfg = _cfg(store, *over)
    start = init_state(cfg, build_mesh(cfg))  # grad_accum_steps changes neither
    ref, ref_params = _train(cfg, start)
    checked = 0
    for k in (2, 4):
        got, params = _train(_cfg(store, *over, f"grad_accum_steps={k}"), start)
        for r, g in zip(ref, got, strict=True):
            assert g["tokens"] == r["tokens"]
            assert _rel(r["loss"], g["loss"]) <= 1e-6, (k, r, g)
            assert _rel(r["grad_norm"], g["grad_norm"]) <= 1e-6, (k, r, g)
        for path, a in jax.tree_util.tree_leaves_with_path(ref_params):
            b = params
            for key in path:
                b = b[key.key]
            assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(a), (k, path)
            checked += 1
    assert checked > 10


QWEN3_NEXT = ["--config", "configs/tiny-qwen3-next.yaml", "model.n_layers=2",
              "model.mixer_pattern=DA",
              "model.d_model=32", "model.moe_ffn_dim=16", "model.moe_shared_ffn_dim=16",
              "model.router_aux_loss_coef=0.0"]  # the router loss: the MoE test below
OPTIONS = {
    "remat_full_offload_checkpoints": ["mesh.seq=2", "mesh.data=2", "model.remat=full",
                                       "model.offload_checkpoints=true"],
    "save_dots_tiled_mlp_bf16_moments": ["mesh.seq=2", "mesh.data=1", "model.remat=save_dots",
                                         "model.mlp_chunk=16",
                                         "optimizer.moment_dtype=bfloat16"],
    "qwen3_next_experts": [*QWEN3_NEXT, "mesh.seq=2", "mesh.data=2"],
    "raw_text": ["data.source=RAW", "mesh.seq=4", "mesh.data=1"],
}


@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_trains_the_same_with_accumulation(store, option, tmp_path):
    """grad_accum_steps=2 against 1 with the other memory options, a Qwen3-Next model
    (DeltaNet layers, experts over the devices) and a raw text source: the same loss and
    gradient norm (1e-6) on the same global batches."""
    over = list(OPTIONS[option])
    preset = "tiny.yaml"
    if over[0] == "--config":
        preset, over = os.path.basename(over[1]), over[2:]
    if "data.source=RAW" in over:
        (tmp_path / "a.txt").write_text(" ".join(str(i) for i in range(3000)))
        (tmp_path / "b.txt").write_text("short")
        over[over.index("data.source=RAW")] = f"data.source={tmp_path}/*.txt"
    else:
        over.append(f"data.source={store}")
    path = os.path.join(ROOT, "configs", preset)
    cfgs = [load_config(path, SMALL + over + [f"grad_accum_steps={k}"]) for k in (1, 2)]
    if cfgs[0].optimizer.moment_dtype == "bfloat16":
        ref, got = _steps_from_the_same_states(*cfgs)
    else:
        start = init_state(cfgs[0], build_mesh(cfgs[0]))  # grad_accum_steps changes neither
        (ref, _), (got, _) = (_train(cfg, start) for cfg in cfgs)
    for r, g in zip(ref, got, strict=True):
        assert _rel(r["loss"], g["loss"]) <= 1e-6, (r, g)
        assert _rel(r["grad_norm"], g["grad_norm"]) <= 1e-6, (r, g)


def test_the_store_makes_a_per_micro_batch_mean_fail(store):
    """The check above can fail: on these batches the mean of the micro-batches' mean losses
    (what averaging per micro-batch gives) is off the global batch's loss by far more than
    1e-6, because their supervised counts differ a lot."""
    cfg = _cfg(store, "mesh.seq=1", "mesh.data=1")
    mesh = build_mesh(cfg)
    graphdef, state, _, _ = init_state(cfg, mesh)
    params = state["params"]
    mean_loss = jax.jit(lambda b: objective(graphdef, params, b, mesh)[1][0])
    worst, uneven = 0.0, 0.0
    for batch in _batches(cfg, mesh, STEPS):
        host = {n: np.asarray(v) for n, v in batch.items()}
        whole = float(mean_loss(batch))
        for k in (2, 4):
            parts = [{n: v[rows] for n, v in host.items()} for rows in _micro_rows(8, k, 1)]
            counts = [p["loss_mask"].sum() for p in parts]
            means = [float(mean_loss(p)) for p in parts]
            exact = sum(c * m for c, m in zip(counts, means)) / sum(counts)
            assert _rel(whole, exact) <= 1e-6          # the token-weighted rule
            uneven = max(uneven, max(counts) / min(counts))
            worst = max(worst, _rel(whole, float(np.mean(means))))
    assert uneven >= 2 and worst > 1e-3, (uneven, worst)


def test_micro_batches_keep_rows_on_their_devices():
    """Rank-coded rows: micro-batch i holds the i-th block of each data replica's rows, laid
    out over the same replicas, and the split moves nothing between devices (no collective
    in its program)."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      ["mesh.data=2", "mesh.seq=4", "batch_size=8", "seq_len=16"])
    mesh = build_mesh(cfg)
    shardings = batch_shardings(mesh, cfg)
    rows = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)  # value // 16 = the row
    batch = {n: jax.device_put(rows.astype(np.float32 if n == "loss_mask" else np.int32), s)
             for n, s in shardings.items()}
    for k in (2, 4):
        fn = jax.jit(lambda b: micro_batches(b, k, mesh, shardings))
        out = fn(batch)
        for n in shardings:
            want = np.stack([rows[r] for r in _micro_rows(8, k, 2)])  # [k, B/k, S]
            np.testing.assert_array_equal(np.asarray(out[n]), want)
            spec = out[n].sharding.spec
            assert tuple(spec)[:3] == (None, "data", "seq"), spec
        assert not any(collective_counts(fn.lower(batch).compile().as_text()).values())


def test_moe_router_loss_is_the_mean_of_the_micro_batches(store):
    """MoE at k=2 (data=2 x seq=2): the cross-entropy equals k=1's; the reported router loss
    is the mean of each micro-batch's own, and the gradient is that of the token-weighted
    cross-entropy plus coef x that mean, computed here micro-batch by micro-batch."""
    over = ["mesh.seq=2", "mesh.data=2", "model.num_experts=4", "model.num_experts_per_tok=2",
            "model.moe_ffn_dim=16", "model.router_aux_loss_coef=0.5"]
    cfg1, cfg2 = _cfg(store, *over), _cfg(store, *over, "grad_accum_steps=2")
    mesh = build_mesh(cfg1)
    batch = _batches(cfg1, mesh, 1)[0]
    graphdef, state, shardings, tx = init_state(cfg2, mesh)
    params = jax.device_put(state["params"], may_alias=False)
    _, m1 = make_train_step(cfg1, mesh, graphdef, tx, shardings)(
        jax.device_put(state, may_alias=False), batch)
    _, m2 = make_train_step(cfg2, mesh, graphdef, tx, shardings)(state, batch)
    assert _rel(float(m1["loss"]), float(m2["loss"])) <= 1e-6

    host = {n: np.asarray(v) for n, v in batch.items()}
    parts = [{n: jax.device_put(v[rows], batch[n].sharding) for n, v in host.items()}
             for rows in _micro_rows(8, 2, 2)]
    counts = [float(p["loss_mask"].sum()) for p in parts]
    coef = cfg2.model.router_aux_loss_coef

    def reference(p, parts):
        value, auxes = 0.0, []
        for part, count in zip(parts, counts):
            _, (ce, metrics) = objective(graphdef, p, part, mesh)
            value += count / sum(counts) * ce
            auxes.append(metrics["moe_aux_loss"])
        return value + coef * sum(auxes) / 2, auxes

    grads, auxes = jax.jit(jax.grad(reference, has_aux=True))(params, parts)
    assert _rel(float(np.mean(auxes)), float(m2["moe_aux_loss"])) <= 1e-6
    squares = jax.jit(lambda gs: [jnp.sum(g ** 2) for g in gs])(jax.tree.leaves(grads))
    norm = math.sqrt(sum(float(x) for x in squares))
    assert _rel(norm, float(m2["grad_norm"])) <= 1e-5
    # the pooled k=1 router loss is another number: accumulation does change that part
    assert abs(float(m1["moe_aux_loss"]) - float(np.mean(auxes))) > 1e-7


@pytest.mark.parametrize("zero3", [False, True])
def test_compiled_peak_is_one_micro_batch_plus_the_accumulator(zero3):
    """XLA's peak per device (tiny preset): batch_size=8 in 4 micro-batches needs what
    batch_size=2 needs plus the float32 accumulator (the parameters' bytes per device), the
    larger global batch's own input bytes (twice: the batch and its micro-batch-major copy)
    and 16 KiB of loop bookkeeping; 8 micro-batches of the same size need no more than 4 but
    their inputs, and batch_size=8 at once needs far more. With ZeRO-3 the CPU compiler also
    keeps its relayouted copies of what the layer loop and the vocabulary-parallel head read
    (a second copy of the parameter shards, and two of the head's [V/P, D] slice) across the
    micro-batch loop; the plain step frees them before its peak."""
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    over = ["param_sharding=zero3", "mesh.data=2", "mesh.seq=4"] if zero3 else []
    peak = {}
    for b, k in ((2, 1), (8, 4), (16, 8), (8, 1)):
        cfg = load_config(tiny, [*over, f"batch_size={b}", f"grad_accum_steps={k}"])
        peak[b, k] = peak_bytes_per_device(compile_step(cfg)[0])
    cfg = load_config(tiny, over)
    mesh = build_mesh(cfg)
    _, abstract, shardings, _ = state_layout(cfg, mesh)
    accumulator = sum(math.prod(s.shard_shape(a.shape)) * 4 for a, s in zip(
        jax.tree.leaves(abstract["params"]), jax.tree.leaves(
            shardings["params"], is_leaf=lambda x: isinstance(x, NamedSharding))))
    devices = cfg.mesh.data * cfg.mesh.seq
    inputs = lambda rows: 2 * rows * cfg.seq_len * 5 * 4 // devices  # noqa: E731  5 fields
    bound = peak[2, 1] + accumulator + inputs(8 - 2) + 16 * 1024
    if zero3:
        head = -(-cfg.model.vocab_size // cfg.mesh.seq) * cfg.model.d_model * 4
        bound += accumulator + 2 * head
    assert peak[8, 4] <= bound, (peak, accumulator, bound)
    assert peak[16, 8] <= peak[8, 4] + inputs(16 - 8) + 16 * 1024, peak
    assert peak[8, 4] < 0.6 * peak[8, 1], peak


@pytest.mark.parametrize("over, words", [
    (["batch_size=6", "grad_accum_steps=4"],
     ["batch_size 6", "grad_accum_steps 4", "divisible by grad_accum_steps x mesh.data = 4 x 1 = 4"]),
    (["batch_size=8", "grad_accum_steps=4", "mesh.data=4", "mesh.seq=2"],
     ["batch_size 8", "grad_accum_steps 4", "mesh.data 4", "= 16"]),
    (["grad_accum_steps=0"], ["grad_accum_steps must be positive, got 0"]),
])
def test_a_split_that_does_not_divide_is_refused(over, words):
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(ROOT, "configs", "tiny.yaml"), over)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_resume_on_another_mesh_with_other_accumulation(store, tmp_path, capsys):
    """Steps 1-2 with grad_accum_steps=2 on seq=4, resumed to 4 with grad_accum_steps=4 on
    data=2 x seq=2, give the loss curve of 4 plain steps on seq=4 (1e-4: another mesh); the
    data position advances by whole global batches; the held-out loss (its batches a
    micro-batch at a time) is the plain run's. The start-up log states the batch and
    metrics.jsonl the tokens of each optimizer step."""
    from ulysses_jax.training.trainer import train
    run = ["log_every=1", "eval_batches=1", "checkpoint_every=2", "steps=4",
           "optimizer.schedule_steps=4"]
    train(_cfg(store, *run, "mesh.seq=4", "mesh.data=1"), str(tmp_path / "ref"), progress=False)
    train(_cfg(store, *run, "steps=2", "mesh.seq=4", "mesh.data=1", "grad_accum_steps=2"),
          str(tmp_path / "acc"), progress=False)
    capsys.readouterr()
    train(_cfg(store, *run, "mesh.seq=2", "mesh.data=2", "grad_accum_steps=4"),
          str(tmp_path / "acc"), progress=False)
    out = capsys.readouterr()
    assert ("batch: 8 sequences = 512 tokens per optimizer step in grad_accum_steps=4 "
            "micro-batches of 2 sequences = 128 tokens; 1 sequence per data replica at a "
            "time") in out.out + out.err
    records = {}
    for name in ("ref", "acc"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            records[name] = {r["step"]: r for r in map(json.loads, f)}
    assert sorted(records["acc"]) == sorted(records["ref"]) == [1, 2, 3, 4]
    for step, r in records["ref"].items():
        a = records["acc"][step]
        assert _rel(r["loss"], a["loss"]) <= 1e-4, (step, r["loss"], a["loss"])
        assert a["step_tokens"] == 8 * 64 and a["supervised_tokens"] == r["supervised_tokens"]
        assert 0 < a["supervised_tokens"] < a["step_tokens"]
    # the held-out loss at the end: the same rows, evaluated a micro-batch at a time
    assert _rel(records["ref"][4]["eval_loss"], records["acc"][4]["eval_loss"]) <= 1e-4
