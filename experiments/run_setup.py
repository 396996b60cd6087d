"""What a run is built from, each checked before the run directory is written: the mesh, the
data, the tiny preset, the rewards (``--reward`` modules imported in a child first)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from experiments import launch_checks
from experiments.config import ExperimentConfig
from experiments.usage import UsageError, mesh_device_count
from podsjax import models as pm
from podsjax import rewards as rewards_lib
from podsjax import rl
from podsjax.data import datasets as data, prompts
from podsjax.devices import hosts
from podsjax.devices import mesh as mesh_lib

TINY_HINT = ("no --model given: using the built-in tiny preset (a small Qwen2-architecture model warmed up "
             "in-process). For a real run, download a checkpoint first and pass --model /path/to/Qwen2.5-3B-Instruct")
# How long importing a --reward module may take (in a child process, before the run starts).
# Generous: a module that imports torch on a cold disk takes tens of seconds.
REWARD_IMPORT_TIMEOUT_S = 120.0


def _mesh(spec, topology: str | None = None):
    if topology is not None:
        return _topology_mesh(spec, topology)
    if spec is None:
        return None
    wanted = mesh_device_count(spec)
    if jax.default_backend() != "cpu" and jax.device_count() < wanted:
        raise UsageError(f"--mesh {spec} needs {wanted} devices but this {jax.default_backend()} host has "
                         f"{jax.device_count()}")
    return _make_mesh(spec)


def _make_mesh(spec, devices=None):
    try:
        return mesh_lib.make_mesh(spec, devices=devices)
    except ValueError as exc:
        raise UsageError(f"--mesh {spec}: {exc}") from None


def _topology_mesh(spec, topology: str):
    """The mesh over a TPU slice's or a GPU host's compile-only devices (all of them unless
    --mesh names fewer)."""
    from podsjax.devices.topology import compile_only_devices

    try:
        devices = compile_only_devices(topology)
    except ValueError as exc:
        raise UsageError(f"--topology {topology}: {exc}") from None
    wanted = len(devices) if spec is None else mesh_device_count(spec)
    if wanted > len(devices):
        raise UsageError(f"--mesh {spec} needs {wanted} devices but --topology {topology} has {len(devices)}")
    return _make_mesh(spec, devices[:wanted])


def _load_tasks(config: ExperimentConfig):
    d = config.data
    columns = d.columns(config.task) or None
    return tuple(_load_split(config.task, split, path, columns, d.hub)
                 for split, path in ((d.train_split, d.train), (d.test_split, d.test)))


def _load_split(task: str, split: str, path: str | None, columns: dict | None = None, hub: str | None = None):
    try:
        return data.load_task(task, split, path=path, columns=columns, hub=hub).examples
    except data.DataError as exc:
        hint = "" if path is not None else " (on the command line: --dataset DIR or a Hub name, or --data and --eval-data)"
        if path is None and hub is not None and not os.path.exists(hub.split(":")[0]):  # a mistyped local path?
            hint = f" ({hub} is no local file or directory either; on the command line: --dataset DIR or a Hub name)"
        raise UsageError(f"{exc}{hint}") from None


def _tiny(config, out_dir):
    from podsjax import tiny
    from podsjax.tiny import warmup_cache

    print(TINY_HINT, flush=True)
    seed = config.run.seed
    steps = {"steps": config.tiny.warmup_steps} if config.tiny.warmup_steps else {}
    max_operations = config.tiny.max_operations
    settings = tiny.WarmupConfig(seed=seed, data_seed=seed, task=config.task, max_operations=max_operations, **steps)
    directory = config.tiny.warmup_dir or _warmup_dir(settings, out_dir)

    def warm_up():
        try:
            return tiny.warm_up(directory, settings, log=lambda line: print(line, flush=True))
        except tiny.WarmupError as exc:
            raise UsageError(str(exc)) from None
        except OSError as exc:
            if config.tiny.warmup_dir or exc.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise
            raise UsageError(f"cannot write the tiny warm-up cache {directory}: {exc.strerror}; set "
                             f"${warmup_cache.CACHE_ENV} or pass --warmup-dir DIR") from None

    # Process 0 warms up; the others then find its result (in a directory they share, when there are several).
    stats = warm_up() if hosts.is_primary() else None
    hosts.barrier("tiny warm-up")
    stats = stats or warm_up()
    how = "reused" if stats.cached else f"trained in {stats.total_seconds:.0f} s"
    print(f"tiny preset: warm-up test accuracy {stats.test_accuracy:.0%} ({how}; cached in {directory})",
          flush=True)
    # The test split is a prefix-stable stream, so a larger --eval-limit extends it.
    num_test = max(tiny.TEST_PROBLEMS, config.run.eval_limit or 0)
    train_set, test_set = tiny.tiny_tasks(seed, task=config.task, num_test=num_test, max_operations=max_operations)
    if len(test_set) < num_test:
        print(f"tiny preset: the {config.task} test split holds {len(test_set)} problems (at most "
              f"{tiny.MAX_TEST_PROBLEMS}); --eval-limit {num_test} evaluates all of them", flush=True)
    return stats.path, train_set, test_set


def _warmup_dir(settings, out_dir: str) -> str:
    """Where the tiny preset's warm-up is when --warmup-dir names none.

    Every run on a host that would train the same warm-up (a rerun, another method, a
    comparison) shares the cache's. A run started before that cache keeps ``<out>/tiny_warmup``
    when it resumes. A run over several hosts uses ``<out>/tiny_warmup`` too, on the filesystem
    they share, unless ``$PODSJAX_WARMUP_CACHE_DIR`` names a cache (which must then be shared).
    """
    from podsjax.tiny import WARMUP_DIRNAME, warmup_cache

    in_run = os.path.join(out_dir, WARMUP_DIRNAME)
    if os.path.isdir(in_run) or (hosts.count() > 1 and not os.environ.get(warmup_cache.CACHE_ENV)):
        return in_run
    return warmup_cache.cache_dir(settings)

def check_sizes(config: ExperimentConfig) -> None:
    """Prompt + completion within the checkpoint's positions, from its config.json (or the
    tiny preset's model) before any weight is read; and the tiny preset's training set
    against a step's prompts before it warms up (a checkpoint's is checked once it loads)."""
    if config.model.path is None:
        from podsjax.rl import prompt_source
        from podsjax.tiny import build, problems

        prompt_source.check_step_size(problems.TRAIN_PROBLEMS, config.run.prompts_per_step)
        limit, model = build.TINY_MODEL.max_position_embeddings, "the tiny preset's model"
    else:
        try:
            limit, model = pm.from_hf_config(config.model.path).max_position_embeddings, f"--model {config.model.path}"
        except (OSError, ValueError):
            return  # the model's own load reports what is wrong with its config.json
    try:
        config.run.check_positions(limit, model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_vocab(tokenizer, path: str) -> None:
    """The tokenizer's ids against the model's vocabulary, from config.json before any weight is read."""
    try:
        vocab_size = pm.from_hf_config(path).vocab_size
    except (OSError, ValueError):
        return  # the model's own load reports what is wrong with its config.json
    prompts.check_vocab(tokenizer, vocab_size, f"--model {path}")

# Run by check_reward_imports in a child: imports argv[1] with the parent's sys.path (argv[2])
# and writes what happened to argv[3]. An exception is left to the parent's own import, which
# reports it as it always has; what ends or stops a process is reported from here.
_IMPORT_CHILD = """\
import importlib, json, os, sys
sys.path[:] = json.loads(sys.argv[2])
try:
    importlib.import_module(sys.argv[1])
    result = "ok"
except Exception:
    result = "ok"
except BaseException as exc:
    result = "raised " + (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
with open(sys.argv[3], "w") as f:
    f.write(result)
os._exit(0)  # the module's threads and exit hooks must not keep this process alive
"""


def check_reward_imports(config: ExperimentConfig, timeout_s: float | None = None) -> None:
    """Imports the module of each ``--reward module:function`` in a child process first.

    User code at import time can end the process (``os._exit``, a crash, ``sys.exit``) or
    never return; in the run itself that is an exit with no message, or a run that hangs
    before its first line. In a child it is one line naming the module.
    """
    timeout_s = REWARD_IMPORT_TIMEOUT_S if timeout_s is None else timeout_s
    for name, _ in config.rewards.extras():
        module, colon, _ = name.partition(":")
        if not colon or not module:
            continue  # a registered name: the library's own
        problem = _import_in_child(module, timeout_s)
        if problem is not None:
            raise UsageError(f"--reward {name}: importing {module} {problem}")


def _import_in_child(module: str, timeout_s: float) -> str | None:
    """What went wrong importing ``module`` in a fresh interpreter (None: nothing)."""
    with tempfile.TemporaryDirectory(prefix="podsjax-reward-import-") as tmp:
        result = os.path.join(tmp, "result")
        # Its own session, so that the whole group (the module may start processes) can be killed;
        # no accelerator, which this process holds already.
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        child = subprocess.Popen([sys.executable, "-c", _IMPORT_CHILD, module, json.dumps(sys.path), result],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 env=env, start_new_session=True)
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        if code is None:
            return (f"did not finish within {timeout_s:g} s (it hangs or waits at import time); "
                    "move slow work out of import time")
        try:
            with open(result, encoding="utf-8") as f:
                outcome = f.read()
        except OSError:
            outcome = None
    if outcome == "ok":
        return None
    if outcome is not None:
        return outcome.splitlines()[0] if outcome.strip() else "raised an exception"
    if code < 0:
        return f"ended the process (killed by {signal.Signals(-code).name})"
    return f"ended the process (exit status {code}, with no error: os._exit or a crash at import time)"


def _dtype(config: ExperimentConfig):
    return jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32


def make_rewards(config: ExperimentConfig):
    """The run's reward functions and weights: ``default_rewards(task, **rewards.weights())``,
    then the user's own (``rewards.extra``: a registered name or module:function, weighted).
    """
    try:
        defaults = rewards_lib.default_rewards(config.task, **config.rewards.weights())
        extra = tuple(rewards_lib.WeightedReward(name, weight) for name, weight in config.rewards.extras())
        return rewards_lib.as_weighted((*defaults, *extra))
    except (KeyError, TypeError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise UsageError(f"--reward: {message}") from None


def _check_rows(mesh, algo, run_config) -> None:
    """Rollout rows are split over the mesh's batch shards, and trained rows into micro-batches."""
    prompt_rows = rl.prompt_rows(run_config, algo)
    launch_checks.check_rows_over(prompt_rows * algo.n, mesh_lib.shard_count(mesh, "batch"))
    trained, steps = prompt_rows * algo.m, algo.steps_per_generation
    if trained % (steps * algo.grad_accum) == 0:
        return
    if steps == 1:
        raise UsageError(f"{trained} trained rows per update (prompt rows x --m) do not split into --grad-accum "
                         f"{algo.grad_accum} micro-batches; change --grad-accum, --m or --prompts-per-step")
    raise UsageError(f"{trained} trained rows per step (prompt rows x --m) do not split into "
                     f"--algorithm.steps_per_generation {steps} mini-batches of --grad-accum {algo.grad_accum} "
                     "micro-batches; change one of them, --m or --prompts-per-step")
