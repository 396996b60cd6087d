"""Machine facts and fair timing shared by the benchmarks: CPU name, load from other processes,
the device's peak bandwidth and FLOP/s, peak memory, and contenders timed in alternation."""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import statistics
import time

# Datasheet peaks: HBM bytes/s and dense bf16 FLOP/s, keyed by substrings of JAX's
# device_kind (lower case, all must occur; the first matching row wins, so the
# specific rows come first).
PEAKS = (
    (("h200",), "H200", 4.8e12, 989e12),
    (("h100", "pcie"), "H100 PCIe", 2.0e12, 756e12),
    (("h100", "nvl"), "H100 NVL", 3.9e12, 835e12),
    (("h100",), "H100 SXM", 3.35e12, 989e12),
    (("a100", "80gb"), "A100 80GB", 2.0e12, 312e12),
    (("a100",), "A100 40GB", 1.555e12, 312e12),
    (("l40s",), "L40S", 0.864e12, 362e12),
    (("tpu v4",), "TPU v4", 1.2e12, 275e12),
    (("tpu v5 lite",), "TPU v5e", 0.819e12, 197e12),
    (("tpu v5e",), "TPU v5e", 0.819e12, 197e12),
    (("tpu v5",), "TPU v5p", 2.765e12, 459e12),
    (("tpu v6",), "TPU v6e", 1.64e12, 918e12),
)


@dataclasses.dataclass(frozen=True)
class Peaks:
    """What a device can do at best: memory bandwidth (B/s) and matmul FLOP/s, and where the figures come from."""

    name: str
    bandwidth: float | None
    flops: float | None
    source: str


def peaks_for(device_kind: str) -> Peaks | None:
    kind = device_kind.lower()
    for keys, name, bandwidth, flops in PEAKS:
        if all(k in kind for k in keys):
            return Peaks(name, bandwidth, flops, "datasheet, dense bf16")
    return None


@functools.lru_cache(maxsize=1)
def device_peaks() -> Peaks:
    """Peaks of JAX's first device: the datasheet row, or on CPU a quick measurement."""
    import jax

    device = jax.devices()[0]
    known = peaks_for(device.device_kind)
    if known is not None:
        return known
    if device.platform == "cpu":
        return measure_cpu_peaks()
    return Peaks(device.device_kind, None, None, "unknown device: add it to benchmarks/machine.py PEAKS")


def measure_cpu_peaks() -> Peaks:
    """Host memcpy bandwidth (bytes read + written) and fp32 matmul rate, best of a few NumPy runs."""
    import numpy as np

    src = np.ones(2**25, np.float32)  # 128 MiB, far beyond any cache
    dst = np.empty_like(src)
    copy_s = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    n = 1024
    a = np.ones((n, n), np.float32)
    matmul_s = min(_timed(lambda: a @ a) for _ in range(5))
    return Peaks(cpu_name(), 2 * src.nbytes / copy_s, 2 * n**3 / matmul_s,
                 "measured here: NumPy memcpy and fp32 matmul")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def describe_peaks(peaks: Peaks) -> str:
    bandwidth = "n/a" if peaks.bandwidth is None else f"{peaks.bandwidth / 1e9:,.0f} GB/s"
    flops = "n/a" if peaks.flops is None else f"{peaks.flops / 1e12:,.1f} TFLOP/s"
    return f"peaks of {peaks.name}: memory {bandwidth}, matmul {flops} ({peaks.source})"


# ------------------------------------------------------------------ torch device


def torch_device(torch) -> str:
    """Where the PyTorch contender runs: the GPU when torch has CUDA, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_sync(torch) -> None:
    """Waits for queued CUDA kernels, so a timer sees the work done (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def torch_synced(torch, fn):
    """``fn`` followed by :func:`torch_sync`: what a timed torch contender runs."""
    def run():
        out = fn()
        torch_sync(torch)
        return out
    return run


def reset_torch_peak(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def torch_peak_bytes(torch) -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def jax_peak_bytes() -> int | None:
    """Peak bytes JAX has held on its first device since the process started (None where not reported, as on CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def fmt_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


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
    podsjax CLI uses (``experiments.host_memory``) unless ``retain_memory`` is False;
    they are process-wide, so every contender runs under them.
    """
    from experiments import host_memory

    allocator = "glibc defaults"
    if retain_memory and host_memory.retain_freed_memory():
        allocator = "freed memory retained (experiments.host_memory, for every contender)"
    import jax

    busy = busy_cores()
    if torch.cuda.is_available():
        torch_where = f"CUDA {torch.version.cuda} on {torch.cuda.get_device_name()}"
    else:
        torch_where = f"CPU, {torch.get_num_threads()} threads"
    print(
        f"machine: {cpu_name()}, {usable_cores()} cores, {jax.device_count()} x {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), jax {jax.__version__}, torch {torch.__version__} ({torch_where}), "
        f"transformers {transformers.__version__}; host allocator: {allocator}; before the run {busy_note(busy)}"
    )
    print(describe_peaks(device_peaks()))
    if busy_warning(busy):
        print(busy_warning(busy))
    return busy


def print_runs(times: dict, busy_during: float | None, already_warned: bool, during: str = "during the runs") -> None:
    """The raw timings of each contender and the load they ran under (warning once if it was busy)."""
    runs = "; ".join(f"{name} " + ", ".join(f"{t:.2f}" for t in ts) for name, ts in times.items())
    print(f"runs (s): {runs}; {during} {busy_note(busy_during)}")
    if not already_warned and busy_warning(busy_during):
        print(busy_warning(busy_during))
