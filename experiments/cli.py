"""The process side of ``python -m experiments.gsm8k`` (and math, chemistry): errors, devices, hosts.

It reads the flags into one config (``experiments.flags``) before JAX creates its
devices, so ``--mesh 8`` can give a CPU-only machine 8 host devices; then it joins a
multi-host run if there is one and hands the config to ``experiments.runner``.
Bad flags, paths, data or checkpoints, a diverged run and a full disk print one line
and exit with status 2; anything else is a bug and shows its traceback, then a one-line
summary, with status 1. SIGTERM (a preemption) is handled as Ctrl-C is: the run stops at
its last whole step, checkpoints it, says how to continue and exits with status 130.
Orbax's reports from its background threads go to ``<out>/run.log`` (:class:`LibraryOutput`).
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings

from experiments import completed, flags, helptext, launch_checks, run_dir
from experiments.config import describe_setting
from experiments.usage import UsageError, has_accelerator, mesh_device_count

# The library's errors about what the user gave it (module, class): one line, status 2.
# Looked up in sys.modules so that this module never imports JAX itself.
_USER_ERRORS = (
    ("podsjax.data.datasets", "DataError"), ("podsjax.data.prompts", "PromptError"),
    ("podsjax.models.hf_io", "CheckpointError"),
    ("podsjax.run.checkpoint", "CheckpointCorrupt"), ("podsjax.run.checkpoint", "CheckpointMismatch"),
    ("podsjax.rl", "TrainingDiverged"), ("podsjax.rl", "LogDamaged"), ("podsjax.devices.dry_run", "DoesNotFit"),
    ("podsjax.tiny.warmup", "WarmupError"), ("podsjax.rewards.pool", "RewardPoolError"),
    ("podsjax.run.log_backends", "LoggerError"),
)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def user_error_line(exc: BaseException, out: str | None = None) -> str | None:
    """The one line for an error the user can act on, or None when ``exc`` is a bug."""
    if isinstance(exc, UsageError):
        return str(exc)
    for module, name in _USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return str(exc)
    for cause in _chain(exc):
        full = isinstance(cause, OSError) and cause.errno in _NO_SPACE
        if full or "No space left on device" in str(cause):
            where = getattr(cause, "filename", None) or out or "the run directory"
            kept = out and run_dir.kept_run(out)  # a start that failed leaves no run
            return (f"no space left on device writing {where}; " + ("the last complete checkpoint is intact: free some "
                    "space, then rerun with --resume" if kept else "free some space, then rerun the same command"))
        if isinstance(cause, OSError) and cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return f"cannot write {cause.filename or out}: {cause.strerror}"
    return None


RUN_LOG = "run.log"
# Code whose reports LibraryOutput keeps off the console: orbax and what it writes with.
_LIBRARY_DIRS = tuple(f"{os.sep}{name}{os.sep}" for name in ("orbax", "tensorstore", "etils", "asyncio"))


def _in_library(filename: str | None) -> bool:
    return bool(filename) and any(d in filename for d in _LIBRARY_DIRS)


def _through_library(tb) -> bool:
    return any(_in_library(frame.filename) for frame in traceback.extract_tb(tb)) if tb is not None else False


def _foreign_thread() -> bool:
    """Whether the caller is a thread Python did not start (tensorstore's, calling back into Python)."""
    return isinstance(threading.current_thread(), getattr(threading, "_DummyThread", ()))


class LibraryOutput:
    """Orbax's background reports, kept in the run's ``run.log`` instead of on the console.

    Orbax writes and reads checkpoints in background threads and tensorstore callbacks. When a
    write fails (a full disk) or a restore gives up on a damaged checkpoint, they report through
    absl logging, the unraisable-exception hook (callbacks into an event loop already closed),
    thread exceptions and "coroutine was never awaited" warnings: hundreds of lines around the
    one line that says what to do. While installed, those go to ``<out>/run.log``
    (``run.<i>.log`` on process i > 0; the console while ``out`` is not a directory yet), and
    :meth:`print_note` says where. podsjax's lines, a bug's traceback, a user's errors and other
    libraries' messages reach the console as before.
    """

    def __init__(self):
        self.out: str | None = None
        self.process: int | None = None  # None: jax.process_index(), once JAX has started
        self.kept = self.lost = 0
        self.lost_why = ""
        self._noted = False
        self._lock = threading.RLock()  # a report may arrive while writing another one
        self._format = logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s")
        self._undo: list = []
        self._previous: dict = {}

    def path(self) -> str | None:
        if self.out is None:
            return None
        if self.process is None and _jax_started():
            try:
                self.process = sys.modules["jax"].process_index()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
        index = self.process or 0
        return os.path.join(self.out, RUN_LOG if index == 0 else f"run.{index}.log")

    def write(self, text: str) -> None:
        text = text if text.endswith("\n") else text + "\n"
        with self._lock:
            path = self.path()
            if path is None or not os.path.isdir(self.out):
                try:
                    sys.stderr.write(text)
                except Exception:  # noqa: BLE001 - no console left
                    pass
                return
            try:
                with open(path, "a", encoding="utf-8") as f:  # opened per report: they are rare
                    f.write(text)
                self.kept += 1
            except Exception as exc:  # noqa: BLE001 - a full disk: lost, the run's own error line is not
                self.lost += 1
                self.lost_why = getattr(exc, "strerror", None) or type(exc).__name__

    def print_note(self) -> None:
        """Says on stderr, once, where the reports so far went (nothing when there were none)."""
        if self._noted or not (self.kept or self.lost):
            return
        self._noted = True
        if self.lost:
            line = (f"note: {self.lost} messages from orbax's background threads could not be written to "
                    f"{self.path()} ({self.lost_why})")
        else:
            line = f"note: {self.kept} messages from orbax's background threads are in {self.path()}"
        print(line, file=sys.stderr, flush=True)

    # -- the hooks ---------------------------------------------------------------------

    def install(self) -> LibraryOutput:
        try:  # absl's logger must be made by absl (an ABSLLogger), not by getLogger below
            import absl.logging  # noqa: F401
        except ImportError:
            pass
        for name, everything in (("absl", True), ("asyncio", True), ("", False)):
            logger = logging.getLogger(name)  # "": the root, which orbax also logs to directly
            route = _LibraryRecords(self, everything)
            logger.addFilter(route)
            self._undo.append(lambda logger=logger, route=route: logger.removeFilter(route))
        self._previous = {}
        for module, name, hook in ((sys, "unraisablehook", self._unraisable), (sys, "excepthook", self._uncaught),
                                   (threading, "excepthook", self._thread), (warnings, "showwarning", self._warning)):
            previous = self._previous[f"{module.__name__}.{name}"] = getattr(module, name)
            setattr(module, name, hook)
            self._undo.append(lambda module=module, name=name, previous=previous: setattr(module, name, previous))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _unraisable(self, unraisable) -> None:
        if not (_foreign_thread() or _through_library(unraisable.exc_traceback)):
            return self._previous["sys.unraisablehook"](unraisable)
        where = ""
        if unraisable.object is not None:
            try:
                where = f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}\n"
            except Exception:  # noqa: BLE001 - a repr that fails
                pass
        self.write(where + "".join(traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                                              unraisable.exc_traceback)))

    def _uncaught(self, exc_type, exc_value, tb) -> None:
        if not _foreign_thread():  # the main thread's are the program's own
            return self._previous["sys.excepthook"](exc_type, exc_value, tb)
        self.write("".join(traceback.format_exception(exc_type, exc_value, tb)))

    def _thread(self, args) -> None:
        if not _through_library(args.exc_traceback):
            return self._previous["threading.excepthook"](args)
        name = getattr(args.thread, "name", "?")
        self.write(f"Exception in thread {name}:\n" + "".join(
            traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))

    def _warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        unawaited = issubclass(category, RuntimeWarning) and "was never awaited" in str(message)
        if not (unawaited or _in_library(filename)):
            return self._previous["warnings.showwarning"](message, category, filename, lineno, file, line)
        self.write(warnings.formatwarning(message, category, filename, lineno, line))


class _LibraryRecords(logging.Filter):
    """On a logger: hands orbax's records (all of them, or those logged from its files) to the run log."""

    def __init__(self, output: LibraryOutput, everything: bool):
        super().__init__()
        self.output, self.everything = output, everything

    def filter(self, record: logging.LogRecord) -> bool:
        if not (self.everything or _in_library(record.pathname)):
            return True
        try:
            self.output.write(self.output._format.format(record))
        except Exception:  # noqa: BLE001 - never let a report break the run
            pass
        return False


# Collectives of fake CPU host devices can deadlock: single-threaded Eigen makes it rarer, and a
# 5-minute timeout turns a hang into an abort that --resume continues (docs/reliability.md,
# "Not promised").
CPU_DEVICE_FLAGS = {"xla_cpu_multi_thread_eigen": "false", "xla_cpu_collective_call_terminate_timeout_seconds": "300"}


def host_device_flags(count: int, flags: str) -> str:
    """``flags`` (XLA_FLAGS) plus ``count`` CPU host devices, run safely (``CPU_DEVICE_FLAGS``)."""
    if count > 1 and "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={count}"
    if "xla_force_host_platform_device_count" in flags:
        flags += "".join(f" --{name}={value}" for name, value in CPU_DEVICE_FLAGS.items() if name not in flags)
    return flags.strip()


def prepare_devices(spec: str | None, processes: int = 1, topology: str | None = None) -> None:
    """Gives the CPU platform enough host devices for this process's part of the mesh and
    keeps freed host memory for reuse (``experiments.host_memory``); must run before JAX starts.

    On a host with no accelerator JAX starts on the CPU alone: an installed CUDA or TPU
    plugin would otherwise probe for its device and print pages of warnings. Compiling for
    GPUs from such a host (``--topology h100``) still works.
    """
    from experiments import host_memory

    count = mesh_device_count(spec)
    if count % processes:
        raise UsageError(f"--mesh {spec} ({count} devices) does not split over {processes} processes")
    host_memory.retain_freed_memory()
    if _jax_started():
        return
    if "JAX_PLATFORMS" not in os.environ and not has_accelerator():
        os.environ["JAX_PLATFORMS"] = "cpu"  # for child processes
        if "jax" in sys.modules:  # the config tree imported it, and it read the variable then
            sys.modules["jax"].config.update("jax_platforms", "cpu")
    flags = host_device_flags(count // processes, os.environ.get("XLA_FLAGS", ""))
    from podsjax.devices.accelerators import has_nvidia_gpu, with_gpu_flags  # no JAX
    from podsjax.devices.gpu_topology import is_gpu_name

    for_gpus = is_gpu_name(topology) if topology is not None else has_nvidia_gpu()
    os.environ["XLA_FLAGS"] = with_gpu_flags(flags, deviceless=topology is not None) if for_gpus else flags


def _jax_started() -> bool:
    """Whether JAX has created its backends (after which XLA_FLAGS no longer matter).

    Importing JAX creates none, so the config tree (whose sections are the library's
    dataclasses) is read before the devices are set up.
    """
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a JAX without it: assume it has started
        return True


# Cluster managers that start one process per task and tell jax.distributed who its peers
# are: (variable holding the task count, or the TPU worker list, and how to count it).
_CLUSTERS = (("SLURM_NTASKS", int), ("OMPI_COMM_WORLD_SIZE", int),
             ("TPU_WORKER_HOSTNAMES", lambda hosts: len(hosts.split(","))))


def distributed_plan(args) -> tuple[str, int, int] | str | None:
    """How this process joins a multi-host run.

    Returns (coordinator, processes, process id) from the flags or the ``PODSJAX_*``
    variables; "auto" in a SLURM or Open MPI job of several tasks or on a multi-host TPU
    slice, where jax finds its peers itself; None for a single process.
    """
    from podsjax.devices.mesh import DISTRIBUTED_ENV

    flags = (args.coordinator, args.num_processes, args.process_id)
    values = []
    for flag, value, variable in zip(("--coordinator", "--num-processes", "--process-id"), flags, DISTRIBUTED_ENV):
        if value is None and os.environ.get(variable):
            value = os.environ[variable]
            if flag != "--coordinator":
                try:
                    value = int(value)
                except ValueError:
                    raise UsageError(f"${variable} must be an integer; got {value!r}") from None
        values.append(value)
    coordinator, processes, process_id = values
    if any(v is not None for v in values):
        if not all(v is not None for v in values):
            raise UsageError("multi-host needs all of --coordinator, --num-processes and --process-id "
                             "(or their PODSJAX_* variables)")
        launch_checks.check_processes(coordinator, processes, process_id)
        return None if processes == 1 else (coordinator, processes, process_id)
    for variable, count in _CLUSTERS:
        value = os.environ.get(variable)
        if value:
            try:
                if count(value) > 1:
                    return "auto"
            except ValueError:
                continue
    return None


def start_distributed(plan) -> None:
    """Joins the multi-host run ``distributed_plan`` gave (nothing for a single process)."""
    if plan is None:
        return
    from podsjax.devices import mesh as mesh_lib

    try:
        if plan == "auto":
            mesh_lib.initialize_distributed()
        else:
            mesh_lib.initialize_distributed(*plan)
    except (RuntimeError, ValueError) as exc:
        where = "the cluster's coordinator" if plan == "auto" else plan[0]
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot join the multi-host run at {where}: {first}") from None


def setup_compile_cache(args) -> str | None:
    """Turns the persistent compilation cache on (unless --no-compile-cache); before any compile."""
    from podsjax.devices import compilation

    if args.no_compile_cache:
        compilation.disable_compile_cache()
        return None
    try:
        return compilation.enable_compile_cache(args.compile_cache_dir)
    except ValueError as exc:
        raise UsageError(f"{exc}; pass --compile-cache-dir DIR or --no-compile-cache") from None


def start(args, config) -> None:
    """Devices, hosts and the compile cache for ``config``'s mesh, once per process and
    before JAX starts (``args.distributed`` from :func:`distributed_plan`)."""
    prepare_devices(config.model.mesh, args.distributed[1] if isinstance(args.distributed, tuple) else 1,
                    args.topology)
    start_distributed(args.distributed)
    if args.topology:  # programs for absent devices cannot be loaded back from the cache
        print("compile cache: off (compiling for devices this host does not have)", flush=True)
        return
    print(f"compile cache: {setup_compile_cache(args) or 'off'}", flush=True)


def _sigterm_as_interrupt(number, frame):
    raise KeyboardInterrupt("SIGTERM")


def quiet_transformers() -> None:
    """Without PyTorch, importing transformers advises that its models are unavailable: podsjax
    needs only its tokenizers (``[run]`` installs no torch), so the line would read as a broken
    install. Only that advice level is silenced."""
    if importlib.util.find_spec("torch") is None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def main(task: str, argv=None) -> int:
    started_at = time.time()
    quiet_transformers()
    args = None
    # SIGTERM (SLURM, spot-VM preemption, `kill`) takes Ctrl-C's way out: the trainer's own
    # handler checkpoints the last whole step, and everything else unwinds (the lock, workers).
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt) if in_main else None
    library = LibraryOutput().install()
    config = None
    try:
        args, config = flags.parse(task, argv)
        if args.help:
            print(helptext.help_text(task, sys.argv[1:] if argv is None else argv))
            return 0
        args.distributed = distributed_plan(args)
        if args.out is None:
            if args.distributed is not None:
                raise UsageError("a multi-host run needs --out: every process must name the same run directory")
            args.out = os.path.join("runs", f"{task}-{args.method}-{time.strftime('%Y%m%d-%H%M%S')}")
        library.out = args.out
        if isinstance(args.distributed, tuple):
            library.process = args.distributed[2]
        launch_checks.check_out(args)
        if config is None:  # --resume
            config = flags.read_run_config(args.out, args.field_flags)
            if not args.dry_run and completed.is_complete(config, args.out):
                print(completed.complete_line(config, args.out), flush=True)
                return 0  # nothing to train, so nothing is written
        launch_checks.check(args, config)
        if args.overwrite:
            run_dir.check_overwrite(args.out, config, args.config)
        print(f"run directory: {args.out}", flush=True)  # named now: the summary names it only at the end
        start(args, config)
        if args.setting:
            print(describe_setting(args.setting, args.method, config, getattr(args, "origins", None)), flush=True)
        from experiments import runner

        return runner.run_experiment(config, args.out, overwrite=args.overwrite, resume=args.resume,
                                     dry_run=args.dry_run, topology=args.topology, started_at=started_at)
    except KeyboardInterrupt as exc:
        library.print_note()
        print(completed.interrupted_line(exc, task, getattr(args, "out", None), config), file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        line = user_error_line(exc, getattr(args, "out", None))
        if line is None:
            traceback.print_exc()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            library.print_note()
            print(f"error: unexpected {type(exc).__name__}: {first} (a bug: the traceback above says where)",
                  file=sys.stderr)
            return 1
        library.print_note()  # before the error line, which stays the last
        print(f"error: {line}", file=sys.stderr)
        return 2
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        if "podsjax.devices.compilation" in sys.modules:  # a run started: its weights may still be loading
            sys.modules["podsjax.devices.compilation"].finish_background()
        library.print_note()
        if argv is not None:
            library.uninstall()
        # else: this is the program, which ends on return; orbax's threads and its coroutines'
        # warnings may still report while the interpreter exits, so the routing stays.
