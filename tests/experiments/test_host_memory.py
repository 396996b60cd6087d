"""experiments.host_memory: freed blocks are reused instead of being faulted in again."""

import platform
import subprocess
import sys

import pytest

# Allocates and frees a 256 MB block twice and prints the page faults of the second
# allocation; the first one may fault, the second reuses it only if memory is retained.
SCRIPT = """
import resource, sys
import numpy as np
if sys.argv[1] == "retain":
    from experiments import host_memory
    assert host_memory.retain_freed_memory()
for i in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.ones(64 * 2**20, np.float32)
    del block
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults)
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")


def second_allocation_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


@glibc_only
def test_retained_memory_is_reused_without_page_faults():
    default = second_allocation_faults("default")
    # glibc unmaps the block on free and faults it in again: at least one fault per
    # 2 MB page (fewer faults than 4 KB pages when numpy asks for transparent huge pages).
    assert default >= 128
    assert second_allocation_faults("retain") <= default // 20
