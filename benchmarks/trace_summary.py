"""Where a traced program's device time went: busy time against the span, and the kernels that took it.

Reads the Perfetto trace that ``jax.profiler.trace(dir, create_perfetto_trace=True)``
writes (``<dir>/plugins/profile/<run>/perfetto_trace.json.gz``). A device's kernels are the
complete ("X") events of the trace processes whose name starts with ``--device`` (default
``/device:GPU``, one process per GPU; ``/host:CPU`` reads the host's threads instead).

The summary says whether a program is bound by its kernels or by what runs between them:
``busy`` is the union of the kernels' intervals, ``span`` runs from the first kernel's start
to the last one's end, and ``busy / span`` well under 1 means the device waited for the
host (launches, a loop's predicate copied back each iteration). ``--steps T`` divides the
figures by the decode steps traced, so they read per step.

Under the profiler XLA's GPU runtime turns its CUDA graphs off and launches each kernel
alone (``--xla_enable_command_buffers_during_profiling`` would keep them, at CUPTI's risk),
so a traced loop's gaps are its launches one by one: the kernels' times hold, but an untraced
run, whose decode step is one graph (``podsjax.devices.gpu_thunks``), has fewer gaps.

Run: python -m benchmarks.trace_summary <trace dir or .json.gz> [--steps T] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re

_SUFFIX = re.compile(r"([._]\d+)+$")  # fusion_12 and fusion.13 are one kind of kernel


@dataclasses.dataclass(frozen=True)
class Summary:
    span_us: float
    busy_us: float
    kernels: int
    by_name: list[tuple[str, int, float]]  # (name, count, total us), longest total first


def find_trace(path: str) -> str:
    """The newest Perfetto trace under ``path`` (a trace directory), or ``path`` itself."""
    if os.path.isfile(path):
        return path
    found = glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise SystemExit(f"error: no perfetto_trace.json.gz under {path}")
    return max(found, key=os.path.getmtime)


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_kernels(events: list[dict], device: str = "/device:GPU") -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every complete event on the processes named ``device...``.

    A device's process also has lines derived from its work ("XLA Modules": one event over a
    whole program would read as busy throughout), so only its kernels' lines count: the
    ``Stream ...`` threads of a GPU, else the ``XLA Ops`` line (a TPU's), else all of them.
    """
    meta = [e for e in events if e.get("ph") == "M"]
    pids = {e["pid"] for e in meta if e.get("name") == "process_name" and e["args"]["name"].startswith(device)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    kernel_lines: dict[int, set] = {}  # pid -> the thread ids whose events are its kernels
    for pattern in (lambda name: name.startswith("Stream"), lambda name: name == "XLA Ops"):
        for pid in pids - set(kernel_lines):
            lines = {tid for (p, tid), name in threads.items() if p == pid and pattern(name)}
            if lines:
                kernel_lines[pid] = lines

    def counted(e):
        pid = e.get("pid")
        return pid in pids and (pid not in kernel_lines or e.get("tid") in kernel_lines[pid])

    return [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events if e.get("ph") == "X" and counted(e)]


def summarize(kernels: list[tuple[str, float, float]]) -> Summary:
    if not kernels:
        raise SystemExit("error: the trace holds no kernels of that device")
    intervals = sorted((start, start + dur) for _, start, dur in kernels)
    busy, (run_start, run_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:  # union of the intervals: overlapping streams count once
        if start > run_end:
            busy += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    span = max(end for _, end in intervals) - intervals[0][0]
    counts, totals = collections.Counter(), collections.Counter()
    for name, _, dur in kernels:
        kind = _SUFFIX.sub("", name)
        counts[kind] += 1
        totals[kind] += dur
    by_name = sorted(((k, counts[k], totals[k]) for k in totals), key=lambda row: -row[2])
    return Summary(span, busy, len(kernels), by_name)


def format_summary(summary: Summary, steps: int = 1, top: int = 15) -> str:
    if summary.busy_us <= 0:
        raise SystemExit("error: the trace's kernels have no duration")
    unit = "per step" if steps > 1 else "in all"
    lines = [
        f"device: {summary.kernels / steps:,.0f} kernels {unit}; span {summary.span_us / steps / 1e3:,.3f} ms, "
        f"busy {summary.busy_us / steps / 1e3:,.3f} ms ({summary.busy_us / summary.span_us:.0%} of the span)",
        f"| kernel | count {unit} | time {unit} | share of busy |",
        "|---|---:|---:|---:|",
    ]
    for name, count, total in summary.by_name[:top]:
        lines.append(f"| {name[:80]} | {count / steps:,.1f} | {total / steps / 1e3:,.3f} ms | "
                     f"{total / summary.busy_us:.0%} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a jax.profiler trace directory or a perfetto_trace.json.gz")
    parser.add_argument("--device", default="/device:GPU", help="trace process name prefix of the device")
    parser.add_argument("--steps", type=int, default=1, help="divide by this many steps (decode steps traced)")
    parser.add_argument("--top", type=int, default=15, help="kernel kinds listed")
    args = parser.parse_args()
    path = find_trace(args.trace)
    print(format_summary(summarize(device_kernels(load_events(path), args.device)), args.steps, args.top))


if __name__ == "__main__":
    main()
