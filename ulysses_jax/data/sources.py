"""Streaming readers of raw corpora for ``prepare``: files, directories and globs, read one
record at a time so memory stays bounded whatever the corpus size.

Kinds (by suffix): ``.txt``/``.md`` one document per file; ``.jsonl`` one per non-blank line;
``.parquet`` one per row (read a record batch at a time with pyarrow); a Hugging Face
``datasets`` directory written by ``save_to_disk`` (``state.json`` beside ``*.arrow`` files in
Arrow's IPC stream format) one per row. A record is the text under ``text_key``, or with
``chat=True`` the list of messages under ``messages_key``. Names are ``path``, ``path:line``
(1-based) or ``path:row`` (0-based), stable across runs: the held-out split hashes them.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Iterator, Sequence

FILE_KINDS = (".txt", ".md", ".jsonl", ".parquet")
_BATCH_ROWS = 1024  # rows per parquet/arrow record batch: bounds memory per read


def _is_hf_dataset_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) and bool(
        glob.glob(os.path.join(path, "*.arrow")))


def expand_sources(sources: Sequence[str]) -> list[str]:
    """Files (and HF dataset directories) named by ``sources``, sorted, each once.

    A directory is searched recursively for FILE_KINDS (a ``save_to_disk`` directory is one
    source itself); anything else is a glob pattern. ValueError for a source that matches
    nothing or a file of another kind.
    """
    paths = []
    for item in sources:
        if os.path.isdir(item):
            if _is_hf_dataset_dir(item):
                found = [item]
            else:
                found = [p for ext in FILE_KINDS
                         for p in glob.glob(os.path.join(item, "**", f"*{ext}"), recursive=True)]
                found += [os.path.dirname(p) for p in
                          glob.glob(os.path.join(item, "**", "state.json"), recursive=True)
                          if _is_hf_dataset_dir(os.path.dirname(p))]
        else:
            found = glob.glob(item)
        if not found:
            raise ValueError(f"data source {item!r} matches no file")
        for p in found:
            if not (os.path.isdir(p) or p.endswith(FILE_KINDS)):
                raise ValueError(f"{p}: unsupported file type, expected one of "
                                 f"{', '.join(FILE_KINDS)} or a datasets save_to_disk directory")
        paths.extend(found)
    return sorted(set(paths))


def fingerprint(paths: Sequence[str], extra: dict) -> str:
    """Identifies the inputs without reading them: each file's path, size and mtime (for a
    directory source, those of its .arrow files), and ``extra`` (options, tokenizer hash)."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    for p in paths:
        files = sorted(glob.glob(os.path.join(p, "*.arrow"))) if os.path.isdir(p) else [p]
        for f in files:
            st = os.stat(f)
            h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def _field(record, key: str, where: str, chat: bool):
    if not isinstance(record, dict) or key not in record:
        got = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
        raise ValueError(f'{where}: each record must be an object with a "{key}" field, '
                         f'got {got}')
    value = record[key]
    if chat:
        if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
            raise ValueError(f'{where}: "{key}" must be a list of message objects '
                             f'{{"role": ..., "content": ...}}, got {type(value).__name__}')
    elif not isinstance(value, str):
        raise ValueError(f'{where}: "{key}" must be a string, got {type(value).__name__}')
    return value


def _jsonl(path: str, key: str, chat: bool) -> Iterator[tuple[str, object]]:
    for where, record in _jsonl_records(path):
        yield where, _field(record, key, where, chat)


def _jsonl_records(path: str) -> Iterator[tuple[str, object]]:
    """(path:line, the parsed JSON value) of each non-blank line."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            yield where, record


def _arrow_batches(path: str, key: str | Sequence[str]):
    """(record batches of column ``key``, or of the columns ``key`` lists) of a parquet file
    or a save_to_disk directory."""
    keys = [key] if isinstance(key, str) else list(key)
    try:
        import pyarrow.ipc
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading parquet / arrow needs pyarrow: pip install pyarrow") from e
    if os.path.isdir(path):
        for f in sorted(glob.glob(os.path.join(path, "*.arrow"))):
            with pyarrow.memory_map(f) as mm:  # batches are views of the mapped file
                reader = pyarrow.ipc.open_stream(mm)
                _columns(f, keys, reader.schema.names)
                for batch in reader:
                    column = batch.select(keys)
                    for start in range(0, column.num_rows, _BATCH_ROWS):
                        yield column.slice(start, _BATCH_ROWS)
        return
    # Buffered page reads: a row group (often 100s of MB) is not loaded whole.
    pf = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    _columns(path, keys, pf.schema_arrow.names)
    yield from pf.iter_batches(batch_size=_BATCH_ROWS, columns=keys)


def _columns(path: str, keys: list[str], names: list[str]) -> None:
    missing = [k for k in keys if k not in names]
    if missing:
        named = ", ".join('"' + k + '"' for k in missing)
        raise ValueError(f'{path}: no column {named} '
                         f'(columns {names})')


def _table_rows(path: str, key: str, chat: bool) -> Iterator[tuple[str, object]]:
    row = 0
    for batch in _arrow_batches(path, key):
        for value in batch.column(0).to_pylist():
            where = f"{path}:{row}"
            yield where, _field({key: value}, key, where, chat)
            row += 1


def iter_records(paths: Sequence[str], text_key: str = "text", messages_key: str = "messages",
                 chat: bool = False) -> Iterator[tuple[str, object]]:
    """(name, text) pairs, or with ``chat`` (name, messages) pairs, of ``expand_sources``'
    paths in order; ValueError naming file:line (or file:row) for a bad record."""
    key = messages_key if chat else text_key
    for path in paths:
        if path.endswith((".txt", ".md")):
            if chat:
                raise ValueError(f"{path}: chat data must be .jsonl, .parquet or a datasets "
                                 f'directory with a "{messages_key}" field, not plain text')
            with open(path, encoding="utf-8", errors="replace") as f:
                yield path, f.read()
        elif path.endswith(".jsonl"):
            yield from _jsonl(path, key, chat)
        else:
            yield from _table_rows(path, key, chat)


def iter_rows(paths: Sequence[str]) -> Iterator[tuple[str, dict]]:
    """(name, the whole record: every column) of ``paths`` (.jsonl, .parquet or datasets
    directories), names as ``iter_records``'; ValueError for a record that is not an object."""
    for path in paths:
        if path.endswith((".txt", ".md")):
            raise ValueError(f"{path}: rows need .jsonl, .parquet or a datasets directory, "
                             f"not plain text")
        if path.endswith(".jsonl"):
            records = _jsonl_records(path)
        else:
            records = _all_columns(path)
        for where, record in records:
            if not isinstance(record, dict):
                raise ValueError(f"{where}: each record must be an object, got "
                                 f"{type(record).__name__}")
            yield where, record


def _all_columns(path: str) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq
    if os.path.isdir(path):
        names = _arrow_names(path)
    else:
        names = pq.ParquetFile(path).schema_arrow.names
    row = 0
    for batch in _arrow_batches(path, names):
        for record in batch.to_pylist():
            yield f"{path}:{row}", record
            row += 1


def _arrow_names(path: str) -> list[str]:
    import pyarrow.ipc
    first = sorted(glob.glob(os.path.join(path, "*.arrow")))[0]
    with pyarrow.memory_map(first) as mm:
        return list(pyarrow.ipc.open_stream(mm).schema.names)


PAIR_KEYS = ("prompt", "chosen", "rejected")


def _pair(record, where: str) -> dict:
    """A preference record's three fields, each a string or a list of message objects."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: each record must be an object with the fields "
                         f"{', '.join(PAIR_KEYS)}, got {type(record).__name__}")
    missing = [k for k in PAIR_KEYS if record.get(k) is None]
    if missing:
        raise ValueError(f"{where}: a preference record needs the fields "
                         f"{', '.join(PAIR_KEYS)}; missing {', '.join(missing)} (keys "
                         f"{sorted(record)})")
    for k in PAIR_KEYS:
        v = record[k]
        if not (isinstance(v, str) or (isinstance(v, list)
                                       and all(isinstance(m, dict) for m in v))):
            raise ValueError(f'{where}: "{k}" must be a string or a list of message objects '
                             f'{{"role": ..., "content": ...}}, got {type(v).__name__}')
    return {k: record[k] for k in PAIR_KEYS}


def iter_pairs(paths: Sequence[str], bad: list | None = None) -> Iterator[tuple[str, dict]]:
    """(name, {"prompt", "chosen", "rejected"}) of TRL's preference records in ``paths``
    (.jsonl, .parquet or datasets directories), names as ``iter_records``'.

    Args:
      bad: None: a record that is not JSON, misses a field or holds a value of the wrong type
        is a ValueError naming it; a list: its message is appended there and it is skipped.
    """
    def refused(e: ValueError):
        if bad is None:
            raise ValueError(f"{e}. Fix the record, or pass --drop-bad-pairs to leave out "
                             f"the records that are not pairs (counted)") from None
        bad.append(str(e))

    def checked(record, where):
        try:
            return _pair(record, where)
        except ValueError as e:
            return refused(e)

    for path in paths:
        if path.endswith((".txt", ".md")):
            raise ValueError(f"{path}: preference data must be .jsonl, .parquet or a datasets "
                             f"directory with the fields {', '.join(PAIR_KEYS)}, not plain text")
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    where = f"{path}:{n}"
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        record = ValueError(f"{where}: not UTF-8 text (byte {e.start} of the "
                                            f"line)")
                    except json.JSONDecodeError as e:
                        record = ValueError(f"{where}: not valid JSON ({e.msg} at column "
                                            f"{e.colno})")
                    if isinstance(record, ValueError):
                        refused(record)
                        continue
                    pair = checked(record, where)
                    if pair is not None:
                        yield where, pair
            continue
        row = 0
        for batch in _arrow_batches(path, PAIR_KEYS):
            for record in batch.to_pylist():
                where = f"{path}:{row}"
                pair = checked(record, where)
                if pair is not None:
                    yield where, pair
                row += 1
