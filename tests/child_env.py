"""The environment of a process a test starts: the test process's own, without its 8 host
devices (a CLI makes its devices from ``--mesh``), with the suite's compile flags."""

import os

# Tests on a CPU compile far more than they run. LLVM's -O0 leaves XLA's HLO passes
# (fusion, layouts, buffers, sharding) as they are and emits less optimized machine code
# sooner: on the 2-core CI host, four of the heaviest test files ran in 317 s, not 436 s.
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0"


def child_env(**changes: str) -> dict[str, str]:
    """``os.environ`` with ``XLA_FLAGS`` the suite's compile flags alone (none where the suite
    runs on an accelerator, without them), then ``changes``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if SUITE_XLA_FLAGS in os.environ.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = SUITE_XLA_FLAGS
    return {**env, **changes}
