"""Token store: prepare (sources, parallel, atomic, nothing to do), memory-mapped packing plans
(the text rule equals data.PackedRows; chat rows keep each conversation whole), the held-out
split, and ``python -m ulysses_jax.data show``."""
import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.test_data import EOS, check_epoch, fresh_text, unique_docs
from ulysses_jax.data.__main__ import main as data_cli
from ulysses_jax.data import packing, prepare as prepare_lib, text as data
from ulysses_jax.data.store import StoreWriter, TokenStore, name_hash, token_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(tmp_path, rng):
    """.txt, .md, .jsonl and .parquet sources; returns the texts in prepare's order."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    texts = {}
    texts["a.txt"] = [fresh_text(rng, 300)]
    texts["sub/b.md"] = [fresh_text(rng, 50)]
    jl = [fresh_text(rng, int(n)) for n in rng.integers(1, 200, 40)]
    jl[5] = ""  # an empty document: dropped
    (src / "c.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                         for i, t in enumerate(jl)))
    texts["c.jsonl"] = jl
    pt = [fresh_text(rng, int(n)) for n in rng.integers(1, 200, 2500)]  # > one record batch
    pq.write_table(pa.table({"text": pt, "n": list(range(len(pt)))}), src / "d.parquet",
                   row_group_size=700)
    texts["d.parquet"] = pt
    (src / "a.txt").write_text(texts["a.txt"][0])
    (src / "sub" / "b.md").write_text(texts["sub/b.md"][0])
    order = sorted(texts, key=lambda k: str(src / k))
    return str(src), [t for k in order for t in texts[k]]


def test_prepare_text_store(tmp_path):
    rng = np.random.default_rng()
    src, texts = write_corpus(tmp_path, rng)
    out = tmp_path / "store"
    manifest, built = prepare_lib.prepare([src], str(out), workers=2, progress=False,
                                          shard_tokens=5000)
    assert built and manifest["dtype"] == "uint16" and manifest["kind"] == "text"
    kept = [t for t in texts if t]  # an empty document holds no next-token pair
    tok = data.ByteTokenizer()
    assert manifest["num_docs"] == len(kept) and len(kept) < len(texts)
    assert manifest["num_tokens"] == sum(len(t.encode()) + 1 for t in kept)
    assert len(manifest["shards"]) > 5  # documents spread over several shard files
    store = TokenStore(str(out))
    checked = 0
    for d, text in enumerate(kept):
        np.testing.assert_array_equal(store.doc(d), np.append(tok.encode(text), tok.eos_id))
        checked += 1
    assert checked == len(kept)
    # Same inputs: nothing to do. One worker writes the same bytes as two.
    assert prepare_lib.prepare([src], str(out), workers=2, progress=False)[1] is False
    one, _ = prepare_lib.prepare([src], str(tmp_path / "one"), workers=1, progress=False,
                                 shard_tokens=5000)
    for shard in manifest["shards"]:
        assert (out / shard["tokens"]).read_bytes() == (tmp_path / "one" / shard["tokens"]) \
            .read_bytes()
    assert (out / "doc_hash.bin").read_bytes() == (tmp_path / "one" / "doc_hash.bin").read_bytes()
    # Changed inputs: refused without --force, rebuilt with it.
    with open(os.path.join(src, "a.txt"), "a") as f:
        f.write("more")
    with pytest.raises(ValueError, match="--force"):
        prepare_lib.prepare([src], str(out), progress=False)
    manifest2, built = prepare_lib.prepare([src], str(out), force=True, progress=False)
    assert built and manifest2["num_tokens"] == manifest["num_tokens"] + 4
    assert not list(tmp_path.glob("store.*-*"))  # no temporary or old directory left


def test_killed_prepare_leaves_no_store(tmp_path, monkeypatch):
    src = tmp_path / "a.txt"
    src.write_text("hello world")

    def killed(self, manifest):
        raise KeyboardInterrupt

    monkeypatch.setattr(StoreWriter, "finish", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_lib.prepare([str(src)], str(tmp_path / "store"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    leftover = tmp_path / "store.tmp-999999999"  # a dead process's half store
    leftover.mkdir()
    # A --force run killed between its two renames: the replaced store, now unreferenced.
    (tmp_path / "store.old-999999998").mkdir()
    monkeypatch.undo()
    prepare_lib.prepare([str(src)], str(tmp_path / "store"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "store"]


def test_bad_sources(tmp_path):
    (tmp_path / "x.csv").write_text("a")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no"}\n')
    with pytest.raises(ValueError, match="matches no file"):
        prepare_lib.prepare([str(tmp_path / "none*.txt")], str(tmp_path / "s"), progress=False)
    with pytest.raises(ValueError, match="unsupported file type"):
        prepare_lib.prepare([str(tmp_path / "x.csv")], str(tmp_path / "s"), progress=False)
    with pytest.raises(ValueError, match=r'bad.jsonl:2: each record must be an object with a '
                                         r'"text" field'):
        prepare_lib.prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "s"), progress=False)
    assert not (tmp_path / "s").exists()
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def write_store(path, docs, eos_id=EOS, weights=None, names=None):
    """A store of the given token arrays, written directly (not through prepare)."""
    w = StoreWriter(str(path), token_dtype(eos_id + 1), chat=weights is not None,
                    shard_tokens=50)
    for i, d in enumerate(docs):
        w.add(d, name_hash(names[i] if names else f"doc{i}"),
              None if weights is None else weights[i])
    w.finish({"fingerprint": "test", "vocab_size": eos_id + 1, "eos_id": eos_id,
              "tokenizer": {"path": None, "sha256": "none"}})
    return TokenStore(str(path))


@pytest.mark.parametrize("seq_len", [1, 13])
def test_store_rows_are_the_packing_rule(tmp_path, seq_len):
    """StoreRows over a store equals PackedRows over the same documents, row for row, and
    passes test_data's invariant check (every token once per epoch, positions restart per
    document, no target crosses a document, padding unsupervised)."""
    rng = np.random.default_rng()
    lengths = [int(x) for x in rng.integers(1, 3 * seq_len + 2, size=20)]
    docs = unique_docs(rng, lengths)
    store = write_store(tmp_path / "s", [np.append(d, EOS) for d in docs])
    rows = packing.StoreRows(store, np.arange(len(docs)), seq_len)
    ref = data.PackedRows(docs, seq_len, EOS)
    seed = int(rng.integers(1 << 30))
    assert rows.num_rows == ref.num_rows
    for epoch in (0, 1):
        check_epoch(rows, docs, epoch, seed)
        for r in range(rows.num_rows):
            want, got = ref.row(r, epoch, seed), rows.row(r, epoch, seed)
            for f in data.FIELDS:
                np.testing.assert_array_equal(got[f], want[f])
        np.testing.assert_array_equal(rows.segments_per_row(epoch, seed),
                                      ref.segments_per_row(epoch, seed))


def chat_store(tmp_path, rng, n=40, seq_len=32):
    lengths = [int(x) for x in rng.integers(2, seq_len + 12, size=n)]
    docs = unique_docs(rng, lengths)
    weights = [(rng.random(len(d)) < 0.5).astype(np.uint8) for d in docs]
    return write_store(tmp_path / "chat", docs, weights=weights), docs, weights


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_chat_rows_keep_conversations_whole(tmp_path, overflow):
    rng = np.random.default_rng()
    S = 32
    store, docs, weights = chat_store(tmp_path, rng, seq_len=S)
    rows = packing.ChatRows(store, np.arange(len(docs)), S, seed=3, overflow=overflow)
    long = [i for i, d in enumerate(docs) if len(d) > S]
    assert long and rows.num_long == len(long)
    where = {int(t): (i, o) for i, d in enumerate(docs) for o, t in enumerate(d)}
    firsts = []
    for epoch in (0, 1):
        seen = collections.Counter()
        for r in range(rows.num_rows):
            row = rows.row(r, epoch, seed=7)
            tok, tgt, mask, seg, pos = (row[f] for f in data.FIELDS)
            n = int((seg > 0).sum())
            assert (seg[:n] > 0).all() and not seg[n:].any() and not mask[n:].any()
            for s in range(1, int(seg.max()) + 1):
                idx = np.flatnonzero(seg == s)
                d, o = where[int(tok[idx[0]])]
                assert o == 0 and idx[-1] - idx[0] == len(idx) - 1  # whole, contiguous
                L = min(len(docs[d]), S)
                assert len(idx) == L and seen[d] == 0
                seen[d] += 1
                np.testing.assert_array_equal(tok[idx], docs[d][:L])
                np.testing.assert_array_equal(pos[idx], np.arange(L))
                # Target t is token t+1 of the same conversation where it is an answer token.
                np.testing.assert_array_equal(mask[idx[:-1]], weights[d][1:L])
                assert mask[idx[-1]] == 0  # no target crosses into the next conversation
                sup = mask[idx] > 0
                np.testing.assert_array_equal(tgt[idx][sup], docs[d][1:L][sup[:-1]])
            if epoch == 0 and r < 3:
                firsts.append(int(tok[0]))
        expected = set(range(len(docs))) - (set(long) if overflow == "drop" else set())
        assert set(seen) == expected  # every conversation exactly once per epoch
    # Any-fit packing: a row is opened only for a conversation no open row holds, so no two
    # rows could be merged into one (their fills sum past S).
    fills = np.sort(rows.row_fill)
    assert rows.num_rows >= 2 and fills[0] + fills[1] > S
    order1 = [int(rows.row(r, 1, seed=7)["tokens"][0]) for r in range(3)]
    assert order1 != firsts  # rows are visited in another order each epoch
    counts = rows.segments_per_row(1, seed=7)
    assert counts.tolist() == [len(np.unique(rows.row(r, 1, seed=7)["segment_ids"]))
                               for r in range(rows.num_rows)]


def test_split_store_is_stable_and_non_empty(tmp_path):
    rng = np.random.default_rng()
    docs = unique_docs(rng, [3] * 200)
    store = write_store(tmp_path / "s", docs, names=[f"f.jsonl:{i}" for i in range(200)])
    train, held = packing.split_store(store, 0.1, seed=1)
    assert len(train) + len(held) == 200 and not set(train) & set(held)
    assert 5 < len(held) < 40
    np.testing.assert_array_equal(packing.split_store(store, 0.1, seed=1)[1], held)
    assert set(packing.split_store(store, 0.1, seed=2)[1]) != set(held)
    small = write_store(tmp_path / "t", docs[:2])
    assert [len(x) for x in packing.split_store(small, 1e-9, seed=0)] == [1, 1]


def test_show_cli(tmp_path, capsys):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n"
                           for t in ("first doc", "the second", "x" * 40)))
    out = tmp_path / "store"
    assert data_cli(["prepare", str(src), "--out", str(out), "--workers", "1",
                     "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert data_cli(["prepare", str(src), "--out", str(out), "--no-progress"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    rows, _, _ = packing.store_rows(str(out), 16, 0.0, 0)
    assert data_cli(["show", str(out), "--seq-len", "16", "--row", "1", "--json",
                     "--heldout-fraction", "0"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = rows.row(1, 0, 0)
    assert sorted(got) == sorted(data.FIELDS)
    for f in data.FIELDS:
        assert got[f] == want[f].tolist()
    assert data_cli(["show", str(out), "--seq-len", "16", "--row", "0",
                     "--heldout-fraction", "0"]) == 0
    text = capsys.readouterr().out
    assert "segment 1" in text and "\u27e6" in text
    r = subprocess.run([sys.executable, "-m", "ulysses_jax.data", "show", str(out),
                        "--seq-len", "16", "--row", str(rows.num_rows),
                        "--heldout-fraction", "0"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"past the last row: the store packs into {rows.num_rows} rows" in r.stderr


def test_chat_best_fit_picks_the_tightest_row(tmp_path):
    """Lengths 5, 7, 3, 5 into rows of 10, in this order: best fit puts 3 beside 7 (room 3,
    not the first row's 5), so the last 5 still fits beside the first: 2 rows (first fit: 3)."""
    docs = unique_docs(np.random.default_rng(), [5, 7, 3, 5])
    store = write_store(tmp_path / "s", docs, weights=[np.ones(len(d), np.uint8) for d in docs])
    rows = packing.ChatRows(store, np.arange(4), 10, shuffle=False)
    assert rows.num_rows == 2
    got = [sorted(rows.row_docs[rows.row_start[r]:rows.row_start[r + 1]].tolist())
           for r in range(2)]
    assert got == [[0, 3], [1, 2]]


def test_prepare_cli_errors_exit_2(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x")
    cases = [(["prepare", str(tmp_path / "none*.jsonl"), "--out", str(tmp_path / "s")],
              "matches no file"),
             (["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "s"), "--chat"],
              "--chat needs --tokenizer"),
             (["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "s"),
               "--workers", "0"], "--workers must be at least 1, got 0"),
             (["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "a.txt")],
              "already exists and holds something else"),
             (["show", str(tmp_path), "--seq-len", "8", "--row", "0"], "is not a token store")]
    for argv, message in cases:
        assert data_cli(argv + (["--no-progress"] if argv[0] == "prepare" else [])) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "s").exists()


def test_position_is_a_row_index_checked_against_the_store(tmp_path):
    """The saved position is a global row index; the same store (reopened) accepts it, a
    store with other content refuses it, naming the fingerprint."""
    rng = np.random.default_rng()
    docs = unique_docs(rng, [int(x) for x in rng.integers(1, 30, 30)])
    write_store(tmp_path / "a", [np.append(d, EOS) for d in docs])
    write_store(tmp_path / "b", [np.append(d, EOS) for d in docs[1:]])
    it = data.BatchIterator(packing.StoreRows(TokenStore(str(tmp_path / "a")),
                                              np.arange(len(docs)), 8), 4, seed=3)
    first = [next(it) for _ in range(2)]
    state = json.loads(json.dumps(it.get_state()))
    assert state["next_row"] == 8
    again = data.BatchIterator(packing.StoreRows(TokenStore(str(tmp_path / "a")),
                                                 np.arange(len(docs)), 8), 4, seed=3)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["tokens"], next(it)["tokens"])
    assert not np.array_equal(first[0]["tokens"], first[1]["tokens"])
    other = data.BatchIterator(packing.StoreRows(TokenStore(str(tmp_path / "b")),
                                                 np.arange(len(docs) - 1), 8), 4, seed=3)
    with pytest.raises(ValueError, match="fingerprint"):
        other.set_state(state)


def test_prepare_killed_by_sigkill(tmp_path):
    """kill -9 while prepare runs: no store at --out; the next prepare removes the dead
    process's temporary directory and builds the store."""
    import signal
    import time
    rng = np.random.default_rng()
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": fresh_text(rng, 50)}) + "\n"
                           for _ in range(20000)))
    out = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "ulysses_jax.data", "prepare", str(src),
                             "--out", str(out), "--workers", "2", "--no-progress"], cwd=ROOT,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not list(tmp_path.glob("store.tmp-*")) and time.time() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the process group this test started
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
    assert not out.exists() and [p.name for p in tmp_path.glob("store.tmp-*")] == \
        [f"store.tmp-{proc.pid}"]
    manifest, built = prepare_lib.prepare([str(src)], str(out), progress=False)
    assert built and manifest["num_docs"] == 20000
    assert not list(tmp_path.glob("store.tmp-*"))


def test_chat_heldout_all_dropped_leaves_training(tmp_path):
    """data.chat_overflow=drop removing every held-out conversation leaves no held-out rows
    (noted), not a refusal of the whole store: training still has conversations that fit."""
    docs = unique_docs(np.random.default_rng(), [5, 6, 7, 40, 5, 6])
    names = [f"c.jsonl:{i}" for i in range(len(docs))]
    store = write_store(tmp_path / "s", docs, weights=[np.ones(len(d), np.uint8) for d in docs],
                        names=names)
    seed = next(s for s in range(1000)  # a seed that holds out exactly the long conversation
                if packing.split_store(store, 0.1, s)[1].tolist() == [3])
    train, held, notes = packing.store_rows(str(tmp_path / "s"), 16, 0.1, seed, "drop")
    assert held is None and sorted(train.ids.tolist()) == [0, 1, 2, 4, 5]
    assert "no held-out rows" in " ".join(notes)
    with pytest.raises(ValueError, match=r"no conversation fits in seq_len 4 \(all 5"):
        packing.store_rows(str(tmp_path / "s"), 4, 0.1, seed, "drop")


def test_show_bad_seq_len_and_row_exit_2(tmp_path, capsys):
    """show --seq-len 0 (text and chat stores) and a negative --row: exit 2, one line."""
    docs = unique_docs(np.random.default_rng(), [5, 6, 7])
    write_store(tmp_path / "t", [np.append(d, EOS) for d in docs])
    write_store(tmp_path / "c", docs, weights=[np.ones(len(d), np.uint8) for d in docs])
    cases = [(["t", "--seq-len", "0", "--row", "0"], "seq_len must be positive, got 0"),
             (["c", "--seq-len", "0", "--row", "0"], "seq_len must be positive, got 0"),
             (["c", "--seq-len", "8", "--row", "-1"], "row -1 is negative: rows are 0 to")]
    checked = 0
    for (name, *rest), message in cases:
        assert data_cli(["show", str(tmp_path / name), *rest, "--heldout-fraction", "0"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
        checked += 1
    assert checked == 3


def test_force_replaces_only_a_store(tmp_path):
    """--force replaces a token store, never a directory or file that is not one (a typo in
    --out must not delete a corpus)."""
    (tmp_path / "a.txt").write_text("hello world")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "keep.txt").write_text("precious")
    for out in (corpus, tmp_path / "a.txt"):
        with pytest.raises(ValueError, match="not a token store.*even with --force"):
            prepare_lib.prepare([str(tmp_path / "a.txt")], str(out), force=True,
                                progress=False)
    assert (corpus / "keep.txt").read_text() == "precious"
    assert (tmp_path / "a.txt").read_text() == "hello world"
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob("*.old-*"))


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_damaged_shard_is_refused_at_open(tmp_path, capsys, damage):
    """A shard file shorter than the manifest says (or missing) is refused when the store is
    opened, naming the file and the sizes: not an error in the middle of training."""
    docs = unique_docs(np.random.default_rng(), [30] * 6)
    write_store(tmp_path / "s", docs, weights=[np.ones(len(d), np.uint8) for d in docs])
    shard = tmp_path / "s" / "weights-00001.bin"
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(7)
    else:
        shard.unlink()
    with pytest.raises(ValueError, match=r"weights-00001.bin .*manifest.json says .*damaged"):
        TokenStore(str(tmp_path / "s"))
    assert data_cli(["show", str(tmp_path / "s"), "--seq-len", "64", "--row", "0"]) == 2
    err = capsys.readouterr().err
    assert "weights-00001.bin" in err and len(err.splitlines()) == 1, err
