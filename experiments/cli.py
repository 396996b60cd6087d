"""The process side of ``python -m experiments.gsm8k`` (and math, chemistry): errors, devices, hosts.

It reads the flags into one config (``experiments.flags``) before JAX creates its
devices, so ``--mesh 8`` can give a CPU-only machine 8 host devices; then it joins a
multi-host run if there is one and hands the config to ``experiments.runner``.
Bad flags, paths, data or checkpoints, a diverged run and a full disk print one line
and exit with status 2; anything else is a bug and shows its traceback, then a one-line
summary, with status 1. SIGTERM (a preemption) is handled as Ctrl-C is: the run stops at
its last whole step, checkpoints it, says how to continue and exits with status 130.
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import sys
import threading
import time
import traceback

from experiments import flags
from experiments.usage import CONFIG_FILE, UsageError, has_accelerator, mesh_device_count

# The library's errors about what the user gave it (module, class): one line, status 2.
# Looked up in sys.modules so that this module never imports JAX itself.
_USER_ERRORS = (
    ("podsjax.data", "DataError"), ("podsjax.prompts", "PromptError"), ("podsjax.models.hf_io", "CheckpointError"),
    ("podsjax.checkpoint", "CheckpointCorrupt"), ("podsjax.checkpoint", "CheckpointMismatch"),
    ("podsjax.loop", "TrainingDiverged"), ("podsjax.dry_run", "DoesNotFit"), ("podsjax.tiny.warmup", "WarmupError"),
    ("podsjax.rewards.pool", "RewardPoolError"),
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
            return (f"no space left on device writing {where}; the last complete checkpoint is intact: "
                    "free some space, then rerun with --resume")
        if isinstance(cause, OSError) and cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return f"cannot write {cause.filename or out}: {cause.strerror}"
    return None


# Host devices share the CPU's threads. XLA's CPU runtime may run two independent collectives
# of one program on a device at once, and a device can then wait forever for another that
# never arrives (train.TrainBatch removes the case seen in the update). Single-threaded Eigen
# makes it rarer without slowing 2 cores down. A late device on a loaded machine is waited
# for 5 minutes (XLA's default is 40 s); a collective that never completes then aborts the
# run, which --resume continues.
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
    from podsjax.gpu_topology import DEVICELESS_XLA_FLAGS, is_gpu_name  # no JAX

    if topology is not None and is_gpu_name(topology) and DEVICELESS_XLA_FLAGS not in flags:
        flags = f"{flags} {DEVICELESS_XLA_FLAGS}".strip()
    os.environ["XLA_FLAGS"] = flags


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
    from podsjax.mesh import DISTRIBUTED_ENV

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
        if processes < 1 or not 0 <= process_id < processes:
            raise UsageError(f"--process-id must be in 0..{processes - 1} and --num-processes >= 1; "
                             f"got {process_id} of {processes}")
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
    from podsjax import mesh as mesh_lib

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
    from podsjax import compilation

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


def interrupted_line(exc: KeyboardInterrupt, task: str, out: str | None) -> str:
    """What a stopped run prints: where it stopped (``run_state.StopRequested`` says) and how to go on."""
    if type(exc).__name__ == "StopRequested":
        what = str(exc)
    else:
        what = f"interrupted by {exc.args[0]}" if exc.args and isinstance(exc.args[0], str) else "interrupted"
    if out is None or not os.path.isfile(os.path.join(out, CONFIG_FILE)):
        return f"{what}; no run was written yet"
    return f"{what}; to continue: python -m experiments.{task} --out {shlex.quote(out)} --resume"


def main(task: str, argv=None) -> int:
    started_at = time.time()
    args = None
    # SIGTERM (SLURM, spot-VM preemption, `kill`) takes Ctrl-C's way out: the trainer's own
    # handler checkpoints the last whole step, and everything else unwinds (the lock, workers).
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt) if in_main else None
    try:
        args, config = flags.parse(task, argv)
        if args.help:
            print(flags.help_text(task))
            return 0
        args.distributed = distributed_plan(args)
        if args.out is None:
            if args.distributed is not None:
                raise UsageError("a multi-host run needs --out: every process must name the same run directory")
            args.out = os.path.join("runs", f"{task}-{args.method}-{time.strftime('%Y%m%d-%H%M%S')}")
        flags.check_out(args)
        if config is None:  # --resume
            config = flags.read_run_config(args.out, args.field_flags)
        flags.check(args, config)
        start(args, config)
        if args.setting:
            print(flags.describe_setting(args.setting, args.method, config), flush=True)
        from experiments import runner

        return runner.run(config, args.out, overwrite=args.overwrite, resume=args.resume, dry_run=args.dry_run,
                          topology=args.topology, started_at=started_at)
    except KeyboardInterrupt as exc:
        print(interrupted_line(exc, task, getattr(args, "out", None)), file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        line = user_error_line(exc, getattr(args, "out", None))
        if line is None:
            traceback.print_exc()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"error: unexpected {type(exc).__name__}: {first} (a bug: the traceback above says where)",
                  file=sys.stderr)
            return 1
        print(f"error: {line}", file=sys.stderr)
        return 2
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
