"""JAX's persistent compilation cache on CPU devices: programs it cannot read back safely stay out.

An XLA:CPU executable runs the steps of a computation concurrently wherever no data dependency
orders them, and keeps every device's collectives in one order by making all collective steps
share one communicator resource (a loop that holds collectives counts as a collective step).
jaxlib 0.10's serialized CPU executable loses that sharing: on deserialization each loop body
gets a resource of its own, so a loop with collectives and a collective beside it no longer
wait for each other. Read back from the cache, such a program deadlocks (one device in the
loop's all-gather, the other in the collective beside it) or crashes (two collectives with one
rendezvous key at once: "Check failed: id < num_threads", heap corruption). Compiled fresh it
runs. ``hlo.unordered_loop_collectives`` finds the pairs that lose their order;
``benchmarks/cache_collective_repro.py`` shows the crash.

The programs are built as the math reads, with no data edges added for this: on CPU devices
the train step of every configuration ``tests/test_cacheable.py`` compiles has such pairs.
``fence()`` keeps those programs out of the cache on the CPU backend: they are not written,
and an entry read back is dropped and compiled again. Other programs, and every program on
other backends, use the cache as before. train.py, the evaluate and generate CLIs and the test
suite install it. At exit, a process that kept programs out names them in one line on stderr
(``summary``). It acts only where a persistent cache directory is set
(``jax_compilation_cache_dir``): JAX calls its cache hooks whenever the cache is enabled, with
or without a directory, and a run without one has nothing to read back, so it is neither
analysed nor reported.

A program kept out is compiled once per process, not once per use: the executable compiled
in this process (never serialized, so its collectives keep their order) is kept in memory
under its cache key and handed back when JAX asks the cache for that key again, as JAX's own
in-memory cache does for one jitted function. Tests that build the same train step anew
(a new closure, the same program) compile it once per pytest worker.

``keep_compiled()`` extends that to every CPU program, with or without a cache directory: each
executable this process compiles is kept in memory under JAX's cache key (which covers the
program, its compile options and its devices) and handed back when the key comes again, so a
process that builds the same programs many times (the test suite's workers) compiles each once.
Nothing is serialized, so it is safe on every jaxlib; programs with host callbacks are left to
JAX (the executable binds the callbacks it was compiled with).
"""
from __future__ import annotations

import atexit
import inspect
import sys
import threading
import warnings
from collections import OrderedDict

from .hlo import unordered_loop_collectives

_lock = threading.Lock()
_installed = False
_kept_out: dict[str, list] = {}     # program name -> its unordered pairs, first kept out first
_live: OrderedDict = OrderedDict()  # cache key -> (executable compiled here, compile time)
_LIVE_MAX = 256                     # executables kept in memory, the least recently used go
_warn = True
_reporting = False                  # the exit report is registered
_keep_all = False                   # keep_compiled(): every CPU program kept in memory
_with_callbacks: set = set()        # cache keys of programs with host callbacks (not kept)
_kept_hits = 0                      # keys handed back from memory


class CacheFenceWarning(UserWarning):
    """A program compiled fresh instead of read from (or written to) the persistent cache."""


def unsafe_pairs(executable) -> list[tuple[str, str, str]]:
    """The collective steps of a compiled executable that a read-back copy would not order
    (``hlo.unordered_loop_collectives``); [] for a program that is safe to cache."""
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    return unordered_loop_collectives(text)


def kept_out() -> dict[str, list]:
    """Programs this process kept out of the cache: name -> the unordered pairs found."""
    with _lock:
        return dict(_kept_out)


def summary() -> str | None:
    """One line naming the programs this process kept out of the cache, or None for none."""
    with _lock:
        names = list(_kept_out)
    if not names:
        return None
    return (f"compilation cache: {len(names)} CPU program(s) compiled fresh in each run, not "
            f"cached (read back, their loop collectives would lose their order): "
            f"{', '.join(names)} (docs/TRAINING.md, 'Compilation cache')")


def _report() -> None:
    line = summary()
    if line:
        print(line, file=sys.stderr, flush=True)


def _keep_out(name: str, pairs: list, key: str | None = None, live=None) -> None:
    """Records a program kept out; ``live``: (executable compiled in this process, its compile
    time), kept in memory under the cache ``key``. The first one registers the exit report
    (unless the fence was installed with ``warn=False``)."""
    global _reporting
    with _lock:
        _kept_out[name] = pairs
        register = _warn and not _reporting
        _reporting = _reporting or register
    if register:
        atexit.register(_report)
    if key is not None and live is not None:
        _live_put(key, live)


def _live_put(key: str | None, live) -> None:
    """Keeps (executable, compile time) in memory under its cache key; the least recently
    used go past ``_LIVE_MAX``, and while the process holds more than half the memory maps
    Linux allows it: an XLA:CPU executable keeps its machine code in memory maps of its own
    (the tiny preset's train step about 900), and a process past ``vm.max_map_count``
    (65,530 by default) aborts or segfaults in its next compile."""
    with _lock:
        if key is None or key in _with_callbacks:
            return
        _live[key] = live
        _live.move_to_end(key)
        while len(_live) > _LIVE_MAX:
            _live.popitem(last=False)
        limit = _map_limit()
        while limit and len(_live) > 1 and (_maps_in_use() or 0) > limit // 2:
            _live.popitem(last=False)


def _map_limit() -> int | None:
    """The memory maps a process may hold (Linux's ``vm.max_map_count``), or None."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _maps_in_use() -> int | None:
    """The memory maps this process holds (Linux), or None."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _live_get(key: str | None, host_callbacks):
    """The executable kept under ``key``, or None; a key asked for with host callbacks is
    never kept (its executable binds the callbacks it was compiled with)."""
    global _kept_hits
    with _lock:
        if key is None:
            return None
        if host_callbacks:
            _with_callbacks.add(key)
            _live.pop(key, None)
            return None
        live = _live.get(key)
        if live is not None:
            _live.move_to_end(key)
            _kept_hits += 1
        return live


def keep_compiled() -> bool:
    """Keeps every CPU program this process compiles in memory and hands it back when JAX asks
    its compilation cache for the same key (module docstring); installs ``fence`` quietly if
    it is not installed. Returns ``fence``'s answer: False where this JAX offers no hook, and
    then nothing is kept."""
    global _keep_all
    if not fence(warn=False):
        return False
    with _lock:
        _keep_all = True
    return True


def kept_hits() -> int:
    """How many times this process was handed a program kept in memory."""
    with _lock:
        return _kept_hits


def fence(warn: bool = True) -> bool:
    """Keeps CPU programs with loop collectives the cache cannot order out of JAX's persistent
    compilation cache (this process, from now on; installing twice is harmless).

    Args:
      warn: name the programs kept out in one line on stderr at exit (``summary``; the first
        call's choice stands: the test suite installs it quietly before train.py's ``main``
        does).

    Returns:
      True when the fence is in place; False when this JAX keeps its cache elsewhere, in which
      case the persistent cache is turned off for CPU runs instead (only effective before the
      first compile).
    """
    global _installed, _warn
    with _lock:
        if _installed:
            return True
        _warn = warn
        try:
            from jax._src import compilation_cache as cache
            get, put = cache.get_executable_and_time, cache.put_executable_and_time
        except (ImportError, AttributeError):
            return _cache_off_on_cpu(warn)

        # Arguments bound by name: the wrappers pass everything through unchanged, also
        # where a JAX version adds parameters.
        get_sig, put_sig = inspect.signature(get), inspect.signature(put)

        def get_checked(*args, **kwargs):
            if not (_keep_all or _persistent_dir()):
                return get(*args, **kwargs)
            bound = get_sig.bind(*args, **kwargs).arguments
            if _on_cpu(bound):
                live = _live_get(bound.get("cache_key"), bound.get("host_callbacks"))
                if live is not None:
                    return live
            if not _persistent_dir():
                return None, None
            executable, compile_time = get(*args, **kwargs)
            if executable is not None and _on_cpu(bound):
                pairs = unsafe_pairs(executable)
                if pairs:
                    _keep_out(executable.hlo_modules()[0].name, pairs)
                    return None, None
            return executable, compile_time

        def put_checked(*args, **kwargs):
            bound = put_sig.bind(*args, **kwargs).arguments
            if _keep_all and _on_cpu(bound):
                _live_put(bound.get("cache_key"),
                          (bound["executable"], bound.get("compile_time")))
            if not _persistent_dir():
                return None
            if _on_cpu(bound):
                pairs = unsafe_pairs(bound["executable"])
                if pairs:
                    _keep_out(bound.get("module_name", "a program"), pairs,
                              bound.get("cache_key"),
                              (bound["executable"], bound.get("compile_time")))
                    return None
            return put(*args, **kwargs)

        cache.get_executable_and_time = get_checked
        cache.put_executable_and_time = put_checked
        _installed = True
    return True


def _persistent_dir() -> str | None:
    """The persistent cache directory in force, or None (nothing is read back then)."""
    import jax
    return jax.config.jax_compilation_cache_dir or None


def _on_cpu(arguments: dict) -> bool:
    """Whether the bound arguments of a cache call name the CPU backend."""
    return getattr(arguments.get("backend"), "platform", None) == "cpu"


def _cache_off_on_cpu(warn: bool) -> bool:
    import jax
    if jax.default_backend() == "cpu" and jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_enable_compilation_cache", False)
        if warn:
            warnings.warn("the persistent compilation cache is off for this CPU run: this JAX "
                          "version offers no place to keep unsafe programs out of it "
                          "(docs/TRAINING.md, 'Compilation cache')", CacheFenceWarning,
                          stacklevel=2)
    return False
