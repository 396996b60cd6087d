"""A run's weights: the train state, the frozen base, the copy the sampler reads, and the update."""

from __future__ import annotations

import jax

from podsjax.devices import compilation, hosts
from podsjax.devices import mesh as mesh_lib
from podsjax.models import LoraConfig
from podsjax.rl import programs
from podsjax.update import algorithms, train_step


class Weights:
    """The train state and the update that advances it.

    Args:
        model, base_params: the policy to train and its loaded weights.
        algo, lora: what to train (LoRA adapters on a frozen base, or every weight).
        seed: the run's seed (the adapters' initialisation).
        compile_log: where the update's and the policy copy's compiles are labelled.
        update: ``(optimizer, update)`` as :func:`~podsjax.rl.update_program` makes them.

    Attributes:
        state, frozen: the train state and the frozen weights the update reads.
        base_params: the base the adapters train on, or the model-dtype copy of fp32 master
            weights the sampler reads (None when the state's params are the policy).
        overlap_compiles: whether the update compiles behind generation (see ``__init__``).
    """

    def __init__(self, model, base_params, algo: algorithms.AlgorithmConfig, lora: LoraConfig | None, seed: int,
                 compile_log: compilation.CompileLog, update):
        self.model, self.algo, self.lora, self.compile_log = model, algo, lora, compile_log
        self.optimizer, self.update_fn = update
        self.base_params = base_params
        trainable, self.frozen = programs.start_weights(model, algo, lora, base_params, seed)
        self._policy_copy = programs.policy_copy_program(base_params) if lora is None else None
        self._policy_step = 0  # the update step base_params' policy copy was cast at
        if model.mesh is not None:
            shardings = jax.tree.map(lambda x: x.sharding, trainable)
        else:  # committed, as the sampler's compiled programs return arrays: one update signature from step 1
            device = next(iter(jax.tree.leaves(base_params)[0].devices()))
            trainable, shardings = jax.device_put(trainable, device), None
        with compile_log.label("init"):
            self.state = programs.state_program(self.optimizer, shardings)(trainable)
        if lora is None and self._policy_copy is None:
            self.base_params = None  # the state's params are the policy: no second copy stays
        self.update_shapes: set[tuple[int, int]] = set()  # (rows, prompt length) the update compiled for
        # The update compiles behind generation's run on CPUs and TPUs. XLA's GPU compiler
        # times candidate kernels on the device as it compiles (autotuning): beside a running
        # generation those timings are noise and its scratch memory adds to generation's. GPUs,
        # and runs over several hosts (untried), compile it after generation. (The start's
        # compiles, with nothing running yet, overlap on GPUs too: podsjax.rl.start_programs.)
        self.overlap_compiles = mesh_lib.platform(model.mesh) != "gpu" and hosts.count() == 1
        self._pending_compile: compilation.InBackground | None = None

    @property
    def step(self) -> int:
        """RL steps taken: the state counts optimizer steps, ``algo.updates_per_step`` per RL step."""
        return int(self.state.step) // self.algo.updates_per_step

    def policy_params(self):
        """(params, lora) to sample from: the current policy, in the model's dtype.

        A full fine-tune of bf16 weights trains fp32 master weights (``train_step.master_weights``);
        the sampler reads a bf16 copy of them, cast once per update into ``base_params``.
        """
        if self.lora is not None:
            return self.base_params, self.state.params
        if self._policy_copy is None:  # the weights are trained in their own dtype
            return self.state.params, None
        step = int(self.state.step)  # optimizer steps: the policy changes with each
        if step != self._policy_step:
            self.base_params = None  # the old copy goes before the new one is made
            with self.compile_log.label("policy copy"):
                self.base_params = self._policy_copy(self.state.params)
            self._policy_step = step
        return self.base_params, None

    def restore(self, checkpointer, warn) -> tuple[dict, int] | None:
        """Loads the newest checkpoint's state; its saved host state and step, or None."""
        found = checkpointer.restore_latest(jax.tree.map(mesh_lib.abstract, self.state), warn=warn)
        if found is None:
            return None
        self.state, saved, step = found
        return saved, step

    def compile_update_behind(self, rows: int, prompt_len: int, max_new_tokens: int) -> None:
        """Starts compiling the update for a step's batch shape on another thread, to run while
        generation compiles and runs, unless it compiled before. Without it the first step of
        each prompt bucket compiles generation and then the update. With dynamic sampling the
        batch's shape is known only after its draws, so the update compiles when it runs."""
        if (not self.overlap_compiles or self.algo.dynamic_sampling or (rows, prompt_len) in self.update_shapes
                or not hasattr(self.update_fn, "lower")):  # an update of the caller's own, not jitted
            return
        self.update_shapes.add((rows, prompt_len))
        state = jax.tree.map(mesh_lib.abstract, self.state)
        batch = programs.abstract_batch(self.model.mesh, rows, prompt_len, max_new_tokens, self.algo,
                                        like=jax.tree.leaves(self.state.params)[0])
        detail = f"{rows} rows x {prompt_len + max_new_tokens} tokens"

        def compile_update():
            with self.compile_log.label("update", detail):
                self.update_fn.lower(state, batch, self.frozen).compile()

        self._pending_compile = compilation.InBackground(compile_update)

    def update(self, batch, timer, fetch_with):
        """Runs the update on ``batch`` (after its compile behind generation, timed as compile
        on ``timer``); returns the step's metrics and ``fetch_with``, both fetched to the host."""
        if self._pending_compile is not None:
            pending, self._pending_compile = self._pending_compile, None
            with timer.compiling():
                pending.result()
        rows, length = batch.input_ids.shape
        with self.compile_log.label("update", f"{rows} rows x {length} tokens"):
            self.state, step_metrics = self.update_fn(self.state, batch, self.frozen)
            # Fetched together, so the update is dispatched right behind the selection
            # with no host sync between them.
            step_metrics, fetched = jax.device_get((step_metrics, fetch_with))
            train_step.check_prompt_groups(step_metrics)  # the state is as it was then: stop before logging
        return step_metrics, fetched

    def close(self) -> None:
        """Waits for an update compiling behind a step stopped before its update."""
        if self._pending_compile is not None:
            self._pending_compile.wait()
