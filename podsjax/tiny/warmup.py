"""The tiny preset's warm-up: a short supervised fine-tune to a non-trivial starting accuracy.

RL from a random policy never sees a reward, so the tiny policy is first taught the
answer format and some arithmetic by next-token cross-entropy on
``<chat-template prompt><think>steps</think><answer>N</answer><|im_end|>``, with the
loss on the completion only. The prompt is rendered by ``podsjax.data.prompts`` exactly as
the RL loop renders it (default system prompt, chat template, no extra special
tokens), so the warm-up trains on the inputs RL will see.

Training stops as soon as greedy accuracy on a validation split reaches
``target_accuracy``, or after ``steps`` steps, never on the wall clock: the same settings
give the same weights on a quiet machine and a busy one. The starting policy is then right
some of the time (10-60%) and RL has room to improve; one that ends weaker says so. The
result is a normal HF checkpoint directory plus ``warmup.json``; a second call with the
same settings reuses it without training (``podsjax.tiny.warmup_cache`` keeps one per
settings and code version for every run to share).

The training pieces (SFT batches, loss, step, greedy evaluation) live in
``podsjax.tiny.sft``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import tempfile
import time
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from podsjax.data import prompts as prompts_lib
from podsjax.models import Decoder, ModelConfig, from_pretrained, save_pretrained
from podsjax.sampler import sampling
from podsjax.tiny.build import TINY_MODEL, build_tiny_checkpoint, check_tiny_model
from podsjax.tiny.problems import TASKS, check_task, generate_problems, make_splits
from podsjax.tiny.sft import evaluate_greedy, make_sft_optimizer, make_sft_step, tokenize_sft

MARKER_FILE = "warmup.json"
WARMUP_DIRNAME = "tiny_warmup"
_FORMAT_VERSION = 3  # 2: the model is recorded as ModelConfig fields; 3: no wall-clock limit
_READABLE_VERSIONS = (2, 3)  # a version-2 warm-up is read, its wall-clock limit dropped
_STAGING = ".partial-"  # a warm-up in progress: <directory>.partial-XXXX, renamed to <directory> when done
_STALE_STAGING_S = 86400.0  # another host's staging directory untouched this long was left by a killed warm-up


class WarmupError(ValueError):
    """A warm-up cache does not match the requested settings, or the directory is unusable."""


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """Settings of the supervised warm-up (all of them key the cache).

    Attributes:
        steps: the most optimizer steps; training usually stops earlier, at the target.
            Training never stops on the wall clock, so a busy machine trains the same policy.
        batch_size: sequences per step.
        lr: peak AdamW learning rate (linear warm-up, then cosine decay over ``steps``).
        warmup_steps: steps of the linear warm-up.
        weight_decay: AdamW weight decay.
        seed: seeds the model init and the batch order.
        data_seed: seeds the problems (the splits ``tiny_tasks(data_seed, task=task)`` returns).
        task: the tiny task: "gsm8k", "math" or "chemistry" (``tiny.problems.TASKS``).
        max_operations: gsm8k only: at most this many operations per problem (1: the
            easier one-step task); None: the task as it is.
        eval_every: steps between validation evaluations.
        validation_size: validation problems per evaluation (greedy decoding).
        test_size: test problems scored at the end (the reported accuracy).
        target_accuracy: stop once validation accuracy reaches this.
        min_accuracy, max_accuracy: the band a usable starting policy must land in;
            ``WarmupStats.in_range`` reports whether the test accuracy did.
        max_new_tokens: the evaluation's completion budget.
        eval_batch_size: prompts per generate call (one compiled shape).
        pool_size: distinct training problems (tokenized once, reshuffled every epoch); a
            task with fewer distinct training problems uses all it has.
        model: the tiny model's shape (a ModelConfig; see podsjax.tiny.tiny_model).
    """

    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    data_seed: int = 0
    task: str = "gsm8k"
    max_operations: int | None = None
    eval_every: int = 20
    validation_size: int = 64
    test_size: int = 128
    target_accuracy: float = 0.3
    min_accuracy: float = 0.1
    max_accuracy: float = 0.6
    max_new_tokens: int = 40
    eval_batch_size: int = 64
    pool_size: int = 8192
    model: ModelConfig = TINY_MODEL

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "validation_size", "test_size", "max_new_tokens",
                     "eval_batch_size", "pool_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"WarmupConfig.{name} must be a positive int, got {value!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"WarmupConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.lr > 0:
            raise ValueError(f"WarmupConfig.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"WarmupConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.min_accuracy <= self.target_accuracy <= self.max_accuracy <= 1:
            raise ValueError("WarmupConfig needs 0 <= min_accuracy <= target_accuracy <= max_accuracy <= 1, got "
                             f"{self.min_accuracy}, {self.target_accuracy}, {self.max_accuracy}")
        if self.task not in TASKS:
            raise ValueError(f"WarmupConfig.task must be one of {', '.join(TASKS)}, got {self.task!r}")
        check_task(self.task, self.max_operations)
        check_tiny_model(self.model)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> WarmupConfig:
        record = {k: v for k, v in record.items() if k != "max_seconds"}  # format 2's wall-clock limit
        return cls(**{**record, "model": ModelConfig(**record["model"])})


@dataclasses.dataclass(frozen=True)
class WarmupStats:
    """What a warm-up did; stored in ``<directory>/warmup.json``.

    Attributes:
        path: the warmed-up checkpoint directory.
        config: the settings it ran with.
        steps: optimizer steps taken.
        stop_reason: "target" (validation reached the target) or "steps" (the step cap came
            first); "time" in a format-2 warm-up, which also stopped on the wall clock.
        train_seconds: wall-clock of the training phase (compiles and evaluations included).
        total_seconds: the whole call that trained (build, train, test, save).
        final_loss: the last step's mean completion cross-entropy.
        validation_accuracy: greedy accuracy on the validation split at the stop.
        test_accuracy: greedy accuracy on the first ``test_size`` test problems.
        test_format: the fraction of those test completions in the exact think/answer format.
        in_range: ``min_accuracy <= test_accuracy <= max_accuracy``.
        history: one record per evaluation: step, seconds, loss, validation accuracy.
        cached: True when this call reused an earlier warm-up instead of training.
    """

    path: str
    config: WarmupConfig
    steps: int
    stop_reason: str
    train_seconds: float
    total_seconds: float
    final_loss: float
    validation_accuracy: float
    test_accuracy: float
    test_format: float
    in_range: bool
    history: tuple[dict[str, float], ...] = ()
    cached: bool = False

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(config=self.config.to_json(), history=list(self.history), version=_FORMAT_VERSION)
        del out["cached"], out["path"]
        return out

    @classmethod
    def from_json(cls, path: str, record: dict[str, Any]) -> WarmupStats:
        fields = {f.name for f in dataclasses.fields(cls)} - {"path", "config", "history", "cached"}
        return cls(path=path, config=WarmupConfig.from_json(record["config"]),
                   history=tuple(record.get("history", ())), cached=True, **{k: record[k] for k in fields})


# ------------------------------------------------------------------ the warm-up


def _read_marker(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, MARKER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise WarmupError(f"unreadable warm-up marker {path} ({exc}); delete the directory or pass overwrite=True") \
            from None


def load_cached(directory: str | os.PathLike, config: WarmupConfig | None = None) -> WarmupStats | None:
    """The stats of a finished warm-up in ``directory``, or None when there is none.

    Raises:
        WarmupError: it was made with settings other than ``config``.
    """
    directory = os.fspath(directory)
    record = _read_marker(directory)
    if record is None:
        return None
    if record.get("version") not in _READABLE_VERSIONS:
        raise WarmupError(f"{directory} holds a warm-up of format version {record.get('version')}, "
                          f"expected {_FORMAT_VERSION}; pass overwrite=True to redo it")
    try:
        stats = WarmupStats.from_json(directory, record)
    except (KeyError, TypeError, ValueError) as exc:
        raise WarmupError(f"malformed warm-up marker in {directory} ({type(exc).__name__}: {exc}); "
                          "pass overwrite=True to redo it") from None
    if config is not None and stats.config != config:
        changed = sorted(k for k, v in config.to_json().items() if stats.config.to_json().get(k) != v)
        raise WarmupError(f"{directory} holds a warm-up made with other settings ({', '.join(changed)} differ); "
                          "pass overwrite=True to redo it")
    return stats


def warm_up(directory: str | os.PathLike, config: WarmupConfig | None = None, *, overwrite: bool = False,
            log: Callable[[str], None] | None = None, **overrides: Any) -> WarmupStats:
    """Builds the tiny model, fine-tunes it to a non-trivial accuracy and caches the result.

    Args:
        directory: where the warmed-up checkpoint goes (the CLI's default:
            ``podsjax.tiny.warmup_cache.cache_dir(config)``, shared by every run).
            It then loads with ``podsjax.models.from_pretrained`` and
            ``podsjax.data.prompts.load_tokenizer``.
        config: the settings; defaults to ``WarmupConfig()``.
        overwrite: redo a warm-up already in ``directory``, even with other settings.
        log: called with one-line progress messages (e.g. ``print``); None is silent.
        **overrides: ``WarmupConfig`` fields to replace (``steps=``, ``batch_size=``,
            ``lr=``, ``seed=``, ``target_accuracy=`` ...).

    Returns:
        The WarmupStats; ``cached`` is True when an earlier identical warm-up was reused.

    Raises:
        WarmupError: ``directory`` holds a warm-up with other settings (and not ``overwrite``),
            or is a non-empty directory that is not a warm-up.
    """
    config = dataclasses.replace(config or WarmupConfig(), **overrides)
    directory = os.path.abspath(os.fspath(directory))
    say = log or (lambda message: None)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise WarmupError(f"{directory} exists and is not a directory")
    if not overwrite:
        cached = load_cached(directory, config)
        if cached is not None:
            say(f"tiny warm-up: reusing {directory} (test accuracy {cached.test_accuracy:.0%})")
            _warn_if_weak(cached, say)
            return cached
        if os.path.isdir(directory) and os.listdir(directory):
            raise WarmupError(f"{directory} is not empty and holds no finished warm-up; "
                              "pass overwrite=True to replace it")
    started = time.perf_counter()
    # Work in a sibling staging directory of this call's own and rename at the end, so a killed
    # warm-up never leaves a directory that looks finished, and two runs that warm up at once
    # (sharing the cache) do not write into each other's.
    try:
        os.makedirs(os.path.dirname(directory), exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # e.g. $PODSJAX_WARMUP_CACHE_DIR or $XDG_CACHE_HOME names a file
        raise WarmupError(f"cannot make the warm-up folder {os.path.dirname(directory)}: a file stands in its "
                          "path") from None
    _remove_stale_staging(directory)
    owner = f"{socket.gethostname()}.{os.getpid()}."  # who stages, so that a later call knows when it died
    staging = tempfile.mkdtemp(prefix=os.path.basename(directory) + _STAGING + owner, dir=os.path.dirname(directory))
    try:
        result = _build(directory, staging, config, say, started, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if result.cached:
        say(f"tiny warm-up: another run finished the same warm-up first; reusing {directory}")
        _warn_if_weak(result, say)
        return result
    say(f"tiny warm-up: {result.steps} steps in {result.train_seconds:.0f}s ({_STOPPED[result.stop_reason]}), "
        f"test accuracy {result.test_accuracy:.0%} (format {result.test_format:.0%}), saved to {directory}")
    _warn_if_weak(result, say)
    return result


def _build(directory: str, staging: str, config: WarmupConfig, say: Callable[[str], None], started: float,
           overwrite: bool) -> WarmupStats:
    """Builds and trains the warm-up in ``staging``, then renames it to ``directory``; the
    stats of the one already there when another call finished first (``cached``)."""
    build_tiny_checkpoint(staging, seed=config.seed, model=config.model, task=config.task, overwrite=True)
    tokenizer = prompts_lib.load_tokenizer(staging)
    model, params = from_pretrained(staging)
    stats = _train(model, params, tokenizer, config, say)
    save_pretrained(model, stats.pop("params"), staging, overwrite=True)
    tokenizer.save_pretrained(staging)
    result = WarmupStats(path=directory, config=config, total_seconds=time.perf_counter() - started, **stats)
    with open(os.path.join(staging, MARKER_FILE), "w") as handle:
        json.dump(result.to_json(), handle, indent=2)
    return _publish(staging, directory, config, overwrite) or result


def _publish(staging: str, directory: str, config: WarmupConfig, overwrite: bool) -> WarmupStats | None:
    """Renames the finished ``staging`` to ``directory``; the stats of the warm-up another call
    put there first (None when this one's is there now)."""
    if not overwrite and (theirs := load_cached(directory, config)) is not None:
        return theirs
    if overwrite:
        shutil.rmtree(directory, ignore_errors=True)
    else:  # only an empty one: another call may have renamed its warm-up there since the check
        try:
            os.rmdir(directory)
        except OSError:  # absent, or no longer empty
            pass
    try:
        os.replace(staging, directory)
    except OSError:  # another call renamed its own there in between
        theirs = None if overwrite else load_cached(directory, config)
        if theirs is None:
            raise
        return theirs
    return None


def _remove_stale_staging(directory: str) -> None:
    """Deletes the staging directories of ``directory`` that killed warm-ups left behind: those
    of a process of this host that is gone, and any untouched for longer than a warm-up takes."""
    parent, prefix = os.path.dirname(directory), os.path.basename(directory) + _STAGING
    host, cutoff = socket.gethostname(), time.time() - _STALE_STAGING_S
    for name in os.listdir(parent):
        if not name.startswith(prefix):
            continue
        path = os.path.join(parent, name)
        try:
            old = os.path.getmtime(path) < cutoff
        except OSError:  # gone meanwhile
            continue
        owner, _, pid = name[len(prefix):].rpartition(".")[0].rpartition(".")  # <host>.<pid>.<random>
        if old or (owner == host and pid.isdigit() and not _alive(int(pid))):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        pass
    return True


_STOPPED = {"target": "validation reached the target", "steps": "the step cap", "time": "the wall-clock limit"}


def weakness(stats: WarmupStats) -> str | None:
    """One line saying that a warm-up ended weak or too strong, and what to do; None when it is usable."""
    config = stats.config
    if stats.test_accuracy > config.max_accuracy:
        return (f"tiny warm-up: WARNING test accuracy {stats.test_accuracy:.0%} is above {config.max_accuracy:.0%}, "
                "so RL has little room to improve; lower target_accuracy")
    if stats.stop_reason == "target" and stats.in_range:
        return None
    if stats.stop_reason == "target":
        why = f"validation reached the target but test accuracy is {stats.test_accuracy:.0%}"
    else:
        why = (f"validation did not reach the target {config.target_accuracy:.0%} in {stats.steps} steps "
               f"(test accuracy {stats.test_accuracy:.0%})")
    return (f"tiny warm-up: WARNING it ended weak: {why}, so RL starts with little reward signal; raise the step "
            f"cap (--warmup-steps {2 * config.steps}; it is {config.steps}) or try another --seed")


def _warn_if_weak(stats: WarmupStats, say: Callable[[str], None]) -> None:
    line = weakness(stats)
    if line is not None:
        say(line)


def _train(model: Decoder, params: Any, tokenizer, config: WarmupConfig, say: Callable[[str], None]) -> dict:
    splits = make_splits(config.data_seed, task=config.task, num_train=1, num_validation=config.validation_size,
                         num_test=config.test_size, max_operations=config.max_operations)
    examples = generate_problems(min(config.steps * config.batch_size, config.pool_size), config.data_seed, "train",
                                 config.task, at_most=True, max_operations=config.max_operations)
    data = tokenize_sft(tokenizer, examples)
    rng = np.random.default_rng(config.seed)
    order = np.zeros((0,), np.int64)
    prefix = jnp.asarray(data.prefix_ids)
    optimizer = make_sft_optimizer(config.lr, config.steps, config.warmup_steps, config.weight_decay)
    opt_state = optimizer.init(params)
    step_fn = make_sft_step(model, optimizer)
    generator = sampling.Generator(model)  # every evaluation of the warm-up reuses its programs

    def evaluate(examples):
        return evaluate_greedy(model, params, tokenizer, examples, max_new_tokens=config.max_new_tokens,
                               batch_size=config.eval_batch_size, task=config.task, generator=generator)

    started = time.perf_counter()
    history: list[dict[str, float]] = []
    loss = float("nan")
    validation = {"accuracy": 0.0}
    stop_reason, step = "steps", 0
    while step < config.steps:
        if len(order) < config.batch_size:  # a new epoch over the pool, reshuffled
            order = np.concatenate([order, rng.permutation(len(examples))])
        rows, order = order[:config.batch_size], order[config.batch_size:]
        params, opt_state, loss_value = step_fn(params, opt_state, prefix, data.suffix_ids[rows],
                                                data.suffix_mask[rows], data.loss_mask[rows])
        step += 1
        if step % config.eval_every == 0 or step == config.steps:
            loss = float(loss_value)
            eval_started = time.perf_counter()
            validation = evaluate(splits.validation)
            elapsed = time.perf_counter() - started
            history.append({"step": step, "seconds": round(elapsed, 2), "loss": loss,
                            "eval_seconds": round(time.perf_counter() - eval_started, 2),
                            "validation_accuracy": validation["accuracy"], "validation_format": validation["format"]})
            say(f"tiny warm-up: step {step} loss {loss:.3f} validation accuracy {validation['accuracy']:.0%} "
                f"format {validation['format']:.0%} ({elapsed:.0f}s, eval {history[-1]['eval_seconds']:.1f}s)")
            if validation["accuracy"] >= config.target_accuracy:
                stop_reason = "target"
                break
    train_seconds = time.perf_counter() - started
    test = evaluate(splits.test)
    return dict(
        params=params, steps=step, stop_reason=stop_reason, train_seconds=train_seconds, final_loss=loss,
        validation_accuracy=validation["accuracy"], test_accuracy=test["accuracy"], test_format=test["format"],
        in_range=config.min_accuracy <= test["accuracy"] <= config.max_accuracy, history=tuple(history),
    )
