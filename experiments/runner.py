"""Turns a resolved experiment config into a podsjax run: model, data, trainer, export, summary
(what the run is built from, checked first: ``experiments.run_setup``)."""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from experiments import completed, config_decoding, flags, launch_checks, run_dir
from experiments.config import ExperimentConfig
from experiments.run_setup import (
    _check_rows,
    _check_vocab,
    _dtype,
    _load_tasks,
    _mesh,
    _tiny,
    check_sizes,
    check_reward_imports,
    make_rewards,
)
from experiments.usage import CONFIG_FILE, DRY_RUN_FILE, UsageError
from podsjax import models as pm
from podsjax import rewards as rewards_lib
from podsjax import rl
from podsjax.data import prompts
from podsjax.devices import compilation, hosts
from podsjax.devices import dry_run as dry_run_lib
from podsjax.models import peft_io
from podsjax.rl import prompt_source
from podsjax.run import run_state


def run_experiment(config: ExperimentConfig, out_dir: str, *, overwrite: bool, resume: bool, dry_run: bool = False,
                   topology: str | None = None, started_at: float | None = None) -> int:
    config = flags.replace_run(config, out_dir=out_dir)
    if overwrite:
        run_dir.check_overwrite(out_dir, config)
    tokenizer_load = None
    if not dry_run and config.model.path is not None:
        # Importing transformers takes seconds (torch's import too, where installed): it runs
        # while the devices start and the data loads. A daemon: an error below need not wait.
        tokenizer_load = compilation.InBackground(lambda: prompts.load_tokenizer(config.model.path),
                                                  name="podsjax-tokenizer")
    mesh = _mesh(config.model.mesh, topology)
    # Every check that needs no model comes before anything is written to out_dir, so a
    # corrected rerun is not refused as "not empty".
    _check_rows(mesh, config.algorithm, config.run)
    check_sizes(config)
    check_reward_imports(config)
    make_rewards(config)
    tasks = tokenizer = model_load = None
    # A dry run reads local data files too: it had passed data the run then refused.
    local_data = config.model.path is not None and None not in (config.data.train, config.data.test)
    if tokenizer_load is not None or (dry_run and local_data):
        tasks = _load_tasks(config)  # a bad data file is refused before any weight is read
        prompt_source.check_step_size(len(tasks[0]), config.run.prompts_per_step)
    if tokenizer_load is not None and hosts.count() == 1:
        # The weights load while transformers imports (one process: on several, loading
        # gathers across processes, which must not race the checks' barriers).
        model_load = _load_model(config, config.model.path, mesh)
    if tokenizer_load is not None:
        tokenizer = tokenizer_load.result()
        _check_vocab(tokenizer, config.model.path)
        if tasks[0]:
            prompts.check_chat_template(tokenizer, tasks[0][0].prompt, system_prompt=config.run.system_prompt)
    hosts.barrier("run checked")  # every process has looked at out_dir before process 0 writes to it
    existed = os.path.isdir(out_dir)
    # A dry run deletes nothing, --overwrite or not, and records the config it planned only where
    # the run may follow it: never over the config.json of a model or of another run.
    write_config = not resume and (not dry_run or not existed or launch_checks.planned_only(out_dir))
    lock = _lock(out_dir)
    run_dir.ReplacedRun.restored.discard(os.path.realpath(out_dir))  # this run's stop speaks for itself
    before = None  # what out_dir held before this run wrote to it (process 0; a new run)
    replaced = None  # --overwrite's old run, aside until the new one finishes a step (process 0)
    failed = stopped = False
    try:
        try:
            if hosts.is_primary():
                run_dir.say_replaced_leftovers(out_dir, overwrite and not dry_run)
                if overwrite and not dry_run:
                    replaced = run_dir.ReplacedRun(out_dir)
                if not resume:
                    before = set(os.listdir(out_dir))
                if write_config:
                    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
                        json.dump(config_decoding.as_json(config), f, indent=2, sort_keys=True)
        except OSError as exc:
            raise UsageError(f"cannot write the run directory {out_dir}: {exc.strerror or exc}") from None
        hosts.barrier("run directory ready")
        if dry_run:
            return _dry_run(config, out_dir, mesh, topology)
        return _train_and_export(config, out_dir, mesh, started_at, tasks, tokenizer, model_load, replaced)
    except Exception:  # an error; an interrupt's line says to --resume, which starts it again
        failed = True
        raise
    except BaseException:
        stopped = True
        raise
    finally:
        if replaced is not None:  # under the lock: the old run goes, or comes back whole
            if (failed or stopped) and not run_dir.made_progress(out_dir, before):
                run_dir.remove_failed_start(out_dir, before, existed)
                replaced.put_back()
                print(f"--overwrite: the new run stopped before its first step; {out_dir} holds the run it was "
                      "to replace, as it was", file=sys.stderr, flush=True)
            else:
                replaced.drop()
        if lock is not None:
            lock.release()
        if failed and before is not None and replaced is None:  # a new run failed before its first step: nothing stays
            run_dir.remove_failed_start(out_dir, before, existed)


def _lock(out_dir: str) -> run_state.RunLock | None:
    """The run directory's lock (``podsjax.run.run_state.RunLock``), taken by process 0 for every
    process of the run before anything else is written there; None on the other processes."""
    lock, error = None, None
    if hosts.is_primary():
        try:
            lock = run_state.RunLock.acquire(out_dir)
        except run_state.RunLocked as exc:
            error = UsageError(str(exc))
        except OSError as exc:
            error = UsageError(f"cannot write the run directory {out_dir}: {exc.strerror or exc}")
    if not hosts.agree(float(error is None)):  # the others learn that process 0 was refused
        raise error or UsageError(f"process 0 could not lock the run directory {out_dir} (its error says why)")
    return lock


class _DropReplacedRun(rl.Hook):
    """Deletes the run that --overwrite replaces once the new run has finished its first step."""

    def __init__(self, replaced: run_dir.ReplacedRun):
        self.replaced = replaced

    def on_step(self, step, result):
        self.replaced.drop()


def _millions(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def _load_model(config: ExperimentConfig, checkpoint: str, mesh) -> compilation.InBackground:
    """``(model, params, seconds)`` of ``checkpoint``, loading on a thread of its own from now."""
    dtype, remat = _dtype(config), config.model.remat
    print(f"loading model from {checkpoint} ({jnp.dtype(dtype).name}, remat {remat}) ...", flush=True)

    def load():
        start = time.time()
        model, params = pm.from_pretrained(checkpoint, dtype=dtype, mesh=mesh, remat=remat)
        return model, params, time.time() - start

    return compilation.InBackground(load, name="podsjax-load", finish_before_exit=True)


def _train_and_export(config: ExperimentConfig, out_dir: str, mesh, started_at: float | None, tasks,
                      tokenizer=None, model_load: compilation.InBackground | None = None,
                      replaced: run_dir.ReplacedRun | None = None) -> int:
    if config.model.path is None:
        checkpoint, train_set, test_set = _tiny(config, out_dir)
    else:
        checkpoint = config.model.path
        train_set, test_set = tasks
    algo, run_config, lora = config.algorithm, config.run, config.lora
    dtype = _dtype(config)
    # The reward workers start up (processes importing the rewards) while the model loads
    # and the first programs load or compile; the first scoring waits for them.
    scorer = _reward_pool(config, out_dir).start(wait=False)
    try:
        model, params, load_s = (model_load or _load_model(config, checkpoint, mesh)).result()
        if tokenizer is None:  # the tiny preset's, written by its warm-up
            tokenizer = prompts.load_tokenizer(checkpoint)
            prompts.check_vocab(tokenizer, model.config.vocab_size, checkpoint)
        print(f"loaded {_millions(model.config.num_params)} params in {load_s:.1f} s", flush=True)
        start = time.time()
        trainer = rl.Trainer(model, params, tokenizer, train_set, test_set, algo, run_config, lora=lora,
                             rewards=make_rewards(config), started_at=started_at, scorer=scorer)
    except BaseException:
        scorer.close()
        raise
    if lora is None:
        params = None  # the trainer holds the policy; a second copy of the weights would stay alive
    if replaced is not None:
        trainer.add_hook(_DropReplacedRun(replaced))
    try:
        _check_fits(trainer)
    except BaseException:
        trainer.close()
        raise
    state_lora = None
    history = trainer.run()
    if lora is not None:
        state_lora = trainer.state.params
        final_params = params
    else:
        final_params = trainer.state.params
    export_dir = os.path.join(out_dir, completed.FINAL_MODEL)
    # In the checkpoint's dtype: a bf16 full fine-tune's fp32 master weights are not what was loaded.
    pm.save_pretrained(model, final_params, export_dir, lora=state_lora, dtype=dtype, overwrite=True,
                       tokenizer_from=checkpoint)
    if state_lora is not None:  # the adapters alone too, for PEFT users: PeftModel.from_pretrained(base, dir)
        adapter_dir = os.path.join(out_dir, completed.FINAL_ADAPTER)
        peft_io.save_peft_adapter(model, state_lora, adapter_dir, overwrite=True,
                                  base_model_name_or_path=config.model.hub_name or checkpoint)
        export_dir += f" (merged); PEFT adapter: {adapter_dir}"
    best = trainer.best.restore(trainer.state.params) if trainer.best is not None else None
    if best is not None:
        best_dir = os.path.join(out_dir, completed.BEST_MODEL)
        base, lora = (params, best) if lora is not None else (best, None)
        pm.save_pretrained(model, base, best_dir, lora=lora, dtype=dtype, overwrite=True, tokenizer_from=checkpoint)
        export_dir += (f"\nbest model ({trainer.best.accuracy:.1%} at step {trainer.best.step}; "
                       f"chosen on the eval split): {best_dir}")
    if hosts.is_primary():
        completed.mark_exported(out_dir, [name for name in completed.EXPORTS if os.path.isdir(os.path.join(out_dir, name))],
                                config.run)
        print_summary(config, history, trainer.step, trainer.host.elapsed_train_s,
                      time.time() - start, export_dir)
    return 0


def _reward_pool(config: ExperimentConfig, out_dir: str) -> rewards_lib.RewardPool:
    """The run's reward workers; what rewards print past a few KiB goes to the run log, not the console."""
    index = jax.process_index()
    log = os.path.join(out_dir, "run.log" if index == 0 else f"run.{index}.log")
    return rewards_lib.RewardPool(config.run.reward_workers, timeout_s=config.run.reward_timeout_s, output_log=log)


def _check_fits(trainer, limit: int | None = None) -> dry_run_lib.MemoryPlan | None:
    """Before the first step, on a device that reports its memory: stop a run that cannot fit."""
    limit = limit if limit is not None else dry_run_lib.device_memory_limit(dry_run_lib.run_device(trainer.model.mesh))
    if limit is None:  # CPU: nothing to check against
        return None
    print("checking that the run fits in device memory ...", flush=True)
    memory = trainer.memory_plan()
    memory.limit = limit
    print("\n".join(memory.lines()), flush=True)
    memory.check_fits()
    return memory


def _dry_run_model(config, mesh):
    """The decoder from config.json alone (or the tiny preset's shape): no weights are read."""
    path = config.model.path
    if path is None:
        from podsjax.tiny import TINY_MODEL

        model_config, source = TINY_MODEL, "the tiny preset"
    else:
        try:
            model_config, source = pm.from_hf_config(path), path
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--model {path}: cannot read config.json ({exc})") from None
    dtype = _dtype(config)
    return pm.Decoder(model_config, dtype=dtype, param_dtype=dtype, remat=config.model.remat, mesh=mesh), source


def _dry_run(config: ExperimentConfig, out_dir: str, mesh, topology: str | None = None) -> int:
    """Compiles generate and the update, prints and writes memory and compile times; trains nothing."""
    algo, run_config, lora = config.algorithm, config.run, config.lora  # run() has checked the rows
    model, source = _dry_run_model(config, mesh)
    prompt_len = rl.padded_prompt_length(run_config)
    prompt_rows = rl.prompt_rows(run_config, algo)
    rows = prompt_rows * algo.m
    print(f"dry run: {source} ({_millions(model.config.num_params)} params, {config.model.dtype}, "
          f"{'LoRA rank ' + str(lora.rank) if lora else 'full fine-tune'}), {algo.algorithm}: "
          f"{prompt_rows} prompt rows x {algo.n} samples, update on {rows} rows x "
          f"{prompt_len} + {run_config.max_new_tokens} tokens", flush=True)
    eos = model.config.eos_token_id
    eos = (eos,) if isinstance(eos, int) else tuple(eos or ()) or (model.config.pad_token_id or 0,)
    compiles = compilation.CompileLog(lambda line: print(line, flush=True), min_report_s=0.0)
    memory = dry_run_lib.plan(model, algo, lora, base_params=dry_run_lib.abstract_base(model),
                              prompts=prompt_rows, prompt_len=prompt_len,
                              max_new_tokens=run_config.max_new_tokens,
                              eos_token_ids=eos, pad_token_id=model.config.pad_token_id or 0, compile_log=compiles)
    print("\n".join(memory.lines()), flush=True)
    report = {**memory.to_json(), "shapes": {"prompts": prompt_rows, "samples": algo.n,
                                             "update_rows": rows, "prompt_len": prompt_len,
                                             "max_new_tokens": run_config.max_new_tokens}}
    path = os.path.join(out_dir, DRY_RUN_FILE)
    if hosts.is_primary():  # whole or not at all: a torn file would read as no podsjax dry run's
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)
        os.replace(path + ".tmp", path)
    memory.check_fits()
    if topology is not None and mesh.devices.flat[0].platform == "tpu":
        fits = f"the TPU compiler fitted each program into one {memory.device_kind} chip, " + (
            "and the peak is within its HBM" if memory.limit else "whose HBM is not known here: the peak is unchecked")
    elif topology is not None:
        fits = f"the peak is within one {memory.device_kind}'s memory"
    else:
        fits = "fits" if memory.limit else "no device limit reported; nothing to check against"
    print(f"dry run done ({fits}); figures in {path}", flush=True)
    return 0


def print_summary(config, history, steps, train_seconds, wall_seconds, export_dir, file=None):
    accuracies = [h["eval/accuracy"] for h in history]
    peak = max(accuracies) if accuracies else float("nan")
    peak_at = history[accuracies.index(peak)]["time/elapsed_train_s"] if accuracies else float("nan")
    rows = [
        ("method", config.algorithm.algorithm),
        ("n / m", f"{config.algorithm.n} / {config.algorithm.m}"),
        ("steps", str(steps)),
        ("training clock", f"{train_seconds:.0f} s (wall {wall_seconds:.0f} s)"),
        ("accuracy first / last", f"{accuracies[0]:.1%} / {accuracies[-1]:.1%}" if len(accuracies) > 1
         else f"{accuracies[0]:.1%} (one evaluation, at step {history[0].get('step', 0)})" if accuracies
         else "- (no evaluation)"),
        ("peak accuracy", f"{peak:.1%} at {peak_at:.0f} s" if accuracies else "-"),
        ("exported model", export_dir),
    ]
    width = max(len(k) for k, _ in rows)
    # sys.stdout is looked up per call: a default bound at import would outlive a redirect.
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), file=file or sys.stdout, flush=True)
