"""The files a run keeps beside its checkpoints: a lock, metrics.jsonl and config.yaml.

    WORKDIR/train.lock      pid and host of the run that uses WORKDIR. Held with flock(2), so
                            the kernel releases it when that process ends, even by kill -9; the
                            file itself stays, and only a held lock counts.
    WORKDIR/metrics.jsonl   one JSON object per logged step, each step exactly once
    WORKDIR/config.yaml     the resolved config of the run whose checkpoints are there

Exactly once: the record of a step is appended (one write of a whole line) before the
checkpoint of that step is started, so every step a checkpoint holds has its record. A run that
starts from step k (its checkpoint's, or 0) first cuts the file back to the records of steps
<= k, because the steps after k will run, and be logged, again. The cut also drops an unfinished
last line (a run stopped mid-write), and rewrites the file atomically (temporary file, then
rename), so a kill during it loses nothing.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket

from ..config import ConfigError

LOCK, METRICS, CONFIG = "train.lock", "metrics.jsonl", "config.yaml"


class RunError(RuntimeError):
    """A fault outside the config: the workdir is in use, a write failed (disk full, ...).

    The message is one paragraph saying what happened, what was kept and what to do."""


def make_workdir(path: str) -> str:
    """Creates ``path`` (and its parents) if missing and returns it absolute.

    Raises:
      ConfigError: ``path`` is a file, or cannot be created (the message names --workdir).
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--workdir {path}: is a file, not a directory; pass a directory "
                          f"(it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--workdir {path}: cannot be created ({e.strerror}"
                          f"{f': {e.filename}' if e.filename else ''})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--workdir {path}: is not writable by this user")
    return path


class WorkdirLock:
    """An exclusive, non-blocking lock on ``WORKDIR/train.lock`` holding our pid and host."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK)
        self._file = None

    def acquire(self) -> None:
        """Takes the lock.

        Raises:
          RunError: another process holds it (the message names its pid), or the file cannot
            be written.
        """
        try:
            f = open(self.path, "a+")
        except OSError as e:
            raise RunError(f"cannot create the lock file {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = " on ".join(f.read().split()[:2]) or "unknown"
            f.close()
            raise RunError(
                f"--workdir {os.path.dirname(self.path)} is in use by another run (process "
                f"{holder}, lock file {self.path}); two runs in one workdir would mix their "
                f"checkpoints and metrics. Wait for that run to end or stop it, or pass "
                f"another --workdir") from None
        except OSError as e:  # e.g. ENOLCK: a network file system without flock
            f.close()
            raise RunError(f"cannot lock {self.path}: {e.strerror}; put --workdir on a file "
                           f"system that supports flock") from None
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()} {socket.gethostname()}\n")
            f.flush()
        except OSError as e:
            f.close()
            raise RunError(f"cannot write the lock file {self.path}: {e.strerror}") from None
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the last descriptor releases the flock
            self._file = None


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl; an unfinished last line (a run stopped mid-write) is
    left out.

    Raises:
      ValueError: a finished line that is not a JSON object with an integer "step"; the
        message names ``path:line``.
    """
    with open(path, "rb") as f:
        return [record for _, record in _parse(f.read(), path)[0]]


def _parse(data: bytes, path: str) -> tuple[list[tuple[bytes, dict]], bool]:
    """(line, record) pairs of the finished lines, and whether an unfinished one followed."""
    lines = data.split(b"\n")
    unfinished = lines.pop() != b""  # text after the last newline
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}:{n}: not a JSON record ({e}); fix or delete that "
                             f"line") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f'{path}:{n}: a record must be a JSON object with an integer '
                             f'"step"; fix or delete that line')
        out.append((line + b"\n", record))
    return out, unfinished


class MetricsLog:
    """Appends records to ``WORKDIR/metrics.jsonl``; ``enabled=False`` (processes other than
    0 of a multi-process run) makes every method a no-op."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.path = os.path.join(workdir, METRICS)
        self.enabled = enabled

    def restart_at(self, step: int) -> bool:
        """Keeps only the records of steps <= ``step``, where this run starts.

        Returns:
          True if an unfinished last line was dropped.

        Raises:
          RunError: a damaged line other than the last, or the file cannot be rewritten.
        """
        if not self.enabled or not os.path.exists(self.path):
            return False
        with open(self.path, "rb") as f:
            data = f.read()
        try:
            lines, unfinished = _parse(data, self.path)
        except ValueError as e:
            raise RunError(str(e)) from None
        kept = b"".join(line for line, record in lines if record["step"] <= step)
        if kept != data:
            try:
                _atomic_write(self.path, kept)
            except OSError as e:
                raise RunError(f"cannot rewrite {self.path}: {e.strerror}") from None
        return unfinished

    def append(self, record: dict) -> None:
        if not self.enabled:
            return
        line = (json.dumps(record) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write: a kill leaves a whole line or a prefix of one
            finally:
                os.close(fd)
        except OSError as e:
            raise RunError(f"cannot append to {self.path}: {e.strerror}. The checkpoints are "
                           f"intact: free space (or fix the file system) and run again to "
                           f"resume") from None


def write_config(workdir: str, text: str) -> None:
    """Writes ``WORKDIR/config.yaml`` atomically."""
    path = os.path.join(workdir, CONFIG)
    try:
        _atomic_write(path, text.encode())
    except OSError as e:
        raise RunError(f"cannot write {path}: {e.strerror}") from None


def _atomic_write(path: str, data: bytes) -> None:
    """Replaces ``path`` by ``data`` so that a reader (or a crash) sees the old or the new
    file, never a part of one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
