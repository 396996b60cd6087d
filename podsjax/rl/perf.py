"""A step's throughput and model flops utilisation, under the names verl logs (``perf/*``).

The flops are the usual dense estimate, 2N per token forward and 6N forward and backward
for N parameters (attention's own flops are left out, so short sequences are estimated
best). A step counts its generation (prefill of each prompt once and one decode per
completion token), the update's forward and backward over every trained token of each
optimizer step, and the extra forwards over them (the old policy recomputed, the
reference for the KL). ``perf/mfu`` divides by the devices' peak bf16 flops, known for
TPUs and GPUs (``podsjax.devices.topology.CHIPS``); on a CPU it is left out.
"""

from __future__ import annotations

import math


def step_flops(num_params: int, *, prompt_tokens: int, completion_tokens: int, trained_tokens: int,
               passes: int, extra_forwards: int) -> float:
    """Model flops of one RL step.

    Args:
        num_params: the policy's parameter count N.
        prompt_tokens: prompt tokens prefilled (each prompt once, however many samples).
        completion_tokens: tokens the sampler generated, every rollout of every draw.
        trained_tokens: prompt and completion tokens of the update's rows, once.
        passes: forward-and-backward passes over them (``num_iterations``).
        extra_forwards: forward-only passes over them (old policy, reference).
    """
    generation = 2.0 * num_params * (prompt_tokens + completion_tokens)
    update = (6.0 * passes + 2.0 * extra_forwards) * num_params * trained_tokens
    return generation + update


def perf_scalars(*, seconds: float, tokens: int, flops: float, devices: int,
                 peak_flops: float | None) -> dict[str, float]:
    """``perf/time_per_step``, ``perf/throughput`` (tokens per second per device) and, with a
    known peak, ``perf/mfu``."""
    out = {"perf/time_per_step": float(seconds),
           "perf/throughput": tokens / seconds / devices if seconds > 0 else math.nan}
    if peak_flops:
        out["perf/mfu"] = flops / (seconds * devices * peak_flops) if seconds > 0 else math.nan
    return out
