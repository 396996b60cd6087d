"""Keep freed host memory in the process, so XLA CPU steps stop paying page faults.

XLA's CPU runtime allocates each execution's temporaries (gigabytes for a train
step) with ``malloc`` and frees them at the end. glibc serves blocks that large
with fresh ``mmap`` pages and gives them back on ``free``, so every step
page-faults its whole working set in again: on a 98M-param update that was
600,000 faults and about 0.5 s of a 3.1 s step. Telling glibc to use one arena,
never ``mmap`` and never trim makes freed blocks reusable, at the cost of
keeping the process's peak footprint resident (as a GPU allocator does).

This changes process-wide allocator settings, so nothing calls it on import:
the experiment CLI, the benchmarks (for every contender in them) and the test
suite call it first thing. The settings only reach threads that have not
allocated yet, so call it before the first JAX computation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameters from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def retain_freed_memory() -> bool:
    """Makes glibc reuse freed blocks instead of unmapping them.

    Returns:
      True if the settings were applied; False on a C library other than glibc
      (macOS, musl), where this does nothing.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # One arena: XLA's worker threads would otherwise get arenas whose heaps
    # cannot grow past 64 MB, and those fall back to mmap whatever MMAP_MAX says.
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))  # -1: never trim
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
