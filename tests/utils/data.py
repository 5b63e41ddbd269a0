"""Files the tests train and evaluate on: a small text corpus; a relocated copy of a store run."""
import glob
import json
import os
import shutil


def small_corpus(path, n=16, chars=3000):
    """n text files cut from stdlib modules: a corpus that loads and tokenizes in a moment
    (the whole stdlib takes seconds per tokenizer and sequence length)."""
    os.makedirs(path, exist_ok=True)
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:n]
    for f in files:
        with open(f, encoding="utf-8") as src, open(os.path.join(
                path, os.path.basename(f)[:-3] + ".txt"), "w", encoding="utf-8") as dst:
            dst.write(src.read(chars))
    return str(path)


def relocated_store_run(run, store, tok_dir, dest):
    """A copy under ``dest`` of a store run (``chat_store_run``) whose config.yaml names a
    copy of its store, whose manifest records a copy of the tokenizer directory: tests change
    or remove the copied tokenizer files. The checkpoints are a link to the run's.

    Returns:
      (run copy, store copy, tokenizer directory copy), paths.
    """
    dest = str(dest)
    new_tok, new_store, new_run = (os.path.join(dest, d) for d in ("tok", "store", "run"))
    shutil.copytree(tok_dir, new_tok)
    shutil.copytree(store, new_store)
    with open(os.path.join(new_store, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["tokenizer"]["path"] == os.path.abspath(tok_dir)
    manifest["tokenizer"]["path"] = new_tok
    with open(os.path.join(new_store, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    os.makedirs(new_run)
    os.symlink(os.path.join(run, "checkpoints"), os.path.join(new_run, "checkpoints"))
    with open(os.path.join(run, "config.yaml")) as f:
        text = f.read()
    assert f"source: {store}\n" in text
    with open(os.path.join(new_run, "config.yaml"), "w") as f:
        f.write(text.replace(f"source: {store}\n", f"source: {new_store}\n"))
    return new_run, new_store, new_tok
