"""Machine facts and fair timing shared by the benchmarks: CPU name, load from other processes,
and contenders timed in alternation."""

from __future__ import annotations

import os
import platform
import statistics
import time


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_snapshot() -> tuple[int, int, float, float] | None:
    """(busy jiffies of all CPUs, all jiffies, this process's CPU seconds, wall seconds)."""
    try:
        with open("/proc/stat", encoding="utf-8") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + values[4]  # idle + iowait
    own = os.times()  # user + system of this process and of its reaped children (reward workers)
    return sum(values) - idle, sum(values), own[0] + own[1] + own[2] + own[3], time.perf_counter()


def others_busy(since) -> float | None:
    """Average number of cores that other processes kept busy since a cpu_snapshot()."""
    now = cpu_snapshot()
    if since is None or now is None:
        return None
    everyone = usable_cores() * (now[0] - since[0]) / max(1, now[1] - since[1])
    return max(0.0, everyone - (now[2] - since[2]) / max(1e-9, now[3] - since[3]))


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores kept busy by other processes, sampled while this one sleeps."""
    since = cpu_snapshot()
    time.sleep(seconds)
    return others_busy(since)


def busy_note(busy: float | None) -> str:
    if busy is None:
        return "other load n/a"
    return f"{busy:.1f} of {usable_cores()} cores busy with other work"


def busy_warning(busy: float | None) -> str | None:
    """A warning line when other processes already load the cores this run will use."""
    if busy is None or busy < 0.25:
        return None
    return (
        f"warning: the machine is busy ({busy_note(busy)}). torch's OpenMP threads stall far more than "
        "XLA's thread pool when they share cores, so the podsjax ratios below are inflated; rerun on a quiet "
        "machine (or compare with --threads 1)."
    )


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def interleaved_medians(fns, repeats: int, warm_up: bool = True) -> list[tuple[float, list[float]]]:
    """Median wall times of several contenders timed in alternation.

    Each runs once to warm up (unless the caller already ran it); then every
    round times each of them once, in forward order on even rounds and reverse
    order on odd ones, so that load from other processes on a shared machine
    falls on all of them alike.
    """
    if warm_up:
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for round_ in range(repeats):
        order = range(len(fns)) if round_ % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [(statistics.median(t), t) for t in times]


def print_machine(torch, transformers, retain_memory: bool = True) -> float | None:
    """Prints the machine line (and a warning when it is busy); returns the cores other work kept busy.

    Runs before JAX starts, so it also applies the host allocator settings the
    podsjax CLI uses (``podsjax.host_memory``) unless ``retain_memory`` is False;
    they are process-wide, so every contender runs under them.
    """
    from podsjax import host_memory

    allocator = "glibc defaults"
    if retain_memory and host_memory.retain_freed_memory():
        allocator = "freed memory retained (podsjax.host_memory, for every contender)"
    import jax

    busy = busy_cores()
    print(
        f"machine: {cpu_name()}, {usable_cores()} cores, {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}; host allocator: {allocator}; before the run {busy_note(busy)}"
    )
    if busy_warning(busy):
        print(busy_warning(busy))
    return busy


def print_runs(times: dict, busy_during: float | None, already_warned: bool, during: str = "during the runs") -> None:
    """The raw timings of each contender and the load they ran under (warning once if it was busy)."""
    runs = "; ".join(f"{name} " + ", ".join(f"{t:.2f}" for t in ts) for name, ts in times.items())
    print(f"runs (s): {runs}; {during} {busy_note(busy_during)}")
    if not already_warned and busy_warning(busy_during):
        print(busy_warning(busy_during))
