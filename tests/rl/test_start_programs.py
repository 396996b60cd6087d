"""The programs a run needs before its first step compile side by side (podsjax.rl.start_programs)."""

import os
import threading
import time

import pytest
from tiny_checkpoint import save_tiny_checkpoint

from podsjax import rl
from podsjax.devices import compilation
from podsjax.sampler import sampler_programs

PROGRAMS = ("generate[rollout_weights]", "generate[sample]", "update", "select[build_batch]")


class _Watched(dict):
    """``Programs._compiling`` that says when a caller found a compile in flight (it waits on it)."""

    def __init__(self):
        super().__init__()
        self.joined = threading.Event()

    def get(self, key, default=None):
        found = super().get(key, default)
        if found is not None:
            self.joined.set()
        return found


def _watched_programs():
    programs = sampler_programs.Programs(8)
    programs._compiling = _Watched()
    return programs


def test_a_program_asked_for_by_two_threads_compiles_once_while_another_compiles_beside_it():
    programs = _watched_programs()
    both_building = threading.Barrier(2, timeout=30)  # two keys must build at the same time
    a_building = threading.Event()
    builds = []

    def build(name):
        def run():
            builds.append(name)
            if name == "a":
                a_building.set()
            both_building.wait()
            if name == "a":
                assert programs._compiling.joined.wait(30), "no second caller joined the compile of a"
                time.sleep(0.2)  # a compile of known length, for the waiter to report
            return name
        return run

    results, timings = {}, {}
    threads = [threading.Thread(target=lambda k=k: results.setdefault(k, programs.compiled((k,), build(k), None)))
               for k in ("a", "b")]
    for t in threads:
        t.start()
    assert a_building.wait(30)  # "a" is in flight: this call joins it rather than building it
    waiter = programs.compiled(("a",), build("a again"), timings)
    for t in threads:
        t.join()
    assert sorted(builds) == ["a", "b"] and waiter == results["a"] == "a" and results["b"] == "b"
    assert programs.compiles["a"] == programs.compiles["b"] == 1
    assert timings["a"] >= 0.2  # the waiter reports the compile it waited for


def test_a_failed_compile_raises_in_the_thread_that_waited_and_compiles_again_when_asked():
    programs = _watched_programs()
    started = threading.Event()

    def failing():
        started.set()
        assert programs._compiling.joined.wait(30)
        raise ValueError("does not compile")

    errors = []
    owner = threading.Thread(target=lambda: errors.append(pytest.raises(ValueError, programs.compiled, ("k",),
                                                                        failing, None)))
    owner.start()
    assert started.wait(30)
    with pytest.raises(ValueError, match="does not compile"):
        programs.compiled(("k",), lambda: "never", None)
    owner.join()
    assert programs.compiled(("k",), lambda: "now", None) == "now" and programs.compiles["k"] == 1


def test_an_interrupt_as_a_compile_returns_leaves_no_thread_waiting_for_it(monkeypatch):
    programs = _watched_programs()
    started = threading.Event()

    def compile_then_interrupted():
        started.set()
        assert programs._compiling.joined.wait(30)  # the waiter below has joined this compile
        monkeypatch.setattr(programs, "remember", _interrupt)  # Ctrl-C lands as the compile returns
        return "program"

    owner = threading.Thread(target=lambda: pytest.raises(KeyboardInterrupt, programs.compiled, ("k",),
                                                          compile_then_interrupted, None))
    owner.start()
    assert started.wait(30)
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(pytest.raises(BaseException, programs.compiled, ("k",),
                                                                         lambda: "never", None)))
    waiter.start()
    owner.join(30)
    waiter.join(30)
    assert not waiter.is_alive(), "a thread still waits for the interrupted compile"
    assert errors and errors[0].type is KeyboardInterrupt
    monkeypatch.undo()
    assert programs.compiled(("k",), lambda: "again", None) == "again"  # asked again, it compiles


def _interrupt(*args):
    raise KeyboardInterrupt


def test_a_compile_pool_runs_jobs_beside_the_caller_and_raises_their_first_error():
    together = threading.Barrier(2, timeout=10)
    with compilation.CompilePool(2) as pool:
        job = pool.submit(together.wait)
        together.wait()  # only returns if the job runs beside this thread
        failed = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            pool.wait()
    assert job.done() and failed.done()
    with compilation.CompilePool(1) as pool:  # one thread: each job now, on the caller's
        assert pool.submit(threading.get_ident).result() == threading.get_ident()
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="compile threads must be an integer >= 1"):
            compilation.CompilePool(bad)
    with pytest.raises(ValueError, match="compile_threads must be >= 1"):
        rl.RunConfig(out_dir="x", max_steps=1, compile_threads=0)


def overlapping(intervals):
    """Pairs of compiles that ran at the same time."""
    return [(a[0], b[0]) for i, a in enumerate(intervals) for b in intervals[i + 1:] if a[1] < b[2] and b[1] < a[2]]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("start_ckpt"))


# Run in a process of its own: which programs compile is a fact of one process, and other
# test modules that ran before in this one may already hold some of them.
FIT_CHECK_RUN = """
import json, os, sys
import jax.numpy as jnp
import podsjax.models as pm
from experiments import paper_settings, runner
from podsjax import rl
from podsjax.data import datasets as data, prompts
checkpoint, gsm8k, out, threads, layers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
train = data.load_task("gsm8k", "train", path=os.path.join(gsm8k, "train.jsonl"), limit=4).examples
test = data.load_task("gsm8k", "test", path=os.path.join(gsm8k, "test.jsonl"), limit=4).examples
model, params = pm.from_pretrained(checkpoint, dtype=jnp.float32)
model = model.clone(rollout_layers=layers)
run = rl.RunConfig(out_dir=out, max_steps=1, prompts_per_step=2, max_new_tokens=8, max_prompt_length=256,
                   eval_every_s=0.0, reward_workers=1, progress=False, console=False, compile_threads=threads)
trainer = rl.Trainer(model, params, prompts.load_tokenizer(checkpoint), train, test,
                     paper_settings.method_config("pods", n=4, m=2), run, lora=pm.LoraConfig(rank=2, alpha=4.0))
trainer.weights.overlap_compiles = False  # as on a GPU, where the first step compiles nothing behind generation
try:
    runner._check_fits(trainer, limit=2**40)
    fit_check = dict(trainer.compile_counts)
    trainer.evaluate()
    trainer.rl_step()
finally:
    trainer.close()
print(json.dumps({"fit_check": fit_check, "after": dict(trainer.compile_counts),
                  "intervals": trainer.compile_log.intervals}))
"""


@pytest.mark.slow
@pytest.mark.cpu_mesh
@pytest.mark.parametrize("threads, layers", [(4, "unrolled"), (1, "scanned")])  # a GPU's layout, and a TPU's
def test_the_fit_check_compiles_what_the_first_evaluation_and_step_need(tiny_checkpoint, data_dir, tmp_path, threads,
                                                                        layers):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", FIT_CHECK_RUN, tiny_checkpoint, os.path.join(data_dir, "gsm8k"),
                           str(tmp_path / "run"), str(threads), layers], cwd=root, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    fit_check, after = result["fit_check"], result["after"]
    intervals = [tuple(i) for i in result["intervals"]]
    # The rollouts' and evaluation's sampling, the update, the batch builder, and in the
    # unrolled layout the rollout weights' merge: 5 programs at most before the first step.
    assert fit_check["select[build_batch]"] == 1 and fit_check["generate[sample]"] == 2, fit_check
    assert fit_check.get("generate[rollout_weights]", 0) == (layers == "unrolled"), fit_check
    # (Eager conversions such as a key's fold_in compile too, in milliseconds: not counted.)
    assert {k: v for k, v in after.items() if k in PROGRAMS} == {
        k: v for k, v in fit_check.items() if k in PROGRAMS}
    assert sum(v for k, v in fit_check.items() if k in PROGRAMS) <= 5
    pairs = overlapping([i for i in intervals if i[0] in PROGRAMS])
    if threads == 1:
        assert not pairs
    else:
        assert pairs, intervals
