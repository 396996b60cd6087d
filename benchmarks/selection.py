"""Max-variance selector against the platform's sort floors and the reference loop.

Contenders, timed in one run on the same rewards [B, N] with M = N / 4:
  (a) podsjax: jit ``max_variance``
  (b) jit ``jnp.sort`` of the same array: the platform's own floor
  (c) NumPy port of the reference approach: per group, sort, then loop over k
      and recompute each candidate subset's variance from scratch
  (d) ``np.sort`` of the same array: the CPU's real floor

Run: python -m benchmarks.selection [--shapes 4096x64,...] [--min-time 0.5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from podsjax.core.selection import max_variance

DEFAULT_SHAPES = [(b, n) for b in (1, 64, 4096) for n in (16, 64, 256)]


def reference_loop(rewards_BN: np.ndarray, m: int) -> np.ndarray:
    """The reference implementation's approach: O(N log N + M^2) per group."""
    out = np.empty((rewards_BN.shape[0], m), np.int64)
    for row, rewards in enumerate(rewards_BN):
        order = np.argsort(rewards, kind="stable")
        sorted_r = rewards[order]
        best_k, best_var = 0, -np.inf
        for k in range(m + 1):
            subset = np.concatenate([sorted_r[: m - k], sorted_r[len(sorted_r) - k :]])
            var = np.var(subset)
            if var > best_var:
                best_k, best_var = k, var
        out[row] = np.concatenate([order[: m - best_k], order[len(order) - best_k :]])
    return out


def median_seconds(fn, min_time: float, max_reps: int = 2000) -> float:
    """Median wall time of fn() after one warm-up, over >= 3 runs or min_time seconds."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(shapes, min_time: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    select = jax.jit(max_variance, static_argnums=1)
    sort = jax.jit(jnp.sort)
    rows = []
    for b, n in shapes:
        m = max(1, n // 4)
        # Binary-ish rewards with ties, like accuracy + format rewards.
        rewards_np = (rng.integers(0, 2, (b, n)) + 0.25 * rng.integers(0, 3, (b, n))).astype(np.float32)
        rewards = jax.device_put(rewards_np)
        chosen = np.asarray(select(rewards, m))
        ref = reference_loop(rewards_np[: min(b, 256)], m)
        # Same maximal variance as the reference on every checked group.
        np.testing.assert_allclose(
            np.var(np.take_along_axis(rewards_np[: len(ref)], chosen[: len(ref)], -1), -1),
            np.var(np.take_along_axis(rewards_np[: len(ref)], ref, -1), -1),
            rtol=1e-6,
        )
        t_a = median_seconds(lambda: select(rewards, m).block_until_ready(), min_time)
        t_b = median_seconds(lambda: sort(rewards).block_until_ready(), min_time)
        t_c = median_seconds(lambda: reference_loop(rewards_np, m), min_time, max_reps=5)
        t_d = median_seconds(lambda: np.sort(rewards_np, axis=-1), min_time)
        rows.append((b, n, m, t_a, t_b, t_c, t_d))
    return rows


def format_table(rows) -> str:
    header = "| B | N | M | (a) podsjax | (b) jnp.sort | (c) reference loop | (d) np.sort | a/b | c/a | a/d |"
    lines = [header, "|" + "---|" * 10]
    for b, n, m, t_a, t_b, t_c, t_d in rows:
        us = lambda t: f"{t * 1e6:,.0f} us" if t < 1e-2 else f"{t * 1e3:,.1f} ms"  # noqa: E731
        lines.append(
            f"| {b} | {n} | {m} | {us(t_a)} | {us(t_b)} | {us(t_c)} | {us(t_d)} "
            f"| {t_a / t_b:.2f} | {t_c / t_a:,.0f} | {t_a / t_d:.1f} |"
        )
    return "\n".join(lines)


def parse_shapes(text: str):
    try:
        return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]
    except ValueError:
        raise SystemExit(f"error: --shapes wants BxN pairs like 64x16,4096x64; got {text!r}") from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES, help="comma-separated BxN")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds of timing per contender")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} x {device.device_kind}, jax {jax.__version__}")
    print(format_table(run(args.shapes, args.min_time)))


if __name__ == "__main__":
    main()
