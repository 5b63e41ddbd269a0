"""Tests for ulysses_jax.data.text: tokenizers, corpora, split, packing, batches, resume, sharding."""
import collections
import json
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.utils.devices import need_devices
from ulysses_jax.data import text as data
from ulysses_jax.mesh import make_mesh

EOS = 1_000_000  # outside the synthetic token range, so it never collides with a doc token


def unique_docs(rng, lengths):
    """Docs whose tokens are globally unique: a token identifies its (doc, offset)."""
    ids = rng.permutation(sum(lengths)).astype(np.int32)
    cuts = np.cumsum(lengths)[:-1]
    return np.split(ids, cuts)


def fresh_text(rng, n):
    alphabet = list("abc xyz\n\t{}()é漢字🙂") + ["def ", "return "]
    return "".join(rng.choice(alphabet, size=n))


# ---- tokenizers -------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    rng = np.random.default_rng()
    tok = data.load_tokenizer(None)
    assert isinstance(tok, data.ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    text = fresh_text(rng, 500)
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(np.append(ids, tok.eos_id)) == text  # EOS decodes to nothing


def _write_hf_tokenizer(tmp_path, rng, special):
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([fresh_text(rng, 300) for _ in range(50)], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tok


def test_hf_tokenizer(tmp_path):
    rng = np.random.default_rng()
    ref = _write_hf_tokenizer(tmp_path, rng, ["<pad>", "<|endoftext|>"])
    tok = data.load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert isinstance(tok, data.HFTokenizer)
    assert tok.eos_id == ref.token_to_id("<|endoftext|>") == 1
    assert tok.vocab_size == ref.get_vocab_size()
    text = fresh_text(rng, 400)
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids) == text
    batch = tok.encode_batch([text, "abc"])
    np.testing.assert_array_equal(batch[0], ids)
    # An explicit EOS wins over the built-in list.
    assert data.load_tokenizer(str(tmp_path), eos_token="<pad>").eos_id == 0


def test_hf_tokenizer_without_eos_is_an_error(tmp_path):
    _write_hf_tokenizer(tmp_path, np.random.default_rng(), ["<pad>"])
    with pytest.raises(ValueError, match="no EOS token"):
        data.load_tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert data.load_tokenizer(str(tmp_path)).eos_id == 0


def test_hf_tokenizer_missing_package_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        data.HFTokenizer("unused.json")


# ---- corpora and split ------------------------------------------------------------------------

def test_stdlib_corpus_deterministic_and_split():
    docs = data.stdlib_documents()
    names = [n for n, _ in docs]
    assert len(docs) > 200 and sum(len(t) for _, t in docs) > 1_000_000
    assert names == sorted(names) and len(set(names)) == len(names)
    assert not [n for n in names if set(n.split("/")[:-1]) & {"test", "tests", "site-packages"}]
    assert any(n == "json/decoder.py" for n in names)
    data._stdlib.cache_clear()  # really read the files again
    assert data.stdlib_documents() == docs

    tok = data.ByteTokenizer()
    tokens = data.tokenize(docs, tok)
    assert sum(map(len, tokens)) == sum(len(t.encode("utf-8", "replace")) for _, t in docs)

    train, held = data.split_documents(docs, 0.1, seed=3)
    tn, hn = {n for n, _ in train}, {n for n, _ in held}
    assert train and held and not tn & hn and tn | hn == set(names)
    assert 0.05 < len(held) / len(docs) < 0.15
    assert data.split_documents(docs, 0.1, seed=3) == (train, held)
    shuffled = [docs[i] for i in np.random.default_rng().permutation(len(docs))]
    assert {n for n, _ in data.split_documents(shuffled, 0.1, seed=3)[1]} == hn
    assert {n for n, _ in data.split_documents(docs, 0.1, seed=4)[1]} != hn


def test_split_keeps_both_parts_non_empty():
    docs = [("a", "x"), ("b", "y")]
    for frac in (1e-9, 0.999999):
        train, held = data.split_documents(docs, frac, seed=0)
        assert len(train) == len(held) == 1
    assert data.split_documents(docs, 0.0)[1] == []
    with pytest.raises(ValueError, match="heldout_fraction"):
        data.split_documents(docs, 1.0)
    # a lone document stays for training whatever its hash (it was held out when its hash
    # fell under the fraction, and training found "no non-empty document to pack")
    assert data.split_documents(docs[:1], 0.999999) == (docs[:1], [])
    assert data.split_documents(docs[:1], 1e-9) == (docs[:1], [])


def test_local_text_sources(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "b.md").write_text("# beta")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" +
                                      json.dumps({"text": "two", "id": 7}) + "\n")
    (tmp_path / "skip.csv").write_text("x")
    docs = data.load_documents(str(tmp_path))
    assert [t for _, t in docs] == ["alpha", "one", "two", "# beta"]
    assert docs[2][0] == f"{tmp_path}/c.jsonl:3"
    both = data.load_documents(f"{tmp_path}/*.txt, {tmp_path}/sub/b.md")
    assert [t for _, t in both] == ["alpha", "# beta"]
    with pytest.raises(ValueError, match="matches no file"):
        data.load_documents(str(tmp_path / "nothing*.txt"))
    with pytest.raises(ValueError, match="unsupported"):
        data.load_documents(str(tmp_path / "skip.csv"))


# ---- packing ----------------------------------------------------------------------------------

def check_epoch(rows, docs, epoch, seed):
    """Checks one epoch's rows against the original docs; returns the epoch's doc order."""
    S = rows.seq_len
    full = [np.append(d, EOS) for d in docs]
    where = {int(t): (i, o) for i, d in enumerate(docs) for o, t in enumerate(d)}
    n_tokens = sum(len(f) for f in full if len(f) > 1)  # empty docs are dropped
    assert rows.num_rows == -(-(n_tokens - 1) // S)
    seen = collections.Counter()
    order, prev = [], EOS  # prev: the stream token before the current one
    for r in range(rows.num_rows):
        row = rows.row(r, epoch, seed)
        tok, tgt, mask, seg, pos = (row[f] for f in data.FIELDS)
        assert all(row[f].shape == (S,) for f in data.FIELDS)
        assert mask.dtype == np.float32 and tok.dtype == tgt.dtype == np.int32
        real = seg > 0
        n = int(real.sum())
        assert real[:n].all() and not real[n:].any()  # padding only at the tail...
        assert n == S or r == rows.num_rows - 1  # ...of the epoch's last row
        assert not mask[n:].any() and not pos[n:].any() and not tok[n:].any()
        assert seg[0] == 1 and pos[0] == 0
        for t in range(n):
            if t > 0:
                new = seg[t] != seg[t - 1]
                assert seg[t] - seg[t - 1] == int(new)
                assert pos[t] == (0 if new else pos[t - 1] + 1)
                # A piece ends inside a row only at its document's EOS; otherwise the next
                # token is the document's next token.
                assert new == (tok[t - 1] == EOS)
                if not new and tok[t] != EOS:
                    d, o = where[int(tok[t - 1])]
                    assert where[int(tok[t])] == (d, o + 1)
            if prev == EOS:  # a document starts here
                order.append(where[int(tok[t])][0])
            prev = tok[t]
            if mask[t] == 1:
                d, o = where[int(tok[t])]
                assert tgt[t] == full[d][o + 1]  # the true next token, EOS included
                seen[(d, o)] += 1
            else:
                assert tok[t] == EOS  # the only real token without a same-doc target
    # Every next-token pair of every document exactly once; empty docs have none.
    expected = {(d, o) for d, doc in enumerate(docs) for o in range(len(doc))}
    assert set(seen) == expected and set(seen.values()) == {1}
    assert sorted(order) == [d for d, doc in enumerate(docs) if len(doc)]
    return order


@pytest.mark.parametrize("seq_len", [1, 8, 13])
def test_packing_invariants(seq_len):
    rng = np.random.default_rng()
    lengths = list(rng.integers(1, 3 * seq_len + 2, size=20)) + [0, 1, seq_len, seq_len - 1]
    lengths = [int(x) for x in rng.permutation(lengths)]
    docs = unique_docs(rng, lengths)
    rows = data.PackedRows(docs, seq_len, EOS)
    seed = int(rng.integers(1 << 30))
    orders = [check_epoch(rows, docs, e, seed) for e in (0, 1)]
    assert orders[0] != orders[1]  # reshuffled per epoch
    fixed = data.PackedRows(docs, seq_len, EOS, shuffle=False)
    nonempty = [d for d, x in enumerate(lengths) if x]
    assert check_epoch(fixed, docs, 0, seed) == check_epoch(fixed, docs, 5, 1) == nonempty


def test_eval_batches_cover_heldout_once():
    rng = np.random.default_rng()
    docs = unique_docs(rng, [int(x) for x in rng.integers(1, 30, size=9)])
    rows = data.PackedRows(docs, 8, EOS, shuffle=False)
    batches = list(data.eval_batches(rows, 4))
    assert len(batches) == -(-rows.num_rows // 4)
    assert all(b[f].shape == (4, 8) for b in batches for f in data.FIELDS)
    got = np.concatenate([b["targets"][b["loss_mask"] == 1] for b in batches])
    assert sorted(got.tolist()) == sorted(np.concatenate([np.append(d[1:], EOS) for d in docs])
                                          .tolist())
    pad = rows.num_rows % 4
    if pad:
        assert not batches[-1]["segment_ids"][pad:].any()
    assert len(list(data.eval_batches(rows, 4, max_batches=1))) == 1


# ---- batches: determinism, resume -------------------------------------------------------------

def small_rows(rng, seq_len=8):
    docs = unique_docs(rng, [int(x) for x in rng.integers(1, 20, size=12)])
    return data.PackedRows(docs, seq_len, EOS)


def take(it, k):
    return [next(it) for _ in range(k)]


def assert_batches_equal(xs, ys):
    assert len(xs) == len(ys) > 0
    for x, y in zip(xs, ys):
        for f in data.FIELDS:
            np.testing.assert_array_equal(x[f], y[f])


def test_same_seed_same_batches_other_seed_other_order():
    rng = np.random.default_rng()
    rows = small_rows(rng)
    a = take(data.BatchIterator(rows, 4, seed=1), 6)
    assert all(b[f].shape == (4, 8) for b in a for f in data.FIELDS)
    assert_batches_equal(a, take(data.BatchIterator(rows, 4, seed=1), 6))
    b = take(data.BatchIterator(rows, 4, seed=2), 6)
    assert any(not np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))


@pytest.mark.parametrize("k", [0, 2, 3])
def test_resume_mid_epoch_and_across_epoch_boundary(k):
    rng = np.random.default_rng()
    rows = small_rows(rng)
    it = data.BatchIterator(rows, 3, seed=7)
    take(it, k)
    state = json.loads(json.dumps(it.get_state()))
    epoch_before = it.epoch
    n = rows.num_rows // 3 + 2  # enough batches to reach the next epoch
    expected = take(it, n)
    assert it.epoch > epoch_before  # the compared batches do cross an epoch boundary
    resumed = data.BatchIterator(rows, 3, seed=7)
    resumed.set_state(state)
    assert_batches_equal(take(resumed, n), expected)
    with pytest.raises(ValueError, match="seed"):
        data.BatchIterator(rows, 3, seed=8).set_state(state)
    other = data.PackedRows(rows.docs[1:], 8, EOS)
    with pytest.raises(ValueError, match="fingerprint"):
        data.BatchIterator(other, 3, seed=7).set_state(state)


def test_build_rows_from_local_files(tmp_path):
    rng = np.random.default_rng()
    texts = [fresh_text(rng, int(n)) for n in rng.integers(5, 80, size=30)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train, held = data.build_rows(str(tmp_path), data.ByteTokenizer(), 16, 0.2, seed=0)
    assert train.shuffle and not held.shuffle
    n_bytes = sum(len(t.encode()) + 1 for t in texts)
    assert train.num_tokens + held.num_tokens == n_bytes


# ---- sharded global batches -------------------------------------------------------------------

def test_shard_batch_matches_numpy_and_materialises_per_block():
    mesh = make_mesh(seq=4, data=2, devices=need_devices(8))
    rng = np.random.default_rng()
    rows = small_rows(rng, seq_len=16)
    it, twin = data.BatchIterator(rows, 4, seed=3), data.BatchIterator(rows, 4, seed=3)
    for _ in range(3):
        want = next(twin)
        calls = []
        fn = it.rows_fn()
        got = data.shard_batch(lambda a, b: calls.append((a, b)) or fn(a, b), mesh, (4, 16))
        it.next_row += 4
        assert sorted(calls) == [(0, 2), (2, 4)]  # one block per data shard, not per device
        for f in data.FIELDS:
            x = got[f]
            assert x.shape == (4, 16) and x.dtype == want[f].dtype
            assert x.sharding.spec == P("data", "seq")
            np.testing.assert_array_equal(np.asarray(x), want[f])
            for s in x.addressable_shards:
                assert s.data.shape == (2, 4)
                np.testing.assert_array_equal(np.asarray(s.data), want[f][s.index])
    from_numpy = data.shard_batch(want, mesh)
    np.testing.assert_array_equal(np.asarray(from_numpy["targets"]), want["targets"])
    glob = data.BatchIterator(rows, 4, seed=3).next_global(mesh)
    first = next(data.BatchIterator(rows, 4, seed=3))
    np.testing.assert_array_equal(np.asarray(glob["segment_ids"]), first["segment_ids"])
    with pytest.raises(ValueError, match="length 10 is not divisible by the seq axis size 4"):
        data.shard_batch(fn, mesh, (4, 10))
    with pytest.raises(ValueError, match="batch size 3 is not divisible by the data axis size 2"):
        data.shard_batch(fn, mesh, (3, 16))


def test_segments_per_row_counts_the_ids_of_each_row():
    """From the layout alone, the number of distinct segment ids each built row holds."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 200, int(n)).astype(np.int32) for n in rng.integers(1, 90, 60)]
    rows = data.PackedRows(docs, seq_len=64, eos_id=256)
    checked = 0
    for epoch in (0, 1):
        counts = rows.segments_per_row(epoch, seed=5)
        assert counts.shape == (rows.num_rows,)
        for r in range(rows.num_rows):
            assert counts[r] == len(np.unique(rows.row(r, epoch, seed=5)["segment_ids"])), r
            checked += 1
    assert checked == 2 * rows.num_rows
