"""Every test sees 8 CPU devices; the flag must be set before jax is imported."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
# Tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The CLI and the benchmarks keep freed host memory for reuse; tests run the same way.
from podsjax import host_memory  # noqa: E402

host_memory.retain_freed_memory()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI replays the same examples every run; locally hypothesis keeps exploring.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config):
    if jax.default_backend() == "cpu":
        assert jax.device_count() == 8, f"expected 8 fake CPU devices, got {jax.device_count()}"


@pytest.fixture(scope="session")
def shared_data_dir():
    """../shared/data beside the checkout (GSM8K and MATH-500 jsonl files)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.normpath(os.path.join(here, "..", "..", "shared", "data"))
    if not os.path.isdir(path):
        if os.environ.get("CI"):  # CI always has shared/ beside the clone: a skip would hide a failure
            pytest.fail(f"shared data not found at {path}")
        pytest.skip(f"shared data not found at {path}")
    return path
