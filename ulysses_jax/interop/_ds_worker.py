"""DeepSpeed's ``DistributedAttention`` on CPU, one process per rank, for ``ulysses_jax.compare``.

Two halves. The rank side (``main``) runs as a script, ``python path/to/_ds_worker.py``, never
as ``-m ulysses_jax._ds_worker``: the package imports JAX, and the torch ranks stay free of it.
The launcher side (``DeepSpeedWorkers``, imported by compare.py; stdlib and numpy only) starts
one such process per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set.
Each joins a gloo process group through ``deepspeed.init_distributed`` once and then serves
jobs, one JSON line each on stdin, answering one JSON line each on the original stdout (library
output goes to stderr, which the launcher keeps in a log file).

A job names an .npz of full [B, S, heads, H] float32 arrays (q, k, v, do) and a Ulysses degree
p <= WORLD_SIZE; ranks 0..p-1 form the sequence-parallel group, hold tokens
[r*S/p, (r+1)*S/p) and write their shards of out, dq, dk, dv to ``{out_dir}/rank{r}.npz``.
Every rank reads every job, because torch needs all ranks to enter ``new_group``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import numpy as np

TENSORS = ("out", "dq", "dk", "dv")


def _send(channel, obj) -> None:
    channel.write(json.dumps(obj) + "\n")
    channel.flush()


def _local_attention(causal: bool):
    """DeepSpeed's ``local_attention``: plain torch SDPA on [B, S, heads, H] tensors."""
    import torch
    import torch.nn.functional as F

    class SdpaAttention(torch.nn.Module):
        def forward(self, q, k, v):
            # q: [B, S, N/p, H]; k, v: [B, S, K/p, H] (after DeepSpeed's all-to-all)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),    # [B, heads, S, H]
                is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
            return out.transpose(1, 2)                                      # [B, S, N/p, H]

    return SdpaAttention()


class _SequenceParallelMpu:
    """The sequence-parallel part of the ``mpu`` that ``deepspeed.initialize(mpu=...)`` installs.

    DeepSpeed's all-to-all for kv heads not divisible by P (``uneven_heads_all2all``) takes the
    caller's rank from ``deepspeed.utils.groups.mpu`` rather than from the group it is given;
    without the training engine nobody sets it, every rank reads 0 and gloo aborts.
    """

    def __init__(self, group):
        import deepspeed.comm as dist
        self._group, self._dist = group, dist

    def get_sequence_parallel_group(self):
        return self._group

    def get_sequence_parallel_world_size(self):
        return self._dist.get_world_size(group=self._group)

    def get_sequence_parallel_rank(self):
        return self._dist.get_rank(group=self._group)


def _run_job(job, rank, groups):
    import torch
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups as ds_groups

    p = job["p"]
    if p not in groups:  # collective: every rank of the world calls it, in job order
        groups[p] = dist.new_group(list(range(p)))
    if rank >= p:
        return {"ok": True, "member": False}
    group = groups[p]
    ds_groups.mpu = _SequenceParallelMpu(group)
    dtype = getattr(torch, job["dtype"])
    data = np.load(job["inputs"])
    s_local = data["q"].shape[1] // p
    rows = slice(rank * s_local, (rank + 1) * s_local)
    shard = {n: torch.from_numpy(np.ascontiguousarray(data[n][:, rows])).to(dtype)
             for n in ("q", "k", "v", "do")}                               # [B, S/p, heads, H]
    kv_heads = shard["k"].shape[2]
    # Batch-first layout: scatter the head dim (2), gather the sequence dim (1), batch dim 0.
    attn = DistributedAttention(_local_attention(job["causal"]), group, scatter_idx=2,
                                gather_idx=1)
    leaves = {n: shard[n].clone().requires_grad_(True) for n in ("q", "k", "v")}

    def fwd_bwd(reps):
        for t in leaves.values():
            t.grad = None
        k, v = leaves["k"], leaves["v"]
        if reps > 1:  # each kv head reps times in a row, so head j serves q heads of group j//reps
            k, v = k.repeat_interleave(reps, dim=2), v.repeat_interleave(reps, dim=2)
        out = attn(leaves["q"], k, v, 0)                                    # [B, S/p, N, H]
        out.backward(shard["do"])
        return out

    native_error, reps = None, 1
    try:
        out = fwd_bwd(1)
    except AssertionError as e:  # DeepSpeed checks shapes with asserts, before any exchange
        native_error = str(e) or "AssertionError"
        if not (job["kv_repeat"] and kv_heads < p and p % kv_heads == 0):
            return {"ok": False, "member": True, "unsupported": native_error}
        reps = p // kv_heads
        out = fwd_bwd(reps)
    result = {"out": out, "dq": leaves["q"].grad, "dk": leaves["k"].grad, "dv": leaves["v"].grad}
    np.savez(os.path.join(job["out_dir"], f"rank{rank}.npz"),
             **{n: t.detach().to(torch.float32).numpy() for n, t in result.items()})

    times = []
    for i in range(job["warmup"] + job["repeats"]):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fwd_bwd(reps)
        dist.barrier(group=group)  # the step ends when the slowest rank is done
        if i >= job["warmup"]:
            times.append(time.perf_counter() - t0)
    return {"ok": True, "member": True, "native_error": native_error, "kv_repeat": reps,
            "times": times}


def main() -> None:
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to the log, not into the protocol
    sys.stdout = sys.stderr
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import torch
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention  # noqa: F401
    except ImportError as e:
        _send(channel, {"unavailable": f"{type(e).__name__}: {e}"})
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = timedelta(seconds=float(os.environ.get("ULYSSES_DS_TIMEOUT", 300)))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=timeout)
    _send(channel, {"ready": True, "torch": torch.__version__, "deepspeed": deepspeed.__version__})
    groups = {}
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("cmd") == "exit":
            break
        try:
            reply = _run_job(job, rank, groups)
        except Exception:  # reported to the launcher, which shows it and stops the ranks
            reply = {"ok": False, "error": traceback.format_exc()}
        _send(channel, reply)


# ------------------------------------------------------------------------ launcher (parent side)

class DeepSpeedUnavailable(RuntimeError):
    """torch or deepspeed cannot be imported by the worker processes."""


@dataclasses.dataclass
class DeepSpeedResult:
    results: dict | None  # full [B, S, ...] out, dq, dk, dv; None if unsupported
    times: list[float]
    native_error: str | None = None  # what DistributedAttention raised on the kv heads as given
    kv_repeat: int = 1               # kv head copies the caller made before calling it
    unsupported: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DeepSpeedWorkers:
    """A gloo world of ``world_size`` torch processes, each running ``_ds_worker.py``.

    Start it once and run many cases (any P <= world_size) through it; ranks 0..P-1 form each
    case's group. Use as a context manager. Raises ``DeepSpeedUnavailable`` on start when the
    workers cannot import torch or deepspeed.
    """

    def __init__(self, world_size: int, timeout: float = 300.0, python: str = sys.executable):
        self.world_size, self.timeout, self.python = world_size, timeout, python
        self.versions: dict[str, str] = {}
        self._procs: list[subprocess.Popen] = []
        self._tmp = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        self._tmp = tempfile.mkdtemp(prefix="ulysses_ds_")
        env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()), WORLD_SIZE=str(self.world_size),
                   ULYSSES_DS_TIMEOUT=str(self.timeout))
        for r in range(self.world_size):
            log = open(os.path.join(self._tmp, f"rank{r}.log"), "wb")
            self._procs.append(subprocess.Popen(
                [self.python, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
            log.close()
        replies = self._replies()
        missing = [r["unavailable"] for r in replies if "unavailable" in r]
        if missing:
            self.close()
            raise DeepSpeedUnavailable(missing[0])
        self.versions = {"torch": replies[0]["torch"], "deepspeed": replies[0]["deepspeed"]}

    def run(self, case, inputs: dict) -> DeepSpeedResult:
        """Runs DistributedAttention forward + backward on P ranks; gathers the shards.

        Args:
          case: a ``compare.Case`` (reads p, dtype, causal, kv_repeat, warmup, repeats).
          inputs: float32 numpy q [B, S, N, H], k, v [B, S, K, H], do [B, S, N, H].
        """
        if case.p > self.world_size:
            raise ValueError(f"P={case.p} exceeds the {self.world_size} worker processes")
        job_dir = tempfile.mkdtemp(dir=self._tmp)
        np.savez(os.path.join(job_dir, "inputs.npz"), **inputs)
        job = {"cmd": "run", "inputs": os.path.join(job_dir, "inputs.npz"), "out_dir": job_dir,
               "p": case.p, "dtype": case.dtype, "causal": case.causal, "kv_repeat": case.kv_repeat,
               "warmup": case.warmup, "repeats": case.repeats}
        line = (json.dumps(job) + "\n").encode()
        for proc in self._procs:
            proc.stdin.write(line)
            proc.stdin.flush()
        replies = self._replies()[:case.p]
        lead = replies[0]
        if not lead["ok"]:
            return DeepSpeedResult(None, [], native_error=lead["unsupported"],
                                   unsupported=lead["unsupported"])
        shards = [np.load(os.path.join(job_dir, f"rank{r}.npz")) for r in range(case.p)]
        results = {n: np.concatenate([s[n] for s in shards], axis=1) for n in TENSORS}
        shutil.rmtree(job_dir, ignore_errors=True)
        return DeepSpeedResult(results, lead["times"], lead["native_error"], lead["kv_repeat"])

    def _log_tail(self, rank: int, chars: int = 3000) -> str:
        path = os.path.join(self._tmp, f"rank{rank}.log")
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")[-chars:]

    def _replies(self) -> list[dict]:
        """One JSON line from every rank, within ``timeout`` seconds."""
        deadline = time.monotonic() + self.timeout
        bufs, replies = [b""] * self.world_size, [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                tail = self._log_tail(min(pending))
                self.close()
                raise TimeoutError(f"DeepSpeed ranks {sorted(pending)} gave no answer in "
                                   f"{self.timeout:.0f} s; log of one:\n{tail}")
            fds = {self._procs[r].stdout.fileno(): r for r in pending}
            ready, _, _ = select.select(list(fds), [], [], min(left, 1.0))
            for fd in ready:
                r = fds[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    tail = self._log_tail(r)
                    self.close()
                    raise RuntimeError(f"DeepSpeed rank {r} exited; its log ends:\n{tail}")
                bufs[r] += chunk
                if b"\n" in bufs[r]:
                    replies[r] = json.loads(bufs[r].split(b"\n", 1)[0])
                    pending.discard(r)
                    if "error" in replies[r]:  # its peers may wait on it in a collective forever
                        self.close()
                        raise RuntimeError(f"DeepSpeed rank {r} failed:\n{replies[r]['error']}")
        return replies

    def close(self):
        for proc in self._procs:
            try:
                proc.stdin.write(b'{"cmd": "exit"}\n')
                proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        self._procs = []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


if __name__ == "__main__":
    main()
