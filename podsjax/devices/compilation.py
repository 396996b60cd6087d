"""Compiles: JAX's persistent compilation cache, and a log of the big compiles of a run.

A first run on an accelerator spends most of its start in XLA compiles; the persistent
cache makes a second run of the same command load them from disk instead.
:class:`CompileLog` reports each compile that happens inside a labelled block, e.g.
``compiled generate[sample] (1 prompt x 64 samples, 512 + 512 tokens) in 12.3 s``, and
counts them, so a test can check that a run compiles each program once.

Example:
    >>> enable_compile_cache()
    >>> log = CompileLog(print)
    >>> with log.label("update"):
    ...     state, metrics = step_fn(state, batch, frozen)
    >>> log.counts
    {'update': 1}
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import jax
from jax import monitoring
from jax._src import monitoring as _jax_monitoring  # its listener lists: jax.monitoring has no getters
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

# Event names in jax/_src/dispatch.py and jax/_src/compiler.py (jax 0.4.30 - 0.11).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_CACHE_SAVED_EVENT = "/jax/compilation_cache/compile_time_saved_sec"  # a hit's compile time less its read
# Every program is cached, however fast it compiled: a start runs dozens of small ones (the
# loader's per-shape writes, key and optimizer setup, checksums), and a disk read is about a
# fifth of their compile (tiny preset, 2-core CPU: 57 programs of a warm start compiled in
# 2.5 s, read in 0.45 s; start to first step 8.9 -> 7.6 s). JAX's default leaves out
# programs under 1 s.
MIN_CACHED_COMPILE_S = 0.0


def default_cache_dir() -> str:
    """``$PODSJAX_CACHE_DIR``, else JAX's own ``$JAX_COMPILATION_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/podsjax/jax``, else ``~/.cache/podsjax/jax``."""
    for name in ("PODSJAX_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR"):
        if os.environ.get(name):
            return os.environ[name]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "podsjax", "jax")


def enable_compile_cache(directory: str | os.PathLike | None = None,
                         min_compile_time_s: float = MIN_CACHED_COMPILE_S) -> str:
    """Turns on JAX's persistent compilation cache, also in a process that has compiled
    before (JAX decides once whether to use the cache; this makes it decide again).

    Args:
        directory: where compiled programs are kept (default: :func:`default_cache_dir`).
        min_compile_time_s: programs that compile faster are not written.

    Returns:
        The cache directory.

    Raises:
        ValueError: the directory cannot be created or written.
    """
    if directory is not None and not os.fspath(directory).strip():  # "" had meant the default folder
        raise ValueError("compile cache: the directory is empty; name one, or pass None for the default")
    if isinstance(min_compile_time_s, bool) or not isinstance(min_compile_time_s, (int, float)) \
            or not 0 <= min_compile_time_s < float("inf"):
        raise ValueError(f"compile cache: min_compile_time_s must be seconds >= 0; got {min_compile_time_s!r}")
    path = os.path.abspath(os.path.expanduser(os.fspath(directory if directory is not None else default_cache_dir())))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"compile cache {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"compile cache {path}: not writable")
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax_compilation_cache.reset_cache()
    return path


def disable_compile_cache() -> None:
    """Turns the persistent cache off, also when ``JAX_COMPILATION_CACHE_DIR`` names one."""
    jax.config.update("jax_enable_compilation_cache", False)
    jax_compilation_cache.reset_cache()


def compile_cache_dir() -> str | None:
    """The persistent cache directory in effect, or None when the cache is off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir


# -- compile log ----------------------------------------------------------------------

_local = threading.local()  # per thread: the label stack and whether the current compile hit the cache
_install_lock = threading.Lock()
_registered: set = set()


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


# A compile still running this long is said on the console as it runs: a cold start's
# minutes-long compiles had shown nothing until they ended (only with the compile cache on:
# JAX says a compile begins only through the cache's request).
STILL_COMPILING_S = 20.0


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_REQUEST_EVENT:
        _local.hit, _local.saved = False, None
        _watch(start=True)
    elif event == _CACHE_HIT_EVENT:
        _local.hit = True


def _watch(start: bool) -> None:
    """Starts (or stops) this thread's timer that says the labelled compile is still running."""
    timer = getattr(_local, "timer", None)
    if timer is not None:
        timer.cancel()
    _local.timer = None
    stack = _stack()
    if start and stack and stack[-1][0].log is not None:
        log, name, detail = stack[-1]
        what = f"{name} ({detail})" if detail else name
        _local.timer = threading.Timer(STILL_COMPILING_S, log.log,
                                       (f"compiling {what}: {STILL_COMPILING_S:.0f} s so far",))
        _local.timer.daemon = True
        _local.timer.start()


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    if event == _CACHE_SAVED_EVENT:
        _local.saved = seconds
        return
    if event != BACKEND_COMPILE_EVENT:
        return
    _watch(start=False)
    hit, _local.hit = getattr(_local, "hit", False), False
    saved, _local.saved = getattr(_local, "saved", None), None
    stack = _stack()
    if stack:
        log, name, detail = stack[-1]
        compiled_s = seconds  # a hit's first compile: what the read saved plus the read (None: jax did not say)
        if hit:
            compiled_s = seconds + saved if saved is not None else None
        log._record(name, detail, str(kwargs.get("fun_name", "")), seconds, hit, compiled_s)


def _install() -> None:
    """Registers the JAX listeners, again when another library cleared them (tunix's metrics
    logger calls ``jax.monitoring.clear_event_listeners()`` as it closes)."""
    with _install_lock:
        for getter, register, callback in (
                ("get_event_listeners", monitoring.register_event_listener, _on_event),
                ("get_event_duration_listeners", monitoring.register_event_duration_secs_listener, _on_duration)):
            get = getattr(_jax_monitoring, getter, None)  # jax.monitoring has no getters; a jax without them:
            registered = get() if get is not None else _registered  # trust what this module registered
            if callback not in registered:
                register(callback)
                _registered.add(callback)


def program_name(fun_name: str) -> str:
    """``"jit(_prefill)"`` -> ``"prefill"``: the jitted function's name, without the wrapper."""
    name = fun_name
    while "(" in name and name.endswith(")"):
        name = name[name.index("(") + 1 : -1]
    return name.lstrip("_") or fun_name


class CompileLog:
    """Counts, times and reports the compiles that run inside :meth:`label` blocks.

    Args:
        log: called with one line per compile (None: count only).
        min_report_s: shorter compiles (eager ops, small helpers), and loads from the compile
            cache of programs that compiled in less, are counted, not printed.

    Attributes:
        counts: ``{key: compiles}``, key ``label`` or ``label[program]`` when the jitted
            function has another name (``generate[sample]``).
        seconds: ``{key: total compile seconds}``.
        events: every compile as ``(key, detail, seconds, from_cache)``, in order.
        intervals: every compile as ``(key, start, end)``, ``time.perf_counter()`` seconds.
    """

    def __init__(self, log: Callable[[str], None] | None = None, min_report_s: float = 0.25):
        _install()
        self.log, self.min_report_s = log, min_report_s
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.events: list[tuple[str, str, float, bool]] = []
        self.intervals: list[tuple[str, float, float]] = []
        self._thread_seconds: dict[int, float] = {}
        self._lock = threading.Lock()  # the start's compiles end on several threads at once

    @contextlib.contextmanager
    def label(self, name: str, detail: str = "") -> Iterator[None]:
        """Attributes the compiles in the ``with`` body (this thread only) to ``name``."""
        _install()
        stack = _stack()
        stack.append((self, name, detail))
        try:
            yield
        finally:
            _watch(start=False)  # a compile that failed says nothing later
            stack.pop()

    def _record(self, name: str, detail: str, fun_name: str, seconds: float, hit: bool,
                compiled_s: float | None) -> None:
        program = program_name(fun_name)
        key = name if program == name else f"{name}[{program}]"
        thread = threading.get_ident()  # the listener runs on the compiling thread
        end = time.perf_counter()  # the listener runs as the compile ends
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds
            self._thread_seconds[thread] = self._thread_seconds.get(thread, 0.0) + seconds
            self.events.append((key, detail, seconds, hit))
            self.intervals.append((key, end - seconds, end))
        # A cached program is reported where its compile would have been (or when that is unknown).
        if self.log is not None and (compiled_s is None or compiled_s >= self.min_report_s):
            what = f"{key} ({detail})" if detail else key
            verb = "loaded" if hit else "compiled"
            where = " from the compile cache" if hit else ""
            self.log(f"{verb} {what}{where} in {seconds:.1f} s")

    def thread_seconds(self) -> float:
        """Seconds of the compiles recorded on the calling thread so far (``metrics.PhaseTimer``
        takes them off the phase they ran in)."""
        return self._thread_seconds.get(threading.get_ident(), 0.0)

    def total(self) -> int:
        """Compiles so far, all labels together."""
        return sum(self.counts.values())


_FINISH_BEFORE_EXIT: set[threading.Thread] = set()


class InBackground:
    """``fn()`` on a thread of its own, started at once; :meth:`result` waits and re-raises.

    For compiles that can overlap other work: XLA compiles without holding Python's lock, so
    a program compiles while another compiles or runs. The thread is a daemon: a process that
    stops does not wait for a compile nobody will use. With ``finish_before_exit``,
    :func:`finish_background` waits for it (work that moves arrays onto the devices: a process
    whose interpreter stops under it aborts, exit status 134).
    """

    def __init__(self, fn: Callable[[], object], name: str = "podsjax-compile", finish_before_exit: bool = False):
        self._value: object = None
        self._error: BaseException | None = None

        def run():
            try:
                self._value = fn()
            except BaseException as exc:  # handed to the caller of result()
                self._error = exc

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        if finish_before_exit:
            _FINISH_BEFORE_EXIT.add(self._thread)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

    def wait(self) -> None:
        """Until ``fn`` has returned or raised; its error is dropped (the caller is failing already)."""
        self._thread.join()


def finish_background() -> None:
    """Waits for every :class:`InBackground` made with ``finish_before_exit`` (e.g. a checkpoint
    still loading when a check fails), so that the process can exit cleanly."""
    for thread in list(_FINISH_BEFORE_EXIT):
        thread.join()
        _FINISH_BEFORE_EXIT.discard(thread)


class CompilePool:
    """Runs compiles side by side on at most ``threads`` threads: the caller's and ``threads - 1`` workers.

    XLA compiles without holding Python's lock, so programs that do not depend on each other
    compile at once, and a start waits for about the longest compile rather than their sum.
    With ``threads`` 1 each job runs at once on the caller's thread. Leaving the ``with``
    block waits for every job, so no compile runs into an error's exit.

    Example:
        >>> with CompilePool(4) as pool:
        ...     update = pool.submit(lambda: update_fn.lower(state, batch, frozen).compile())
        ...     prefill = prefill_fn.lower(params, ids, mask).compile()  # meanwhile, on this thread
        ...     pool.wait()  # the first job error, if any, raises here
    """

    def __init__(self, threads: int):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"compile threads must be an integer >= 1; got {threads!r}")
        self._executor = (concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="podsjax-compile")
                          if threads > 1 else None)
        self._futures: list[concurrent.futures.Future] = []

    def submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """``fn()`` on a worker (or now, without workers); its future holds the value or the error."""
        if self._executor is not None:
            future = self._executor.submit(fn)
        else:
            future = concurrent.futures.Future()
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller of result(), as a worker's
                future.set_exception(exc)
        self._futures.append(future)
        return future

    def wait(self) -> None:
        """Until every job submitted has ended; raises the first error among them."""
        for future in list(self._futures):
            future.result()

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
