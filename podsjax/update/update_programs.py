"""The jitted programs of an update, besides generation: the first state, the batch, the update.

The Trainer runs them and ``--dry-run`` (``podsjax.devices.dry_run``) compiles the same ones ahead of
time, on the same state built the same way, so the plan's figures are the run's. They know
the model, the algorithm and the mesh, not the loop's :class:`~podsjax.rl.RunConfig`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from podsjax.devices import mesh as mesh_lib
from podsjax.models import LoraConfig, init_lora, lora_logical_axes
from podsjax.update import algorithms, train_step

# Folded into ``jax.random.key(seed)`` for the LoRA adapters' first values (the loop's
# other streams are in ``podsjax.rl.programs``).
LORA_INIT_STREAM = 1


def start_weights(model, algo: algorithms.AlgorithmConfig, lora: LoraConfig | None, base_params, seed: int):
    """``(trainable, frozen)`` a run starts from: fresh LoRA adapters on the frozen base, or
    the base itself with (when ``algo.beta > 0``) a frozen copy as the KL reference."""
    if lora is not None:
        key = jax.random.fold_in(jax.random.key(seed), LORA_INIT_STREAM)
        return init_lora(key, model, lora, mesh=model.mesh), base_params
    return base_params, (jax.tree.map(jnp.copy, base_params) if algo.beta > 0 else None)


def state_program(optimizer: optax.GradientTransformation, shardings: Any):
    """The jitted ``init(trainable) -> TrainState``, its moments born in their params' shardings.

    Without the constraint XLA creates the moments replicated; the first step then reshards
    them and compiles twice, and a big full fine-tune may not fit. ``shardings`` None: as given.
    """
    def init(trainable):  # the name compile reports use
        state = train_step.init_state(trainable, optimizer)
        if shardings is None:
            return state
        params = jax.tree.map(jax.lax.with_sharding_constraint, state.params, shardings)
        opt_state = optax.tree_utils.tree_map_params(
            optimizer, lambda x, s: jax.lax.with_sharding_constraint(x, s), state.opt_state, shardings)
        return state.replace(params=params, opt_state=opt_state)

    return jax.jit(init)


def abstract_state(model, algo: algorithms.AlgorithmConfig, optimizer, lora: LoraConfig | None,
                   base_params: Any) -> tuple[train_step.TrainState, Any]:
    """``(state, frozen)`` as :func:`start_weights` and :func:`state_program` build them, as
    sharded ``ShapeDtypeStruct``s of the abstract ``base_params``."""
    mesh = model.mesh
    if lora is not None:
        trainable = jax.eval_shape(lambda k: init_lora(k, model, lora), jax.random.key(0))
        if mesh is not None:
            shardings = mesh_lib.tree_shardings(mesh, lora_logical_axes(trainable), trainable.weights)
            trainable = trainable.replace(weights=mesh_lib.with_shardings(trainable.weights, shardings))
        frozen = base_params
    else:  # fp32 master weights of a narrower model, sharded as the model (train_step.master_weights)
        trainable = jax.eval_shape(train_step.master_weights, base_params)
        if mesh is not None:
            trainable = mesh_lib.with_shardings(trainable, jax.tree.map(lambda x: x.sharding, base_params))
        frozen = base_params if algo.beta > 0 else None
    state = jax.eval_shape(lambda t: train_step.init_state(t, optimizer), trainable)
    if mesh is None:
        return state.replace(params=trainable), frozen
    replicated = mesh_lib.batch_sharding(mesh, 0)
    opt_state = optax.tree_utils.tree_map_params(
        optimizer, lambda x, p: mesh_lib.with_shardings(x, p.sharding), state.opt_state, trainable,
        transform_non_params=lambda x: mesh_lib.with_shardings(x, replicated))
    scalars = {name: mesh_lib.with_shardings(getattr(state, name), replicated) for name in ("step", "skipped_updates")}
    return state.replace(params=trainable, opt_state=opt_state, **scalars), frozen


def update_program(model, algo: algorithms.AlgorithmConfig, lora: LoraConfig | None):
    """The optimizer and the jitted update ``update(state, batch, frozen)`` (the state is donated)."""
    optimizer = algorithms.make_optimizer(algo)
    policy, reference = train_step.lora_apply_fn(model) if lora is not None else train_step.full_apply_fn(model)
    step = train_step.make_train_step(policy, optimizer, algo, reference)

    def update(state, batch, frozen):  # the name compile reports use
        return step(state, batch, frozen)

    return optimizer, jax.jit(update, donate_argnums=0)


def policy_copy_program(params: Any) -> Callable[[Any], Any] | None:
    """A jitted cast of master weights back to ``params``' dtypes and shardings, or None
    when ``train_step.master_weights`` keeps every leaf as it is."""
    leaves, treedef = jax.tree.flatten(params)
    dtypes = [x.dtype for x in leaves]  # not the arrays: the program must not keep them alive
    if dtypes == [x.dtype for x in jax.tree.leaves(jax.eval_shape(train_step.master_weights, params))]:
        return None
    shardings = treedef.unflatten([x.sharding for x in leaves])

    def policy_copy(master):  # the name compile reports use
        return treedef.unflatten([x.astype(d) for x, d in zip(jax.tree.leaves(master), dtypes)])

    return jax.jit(policy_copy, out_shardings=shardings)


def batch_program(mesh, rows: int, algo: algorithms.AlgorithmConfig | None = None):
    """``train_step.build_batch`` over flat rollouts ``[P * N, T]``, jitted.

    With a mesh the batch comes out split over its batch axes (replicated when its
    ``rows`` do not divide evenly), so the update takes it as it is, on every host.
    ``algo`` says which optional parts the batch has (None: the defaults'); the call passes
    the same one as ``config``.
    """
    def build_batch(prompt_ids_PL, prompt_mask_PL, tokens_BT, mask_BT, rewards_PN, config, key,
                    logprobs_BT=None):  # the compile label
        p, n = rewards_PN.shape
        logprobs = None if logprobs_BT is None else logprobs_BT.reshape(p, n, -1)
        return train_step.build_batch(prompt_ids_PL, prompt_mask_PL, tokens_BT.reshape(p, n, -1),
                                      mask_BT.reshape(p, n, -1), rewards_PN, config=config, key=key, logprobs_PNT=logprobs)

    if mesh is None:
        return jax.jit(build_batch, static_argnames="config")
    replicated = mesh_lib.batch_sharding(mesh, 0)
    return jax.jit(build_batch, static_argnames="config",
                   out_shardings=(batch_shardings(mesh, rows, algo), replicated))


def batch_shardings(mesh, rows: int, algo: algorithms.AlgorithmConfig | None = None) -> train_step.TrainBatch:
    """Where the update's input batch lives: rows over the mesh's batch axes when they
    divide evenly, else replicated; the whole-batch and per-mini-batch scalars replicated."""
    algo = algo or algorithms.AlgorithmConfig()

    def sharding(ndim):
        return mesh_lib.rows_sharding(mesh, rows, ndim)

    return train_step.TrainBatch(input_ids=sharding(2), attention_mask=sharding(2), completion_mask=sharding(2),
                                 advantages=sharding(1), loss_denominator=sharding(0), advantage_mean=sharding(0),
                                 sampler_logprobs=sharding(2) if algo.sampler_logprobs else None)


def abstract_batch(mesh, rows: int, prompt_len: int, max_new_tokens: int,
                   algo: algorithms.AlgorithmConfig | None = None, like: Any = None) -> train_step.TrainBatch:
    """The update's input batch as ``ShapeDtypeStruct``s, placed as :func:`batch_program` places it.

    Without a mesh the step's batch arrives committed to the state's device; ``like`` (a leaf
    of the state) gives that placement, so an ahead-of-time compile has the call's signature.
    """
    algo = algo or algorithms.AlgorithmConfig()
    shardings = batch_shardings(mesh, rows, algo) if mesh is not None else None
    device = getattr(like, "sharding", None) if mesh is None else None

    def struct(name, shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=getattr(shardings, name) if shardings else device)

    length = prompt_len + max_new_tokens
    steps = algo.steps_per_generation
    completion = (rows, max_new_tokens)
    return train_step.TrainBatch(
        input_ids=struct("input_ids", (rows, length), jnp.int32),
        attention_mask=struct("attention_mask", (rows, length), jnp.int32),
        completion_mask=struct("completion_mask", completion, jnp.float32),
        advantages=struct("advantages", (rows,), jnp.float32),
        loss_denominator=struct("loss_denominator", () if steps == 1 else (steps,), jnp.float32),
        advantage_mean=struct("advantage_mean", (), jnp.float32),
        sampler_logprobs=struct("sampler_logprobs", completion, jnp.float32) if algo.sampler_logprobs else None)
