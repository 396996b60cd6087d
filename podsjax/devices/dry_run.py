"""Memory per device and compile time of a run's two big programs, before it trains.

:func:`plan` compiles generate and the update ahead of time for the run's largest
shapes and reads XLA's ``memory_analysis()``. Params may be abstract
(``jax.ShapeDtypeStruct``), so ``--dry-run`` reads no weights. :meth:`MemoryPlan.check_fits`
turns a plan larger than the device's memory into one clear error before training,
instead of an out-of-memory error deep inside XLA.

Example:
    >>> memory = plan(model, algo, lora, base_params=abstract_base(model), prompts=1,
    ...               prompt_len=512, max_new_tokens=512, eos_token_ids=(151645,))
    >>> print("\\n".join(memory.lines())); memory.check_fits()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from podsjax import models as pm
from podsjax.devices import compilation, hlo_cost, topology
from podsjax.devices import mesh as mesh_lib
from podsjax.sampler import sampling
from podsjax.update import algorithms, update_programs

FIELDS = ("params", "optimizer", "kv_cache", "generate_temp", "update_temp")
# What shrinks a run's memory per device, for the one-line refusals.
_REMEDIES = ("fewer rows (--n, --m, --prompts-per-step), more micro-batches (--grad-accum), a shorter "
             "--max-completion-length, LoRA (--lora-rank) or more devices (--mesh)")


class DoesNotFit(ValueError):
    """The run needs more memory per device than the device has."""


def human_bytes(n: int) -> str:
    """Bytes as GiB, MiB or KiB, for the console."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


@dataclasses.dataclass
class MemoryPlan:
    """Bytes per device of what a step holds, and the compile seconds of each program.

    Attributes:
        params: the weights the sampler reads, the trained weights (LoRA, or a full
            fine-tune's fp32 master copy of bf16 weights), and a full fine-tune's KL reference.
        optimizer: optimizer state (AdamW moments of what is trained).
        kv_cache: the sampler's KV cache.
        generate_temp: XLA temporaries of generation beside the KV cache (the larger of the
            weights merge's and sampling's).
        update_temp: XLA temporaries of the update (activations kept for the backward pass).
        batch: the update's input batch.
        compile_s: seconds per program ("weights", "sample", "update").
        device_kind: e.g. "NVIDIA H100 80GB HBM3" or "cpu".
        devices: devices the model is sharded over.
        limit: bytes one device can hold, when the backend reports it (None on CPU).
        remat: the decoder's remat policy.
        stage_temp: temporaries of each generation stage ("weights", "sample": beside the KV cache).
        rollout_weights: the sampler's merged per-layer copy of the weights
            (``podsjax.models.rollout``), held while generating.
        costs: per program ("prefill", "decode_step", "update"), the ``flops``, ``bytes``
            and ``kernels`` per device counted from its optimized HLO (``podsjax.devices.hlo_cost``,
            loops times their trip counts), and ``roofline_s`` at the device's bandwidth
            and peak flops (0 where they are not known, as on a CPU).
        decode_step_bytes, decode_step_kernels: one decode step's bytes moved and kernels.
        decode_step_floor_bytes: what a decode step must read: the weights it samples
            from and the whole KV cache, once.
        step_roofline_s: one PODS step at the device's roofline: prefill, ``max_new_tokens``
            decode steps (every row running to the end) and the update; None off an
            accelerator with known figures.
    """

    params: int
    optimizer: int
    kv_cache: int
    generate_temp: int
    update_temp: int
    batch: int
    compile_s: dict[str, float]
    device_kind: str
    devices: int
    limit: int | None
    remat: str = "full"
    stage_temp: dict[str, int] = dataclasses.field(default_factory=dict)
    rollout_weights: int = 0
    costs: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    decode_step_bytes: float = 0.0
    decode_step_floor_bytes: float = 0.0
    decode_step_kernels: float = 0.0
    step_roofline_s: float | None = None

    @property
    def total(self) -> int:
        """Peak bytes per device: params and optimizer state stay; the rollout weights live
        while generating, beside the weights merge's temporaries and then beside sampling's KV
        cache and temporaries (one program after the other); the update batch only while updating."""
        weights_temp = self.stage_temp.get("weights", 0)
        sampling = self.kv_cache + self.stage_temp.get("sample", self.generate_temp)
        generating = self.rollout_weights + max(weights_temp, sampling)
        updating = self.batch + self.update_temp
        return self.params + self.optimizer + max(generating, updating)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total}

    def lines(self) -> list[str]:
        """The human-readable report, one figure per line."""
        rows = [("params", self.params), ("optimizer", self.optimizer), ("rollout weights", self.rollout_weights),
                ("KV cache", self.kv_cache),
                ("update batch", self.batch), ("generate temporaries", self.generate_temp),
                ("update temporaries", self.update_temp), ("total (peak)", self.total)]
        out = [f"memory per device ({self.devices} x {self.device_kind}, remat {self.remat}):"]
        out += [f"  {name:<21} {human_bytes(value):>12}" for name, value in rows]
        limit = human_bytes(self.limit) if self.limit else "not reported"
        out.append(f"  {'device limit':<21} {limit:>12}")
        out.append("compile: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.compile_s.items()))
        if self.costs:
            out.append("cost per device (from the optimized programs):")
            for name, cost in self.costs.items():
                roof = f", roofline {cost['roofline_s'] * 1e3:.2f} ms" if cost["roofline_s"] else ""
                out.append(f"  {name.replace('_', ' '):<12} {cost['flops'] / 1e9:10.1f} GFLOP {human_bytes(int(cost['bytes'])):>11}"
                           f" moved, {cost['kernels']:.0f} kernels{roof}")
            ratio = self.decode_step_bytes / max(self.decode_step_floor_bytes, 1.0)
            out.append(f"  decode step moves {ratio:.2f}x its floor ({human_bytes(int(self.decode_step_floor_bytes))}: "
                       "the weights and the KV cache, read once)")
        if self.step_roofline_s is not None:
            step = (f"{self.step_roofline_s:.2f} s" if self.step_roofline_s >= 0.1
                    else f"{self.step_roofline_s * 1e3:.3g} ms")  # a tiny model's step: not "0.00 s"
            out.append(f"one PODS step at the {self.device_kind}'s roofline: {step} "
                       "(prefill, every decode step, the update; kernel launches not counted)")
        return out

    def check_fits(self) -> None:
        """Raises :class:`DoesNotFit` (one line, with figures and remedies) when over the limit."""
        if self.limit is None or self.total <= self.limit:
            return
        hint = "--remat full, " if self.remat != "full" else ""
        b = human_bytes
        raise DoesNotFit(
            f"this run needs {b(self.total)} per device but the {self.device_kind} has {b(self.limit)} "
            f"(params {b(self.params)}, optimizer {b(self.optimizer)}, rollout weights {b(self.rollout_weights)}, "
            f"KV cache {b(self.kv_cache)}, "
            f"generate temporaries {b(self.generate_temp)}, update temporaries {b(self.update_temp)}); "
            f"try {hint}{_REMEDIES}")


def run_device(mesh=None):
    """One device of this process that the run's programs run on."""
    if mesh is not None:
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        if local:
            return local[0]
    return jax.local_devices(backend=jax.default_backend())[0]


def device_memory_limit(device=None) -> int | None:
    """Bytes one device can hold, or None when the backend does not say (CPU). A TPU chip or
    GPU compiled for without one (``--topology``) has its kind's memory."""
    device = device or run_device()
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    chip = topology.chip(device.device_kind)  # None for a CPU
    return chip.hbm_bytes if chip is not None else None


def abstract(tree: Any) -> Any:
    """``ShapeDtypeStruct``s of a tree of arrays (shardings kept); structs pass through."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


def abstract_base(model) -> Any:
    """The model's params as ``ShapeDtypeStruct``s, sharded like ``from_pretrained`` loads them."""
    shapes = pm.abstract_params(model)
    if model.mesh is None:
        return shapes
    return mesh_lib.with_shardings(shapes, pm.param_shardings(model, model.mesh))


def rollout_options(algo: algorithms.AlgorithmConfig, max_new_tokens: int, eos_token_ids,
                    pad_token_id: int) -> dict[str, Any]:
    """The options of a step's rollouts that key generation's programs, shared by
    :meth:`podsjax.sampler.sampling.Generator.compile` and ``generate``: compiling with them ahead
    of time gives the programs the steps run."""
    return dict(num_samples=algo.n, max_new_tokens=max_new_tokens, top_p=algo.top_p, top_k=algo.top_k,
                eos_token_ids=(eos_token_ids,) if isinstance(eos_token_ids, (int, np.integer)) else tuple(eos_token_ids),
                pad_token_id=pad_token_id, return_logprobs=algo.sampler_logprobs)


@contextlib.contextmanager
def refused_by_compiler(program: str, device_kind: str):
    """A compiler that sizes memory itself (TPU) refuses a program larger than the chip's
    HBM; that becomes :class:`DoesNotFit` in one line, as the plan's own check does."""
    try:
        yield
    except jax.errors.JaxRuntimeError as exc:
        message = str(exc).strip()
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        reason = message.splitlines()[0].replace("RESOURCE_EXHAUSTED: ", "").rstrip(".")
        raise DoesNotFit(f"{program} does not fit on the {device_kind}: {reason}; try {_REMEDIES}") from None


def _temp(compiled) -> int:
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes) if analysis is not None else 0


def _param_bytes(base: Any, trained: Any, frozen: Any) -> int:
    """Bytes per device of the weights a run holds: what the sampler reads, what is trained
    (LoRA, or a full fine-tune's fp32 master weights), and a full fine-tune's KL reference.
    A full fine-tune in its own dtype trains the sampler's weights: counted once."""
    same = jax.tree.structure(base) == jax.tree.structure(trained) and all(
        b.dtype == t.dtype for b, t in zip(jax.tree.leaves(base), jax.tree.leaves(trained)))
    trained_bytes = 0 if same else mesh_lib.bytes_per_device(trained)
    return mesh_lib.bytes_per_device(base) + trained_bytes + mesh_lib.bytes_per_device(frozen)


def plan(model, algo: algorithms.AlgorithmConfig, lora_config: pm.LoraConfig | None, *, base_params: Any,
         prompts: int, prompt_len: int, max_new_tokens: int, eos_token_ids, pad_token_id: int = 0,
         update_fn=None, optimizer=None, state=None, frozen=None, compile_log=None,
         generator: sampling.Generator | None = None, submit=None) -> MemoryPlan:
    """Compiles generate and the update for these shapes and measures their memory.

    Args:
        model: the decoder (its mesh and remat policy are the run's).
        algo: the algorithm (rows per prompt, micro-batches, optimizer, the sampler's top-p/top-k).
        lora_config: LoRA, or None for a full fine-tune.
        base_params: the model's params, concrete or abstract.
        prompts: prompts per step.
        prompt_len: the longest padded prompt length.
        max_new_tokens: tokens sampled per completion.
        eos_token_ids, pad_token_id: the tokenizer's ids the sampler compiles in.
        update_fn: the jitted update (default: a fresh one, as the Trainer makes it).
        optimizer: its optimizer (needed with ``update_fn``).
        state, frozen: the real train state and frozen tree; default: abstract ones. With
            the Trainer's own ``update_fn`` and state, the first step reuses this compile.
        compile_log: a :class:`podsjax.devices.compilation.CompileLog` to report the compiles to.
        generator: the :class:`podsjax.sampler.sampling.Generator` to compile in (default: a new one);
            the Trainer's own, so its first step reuses these programs.
        submit: runs the update's compile and returns its future (e.g.
            :meth:`podsjax.devices.compilation.CompilePool.submit`), so it compiles while generation
            does (the compile times reported then overlap); default: after generation.

    Returns:
        The :class:`MemoryPlan`.
    """
    if update_fn is None:
        optimizer, update_fn = update_programs.update_program(model, algo, lora_config)
    if state is None:
        state, frozen = update_programs.abstract_state(model, algo, optimizer, lora_config, abstract(base_params))
    base = abstract(base_params)
    lora = abstract(state.params) if lora_config is not None else None
    log = compile_log or compilation.CompileLog()
    device = run_device(model.mesh)
    rows = prompts * algo.m
    batch = update_programs.abstract_batch(model.mesh, rows, prompt_len, max_new_tokens, algo,
                                           like=jax.tree.leaves(state.params)[0])

    def compile_update():
        start = time.perf_counter()
        with (log.label("update", f"{rows} rows x {prompt_len + max_new_tokens} tokens"),
              refused_by_compiler("the update", device.device_kind)):
            return update_fn.lower(state, batch, frozen).compile(), time.perf_counter() - start

    # Overlapped, the two compiles take the longer one's time, but each is timed slower.
    pending = submit(compile_update) if submit is not None else None
    try:
        with (log.label("generate", f"{prompts} prompts x {algo.n} samples, {prompt_len} + {max_new_tokens} tokens"),
              refused_by_compiler("generation", device.device_kind)):
            gen = (generator or sampling.Generator(model)).compile(
                base, lora, prompts=prompts, prompt_len=prompt_len,
                **rollout_options(algo, max_new_tokens, eos_token_ids, pad_token_id))
    except BaseException:
        if pending is not None:
            concurrent.futures.wait([pending])  # no compile left running while the error ends the process
        raise
    update, update_s = pending.result() if pending is not None else compile_update()
    stage_temp = {stage: _temp(gen[stage]) for stage in ("weights", "sample") if gen[stage] is not None}
    # The KV cache lives inside the sampling program; what its layout pads stays a temporary.
    stage_temp["sample"] = max(stage_temp["sample"] - int(gen["kv_cache_bytes"]), 0)
    chip = topology.chip(device.device_kind)  # None for a CPU
    costs = _costs(gen, update, chip)
    floor = int(gen["weights_read_bytes"]) + int(gen["kv_cache_bytes"])
    roofline = None
    if chip is not None:
        roofline = (costs["prefill"]["roofline_s"] + max_new_tokens * costs["decode_step"]["roofline_s"]
                    + costs["update"]["roofline_s"])
    return MemoryPlan(
        params=_param_bytes(base, state.params, frozen if lora_config is None else None),  # LoRA's frozen is base
        optimizer=mesh_lib.bytes_per_device(state.opt_state),
        kv_cache=int(gen["kv_cache_bytes"]),
        rollout_weights=int(gen["rollout_weights_bytes"]),
        generate_temp=max(stage_temp.values()),
        update_temp=_temp(update),
        batch=mesh_lib.bytes_per_device(batch),
        compile_s={**{stage: float(seconds) for stage, seconds in gen["compile_s"].items()
                      if gen[stage] is not None}, "update": update_s},
        device_kind=device.device_kind,
        devices=1 if model.mesh is None else model.mesh.size,
        limit=device_memory_limit(device),
        remat=str(getattr(model, "remat", "none")),
        stage_temp=stage_temp,
        costs=costs,
        decode_step_bytes=costs["decode_step"]["bytes"],
        decode_step_floor_bytes=float(floor),
        decode_step_kernels=costs["decode_step"]["kernels"],
        step_roofline_s=roofline,
    )


def _rates(chip: topology.Chip | None) -> tuple[float | None, float | None]:
    return (chip.bandwidth, chip.peak_flops) if chip is not None else (None, None)


def decode_step_cost(sample, chip: topology.Chip | None = None) -> hlo_cost.Cost:
    """One decode step of a compiled sampling program: of its loop whose length depends on
    the data (rows stop at EOS)."""
    return hlo_cost.data_loop_step(sample.as_text(), *_rates(chip))


def _costs(gen: dict, update, chip: topology.Chip | None) -> dict[str, dict[str, float]]:
    """Flops, bytes, kernels and roofline seconds of prefill, one decode step and the update."""
    # The prefill: the sampling program without its decode loop (and the few elementwise
    # ops that finish the rollouts). One read of the program's text serves both.
    prefill, decode_step = hlo_cost.sampling_costs(gen["sample"].as_text(), *_rates(chip))
    programs = {"prefill": prefill, "decode_step": decode_step,
                "update": hlo_cost.program_cost(update.as_text(), *_rates(chip))}
    return {name: dataclasses.asdict(cost) for name, cost in programs.items()}
