"""The tiny warm-up ends by steps, not the clock, and one cached warm-up serves every run that would build it."""

import hashlib
import os
import time
import types

import pytest

from experiments import flags, run_setup
from podsjax import tiny
from podsjax.tiny import warmup as warmup_lib
from podsjax.tiny import warmup_cache

pytestmark = pytest.mark.cpu_mesh

SMALL = tiny.tiny_model(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16)
# The target is out of reach, so both runs train to the step cap.
SHORT = dict(steps=6, batch_size=4, eval_every=2, validation_size=4, test_size=4, eval_batch_size=4,
             max_new_tokens=6, pool_size=32, min_accuracy=0.0, target_accuracy=1.0, max_accuracy=1.0, model=SMALL)


def _digest(directory):
    with open(os.path.join(directory, "model.safetensors"), "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


@pytest.mark.slow
def test_a_busy_machine_trains_the_same_warm_up_as_a_quiet_one(tmp_path, monkeypatch):
    quiet = tiny.warm_up(tmp_path / "quiet", **SHORT)

    # A machine so busy that each step takes ten minutes of wall clock, by its clock.
    now = [0.0]

    def slow_clock():
        now[0] += 600.0
        return now[0]

    # The training clock runs 10 minutes a step; the wall clock that ages staging folders is real.
    monkeypatch.setattr(warmup_lib, "time", types.SimpleNamespace(perf_counter=slow_clock, time=time.time))
    messages = []
    busy = tiny.warm_up(tmp_path / "busy", log=messages.append, **SHORT)
    assert (busy.steps, busy.stop_reason) == (quiet.steps, quiet.stop_reason) == (6, "steps")
    assert _digest(tmp_path / "busy") == _digest(tmp_path / "quiet")
    assert busy.test_accuracy == quiet.test_accuracy
    # It never reached its target: one line says so, and what to do.
    weak = [m for m in messages if "ended weak" in m]
    assert len(weak) == 1 and "--warmup-steps 12" in weak[0] and "\n" not in weak[0], messages


def test_a_usable_warm_up_says_nothing_and_a_weak_or_too_strong_one_says_what_to_do():
    config = tiny.WarmupConfig(**SHORT)
    stats = tiny.WarmupStats(path="p", config=tiny.WarmupConfig(), steps=480, stop_reason="target",
                             train_seconds=90.0, total_seconds=95.0, final_loss=0.5, validation_accuracy=0.31,
                             test_accuracy=0.3, test_format=1.0, in_range=True)
    assert warmup_lib.weakness(stats) is None
    capped = stats.__class__(**{**stats.__dict__, "stop_reason": "steps", "steps": 1000, "test_accuracy": 0.12})
    assert "raise the step cap (--warmup-steps 2000" in warmup_lib.weakness(capped)
    strong = stats.__class__(**{**stats.__dict__, "config": config, "test_accuracy": 1.0, "in_range": True})
    assert warmup_lib.weakness(strong) is None  # within this config's band
    too_strong = stats.__class__(**{**stats.__dict__, "test_accuracy": 0.9, "in_range": False})
    assert "little room" in warmup_lib.weakness(too_strong)


def test_the_cache_is_keyed_by_the_settings_and_the_code(monkeypatch, tmp_path):
    base = tiny.WarmupConfig()
    same = warmup_cache.cache_dir(tiny.WarmupConfig(), tmp_path)
    assert warmup_cache.cache_dir(base, tmp_path) == same and same.startswith(str(tmp_path / "gsm8k-seed0-"))
    others = {warmup_cache.cache_dir(tiny.WarmupConfig(**change), tmp_path)
              for change in ({"seed": 1}, {"task": "math"}, {"steps": 2000}, {"max_operations": 1}, {"lr": 1e-3})}
    assert len(others) == 5 and same not in others
    monkeypatch.setattr(warmup_cache, "code_version", lambda: "other code")
    assert warmup_cache.cache_dir(base, tmp_path) != same


def test_the_code_version_reads_what_the_warm_up_imports():
    names = {path.relative_to(warmup_cache._PACKAGE_ROOT).as_posix()
             for path in warmup_cache._imported_files("podsjax.tiny.warmup")}
    assert {"__init__.py", "tiny/__init__.py", "tiny/warmup.py", "tiny/sft.py", "tiny/build.py",
            "tiny/problems.py", "models/decoder.py", "sampler/sampling.py", "data/prompts.py"} <= names
    assert "rl/trainer.py" not in names and "tiny/warmup_cache.py" not in names


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(warmup_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert warmup_cache.default_cache_root() == str(tmp_path / "mine")
    monkeypatch.delenv(warmup_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert warmup_cache.default_cache_root() == str(tmp_path / "xdg" / "podsjax" / "tiny_warmup")


def test_the_quick_start_its_baseline_and_a_rerun_share_one_warm_up(monkeypatch, tmp_path):
    asked = []

    def fake_warm_up(directory, config, log=None):
        asked.append((directory, config))
        return types.SimpleNamespace(path=directory, cached=len(asked) > 1, total_seconds=1.0, test_accuracy=0.3)

    monkeypatch.setattr(tiny, "warm_up", fake_warm_up)
    for argv in (["--mesh", "8"], ["--mesh", "8", "--method", "grpo"], ["--method", "grpo-ga", "--time-budget", "9"]):
        _, config = flags.parse("gsm8k", [*argv, "--out", str(tmp_path / str(len(asked)))])
        run_setup._tiny(config, str(tmp_path / str(len(asked))))
    assert len({directory for directory, _ in asked}) == 1
    directory, settings = asked[0]
    assert directory == warmup_cache.cache_dir(settings) and settings.seed == 0
    # Another seed, or another step cap, is another warm-up.
    for argv in (["--seed", "1"], ["--warmup-steps", "50"]):
        _, config = flags.parse("gsm8k", [*argv, "--out", str(tmp_path / "x")])
        run_setup._tiny(config, str(tmp_path / "x"))
    assert len({directory for directory, _ in asked}) == 3


def test_a_warm_up_another_run_renamed_in_after_the_check_is_kept(tmp_path, monkeypatch):
    directory, staging = tmp_path / "w", tmp_path / "w.partial-mine"
    staging.mkdir()
    (staging / "ours").write_text("")
    directory.mkdir()
    (directory / "theirs").write_text("")  # renamed there after this call found no finished warm-up
    found = iter([None])
    monkeypatch.setattr(warmup_lib, "load_cached", lambda d, c: next(found, "their stats"))
    assert warmup_lib._publish(str(staging), str(directory), tiny.WarmupConfig(), overwrite=False) == "their stats"
    assert os.listdir(directory) == ["theirs"]


def test_a_killed_warm_ups_staging_is_removed_and_a_live_ones_kept(tmp_path, monkeypatch):
    import socket
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    names = {"w.partial-k1ll3d": False, f"w.partial-{host}.{gone.pid}.ab12": False,  # old; a process that is gone
             f"w.partial-{host}.{os.getpid()}.cd34": True, "w.partial-elsewhere.1.ef56": True, "x.partial-old": True}
    for name in names:
        (tmp_path / name).mkdir()
    day_ago = os.path.getmtime(tmp_path) - 2 * 86400
    for name in ("w.partial-k1ll3d", "x.partial-old"):
        os.utime(tmp_path / name, (day_ago, day_ago))

    def stop(*args):
        raise RuntimeError("stopped before training")

    monkeypatch.setattr(warmup_lib, "_build", stop)
    with pytest.raises(RuntimeError, match="stopped"):
        tiny.warm_up(tmp_path / "w", **SHORT)
    assert sorted(os.listdir(tmp_path)) == sorted(name for name, kept in names.items() if kept)


def test_a_resumed_run_keeps_its_own_warm_up_and_a_multi_host_run_shares_one_in_its_directory(monkeypatch, tmp_path):
    from podsjax.devices import hosts

    asked = []

    def fake_warm_up(directory, config, log=None):
        asked.append(directory)
        return types.SimpleNamespace(path=directory, cached=True, total_seconds=1.0, test_accuracy=0.3)

    monkeypatch.setattr(tiny, "warm_up", fake_warm_up)
    monkeypatch.delenv(warmup_cache.CACHE_ENV, raising=False)
    out = tmp_path / "run"
    _, config = flags.parse("gsm8k", ["--out", str(out)])
    (out / "tiny_warmup").mkdir(parents=True)  # made by a run started before the shared cache
    run_setup._tiny(config, str(out))
    assert asked[-1] == str(out / "tiny_warmup")
    other = tmp_path / "other"
    monkeypatch.setattr(hosts, "count", lambda: 2)
    monkeypatch.setattr(hosts, "barrier", lambda name: None)
    run_setup._tiny(config, str(other))
    assert asked[-1] == str(other / "tiny_warmup")  # on the filesystem the hosts share, not each host's cache
    monkeypatch.setenv(warmup_cache.CACHE_ENV, str(tmp_path / "shared-cache"))
    run_setup._tiny(config, str(other))
    assert asked[-1].startswith(str(tmp_path / "shared-cache"))
