"""python -m ulysses_jax.evaluate: the same loss by position and passkey results on 1 and 4
sequence devices; per-token losses and greedy predictions equal those of the unsharded
model's full logits; eval.json / eval.png; the trainer logs the loss by position at each
eval; a run from a token store is read with the store's tokenizer and its own held-out rows;
a byte-level export evaluates as its run; --heldout-fraction 1 holds out all of --data; bad
inputs exit 2 with a message."""
import glob
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from tests.utils.data import relocated_store_run, small_corpus
from tests.utils.devices import DEVICES
from ulysses_jax import make_mesh
from ulysses_jax.config import load_config
from ulysses_jax.evaluate import NEEDLE, evaluate, main, passkey_batch
from ulysses_jax.runs import load
from ulysses_jax.training.position_loss import token_losses
from ulysses_jax.data import text as data_lib
from ulysses_jax.training.trainer import train

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="trainer tests run on fake CPU devices")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRID = dict(seq_len=256, batches=2, lengths=[128, 256], depths=[0.0, 0.5, 1.0], trials=1,
            progress=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny byte-level model trained 4 steps on 2 sequence devices, evaluated at 2 and 4."""
    tmp = tmp_path_factory.mktemp("eval")
    path = str(tmp / "run")
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        f"data.source={small_corpus(tmp / 'corpus')}", "data.heldout_fraction=0.25",
        "seq_len=64", "batch_size=2", "mesh.seq=2", "steps=4", "log_every=1", "eval_every=2",
        "eval_batches=2", "checkpoint_every=0", "model.d_model=32", "model.n_layers=1",
        "model.ffn_dim=64", "model.head_dim=8", "model.loss_chunk=16"])
    train(cfg, path, progress=False)
    return path


def test_same_numbers_on_one_and_four_devices(run):
    one = evaluate(run, mesh_seq=1, **GRID)
    four = evaluate(run, mesh_seq=4, **GRID)
    lp1, lp4 = one["loss_by_position"], four["loss_by_position"]
    assert lp1["bounds"] == lp4["bounds"] == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert lp1["tokens"] == lp4["tokens"] and min(lp1["tokens"]) > 0
    np.testing.assert_allclose(lp4["loss"], lp1["loss"], rtol=1e-5)
    assert one["passkey"]["accuracy"] == four["passkey"]["accuracy"]
    assert np.array(one["passkey"]["accuracy"]).shape == (2, 3)
    np.testing.assert_allclose(four["passkey"]["answer_loss"], one["passkey"]["answer_loss"],
                               rtol=1e-5)
    # By generation: the same on both meshes, and every prompt retrieved under teacher
    # forcing is retrieved by the greedy answer (one trial per cell: it writes the answer).
    written = np.array(one["passkey"]["generated_accuracy"])
    assert written.shape == (2, 3)
    assert four["passkey"]["generated_accuracy"] == one["passkey"]["generated_accuracy"]
    assert np.all(written >= np.array(one["passkey"]["accuracy"]))


def test_a_length_the_devices_do_not_divide_is_padded_inside(run):
    """seq_len 250 on 3 sequence devices (and 4): the rows are padded to 252 (256) inside and
    give the numbers of one device, where nothing is padded."""
    grid = dict(GRID, seq_len=250, batches=1, lengths=[250], depths=[0.5], generate=False)
    one = evaluate(run, mesh_seq=1, **grid)
    for p in (3, 4):
        got = evaluate(run, mesh_seq=p, **grid)
        assert got["seq_len"] == 250 and got["mesh_seq"] == p
        lp1, lp = one["loss_by_position"], got["loss_by_position"]
        assert lp["bounds"] == lp1["bounds"] and lp["tokens"] == lp1["tokens"]
        assert min(lp1["tokens"]) > 0
        np.testing.assert_allclose(lp["loss"], lp1["loss"], rtol=1e-5)
        assert got["passkey"]["accuracy"] == one["passkey"]["accuracy"]
        np.testing.assert_allclose(got["passkey"]["answer_loss"],
                                   one["passkey"]["answer_loss"], rtol=1e-5)


def test_token_losses_and_predictions_equal_the_full_logits(run):
    """On passkey rows and held-out rows: the 4-device chunked losses and argmax equal those
    of the one-device model's [B, S, V] logits."""
    tok = data_lib.ByteTokenizer()
    rows = [passkey_batch(tok, 200, 0.5, 12345, 256)]
    source = load_config(os.path.join(run, "config.yaml")).data.source
    _, held = data_lib.build_rows(source, tok, 256, 0.25, 0)
    rows.append({f: v[0] for f, v in next(data_lib.eval_batches(held, 1, 1)).items()})
    batch = {f: np.stack([r[f] for r in rows]) for f in rows[0]}
    mesh1 = make_mesh(seq=1, data=1, devices=jax.devices()[:1])
    ref = load(run, mesh1)
    logits = np.asarray(jax.jit(lambda p, *b: nnx.merge(ref.graphdef, p)(*b))(
        ref.params, batch["tokens"], batch["positions"], batch["segment_ids"]),
        np.float64)  # [B, S, V]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = lse - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    mesh4 = make_mesh(seq=4, data=1, devices=jax.devices()[:4])
    four = load(run, mesh4)
    losses, preds = token_losses(mesh4, four.graphdef, 16)(
        four.params, data_lib.shard_batch(batch, mesh4))
    real = batch["segment_ids"] > 0
    np.testing.assert_allclose(np.asarray(losses)[real], want[real], rtol=1e-5, atol=1e-5)
    top2 = np.sort(logits, -1)[..., -2:]
    clear = real & (top2[..., 1] - top2[..., 0] > 1e-4)  # no near-ties for argmax to break
    assert clear.sum() > 0.9 * real.sum()
    np.testing.assert_array_equal(np.asarray(preds)[clear], logits.argmax(-1)[clear])


def test_cli_writes_json_and_png(run, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main([run, "--seq-len", "256", "--mesh-seq", "4", "--out", out, "--batches", "1",
                 "--lengths", "128", "256", "--depths", "0", "1", "--trials", "1",
                 "--no-progress"]) == 0
    with open(os.path.join(out, "eval.json")) as f:
        result = json.load(f)
    assert result["loss_by_position"]["bounds"][-1] == 256
    assert len(result["loss_by_position"]["loss"]) == 9
    assert result["passkey"]["lengths"] == [128, 256] and result["passkey"]["depths"] == [0, 1]
    assert np.array(result["passkey"]["accuracy"]).shape == (2, 2)
    with open(os.path.join(out, "eval.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "passkey accuracy" in printed and "passkey accuracy by generation" in printed
    assert np.array(result["passkey"]["generated_accuracy"]).shape == (2, 2)


def test_trainer_logs_the_loss_by_position_at_each_eval(run):
    """Each eval record has the buckets, and their token-weighted mean is the eval loss."""
    with open(os.path.join(run, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        lp = r["heldout_loss_by_position"]
        assert lp["bounds"] == [0, 1, 2, 4, 8, 16, 32, 64]
        counts = np.array(lp["tokens"])
        losses = np.array([v if v is not None else 0.0 for v in lp["loss"]])
        assert counts.sum() > 0
        np.testing.assert_allclose((losses * counts).sum() / counts.sum(), r["eval_loss"],
                                   rtol=1e-5)


@pytest.mark.parametrize("args, words", [
    (["{tmp}/nothing"], ["is neither a training run (config.yaml) nor a Hugging Face"]),
    (["{run}", "--seq-len", "256", "--lengths", "20"], ["passkey lengths must be in ["]),
    (["{run}", "--step", "9"], ["step 9 is not a checkpoint", "steps 4"]),
    (["{run}", "--depths", "1.5"], ["depths are fractions in [0, 1], got [1.5]"]),
    (["{run}", "--heldout-fraction", "1.5"], ["held-out fraction must be in [0, 1], got 1.5"]),
    (["{run}", "--heldout-fraction", "1"],
     ["--heldout-fraction 1 holds out every document, but the run trained on its data.source",
      "pass --data"]),
])
def test_bad_input_exits_2_with_a_message(run, tmp_path, capsys, args, words):
    assert main([a.format(tmp=tmp_path, run=run) for a in args] + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for word in words:
        assert word in err, err


def _nan(values):
    """A loss_by_position "loss" list with None (an empty bucket) as nan, to compare."""
    return [np.nan if v is None else v for v in values]


def test_heldout_fraction_one_holds_out_all_of_data(run):
    """--data FILE --heldout-fraction 1: every next-token pair of the file is evaluated (its
    byte count: the run is byte-level), none left for a training part."""
    source = load_config(os.path.join(run, "config.yaml")).data.source
    one = sorted(glob.glob(os.path.join(source, "*.txt")))[0]
    with open(one, encoding="utf-8", errors="replace") as f:
        pairs = len(data_lib.ByteTokenizer().encode(f.read()))
    result = evaluate(run, **dict(GRID, batches=100, batch_size=4, lengths=[256],
                                  depths=[0.5]), data=one, heldout_fraction=1, generate=False)
    lp = result["loss_by_position"]
    assert lp["heldout_fraction"] == 1 and lp["batches"] == -(-(-(-pairs // 256)) // 4)
    assert sum(lp["tokens"]) == pairs > 256


def test_byte_level_export_evaluates_as_its_run(run, tmp_path, capsys):
    """A byte-level run's export has no tokenizer.json: evaluate reads it with the byte
    tokenizer (vocab_size 257) and says so, with the run's numbers; another vocabulary
    without a tokenizer.json is refused."""
    from ulysses_jax.export import export_run
    out = str(tmp_path / "hf")
    assert export_run(run, out, progress=False)["tokenizer_files"] == []
    source = load_config(os.path.join(run, "config.yaml")).data.source
    grid = dict(GRID, mesh_seq=2, batches=1, lengths=[256], depths=[0.5], data=source,
                heldout_fraction=0.25, generate=False)
    ours, exported = evaluate(run, **grid), evaluate(out, **grid)
    assert ours["tokenizer"] == "bytes"
    assert exported["tokenizer"].startswith(f"bytes ({out} has no tokenizer.json and "
                                            f"vocab_size 257")
    assert exported["loss_by_position"]["tokens"] == ours["loss_by_position"]["tokens"]
    assert sum(ours["loss_by_position"]["tokens"]) > 0
    np.testing.assert_allclose(_nan(exported["loss_by_position"]["loss"]),
                               _nan(ours["loss_by_position"]["loss"]), rtol=1e-5)
    np.testing.assert_allclose(exported["passkey"]["answer_loss"],
                               ours["passkey"]["answer_loss"], rtol=1e-5)
    with open(os.path.join(out, "config.json")) as f:
        hf = json.load(f)
    os.makedirs(tmp_path / "other")
    with open(tmp_path / "other" / "config.json", "w") as f:
        json.dump(dict(hf, vocab_size=300), f)
    assert main([str(tmp_path / "other"), "--seq-len", "256", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json" in err and "vocab_size 300 is not the byte tokenizer's 257" \
        in err, err


def test_store_run_uses_the_store_tokenizer_and_its_heldout_rows(chat_store_run):
    """A run from a chat token store with data.tokenizer unset: evaluate reads the store's
    tokenizer (not bytes) and, without --data, the conversations training held out, packed
    as training packs them: the trainer's loss by position at the checkpoint's step again."""
    run, store, tok_dir = chat_store_run
    tok_file = os.path.join(tok_dir, "tokenizer.json")
    store_tok = data_lib.load_tokenizer(tok_dir)
    loaded = load(run, make_mesh(seq=1, data=1, devices=jax.devices()[:1]))
    assert loaded.tokenizer.vocab_size == store_tok.vocab_size > 257
    text = NEEDLE.format(key=12345)
    np.testing.assert_array_equal(loaded.tokenizer.encode(text), store_tok.encode(text))
    assert loaded.tokenizer_file == tok_file
    result = evaluate(run, mesh_seq=2, batches=1, batch_size=2, lengths=[128], depths=[0.5],
                      trials=1, progress=False, generate=False)
    assert result["tokenizer"] == f"{tok_file} (the tokenizer of the store {store})"
    with open(os.path.join(run, "metrics.jsonl")) as f:
        logged = [r for r in map(json.loads, f) if "eval_loss" in r][-1]
    assert logged["step"] == 2
    lp, want = result["loss_by_position"], logged["heldout_loss_by_position"]
    assert lp["source"] == store and lp["heldout_fraction"] == 0.2
    assert lp["bounds"] == want["bounds"] and lp["tokens"] == want["tokens"]
    assert sum(lp["tokens"]) > 0
    np.testing.assert_allclose(_nan(lp["loss"]), _nan(want["loss"]), rtol=1e-5)


def test_a_store_of_another_tokenizer_is_refused_as_data(run, chat_store_run, capsys):
    """--data STORE must have been prepared with the model's tokenizer: a byte-level run
    does not read a BPE chat store's ids as bytes."""
    store, tok_dir = chat_store_run[1:]
    assert main([run, "--data", store, "--seq-len", "256", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (f"error: held-out data {store!r}: the store was prepared with the tokenizer "
            f"{tok_dir} (sha256 ") in err and "but the model's is bytes" in err, err


@pytest.mark.parametrize("change, words", [
    ("edit", ["the run's data.source: the store", "has changed since", "sha256"]),
    ("remove", ["the run's data.source: the store", "which no longer exists"]),
])
def test_store_run_with_a_changed_tokenizer_is_refused(chat_store_run, tmp_path, capsys,
                                                       change, words):
    from ulysses_jax.data.run_data import store_tokenizer
    run, store, tok = relocated_store_run(*chat_store_run, tmp_path)
    tok_file = os.path.join(tok, "tokenizer.json")
    assert store_tokenizer(store) == tok_file  # the copy as it was prepared: accepted
    if change == "edit":
        with open(tok_file, "a") as f:
            f.write("\n")
    else:
        os.remove(tok_file)
    assert main([run, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for word in words:
        assert word in err, err
