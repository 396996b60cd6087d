"""Down-sampling rules: pick M of the N rollouts of each group.

Every rule is a pure function ``rule(rewards, m, *, key=None) -> indices`` with ``rewards``
of shape [..., N] and int32 ``indices`` of shape [..., M] into the last axis. Rules trace
under ``jax.jit`` (``m`` static), ``jax.vmap``, ``shard_map`` and Explicit meshes, over any leading axes.

Shared conventions:

* Order. Rollouts are ranked by the total order (reward, index): equal rewards
  rank by position, so every rule is deterministic and ties never make a
  rule pick the same rollout twice.
* Non-finite rewards (NaN, +-inf) mean "no valid reward" and rank after every
  finite one. A rule chooses among the finite rewards of a group and uses
  non-finite ones only when fewer than M rewards are finite; they then fill
  the remaining slots in index order. Callers can spot them with
  ``~jnp.isfinite(jnp.take_along_axis(rewards, indices, -1))``.
* Subnormal rewards compare equal to zero, because XLA flushes denormals.

Flat layouts. Libraries such as TRL, verl and tunix keep a step's rollouts as
flat rows [P*N, ...], prompt after prompt (row p*N + j is rollout j of prompt
p). ``select_flat`` takes such flat rewards and returns flat rows;
``flat_rows`` turns [..., P, M] indices into those rows. Both, and
``select``, take ``in_position_order=True`` to keep each group's rollouts in
their original order, so a gather does not reorder a host's trajectory ids.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from podsjax.core import arrays


class Rule(Protocol):
    def __call__(self, rewards: jax.Array, m: int, *, key: jax.Array | None = None) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class _RegisteredRule:
    fn: Callable[..., jax.Array]
    needs_key: bool


_RULES: dict[str, _RegisteredRule] = {}


def _canonical_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a selection rule is named by a string (e.g. 'max_variance'); got {type(name).__name__}")
    return name.strip().lower().replace("-", "_")


def _validate(rewards, m) -> tuple[jax.Array, int]:
    """Returns rewards as float32 or wider, and N; raises one-line errors at trace time."""
    rewards = jnp.asarray(arrays.host_rewards(rewards, per_group=True))
    if rewards.ndim < 1:
        raise ValueError(f"rewards must have a last axis of rollouts [..., N]; got a scalar of shape {rewards.shape}")
    if jnp.issubdtype(rewards.dtype, jnp.complexfloating):
        raise TypeError(f"rewards must be real numbers; got dtype {rewards.dtype}")
    # Scores square and sum the rewards: in float16 they overflow past 256, in bfloat16 they
    # keep 8 bits, and either picks a worse subset. float32 holds every narrower value exactly.
    if not jnp.issubdtype(rewards.dtype, jnp.floating) or jnp.finfo(rewards.dtype).bits < 32:
        wide = jnp.issubdtype(rewards.dtype, jnp.integer) and rewards.dtype.itemsize == 8  # int64 under x64
        rewards = rewards.astype(jnp.float64 if wide and jax.config.jax_enable_x64 else jnp.float32)
    n, m = rewards.shape[-1], _static_int(m, "m")
    if not 1 <= m <= n:
        raise ValueError(f"m must satisfy 1 <= m <= N={n} (rollouts per group); got m={m}")
    return rewards, m


def _canonical_keys(values):
    # -0.0 and 0.0 must tie (then rank by index) on every sort path.
    return jnp.where(values == 0, jnp.zeros_like(values), values)


def _sharded_like(x, values):  # on a mesh of Explicit axes, sort and select want operands sharded alike
    return x + jnp.zeros_like(values, dtype=jnp.result_type(x))


def _sort_last_axis(values):
    # One variadic sort keyed on (value, index): a total order, so ties are deterministic.
    idx = _sharded_like(lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1), values)
    return lax.sort((values, idx), dimension=values.ndim - 1, num_keys=2)


def sort_with_indices(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sorts ``values`` [..., N] (floats without NaN) on the last axis by the total order (value,
    index): ``(sorted_values, int32 sorted_indices)``, equal values in their order, as a stable argsort."""
    values = jnp.asarray(values)
    if values.ndim < 1:
        raise ValueError(f"values must have a last axis [..., N]; got a scalar of shape {values.shape}")
    return _sort_last_axis(_canonical_keys(values))


def _sorted_valid(rewards):
    """Sorted keys (non-finite rewards as +inf, so last), their indices, and the finite count."""
    valid = jnp.isfinite(rewards)
    keys = jnp.where(valid, _canonical_keys(rewards), jnp.inf)
    sorted_vals, sorted_idx = _sort_last_axis(keys)
    return sorted_vals, sorted_idx, jnp.sum(valid, axis=-1, dtype=jnp.int32)


def _within_range(rewards: jax.Array) -> jax.Array:
    """Each group scaled by a power of two where its largest finite magnitude reaches the square
    root of the dtype's range, so that neither the shift by the minimum nor a sum of M swaps
    overflows (3e38 - (-3e38) is inf in float32). Exact, order and ties kept, but for values
    2^64 times smaller than the group's largest, which may flush to 0."""
    half = jnp.finfo(rewards.dtype).maxexp // 2  # 64 in float32
    largest = jnp.max(jnp.where(jnp.isfinite(rewards), jnp.abs(rewards), 0), axis=-1, keepdims=True)
    return jnp.where(largest >= 2.0 ** half, rewards * 2.0 ** -half, rewards).astype(rewards.dtype)


def max_variance(rewards: jax.Array, m: int, *, key: jax.Array | None = None) -> jax.Array:
    """The size-M subset of each group with the largest population variance.

    By Theorem 1 of the PODS paper the best subset is the k highest plus the
    M-k lowest rewards for some k in [0, M]. One sort of (reward, index) pairs,
    O(N log N), then O(M): rung k+1 swaps rung k's highest bottom reward b_k for
    the next top reward t_k, which changes M^2 times the variance by

        (t_k - b_k) * ((M-1) t_k + (M+1) b_k - 2 * sum(rung k)),

    and the second factor falls as k grows, so the variance rises while it is
    positive, then falls: the best rung is the first whose factor is not
    positive. Each swap's sign comes from this factor, linear in the rewards,
    not from subtracting two scores of M * sum(r^2) - sum(r)^2, whose rounding
    can swamp the difference between two rungs.

    Ties: among rungs of equal variance the smallest k (fewest top rewards)
    wins, so binary rewards with M odd keep floor(M/2) ones when both kinds are
    plentiful. A factor within its rounding error of 0 counts as 0, so the
    rule holds for rewards such as 0.1 and 0.9 too, which float32 cannot hold
    exactly; where float32 holds every factor exactly (integer rewards whose
    sums stay under 2^24), none is rounded and every tie is exact. Within equal
    rewards the (reward, index) order applies: the bottom block takes the
    lowest indices, the top block the highest.

    Numerics: rewards are shifted by the group's smallest finite reward (a large
    common offset costs no precision); nothing is squared; a group reaching 2^64 in
    float32 (2^512 in float64) is first scaled by a power of two, so nothing overflows.

    Args:
      rewards: [..., N] real rewards (scored in float32, or in float64 under
        JAX's x64 mode when given float64 or int64; without it, NumPy's are shifted
        by each group's smallest on the host first, integers as integers; narrower
        floats, other ints and bools are cast to float32).
      m: static number of rollouts to keep, 1 <= m <= N.
      key: unused; accepted so all rules share one signature.

    Returns:
      int32 [..., M] indices into the last axis, in ascending (reward, index)
      order. Non-finite rewards: see the module docstring.
    """
    del key
    rewards, m = _validate(rewards, m)
    sorted_vals, sorted_idx, num_valid = _sorted_valid(_within_range(rewards))
    nv = num_valid[..., None]
    enough = nv >= m
    center = jnp.where(nv > 0, sorted_vals[..., :1], jnp.zeros_like(sorted_vals[..., :1]))

    ranks_M = jnp.arange(m, dtype=jnp.int32)
    bottom_M = sorted_vals[..., :m] - center
    # The j-th highest finite reward sits at rank nv-1-j.
    top_M = jnp.take_along_axis(sorted_vals, jnp.clip(nv - 1 - ranks_M, 0, None), axis=-1) - center
    # Rows with fewer than M finite rewards never use these; zero them so inf meets no arithmetic.
    bottom_M = jnp.where(enough, bottom_M, 0)
    top_M = jnp.where(enough, top_M, 0)

    zero = jnp.zeros_like(top_M[..., :1])
    # sum(rung k) for k < M: the k highest plus the M-k lowest.
    rung_sum = (jnp.concatenate([zero, jnp.cumsum(top_M, axis=-1)[..., :-1]], axis=-1)
                + jnp.cumsum(bottom_M, axis=-1)[..., ::-1])
    t, b = top_M, bottom_M[..., ::-1]  # t_k, b_k: the rewards swapped from rung k to k+1 (t_k >= b_k)
    factor = (m - 1) * t + (m + 1) * b - 2 * rung_sum
    magnitude = (m - 1) * t + (m + 1) * b + 2 * rung_sum  # every term is >= 0 after the shift
    dtype = factor.dtype
    # Exact where every reward is an integer and every sum stays within the mantissa.
    exact = jnp.all((top_M == jnp.round(top_M)) & (bottom_M == jnp.round(bottom_M))
                    & (magnitude < 2.0 ** (jnp.finfo(dtype).nmant + 1)), axis=-1, keepdims=True)
    # Else each factor's error is a few ulps of its terms, plus the sums' (M terms each).
    slack = jnp.where(exact, 0, (m + 4) * jnp.finfo(dtype).eps * magnitude)
    before_fall = jnp.cumprod(factor > slack, axis=-1, dtype=jnp.int32) > 0  # the swaps up to the first fall
    # Swaps of equal rewards (t_k == b_k) just before it change nothing: the smallest k ties.
    moves = before_fall & (t > b)
    k = jnp.max(jnp.where(moves, ranks_M + 1, 0), axis=-1, keepdims=True)

    # Slot j holds rank j for the bottom block, then ranks nv-m+j for the top.
    ranks = jnp.where(ranks_M < m - k, ranks_M, nv - m + ranks_M)
    ranks = jnp.where(enough, ranks, ranks_M)
    return jnp.take_along_axis(sorted_idx, ranks, axis=-1)


def max_reward(rewards: jax.Array, m: int, *, key: jax.Array | None = None) -> jax.Array:
    """The M highest rewards; among equal rewards the higher index wins. Returns int32
    [..., M] indices in descending (reward, index) order."""
    del key
    rewards, m = _validate(rewards, m)
    sorted_vals, sorted_idx, num_valid = _sorted_valid(rewards)
    nv = num_valid[..., None]
    ranks_M = jnp.arange(m, dtype=jnp.int32)
    ranks = nv - 1 - ranks_M
    # Fewer than M finite: keep all finite ones, then fill from the invalid tail.
    ranks = jnp.where(ranks >= 0, ranks, ranks_M)
    return jnp.take_along_axis(sorted_idx, ranks, axis=-1)


_PERCENTILE_MAX_M = 32768  # 2*M*M < 2**31


def percentile(rewards: jax.Array, m: int, *, key: jax.Array | None = None) -> jax.Array:
    """M rollouts at evenly spaced ranks, the worst and the best included: rank j of M is
    round(j * (nv - 1) / (M - 1)) among the nv finite rewards; M = 1 keeps the best.
    Returns int32 [..., M] indices in ascending order."""
    del key
    rewards, m = _validate(rewards, m)
    sorted_vals, sorted_idx, num_valid = _sorted_valid(rewards)
    nv = num_valid[..., None]
    if m == 1:
        ranks = jnp.maximum(nv - 1, 0)
    else:
        if m > _PERCENTILE_MAX_M:
            raise ValueError(f"percentile keeps at most M={_PERCENTILE_MAX_M} (its ranks are int32); got m={m}")
        j, a, b = jnp.arange(m, dtype=jnp.int32), nv - 1, m - 1
        # Round-half-up of j*a/b in int32, exact and distinct (the spacing a/b is >= 1 when nv >= m);
        # split as j*(a//b) + j*(a%b)/b, since 2*j*a overflows int32 at N*M past 2**30.
        ranks = jnp.where(nv >= m, j * (a // b) + (2 * j * (a % b) + b) // (2 * b), j)
    return jnp.take_along_axis(sorted_idx, ranks, axis=-1)


def random(rewards: jax.Array, m: int, *, key: jax.Array | None = None) -> jax.Array:
    """A uniformly random size-M subset of each group's finite rewards (their values are otherwise
    ignored; non-finite ones only when fewer than M are finite, at random too), drawn with ``key``
    (required). Returns int32 [..., M] indices, in random order."""
    rewards, m = _validate(rewards, m)
    if key is None:
        raise ValueError("selection rule 'random' needs a PRNG key: pass key=jax.random.key(...)")
    if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
        try:  # raw key data of the default implementation (threefry: uint32[2], rbg: uint32[4])
            jax.random.wrap_key_data(jnp.asarray(key))
        except (TypeError, ValueError):
            raise TypeError(f"key must be a PRNG key (jax.random.key(seed)); got {key!r}") from None
    # The ranks of i.i.d. uniforms form a uniform random permutation.
    noise = _sharded_like(jax.random.uniform(key, rewards.shape, dtype=jnp.float32), rewards)
    noise = jnp.where(jnp.isfinite(rewards), noise, noise - 2)  # non-finite below every finite one
    _, idx = lax.top_k(noise, m)
    return idx.astype(jnp.int32)


def register_rule(name: str, fn: Callable[..., jax.Array], *, needs_key: bool = False, overwrite: bool = False) -> None:
    """Makes ``fn(rewards, m, *, key=None) -> int32 [..., M]`` selectable by ``name``
    (case-insensitive, and '-' equals '_': "max-variance" works)."""
    canonical = _canonical_name(name)
    if not canonical:
        raise ValueError("selection rule name must be non-empty")
    if not callable(fn):
        raise TypeError(f"selection rule {name!r} must be callable; got {type(fn).__name__}")
    if canonical in _RULES and not overwrite:
        raise ValueError(f"selection rule {name!r} is already registered; pass overwrite=True to replace it")
    if not isinstance(needs_key, bool):
        raise TypeError(f"needs_key must be True or False; got {needs_key!r}")
    _RULES[canonical] = _RegisteredRule(fn=fn, needs_key=needs_key)


def available_rules() -> tuple[str, ...]:
    return tuple(sorted(_RULES))


def get_rule(name: str) -> Callable[..., jax.Array]:
    """The rule registered under ``name``; unknown names list the known ones."""
    try:
        return _RULES[_canonical_name(name)].fn
    except KeyError:
        raise ValueError(f"unknown selection rule {name!r}; known rules: {', '.join(available_rules())}") from None


def rule_needs_key(name: str) -> bool:
    get_rule(name)
    return _RULES[_canonical_name(name)].needs_key


def select(rule: str, rewards: jax.Array, m: int, *, key: jax.Array | None = None,
           in_position_order: bool = False) -> jax.Array:
    """Dispatches to a registered rule by name.

    Args:
      rule: "max_variance", "max_reward", "random", "percentile" or a name
        added with ``register_rule``.
      rewards: [..., N] rewards.
      m: static number of rollouts to keep per group.
      key: PRNG key, required by rules registered with ``needs_key``.
      in_position_order: sort each group's indices ascending instead of the
        rule's own order (same subset).

    Returns:
      int32 [..., M] indices into the last axis of ``rewards``.
    """
    fn = get_rule(rule)
    if rule_needs_key(rule) and key is None:
        raise ValueError(f"selection rule {rule!r} needs a PRNG key: pass key=jax.random.key(...)")
    indices = fn(rewards, m, key=key)
    shape = (*jnp.shape(rewards)[:-1], m)
    if jnp.shape(indices) != shape or not jnp.issubdtype(jnp.result_type(indices), jnp.integer):
        raise ValueError(f"selection rule {rule!r} returned {jnp.result_type(indices)} {tuple(jnp.shape(indices))}; "
                         f"a rule returns integer indices of shape {shape} ([..., M])")
    _check_positions(indices, jnp.shape(rewards)[-1], rule)
    return jnp.sort(indices, axis=-1) if in_position_order else indices


def _static_int(value, name: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a static Python int (mark it static under jit); "
                        f"got {type(value).__name__}") from None


def _static_group_size(n) -> int:
    n = _static_int(n, "n")
    if n < 1:
        raise ValueError(f"n must be >= 1; got {n}")
    return n


def _check_positions(indices: jax.Array, n: int, rule: str | None = None) -> None:
    """Indices in [0, N), checked when concrete (eager calls only: a traced one cannot raise)."""
    if isinstance(indices, jax.core.Tracer) or isinstance(indices, jax.Array) and not indices.is_fully_addressable:
        return
    indices = np.asarray(indices)  # the caller's values: jnp would wrap int64 past int32
    if not indices.size:
        return
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= n:
        if rule:
            raise ValueError(f"selection rule {rule!r} returned values from {low} to {high}; a rule returns "
                             f"positions in [0, N={n})")
        raise ValueError(f"indices must be positions in [0, N={n}) of each group; got values from {low} to {high}")


def flat_rows(indices: jax.Array, n: int, *, in_position_order: bool = False) -> jax.Array:
    """Rows of a flat [..., P*N] layout picked by per-group indices.

    Args:
      indices: int [..., P, M] positions in [0, N) within each group, as a
        rule returns them for rewards [..., P, N] (checked when called eagerly;
        under jit a position past N would name a row of the next group).
      n: static group size N.
      in_position_order: sort each group's indices ascending first, so the
        rows keep the flat layout's order.

    Returns:
      int32 [..., P*M] rows p*N + indices[..., p, j], group after group.
    """
    n = _static_group_size(n)
    if not isinstance(indices, jax.Array):
        indices = np.asarray(indices)  # checked before jnp, which would wrap int64 past int32
    if indices.ndim < 2 or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(f"indices must be an integer array [..., P, M]; got dtype {indices.dtype}, shape {indices.shape}")
    _check_positions(indices, n)
    indices = jnp.asarray(indices)
    if in_position_order:
        indices = jnp.sort(indices, axis=-1)
    groups_P1 = lax.broadcasted_iota(jnp.int32, (*indices.shape[:-1], 1), indices.ndim - 2)
    rows = groups_P1 * n + indices.astype(jnp.int32)
    return rows.reshape(*indices.shape[:-2], -1)


def select_flat(rule: str, rewards: jax.Array, n: int, m: int, *, key: jax.Array | None = None,
                in_position_order: bool = False) -> jax.Array:
    """``select`` for rewards kept flat, prompt after prompt.

    Args:
      rule: a registered rule name (see ``select``).
      rewards: [..., P*N] rewards; entry p*N + j is rollout j of prompt p.
      n: static rollouts per prompt N.
      m: static rollouts to keep per prompt.
      key: PRNG key, for rules that need one.
      in_position_order: keep each group's rows ascending (the flat order).

    Returns:
      int32 [..., P*M] rows into the last axis of ``rewards``, group after
      group: gather any [P*N, ...] tensor with them to get its [P*M, ...] batch.
    """
    n = _static_group_size(n)
    host = arrays.as_host_array(rewards)  # reshaped as given: each rule converts its own groups
    rewards = jnp.asarray(rewards) if host is None else host
    if rewards.ndim < 1 or rewards.shape[-1] % n:
        raise ValueError(f"rewards must be flat [..., P*N] with N={n} rollouts per prompt; got shape {rewards.shape}")
    rows = rewards if host is not None else arrays.replicated_unless_divides(rewards, rewards.shape[-1] // n)
    rewards_PN = rows.reshape(*rewards.shape[:-1], rewards.shape[-1] // n, n)
    indices_PM = select(rule, rewards_PN, m, key=key)
    return flat_rows(indices_PM, n, in_position_order=in_position_order)


def indices_to_mask(indices: jax.Array, n: int) -> jax.Array:
    """Boolean [..., N] mask that is True at the selected positions.

    Args:
      indices: int [..., M] positions in [0, N); others mark nothing.
      n: static group size N.
    """
    n = _static_group_size(n)
    if not isinstance(indices, jax.Array):
        indices = np.asarray(indices)
    if indices.ndim < 1 or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(f"indices must be an integer array [..., M]; got dtype {indices.dtype}, shape {indices.shape}")
    if isinstance(indices, np.ndarray):  # jnp would wrap int64 past int32 onto a position; -1 marks the same
        indices = np.where((indices >= 0) & (indices < n), indices.astype(np.int64), -1)
    indices = jnp.asarray(indices).astype(jnp.int32)  # not uint8, which would wrap past 255
    # A scatter into [..., N] (O(N) memory, where a comparison held [..., M, N]); a negative or
    # too large index goes to slot N, which the scatter drops (a negative one would wrap).
    slots = jnp.where((indices >= 0) & (indices < n), indices, n)
    mark = lambda slots_M: jnp.zeros(n, jnp.bool_).at[slots_M].set(True, mode="drop")  # noqa: E731
    for _ in range(slots.ndim - 1):  # a vmap an axis, not a reshape, which a sharded minor axis refuses
        mark = jax.vmap(mark)
    return mark(slots)


for _name, _fn, _needs_key in (
    ("max_variance", max_variance, False),
    ("max_reward", max_reward, False),
    ("random", random, True),
    ("percentile", percentile, False),
):
    register_rule(_name, _fn, needs_key=_needs_key)

del _name, _fn, _needs_key
