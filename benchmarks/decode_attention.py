"""One layer's grouped decode attention on a GPU: the kernels' split against the XLA form and the byte floor.

Times the call decoding makes, :func:`podsjax.models.rollout.attend_grouped_kernel` (the
kernel adds the qkv projection's bias, rotates the step's query and key, writes key and value
into the cache and attends), alone at setting a's shape (1 prompt x 64 samples, 2 kv heads,
6 query heads each, head 128, 512 prompt slots, 512 completion slots of which ``--filled``
are written, bf16), under several splits of the work (``benchmarks.kernel_variants``: the
programs the launch must reach, the block, Triton's pipeline stages and warps, a launch a
pass), beside the same work in XLA ops (``rollout.attend_grouped_token``) and on JAX's own
Pallas decode kernels (``benchmarks.jax_decode_kernels``), in one run. One
compiled program makes ``--sets`` calls, each on its own input set, so that together they
outgrow the GPU's L2 cache as a real step's 28 layers do and no call waits on the host's
dispatch; the caches are donated and carried from call to call, as decoding does. The
floor is the call's bytes (the prompt's KV, the written completion slots' KV, the qkv heads
and the output) at the device's memory bandwidth.

    python -m benchmarks.decode_attention [--best-to FILE]    # on a GPU; FILE gets the split for decoding
    python -m benchmarks.decode_attention --rows 8 --prompt-len 32 --slots 32 --filled 16 \\
        --head-dim 16 --sets 2 --iters 2 --dtype float32         # a dry run on a CPU (interpreter)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import jax_decode_kernels, kernel_variants
from benchmarks.machine import device_peaks
from podsjax.models import decode_kernel, rollout

CACHE = ("k_BKTE", "v_BKET")  # the inputs a call writes, donated and carried to the next call
# Another split replaces the plan only when it matches the XLA form (bf16 rounding: the kernel
# tests' 1e-2) and beats the plan by 5 %: inside the decode step the sweep's fastest has lost before.
MAX_DIFF = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-4}
MARGIN = 0.95


def make_inputs(args, seed: int) -> dict:
    """One set of inputs: every row has written ``filled`` completion slots, the step's token last."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(args.dtype)
    b, p, k, g, e = args.rows, args.prompts, args.kv_heads, args.groups, args.head_dim
    heads = k * g + 2 * k
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dt)  # noqa: E731
    angles = rng.uniform(0, 2 * np.pi, (b, e // 2))
    cos, sin = decode_kernel.rope_factors(jnp.asarray(np.cos(angles), dt), jnp.asarray(np.sin(angles), dt))
    allowed = jnp.broadcast_to(jnp.arange(args.slots) < args.filled, (b, 1, args.slots))
    return dict(qkv_BNE=normal(b, heads, e), cos_BE=cos, sin_BE=sin, prompt_k_PKSE=normal(p, k, args.prompt_len, e),
                prompt_v_PKSE=normal(p, k, args.prompt_len, e), prompt_mask_PS=jnp.ones((p, args.prompt_len), bool),
                k_BKTE=normal(b, k, args.slots, e), v_BKET=normal(b, k, e, args.slots), allowed_B1T=allowed,
                length_B=jnp.full((b,), args.filled, jnp.int32), bias_N=normal(heads * e))


def kernel_form(x: dict):
    return rollout.attend_grouped_kernel(**x, mesh=None)


def xla_form(x: dict):
    return rollout.attend_grouped_token(**x)


def floor_bytes(args) -> int:
    item = jnp.dtype(args.dtype).itemsize
    kv = 2 * args.kv_heads * args.head_dim * item  # K and V of one slot
    qkv = args.rows * (args.kv_heads * args.groups + 2 * args.kv_heads) * args.head_dim * item
    out = args.rows * args.kv_heads * args.groups * args.head_dim * item
    return kv * (args.prompts * args.prompt_len + args.rows * args.filled) + qkv + out


def max_abs_diff(got, expected) -> float:
    """Over the output and the written cache."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(expected))
    return max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))) for a, b in pairs)


def timed_program(fn, cache: tuple[str, str] = CACHE):
    """The program :func:`time_calls` times: ``fn`` on every set, returning each call's cache
    (donated, carried to the next run) and its output, which keeps the attention in the
    program (a program returning only the caches lets XLA drop all that does not write them)."""
    def calls(rest, caches):
        results = [fn(dict(x, **dict(zip(cache, written)))) for x, written in zip(rest, caches)]
        return [r[1] for r in results], [r[0] for r in results]

    return jax.jit(calls, donate_argnums=1)


def time_calls(fn, sets: list[dict], iters: int, repeats: int = 5, cache: tuple[str, str] = CACHE) -> float:
    """Median seconds a call: one program calls ``fn`` on every set (its ``cache`` inputs
    donated and carried on); it runs ``iters / len(sets)`` times a repeat."""
    program = timed_program(fn, cache)
    rest = [{name: v for name, v in x.items() if name not in cache} for x in sets]
    caches = [tuple(jnp.array(x[name], copy=True) for name in cache) for x in sets]
    caches, _ = jax.block_until_ready(program(rest, caches))  # compiles
    runs = max(1, iters // len(sets))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(runs):
            caches, outputs = program(rest, caches)
        jax.block_until_ready((caches, outputs))
        times.append((time.perf_counter() - start) / (runs * len(sets)))
    return statistics.median(times)


def row(name: str, split: tuple | None, t: float, t_xla: float, floor_s: float | None, diff: float) -> str:
    """One line of the table; ``split``: (prompt programs, completion programs, longest walk)."""
    programs, walk = (f"{split[0]} + {split[1]}", split[2]) if split else ("-", "-")
    ratio = f"{t / floor_s:.1f}x" if floor_s else "n/a"
    return f"| {name} | {programs} | {walk} | {t * 1e6:.1f} | {ratio} | {t_xla / t:.2f}x | {diff:.1e} |"


def failed_row(name: str, programs: tuple[int, int], error: Exception) -> str:
    """The row of a form the compiler refused (registers, shared memory, a shape): the error's first line."""
    return (f"| {name} | {programs[0]} + {programs[1]} | - | failed: {type(error).__name__}: "
            f"{str(error).splitlines()[0][:120]} | | | |")


def time_split(name: str, args, sets: list[dict], expected, t_xla: float, floor_s: float | None):
    """``(name, seconds a call, max abs diff)`` of podsjax's kernel under split ``name`` (seconds
    None when the compiler refuses it); prints its row."""
    saved = kernel_variants.apply(name)
    jax.clear_caches()
    split = decode_kernel.plan(args.rows, args.prompts, args.kv_heads, args.groups, args.prompt_len, args.slots)
    try:
        t = time_calls(kernel_form, sets, args.iters)
        diff = max_abs_diff(jax.jit(kernel_form)(sets[0]), expected)
    except Exception as e:  # noqa: BLE001 - a split the compiler refuses (registers, shared memory) is a row too
        print(failed_row(name, (split.prefix_programs, split.own_programs), e), flush=True)
        return name, None, None
    finally:
        kernel_variants.restore(saved)
    walk = f"{split.max_slots_per_program // split.block} x {split.block}"
    print(row(name, (split.prefix_programs, split.own_programs, walk), t, t_xla, floor_s, diff), flush=True)
    return name, t, diff


def time_theirs(choice: str, sets: list[dict], iters: int, expected, t_xla: float, floor_s: float | None,
                interpret: bool):
    """``(name, seconds a call, max abs diff)`` of the call on JAX's ``mqa`` kernels at ``choice``
    of k_splits; prints its row."""
    name = f"JAX's mqa kernels, {choice} k_splits"
    form = functools.partial(jax_decode_kernels.attend, choice=choice, interpret=interpret)
    pre, own, blocks, block = jax_decode_kernels.programs(sets[0], choice)
    own_layout = [jax_decode_kernels.kernel_layout(x) for x in sets]
    try:
        t = time_calls(form, own_layout, iters, cache=jax_decode_kernels.CACHE)
        out, (keys, values) = form(own_layout[0])
    except Exception as e:  # noqa: BLE001 - as a split's
        print(failed_row(name, (pre, own), e), flush=True)
        return name, None, None
    diff = max_abs_diff((out, (keys, jnp.swapaxes(values, 2, 3))), expected)
    print(row(name, (pre, own, f"{blocks} x {block}"), t, t_xla, floor_s, diff), flush=True)
    return name, t, diff


def choose(timed: dict[str, tuple[float, float]], max_diff: float) -> str:
    """The split decoding should run, of ``timed`` (name -> (seconds a call, max abs diff)):
    the fastest that matches the XLA form within ``max_diff``, if it is at least
    :data:`MARGIN` of the plan's time; else the plan."""
    plan = timed.get(kernel_variants.DEFAULT)
    right = {name: t for name, (t, diff) in timed.items() if diff <= max_diff}
    if not right:
        return kernel_variants.DEFAULT
    best = min(right, key=right.get)
    return best if plan is None or right[best] <= MARGIN * plan[0] else kernel_variants.DEFAULT


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=6, help="query heads per kv head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--slots", type=int, default=512, help="completion slots in the cache")
    parser.add_argument("--filled", type=int, default=256, help="completion slots written (mid-generation)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sets", type=int, default=8, help="input sets the calls rotate through (outgrow L2)")
    parser.add_argument("--iters", type=int, default=200, help="calls a repeat (a program makes --sets of them)")
    parser.add_argument("--best-to", metavar="FILE", help="write the split decoding should run to FILE (see choose)")
    args = parser.parse_args(argv)
    if not 1 <= args.filled <= args.slots:
        parser.error(f"--filled must be between 1 and --slots ({args.slots}); got {args.filled}")

    interpret = jax.default_backend() != "gpu"
    if interpret:  # the kernel through Pallas's interpreter, where decoding calls it
        decode_kernel.grouped_decode_attention = functools.partial(decode_kernel.grouped_decode_attention,
                                                                   interpret=True)
    peaks = device_peaks()
    sets = [make_inputs(args, seed) for seed in range(args.sets)]
    t_xla = time_calls(xla_form, sets, args.iters)
    expected = jax.jit(xla_form)(sets[0])
    floor_s = floor_bytes(args) / peaks.bandwidth if peaks.bandwidth else None
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}{', Pallas interpreter' if interpret else ''}),"
          f" jax {jax.__version__}; {args.prompts} prompt(s) x {args.rows // args.prompts} samples, {args.kv_heads} kv"
          f" heads x {args.groups}, head {args.head_dim}, {args.prompt_len} prompt + {args.filled}/{args.slots}"
          f" completion slots, {args.dtype}; {args.sets} input sets, median of 5 x {args.iters} calls")
    print(f"floor: {floor_bytes(args) / 1e6:.2f} MB a call"
          + (f" at {peaks.bandwidth / 1e12:.2f} TB/s = {floor_s * 1e6:.2f} us ({peaks.source})" if floor_s else ""))
    print("| split | programs (prompt + completion) | longest walk (blocks x slots) | us a call | x floor "
          "| XLA form / split | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    timed, theirs = {}, {}
    ours = lambda name: time_split(name, args, sets, expected, t_xla, floor_s)  # noqa: E731
    # The plan and JAX's kernels first: a time limit that cuts the sweep keeps them.
    for name, t, diff in [ours(kernel_variants.DEFAULT),
                    *(time_theirs(choice, sets, args.iters, expected, t_xla, floor_s, interpret)
                      for choice in (jax_decode_kernels.PLAN, jax_decode_kernels.DEFAULT)),
                    *(ours(name) for name in kernel_variants.VARIANTS if name != kernel_variants.DEFAULT)]:
        if t is not None:
            (theirs if name.startswith("JAX's") else timed)[name] = (t, diff)
    print(row("XLA form (rollout.attend_grouped_token)", None, t_xla, t_xla, floor_s, 0.0))
    if not timed:
        raise SystemExit("error: no split of podsjax's kernel compiled")
    fastest = min(timed, key=lambda name: timed[name][0])
    plan = timed.get(kernel_variants.DEFAULT)
    print(f"fastest: {fastest} ({timed[fastest][0] * 1e6:.1f} us, the plan "
          + (f"{plan[0] * 1e6:.1f} us)" if plan is not None else "failed)"))
    if theirs:
        best_theirs = min(theirs, key=lambda name: theirs[name][0])
        print(f"JAX's kernels at best: {theirs[best_theirs][0] * 1e6:.1f} us ({best_theirs})")
    chosen = choose(timed, MAX_DIFF.get(args.dtype, MAX_DIFF["bfloat16"]))
    print(f"for decoding: {chosen} (another split replaces the plan when it matches the XLA form and is "
          f"{1 - MARGIN:.0%} faster)")
    if args.best_to:
        with open(args.best_to, "w") as f:
            f.write(chosen + "\n")


if __name__ == "__main__":
    main()
