"""Every test sees 8 CPU devices; the flag must be set before jax is imported.

On a GPU (or TPU) host the suite runs on the accelerator, except the modules that build
multi-device meshes: those are pinned to the 8 CPU devices (their default device,
``jax.devices()`` and child processes all see the CPU), so they test the same sharding.
"""

import os
import shutil
import tempfile
import pathlib
import sys

# Test modules import helpers from one another across folders (``from test_models import
# build_hf``): each folder of tests is on the path, as the flat folder was.
for _folder in sorted(pathlib.Path(__file__).parent.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

from experiments.cli import host_device_flags  # noqa: E402
from experiments.usage import has_accelerator  # noqa: E402 - imports no JAX
from podsjax.devices.accelerators import has_nvidia_gpu, with_gpu_flags  # noqa: E402 - imports no JAX
from child_env import SUITE_XLA_FLAGS  # noqa: E402

os.environ["XLA_FLAGS"] = host_device_flags(8, os.environ.get("XLA_FLAGS", ""))
if not has_accelerator() or has_nvidia_gpu():  # programs for GPUs are compiled as the CLI's are
    os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ["XLA_FLAGS"])
if not has_accelerator():
    # No accelerator plugin probes for a device that is not there (pages of warnings), and
    # the CPU's programs compile at -O0 (``child_env.SUITE_XLA_FLAGS``).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] += f" {SUITE_XLA_FLAGS}"
# Under pytest-xdist several test processes share one accelerator: each allocates what it
# uses instead of most of the device up front.
if has_accelerator():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# CLI runs in tests keep their compiled programs out of the user's compile cache, in a
# directory of each test process's own that goes when it ends (xdist's workers inherit the
# controller's environment, so the marker says the directory is not theirs to share).
_OWN_CACHE = "PODSJAX_TEST_OWN_CACHE"
if "PODSJAX_CACHE_DIR" not in os.environ or os.environ.get(_OWN_CACHE):
    os.environ["PODSJAX_CACHE_DIR"] = _test_cache = tempfile.mkdtemp(prefix="podsjax-test-compile-cache-")
    os.environ[_OWN_CACHE] = "1"
else:
    _test_cache = None
# The tiny preset's warm-ups: shared by every test process of one session (an xdist worker
# takes its controller's directory, which the controller removes), not the user's. A warm-up
# is written aside and renamed into place, so two workers that train the same one at once
# both end with a whole copy; the compile cache above stays per process, as tests count compiles.
_SHARED_WARMUPS = "PODSJAX_TEST_SHARED_WARMUPS"
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_SHARED_WARMUPS):
    os.environ["PODSJAX_WARMUP_CACHE_DIR"] = os.environ[_SHARED_WARMUPS]
    _test_warmups = None
elif "PODSJAX_WARMUP_CACHE_DIR" not in os.environ or os.environ.get(_OWN_CACHE):
    os.environ["PODSJAX_WARMUP_CACHE_DIR"] = _test_warmups = tempfile.mkdtemp(prefix="podsjax-test-warmups-")
    os.environ[_SHARED_WARMUPS] = _test_warmups
else:
    _test_warmups = None
# Tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The CLI and the benchmarks keep freed host memory for reuse; tests run the same way.
from experiments import host_memory  # noqa: E402

host_memory.retain_freed_memory()

import jax  # noqa: E402
import pytest  # noqa: E402

if not has_accelerator():  # also when a plugin imported jax before the variable was set
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
from hypothesis import settings  # noqa: E402

# Every run replays the same examples, so a run fails only for a change of code;
# HYPOTHESIS_PROFILE=explore draws new ones each run.
settings.register_profile("replay", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "replay"))


# fp32 parity tests need true fp32 matmuls (GPUs default to TF32).
jax.config.update("jax_default_matmul_precision", "highest")

ON_ACCELERATOR = jax.default_backend() != "cpu"


def pytest_configure(config):
    # Modules whose tests build meshes of up to 8 devices (or run the CLI with --mesh) set
    # `pytestmark = pytest.mark.cpu_mesh`; tests of several seconds carry `slow`, which
    # `pytest -m "not slow"` leaves out.
    config.addinivalue_line("markers", "cpu_mesh: runs on the 8 CPU devices even when an accelerator is present")
    config.addinivalue_line("markers", "slow: takes seconds (an end-to-end run, a subprocess, a real compile)")
    cpus = jax.devices("cpu")
    assert len(cpus) == 8, f"expected 8 fake CPU devices, got {len(cpus)}"


def pytest_unconfigure(config):
    for own in (_test_cache, _test_warmups):  # the controller and each xdist worker remove their own
        if own:
            shutil.rmtree(own, ignore_errors=True)


def pytest_xdist_auto_num_workers(config):
    # `-n auto`: a process a core, at most 4. Each holds a JAX runtime and compiles on its
    # own; more than 4 gain little on the suite and multiply the memory.
    return max(1, min(os.cpu_count() or 1, 4))


_JAX_CACHE_FLAGS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
                    "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture(autouse=True)
def _restore_jax_compile_cache():
    """An in-process CLI run turns JAX's process-wide compile cache on; later tests in the same
    worker would load programs they expect to compile."""
    saved = {name: getattr(jax.config, name) for name in _JAX_CACHE_FLAGS}
    yield
    if any(getattr(jax.config, name) != value for name, value in saved.items()):
        from jax.experimental.compilation_cache import compilation_cache

        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()  # JAX decides once whether to use its cache: decide again


@pytest.fixture(autouse=True)
def _pin_mesh_tests_to_cpu(request, monkeypatch):
    if not ON_ACCELERATOR or request.node.get_closest_marker("cpu_mesh") is None:
        yield
        return
    real_devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: real_devices(backend or "cpu"))
    monkeypatch.setattr(jax, "device_count", lambda backend=None: len(real_devices(backend or "cpu")))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # CLI and worker subprocesses
    previous = jax.config.jax_default_device  # set globally: `jax.default_device` is one thread's,
    jax.config.update("jax_default_device", real_devices("cpu")[0])  # and a start compiles on several
    try:
        yield
    finally:
        jax.config.update("jax_default_device", previous)


class _OneLineRaises:
    """``pytest.raises``'s context, which also checks that the error it caught is one line."""

    def __init__(self, context):
        self._context = context

    def __enter__(self):
        self._info = self._context.__enter__()
        return self._info

    def __exit__(self, *exc):
        caught = self._context.__exit__(*exc)
        message = str(self._info.value).strip()
        assert "\n" not in message, f"a test of one-line errors caught a message of several lines:\n{message}"
        return caught


@pytest.fixture(autouse=True)
def _errors_are_one_line(request, monkeypatch):
    """In a test whose name promises one-line errors, every ``pytest.raises`` checks it."""
    if "one_line" not in request.node.name:
        return
    real = pytest.raises

    def raises(expected, *args, **kwargs):
        if args:  # the call form, raises(Error, fn, *args): its info, checked the same way
            with _OneLineRaises(real(expected, **kwargs)) as info:
                args[0](*args[1:])
            return info
        return _OneLineRaises(real(expected, **kwargs))

    monkeypatch.setattr(pytest, "raises", raises)


@pytest.fixture(scope="session")
def data_dir():
    """tests/data: real GSM8K and MATH-500 rows kept in the repository (see its README)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.fixture(scope="session")
def chemistry_dir():
    """data/chemistry: SciBench's 223 chemistry problems, the dataset users run setting d on."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "chemistry")
