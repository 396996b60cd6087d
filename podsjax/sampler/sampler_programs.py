"""The sampler's compiled programs: the rollout weights and sampling, each compiled once per signature.

Sampling is one program, prefill and the decode loop together: the KV cache never crosses
a program's edge, so the compiler lays it out for the loop (XLA's TPU compiler packs kv
heads with head_dim; handed a cache in the default layout it copied the whole cache in and
out), and a run compiles one program per generation shape. Greedy evaluation and sampled
rollouts of the same shape share it (temperature is a traced input).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podsjax.devices import mesh as mesh_lib
from podsjax.models import rollout
from podsjax.models.lora import check_lora_fits
from podsjax.models.params import check_params_fit
from podsjax.sampler import decoding

STAGES = ("weights", "sample")


class Programs:
    """Compiled programs by key, the oldest dropped past ``limit``; each compiles once,
    whichever thread asks first, while other programs compile on other threads.

    Attributes:
        by_key: ``(stage, model, ...) -> program``; a ``"stages"`` entry holds one call's
            ``(weights, sample, cache)``, so the steady state traces nothing.
        compiles: programs compiled so far, per stage (evictions do not lower it).
        seconds: compile seconds per key, for a caller that waited on another thread's compile.
        compiler_options: XLA's options each program compiles with (``jax.stages.Lowered.compile``), or None.
    """

    def __init__(self, limit: int, compiler_options: dict | None = None):
        if limit < 1:
            raise ValueError(f"max_programs must be >= 1; got {limit}")
        self.by_key: dict = {}
        self.limit = limit
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self.lock = threading.RLock()  # guards the dicts; never held while compiling
        self.compiles: collections.Counter = collections.Counter()
        self.seconds: dict = {}
        self._compiling: dict[tuple, concurrent.futures.Future] = {}

    def compile(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """``lowered`` compiled with :attr:`compiler_options`; an option XLA refuses is a one-line ValueError."""
        try:
            return lowered.compile(self.compiler_options)
        except jax.errors.JaxRuntimeError as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            if self.compiler_options and "option" in message:
                raise ValueError(f"compiler_options {self.compiler_options}: {message}") from None
            raise

    def remember(self, key: tuple, value):
        with self.lock:
            self.by_key[key] = value
            while len(self.by_key) > self.limit:
                oldest = next(iter(self.by_key))
                del self.by_key[oldest]
                self.seconds.pop(oldest, None)
        return value

    def compiled(self, key: tuple, build: Callable[[], Any], timings: dict | None):
        """The program under ``key``: built by this thread, or by the thread already building it."""
        with self.lock:
            if key in self.by_key:
                return self.by_key[key]
            pending = self._compiling.get(key)
            owner = pending is None
            if owner:
                pending = self._compiling[key] = concurrent.futures.Future()
        if not owner:
            value = pending.result()  # another thread's compile (its error, if it failed)
            if timings is not None:
                timings[key[0]] = self.seconds.get(key, 0.0)
            return value
        start = time.perf_counter()
        try:
            value = build()
            seconds = time.perf_counter() - start
            with self.lock:
                self.seconds[key] = seconds
                self.remember(key, value)
                self.compiles[key[0]] += 1
            pending.set_result(value)
        except BaseException as exc:
            if not pending.done():
                pending.set_exception(exc)
            raise
        finally:  # whatever ends the compile (an interrupt too), no thread waits on it for ever
            with self.lock:
                self._compiling.pop(key, None)
            if not pending.done():
                pending.set_exception(RuntimeError(f"the compile of {key[0]} was interrupted"))
        if timings is not None:
            timings[key[0]] = seconds
        return value


def signature(tree: Any, mesh: Mesh | None) -> tuple:
    """A hashable key of a tree's structure, shapes, dtypes and (under a mesh) partition specs.

    Concrete arrays and the dry run's ``ShapeDtypeStruct``s of the same placement give the
    same key, so the programs the dry run compiles are the ones the first step runs."""
    leaves, treedef = jax.tree.flatten(tree)

    def spec(x):
        sharding = getattr(x, "sharding", None)
        if mesh is None or sharding is None:
            return None
        parts = tuple(p[0] if isinstance(p, tuple) and len(p) == 1 else p
                      for p in getattr(sharding, "spec", (str(sharding),)))
        while parts and parts[-1] is None:
            parts = parts[:-1]
        return parts

    return treedef, tuple((tuple(x.shape), str(x.dtype), spec(x)) for x in leaves)


def _on_mesh(x: jax.ShapeDtypeStruct, mesh: Mesh | None) -> jax.ShapeDtypeStruct:
    """An input placed off the model's mesh (a LoRA tree made without one) is taken
    replicated on it; ``generate`` moves it there, as jit would."""
    sharding = x.sharding
    if mesh is None or (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def stages(programs: Programs, model, cfg: decoding.SamplingConfig, params: Any, lora: Any, prompt_ids_BL: Any,
           timings: dict | None = None) -> tuple:
    """``(weights, sample, cache)`` for these inputs (arrays or ``ShapeDtypeStruct``s), compiled
    into ``programs`` the first time they are asked for; ``cache`` is the KV cache's
    ``ShapeDtypeStruct`` tree, which lives inside ``sample``."""
    mesh: Mesh | None = model.mesh
    params, lora = jax.tree.map(lambda x: _on_mesh(mesh_lib.abstract(x), mesh), (params, lora))
    ids = jax.ShapeDtypeStruct(tuple(prompt_ids_BL.shape), jnp.int32)
    inputs = (signature(params, mesh), signature(lora, mesh))
    call = ("stages", model, cfg.program_key, inputs, ids.shape)
    known = programs.by_key.get(call)  # one lookup: another thread may drop the entry meanwhile
    if known is not None:  # the steady state: no tracing, no lookups by abstract values
        return known
    check_params_fit(model, params)  # one line, not a shape error from inside the merge or a layer
    if lora is not None:
        check_lora_fits(model, lora)
    layers = decoding.layers_for(model)
    weights_fn, weights = None, (params, lora)  # the scanned layout reads the params themselves
    if isinstance(layers, decoding.UnrolledLayers):
        merge = functools.partial(rollout.rollout_weights, model)
        weights = jax.eval_shape(merge, params, lora)
        placed = rollout.weights_shardings(weights, mesh) if mesh is not None else None
        if mesh is not None:
            weights = mesh_lib.with_shardings(weights, placed)

        def build_weights():
            return programs.compile(jax.jit(merge, out_shardings=placed).lower(params, lora))

        weights_fn = programs.compiled(("weights", model) + inputs, build_weights, timings)
        # As the merge places them (one device's arrays included), so sampling's results are
        # committed as the scanned layout's are, and later programs see one signature.
        weights = weights_fn.out_info
    _, cache = jax.eval_shape(functools.partial(decoding.prefill, model, cfg.num_samples, cfg.max_new_tokens),
                              weights, ids, ids)
    if mesh is not None:
        cache = mesh_lib.with_shardings(cache, layers.cache_shardings(cache, mesh))

    def build_sample():
        # Prompt rows placed as Generator.place_rows places them on every process.
        rows = mesh_lib.rows_sharding(mesh, ids.shape[0], ids.ndim) if mesh is not None else None
        fn = jax.jit(functools.partial(decoding.sample, model, cfg.program_key),
                     in_shardings=(None, rows, rows, None, None))
        key = jax.eval_shape(lambda: jax.random.key(0))
        return programs.compile(fn.lower(weights, ids, ids, key, jax.ShapeDtypeStruct((), jnp.float32)))

    sample = programs.compiled(("sample", model, cfg.program_key, signature(weights, mesh), ids.shape), build_sample,
                               timings)
    return programs.remember(call, (weights_fn, sample, cache))
