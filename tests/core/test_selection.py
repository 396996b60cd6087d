"""Selection rules: the PODS theorems, invariances, transforms and edge cases."""

import contextlib
import itertools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

from podsjax.core import selection

pytestmark = pytest.mark.cpu_mesh

# One jitted function per rule, shared by every test, so shapes compile once.
MV = jax.jit(selection.max_variance, static_argnums=1)
MAX_REWARD = jax.jit(selection.max_reward, static_argnums=1)
PERCENTILE = jax.jit(selection.percentile, static_argnums=1)
RANDOM = jax.jit(selection.random, static_argnums=1)

JITTED_SELECT = jax.jit(selection.select, static_argnums=(0, 2))
# XLA flushes subnormal floats to zero (they compare equal to 0), so the NumPy
# references below only see normal floats.
PROPERTY = settings(max_examples=150, deadline=None)


@st.composite
def group_and_m(draw, max_n=12, values=None):
    n = draw(st.integers(1, max_n))
    m = draw(st.integers(1, n))
    if values is None:
        values = st.one_of(
            st.floats(-100, 100, allow_nan=False, allow_subnormal=False, width=32),
            st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),  # forces ties
        )
    rewards = draw(st.lists(values, min_size=n, max_size=n))
    return np.asarray(rewards, np.float32), m


def brute_force_max_variance(rewards, m):
    r = rewards.astype(np.float64)
    return max(np.var(r[list(c)]) for c in itertools.combinations(range(len(r)), m))


def stable_ranks(rewards):
    """Rank of each position under the (reward, index) order."""
    order = np.argsort(rewards, kind="stable")
    ranks = np.empty_like(order)
    ranks[order] = np.arange(len(order))
    return ranks


def exact_score(values, m) -> Fraction:
    """M^2 times the population variance of ``values``, in exact rational arithmetic."""
    exact = [Fraction(float(v)) for v in values]
    return m * sum(v * v for v in exact) - sum(exact) ** 2


def rung_of(rewards, idx, m) -> int:
    """The k of Theorem 1's shape (k highest plus M-k lowest, in (reward, index) order) that
    ``idx`` has, or -1 when it has none."""
    n = len(rewards)
    ranks = set(stable_ranks(rewards)[idx].tolist())
    shapes = [set(range(m - k)) | set(range(n - k, n)) for k in range(m + 1)]
    return shapes.index(ranks) if ranks in shapes else -1


# Groups where rounding decides: a cluster of nearly equal rewards, an outlier or two, and
# copies, as a sampled group of near-identical scores (a length penalty, a format bonus) gives.
clustered = st.builds(
    lambda base, gaps, outliers: np.asarray([base + g for g in gaps] + outliers, np.float32),
    st.floats(-100, 100, allow_subnormal=False, width=32),
    st.lists(st.sampled_from([0.0, 1e-3, 7e-3, -5e-3, 0.011, 2e-4]), min_size=1, max_size=9),
    st.lists(st.floats(-100, 100, allow_subnormal=False, width=32), max_size=2))  # XLA flushes subnormals


@st.composite
def clustered_and_m(draw):
    rewards = draw(clustered)
    return rewards, draw(st.integers(1, len(rewards)))


# --- Theorem 1 -----------------------------------------------------------------


@pytest.mark.slow
@PROPERTY
@given(st.one_of(group_and_m(), clustered_and_m()))
def test_theorem1_the_subset_is_a_rung_at_least_as_good_as_every_smaller_one(case):
    """The k highest plus the M-k lowest, for the k whose exact variance is the maximum up to
    float32 rounding, and strictly above that of every smaller k (ties go to the smallest)."""
    rewards, m = case
    idx = np.asarray(MV(rewards, m))
    k = rung_of(rewards, idx, m)
    assert k >= 0, (rewards, m, idx)
    order = np.lexsort((np.arange(len(rewards)), rewards))
    rungs = [exact_score(rewards[np.r_[order[:m - j], order[len(rewards) - j:]]], m) for j in range(m + 1)]
    assert all(rungs[j] < rungs[k] for j in range(k)), (rewards, m, k, rungs)
    # Short of the best by no more than the rounding the rule allows: each swap's factor within
    # (M+4) ulps of its terms (at most 4M * range), times the swapped gap (at most range).
    spread = float(np.ptp(rewards.astype(np.float64)))
    allowed = m * (m + 4) * 4 * m * float(np.finfo(np.float32).eps) * spread ** 2
    assert float(max(rungs) - rungs[k]) <= allowed, (rewards, m, k, float(max(rungs) - rungs[k]), allowed)
    assert np.var(rewards[idx].astype(np.float64)) == pytest.approx(brute_force_max_variance(rewards, m),
                                                                   rel=1e-5, abs=1e-7 * spread ** 2 + 1e-12)


@pytest.mark.slow
@PROPERTY
@given(group_and_m(values=st.integers(-1000, 1000).map(float)))
def test_theorem1_integer_rewards_choose_the_smallest_exact_best_rung(case):
    """Integer rewards are scored exactly: the rung is the smallest k of the exact maximum, no
    tolerance, M = 1 included (k = 0: the lowest reward)."""
    rewards, m = case
    idx = np.asarray(MV(rewards, m))
    order = np.lexsort((np.arange(len(rewards)), rewards))
    rungs = [exact_score(rewards[np.r_[order[:m - j], order[len(rewards) - j:]]], m) for j in range(m + 1)]
    assert rung_of(rewards, idx, m) == rungs.index(max(rungs)), (rewards, m, idx, rungs)


@pytest.mark.slow
@PROPERTY
@given(st.one_of(group_and_m(), clustered_and_m()))
def test_the_indices_come_in_ascending_reward_index_order(case):
    rewards, m = case
    idx = np.asarray(MV(rewards, m))
    keys = list(zip(rewards[idx].tolist(), idx.tolist()))
    assert keys == sorted(keys), (rewards, m, idx)


def test_theorem1_ties_pick_smallest_k_and_lowest_indices():
    # All equal: every candidate scores 0, k=0 wins, so the bottom block = first m indices.
    assert np.asarray(MV(jnp.full((6,), 3.0), 4)).tolist() == [0, 1, 2, 3]
    # [0,0,1,1], m=3: k=0 (ranks 0,1,2 = indices 0,1,2, one 1) already scores the
    # maximum 3*1 - 1^2 = 2, as do k=1 and k=2 (two 1s: 3*2 - 2^2 = 2); smallest k wins.
    assert np.asarray(MV(jnp.array([0.0, 0.0, 1.0, 1.0]), 3)).tolist() == [0, 1, 2]
    # [1,1,0,0], m=3: same scores; ranks 0,1,2 are indices 2,3 (the zeros) then 0.
    assert np.asarray(MV(jnp.array([1.0, 1.0, 0.0, 0.0]), 3)).tolist() == [2, 3, 0]


def test_ties_within_float32_rounding_pick_the_smallest_k_too():
    # 0.1 and 0.9 are not float32 numbers: k=2 and k=3 tie exactly on paper, and their scores
    # differ by rounding. The rule still keeps floor(M/2) of the high value.
    rewards = np.array([0.1] * 6 + [0.9] * 6, np.float32)
    assert int((rewards[np.asarray(MV(rewards, 5))] > 0.5).sum()) == 2
    thirds = np.array([1 / 3] * 3 + [2 / 3] * 3, np.float32)
    assert int((thirds[np.asarray(MV(thirds, 3))] > 0.5).sum()) == 1


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_narrow_float_rewards_select_as_their_float32_values(dtype):
    # Scored in their own dtype, float16's squares overflowed past 256 and bfloat16's sums
    # kept 8 bits: both picked worse subsets.
    rng = np.random.default_rng(11)
    rewards = jnp.asarray(rng.normal(0, 200, (64, 8)), dtype)
    assert np.array_equal(np.asarray(MV(rewards, 3)), np.asarray(MV(rewards.astype(jnp.float32), 3)))
    wide = jnp.asarray([0, 100, 200, 300, 400, 500], dtype)
    assert sorted(np.asarray(MV(wide, 3)).tolist()) == [0, 1, 5]  # ties {0, 400, 500}: smallest k wins


# --- Theorem 2 -----------------------------------------------------------------


@pytest.mark.parametrize("n,m", [(4, 2), (8, 3), (8, 4), (16, 4), (16, 5), (64, 16), (12, 12)])
def test_theorem2_binary_rewards_exact_cases(n, m):
    for p in range(n + 1):
        q = n - p
        rewards = np.zeros(n, np.float32)
        rewards[np.random.default_rng(p).permutation(n)[:p]] = 1.0
        ones = int(rewards[np.asarray(MV(rewards, m))].sum())
        if p >= m / 2 and q >= m / 2:
            expected = m // 2  # both plentiful: half ones (floor for odd m, the tie rule)
        elif p < q:
            expected = p  # ones are scarcer: take all of them
        else:
            expected = m - q  # zeros are scarcer: take all zeros, fill with ones
        assert ones == expected, (n, m, p)


# --- Invariances ---------------------------------------------------------------

integer_rewards = st.integers(-20, 20).map(float)


@pytest.mark.slow
@PROPERTY
@given(group_and_m(values=integer_rewards), st.integers(-1000, 1000), st.integers(1, 16))
def test_shift_and_positive_scale_keep_the_subset(case, shift, scale):
    # Integer data keeps every swap factor exact, so equality is bit-for-bit, ties included.
    rewards, m = case
    base = np.asarray(MV(rewards, m))
    assert np.array_equal(np.asarray(MV(rewards + np.float32(shift), m)), base)
    assert np.array_equal(np.asarray(MV(rewards * np.float32(scale), m)), base)


@pytest.mark.slow
@PROPERTY
@given(group_and_m(values=st.floats(-10, 10, allow_nan=False, allow_subnormal=False, width=32)), st.floats(-50, 50), st.floats(0.1, 10))
def test_shift_and_scale_keep_the_subset_for_float_rewards(case, shift, scale):
    rewards, m = case
    assume(len(np.unique(rewards)) == len(rewards))
    # Only groups whose best subset wins by a clear margin: rounding may reorder exact ties.
    r = rewards.astype(np.float64)
    variances = sorted(float(np.var(r[list(c)])) for c in itertools.combinations(range(len(r)), m))
    assume(len(variances) == 1 or variances[-1] - variances[-2] > 1e-3 * max(variances[-1], 1e-3))
    base = set(np.asarray(MV(rewards, m)).tolist())
    transformed = (rewards.astype(np.float64) * scale + shift).astype(np.float32)
    assume(len(np.unique(transformed)) == len(transformed))  # float32 rounding must not merge rewards
    assert set(np.asarray(MV(transformed, m)).tolist()) == base


@pytest.mark.slow
@PROPERTY
@given(group_and_m(), st.randoms(use_true_random=False))
def test_permutation_permutes_the_indices(case, rnd):
    rewards, m = case
    perm = np.asarray(rnd.sample(range(len(rewards)), len(rewards)))
    permuted = rewards[perm]
    chosen = set(np.asarray(MV(rewards, m)).tolist())
    chosen_after = set(perm[np.asarray(MV(permuted, m))].tolist())
    if len(np.unique(rewards)) == len(rewards):
        assert chosen_after == chosen
    else:  # ties may swap equal rewards, but the chosen values are the same multiset
        assert sorted(rewards[list(chosen_after)]) == sorted(rewards[list(chosen)])


@pytest.mark.slow
@PROPERTY
@given(group_and_m(values=st.integers(-1000, 1000).map(float)), st.sampled_from([60, 100, 116]))
def test_rewards_near_float32s_range_keep_the_subset_of_their_scaled_down_copy(case, power):
    """A power of two scales every variance alike and keeps floats exact: the subset must not
    change. Up to 1000 * 2^116 (8e37), the shift by the minimum and the swaps' sums had
    overflowed to inf and picked the M lowest."""
    rewards, m = case
    big = rewards * np.float32(2.0 ** power)
    assert np.isfinite(big).all()
    assert np.array_equal(np.asarray(MV(big, m)), np.asarray(MV(rewards, m))), (rewards, m, power)


def test_a_spread_past_float32s_range_still_finds_the_best_subset():
    rewards = np.array([0.0, 1e38, 2e38, 3e38, 0.5e38, 1.5e38, 2.5e38, 3e38], np.float32)
    idx = np.asarray(MV(rewards, 4))
    assert np.var(rewards[idx].astype(np.float64)) == pytest.approx(brute_force_max_variance(rewards, 4))
    symmetric = np.array([-3e38, 3e38, 0.0, 1e38, -1e38], np.float32)  # 6e38 apart: past float32
    assert sorted(np.asarray(MV(symmetric, 3)).tolist()) == [0, 1, 4]  # ties [0, 1, 3]: the smaller k


def test_int64_rewards_under_x64_are_scored_in_float64():
    rewards = np.array([[2**40, 2**40 + 1, 2**40, 2**40 + 3]], np.int64)  # float32 cannot tell them apart
    jax.config.update("jax_enable_x64", True)
    try:
        assert np.asarray(selection.max_variance(jnp.asarray(rewards), 2)).tolist() == [[0, 3]]
    finally:
        jax.config.update("jax_enable_x64", False)


def test_numpy_64_bit_rewards_without_x64_are_neither_wrapped_nor_rounded_first():
    # JAX without x64 had wrapped int64 2**32 + 1 to 1, and rounded float64 1e8 + k to 1e8,
    # before any shift: a silently worse subset. NumPy and Python inputs are shifted on the host
    # (an eager call's: jax.jit converts its arguments itself).
    assert not jax.config.jax_enable_x64
    assert np.asarray(selection.max_variance(np.array([[1, 2**32 + 1, 0, 1]]), 2)).tolist() == [[2, 1]]
    assert np.asarray(selection.max_variance([[1, 2**32 + 1, 0, 1]], 2)).tolist() == [[2, 1]]
    offset = 1e8 + np.array([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, np.nan, 1.0]])
    assert np.asarray(selection.max_variance(offset, 2)).tolist() == [[0, 3], [1, 0]]
    rows = selection.select_flat("max_variance", offset.reshape(-1), n=4, m=2)
    assert np.asarray(rows).tolist() == [0, 3, 5, 4]
    # Groups far apart: each is shifted by its own smallest (the flat row's had lost group 2).
    rows = selection.select_flat("max_variance", [0, 0, 0, 0, 1e8, 1e8, 1e8 + 1, 1e8 + 1], n=4, m=2)
    assert np.asarray(rows).tolist() == [0, 1, 4, 7]
    # Integers are shifted as integers: exact past 2**53, where float64 is not.
    assert np.asarray(selection.max_variance(np.array([[2**53] * 2 + [2**53 + 1] * 2]), 2)).tolist() == [[0, 3]]
    # A rule of the user's sees the rewards as given, not shifted.
    selection.register_rule("test_above_half", lambda r, m, key=None: jnp.argsort(
        -(jnp.asarray(r) > 0.5).astype(jnp.int32), axis=-1, stable=True)[..., :m].astype(jnp.int32))
    try:
        assert np.asarray(selection.select_flat("test_above_half", [0.4, 0.3, 0.6, 0.2], n=4, m=1)).tolist() == [2]
    finally:
        selection._RULES.pop("test_above_half")
    # NumPy's bfloat16 (ml_dtypes) is a number, and a list of tracers converts under jit.
    assert np.asarray(selection.max_variance(np.array([[1, 0, 1, 0]], jnp.bfloat16), 2)).tolist() == [[1, 2]]
    flat = jax.jit(lambda a, b: selection.select_flat("max_variance", [a, b, a, b], n=2, m=1))
    assert np.asarray(flat(jnp.float32(1), jnp.float32(2))).shape == (2,)


def test_rewards_that_are_no_numbers_are_refused_in_one_line():
    for bad, named in (([[1.0, None, 0.0]], "object"), ([[1, 2], [3]], "ragged"), ([["a", "b"]], "<U1"),
                       ([[b"a"]], "S1")):
        with pytest.raises(TypeError, match=f"rewards must be real numbers; got .*{named}"):
            selection.max_variance(bad, 1)


def test_large_common_offset_is_stable():
    rng = np.random.default_rng(0)
    small = rng.permutation(np.arange(-32, 32, dtype=np.float32) * 0.25).reshape(4, 16)
    shifted = small + np.float32(1e6)  # exact in float32: spacing at 1e6 is 1/16
    assert np.array_equal(np.asarray(MV(shifted, 5)), np.asarray(MV(small, 5)))
    # and still the true maximum, checked in float64
    for row in range(4):
        idx = np.asarray(MV(shifted, 5))[row]
        assert np.var(small[row][idx].astype(np.float64)) == pytest.approx(brute_force_max_variance(small[row], 5))


# --- Indices, all rules --------------------------------------------------------

ALL_RULES = ["max_variance", "max_reward", "percentile", "random"]


@pytest.mark.slow
@PROPERTY
@given(
    st.integers(1, 3),
    group_and_m(max_n=20, values=st.one_of(st.floats(-5, 5, allow_subnormal=False, width=32), st.just(float("nan")), st.just(1.0))),
    st.sampled_from(ALL_RULES),
)
def test_indices_unique_and_in_range(batch, case, rule):
    rewards, m = case
    rewards_PN = np.stack([np.roll(rewards, i) for i in range(batch)])
    idx = np.asarray(JITTED_SELECT(rule, rewards_PN, m, key=jax.random.key(0)))
    assert idx.shape == (batch, m) and idx.dtype == np.int32
    assert ((idx >= 0) & (idx < len(rewards))).all()
    for row in idx:
        assert len(set(row.tolist())) == m


# --- Non-finite rewards --------------------------------------------------------


def test_nan_rewards_are_chosen_last():
    rewards = np.array([0.3, np.nan, 1.0, -np.inf, 0.0, 0.9, np.nan, 0.1], np.float32)
    finite = np.flatnonzero(np.isfinite(rewards))
    # With >= m finite rewards the rule runs on the finite ones only.
    idx = np.asarray(MV(rewards, 3))
    ref = finite[np.asarray(MV(rewards[finite], 3))]
    assert sorted(idx.tolist()) == sorted(ref.tolist())
    # With fewer than m finite: all finite ones, then non-finite in index order.
    few = np.array([np.nan, 2.0, np.inf, 1.0, np.nan], np.float32)
    assert np.asarray(MV(few, 4)).tolist() == [3, 1, 0, 2]
    assert np.asarray(MAX_REWARD(few, 3)).tolist() == [1, 3, 0]


# --- Other rules ---------------------------------------------------------------


@pytest.mark.slow
@PROPERTY
@given(group_and_m(max_n=16))
def test_max_reward_keeps_the_highest(case):
    rewards, m = case
    order = np.lexsort((np.arange(len(rewards)), rewards))[::-1]  # (reward, index) descending
    assert np.asarray(MAX_REWARD(rewards, m)).tolist() == order[:m].tolist()


@pytest.mark.slow
@PROPERTY
@given(group_and_m(max_n=16))
def test_percentile_evenly_spaced_ranks_include_extremes(case):
    rewards, m = case
    n = len(rewards)
    ranks = stable_ranks(rewards)[np.asarray(PERCENTILE(rewards, m))]
    if m == 1:
        assert ranks.tolist() == [n - 1]
        return
    expected = np.floor(np.arange(m) * (n - 1) / (m - 1) + 0.5).astype(int)
    assert ranks.tolist() == expected.tolist()
    assert ranks[0] == 0 and ranks[-1] == n - 1


def test_random_is_uniform_and_deterministic_per_key():
    n, m, trials = 8, 3, 4000
    keys = jax.random.split(jax.random.key(7), trials)
    idx = np.asarray(jax.vmap(lambda k: selection.random(jnp.zeros(n), m, key=k))(keys))
    counts = np.bincount(idx.ravel(), minlength=n)
    p = m / n
    sigma = np.sqrt(trials * p * (1 - p))
    assert np.all(np.abs(counts - trials * p) < 5 * sigma), counts
    # pairs are uniform too, not only marginals: every pair appears ~ trials*C(n-2,m-2)/C(n,m)
    pairs = np.zeros((n, n))
    for row in idx:
        for a, b in itertools.combinations(row, 2):
            pairs[min(a, b), max(a, b)] += 1
    expected_pair = trials * m * (m - 1) / (n * (n - 1))
    assert np.all(np.abs(pairs[np.triu_indices(n, 1)] - expected_pair) < 5 * np.sqrt(expected_pair))
    key = jax.random.key(1)
    assert np.array_equal(np.asarray(RANDOM(jnp.zeros(n), m, key=key)), np.asarray(RANDOM(jnp.zeros(n), m, key=key)))


def test_random_draws_from_the_finite_rewards_uniformly_and_from_the_rest_only_when_short():
    keys = jax.random.split(jax.random.key(3), 2000)
    rewards = jnp.array([jnp.nan, jnp.inf, 0.0, 1.0, 0.0, 1.0, 1.0, -jnp.inf])  # five finite
    idx = np.asarray(jax.vmap(lambda k: selection.random(rewards, 4, key=k))(keys))
    assert np.isfinite(np.asarray(rewards)[idx]).all()
    counts = np.bincount(idx.ravel(), minlength=8)[[2, 3, 4, 5, 6]]
    assert np.all(np.abs(counts - 2000 * 4 / 5) < 5 * np.sqrt(2000 * 0.8 * 0.2)), counts
    # Two finite rewards for M = 4: both, then two of the three others, at random.
    short = jnp.array([jnp.nan, 2.0, jnp.inf, jnp.nan, 5.0])
    idx = np.asarray(jax.vmap(lambda k: selection.random(short, 4, key=k))(keys))
    assert all({1, 4} <= set(row.tolist()) for row in idx)
    assert set(np.unique(idx).tolist()) == {0, 1, 2, 3, 4}


# --- Transforms and sharding ---------------------------------------------------


@pytest.mark.slow
def test_jit_equals_no_jit_and_vmap_equals_loop():
    rewards = np.random.default_rng(3).integers(0, 4, (2, 5, 16)).astype(np.float32)
    eager = np.asarray(selection.max_variance(rewards, 6))
    assert np.array_equal(np.asarray(MV(rewards, 6)), eager)
    flat = rewards.reshape(10, 16)
    vmapped = np.asarray(jax.vmap(lambda r: selection.max_variance(r, 6))(flat))
    looped = np.stack([np.asarray(selection.max_variance(r, 6)) for r in flat])
    assert np.array_equal(vmapped, looped)
    assert np.array_equal(vmapped.reshape(2, 5, 6), eager)


def test_second_call_with_new_values_does_not_recompile():
    fn = jax.jit(lambda rewards: selection.max_variance(rewards, 2))  # a fresh cache
    fn(jnp.zeros((4, 8))).block_until_ready()
    fn(jnp.arange(32.0).reshape(4, 8)).block_until_ready()
    assert fn._cache_size() == 1
    fn(jnp.zeros((4, 16))).block_until_ready()  # a new shape does compile: the counter works
    assert fn._cache_size() == 2


def test_sharded_input_matches_unsharded_and_stays_sharded():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rewards = np.random.default_rng(4).normal(size=(16, 32)).astype(np.float32)
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    placed = jax.device_put(rewards, sharding)
    out = MV(placed, 8)
    assert out.sharding.is_equivalent_to(sharding, out.ndim)
    assert np.array_equal(np.asarray(out), np.asarray(MV(rewards, 8)))

    auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    per_shard = jax.jit(
        jax.shard_map(
            lambda r: selection.max_variance(r, 8), mesh=auto, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")
        )
    )
    assert np.array_equal(np.asarray(per_shard(rewards)), np.asarray(MV(rewards, 8)))


def test_the_core_composes_under_a_mesh_of_explicit_axes():
    # jax.make_mesh's default axes are Explicit: under jax.set_mesh every rule, batch-scaled
    # advantages and the chunked head's gradient had failed inside JAX.
    from podsjax.core import grpo, logprobs

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(6)
    rewards = rng.integers(0, 3, (16, 8)).astype(np.float32)
    hidden, head = rng.normal(size=(16, 4, 8)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32)
    targets = rng.integers(0, 32, (16, 4)).astype(np.int32)

    def each(r, h, w, t):
        picks = {rule: selection.select(rule, r, 3, **({"key": jax.random.key(0)} if selection.rule_needs_key(rule)
                                                       else {}))
                 for rule in selection.available_rules()}
        picks["flat"] = selection.select_flat("max_variance", r.reshape(-1), 8, 3)
        picks["advantages"] = grpo.group_advantages(r, std_scaling="batch")
        picks["hidden_grad"], picks["head_grad"] = jax.grad(
            lambda h, w: logprobs.head_logprobs(h, w, t)[0].sum(), argnums=(0, 1))(h, w)
        return picks

    expected = jax.jit(each)(rewards, hidden, head, targets)
    place = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))  # noqa: E731
    with jax.set_mesh(mesh):
        got = jax.jit(each)(place(rewards), place(hidden), head, place(targets))
    # Without jax.set_mesh too: the head's gradient had named a bare PartitionSpec, which needs one.
    got_plain = jax.jit(each)(place(rewards), place(hidden), jax.device_put(head, NamedSharding(mesh, PartitionSpec())),
                              place(targets))
    for name in expected:
        for result in (got, got_plain):
            np.testing.assert_allclose(np.asarray(result[name]), np.asarray(expected[name]), rtol=1e-5, atol=1e-6,
                                       err_msg=name)


@pytest.mark.parametrize("in_mesh", [False, True])
def test_fewer_groups_than_devices_on_a_mesh_of_explicit_axes(in_mesh):
    # Rows sharded over 8 devices in fewer than 8 groups: the reshape into groups had failed inside
    # JAX, in select_flat and in the loss's group-token-mean.
    from podsjax.core import grpo

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    place = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))  # noqa: E731
    rng = np.random.default_rng(7)
    flat = rng.integers(0, 4, 4 * 16).astype(np.float32)  # 4 prompts x 16 rollouts
    logp, adv = -rng.random((8, 6)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    mask = (rng.random((8, 6)) > 0.3).astype(np.float32)
    config = grpo.LossConfig(aggregation="group-token-mean", group_size=4)  # 2 groups
    pick = jax.jit(lambda r: selection.select_flat("max_variance", r, 16, 4))
    loss = jax.jit(lambda lp, a, mk: grpo.grpo_loss(lp, a, mk, config, old_logprobs_BL=lp + 0.1)[0])
    with jax.set_mesh(mesh) if in_mesh else contextlib.nullcontext():
        rows = pick(place(flat))
        value = loss(place(logp), place(adv), place(mask))
        eager_rows = selection.select_flat("max_variance", place(flat), 16, 4)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(pick(flat)))
    np.testing.assert_array_equal(np.asarray(eager_rows), np.asarray(pick(flat)))
    np.testing.assert_allclose(float(value), float(loss(logp, adv, mask)), rtol=1e-6)


def test_percentile_ranks_stay_exact_and_distinct_where_two_j_times_n_passes_int32():
    # 2 * j * (nv - 1) had overflowed int32 from N * M of about 2**30: slots repeated.
    n, m = 50_000, 25_000
    indices = np.asarray(selection.percentile(jnp.arange(n, dtype=jnp.float32), m))
    j = np.arange(m, dtype=np.int64)
    np.testing.assert_array_equal(indices, (2 * j * (n - 1) + (m - 1)) // (2 * (m - 1)))
    with pytest.raises(ValueError, match="percentile keeps at most M=32768"):
        selection.percentile(jnp.zeros(40_000), 32_769)


def test_sort_with_indices_matches_stable_argsort():
    rng = np.random.default_rng(5)
    for rows, n in ((3, 1), (3, 16), (300, 16), (300, 37), (3, 1500)):
        values = rng.integers(-3, 3, (rows, n)).astype(np.float32)
        values[0, : n // 2] = -0.0  # -0.0 ties with 0.0
        sorted_vals, idx = jax.jit(selection.sort_with_indices)(values)
        ref = np.argsort(values, axis=-1, kind="stable")
        assert np.array_equal(np.asarray(idx), ref), n
        assert np.array_equal(np.asarray(sorted_vals), np.take_along_axis(values, ref, -1))


# --- Registry, masks and errors ------------------------------------------------


def test_registry_dispatch_and_user_rules():
    rewards = jnp.array([[0.0, 5.0, 1.0, 3.0]])
    assert np.array_equal(selection.select("max-variance", rewards, 2), MV(rewards, 2))

    def lowest(rewards, m, *, key=None):
        return jnp.argsort(rewards, axis=-1)[..., :m].astype(jnp.int32)

    selection.register_rule("test_lowest", lowest)
    try:
        assert np.asarray(selection.select("test_lowest", rewards, 2)).tolist() == [[0, 2]]
        with pytest.raises(ValueError, match="already registered"):
            selection.register_rule("test-lowest", lowest)
    finally:
        selection._RULES.pop("test_lowest")
    with pytest.raises(ValueError, match="unknown selection rule 'nope'; known rules: max_reward, max_variance"):
        selection.select("nope", rewards, 2)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        selection.select("random", rewards, 2)
    with pytest.raises(TypeError, match="named by a string.*got function"):
        selection.select(selection.max_variance, rewards, 2)

    broken_rules = [  # what select says of a rule's wrong answer (positions past N: select_flat refused them)
        ("test_too_many", lambda r, m, key=None: jnp.zeros((*r.shape[:-1], m + 1), jnp.float32),
         r"'test_too_many' returned float32 \(1, 3\); .* shape \(1, 2\)"),
        ("test_past_n", lambda r, m, key=None: jnp.full((*r.shape[:-1], m), r.shape[-1], jnp.int32),
         r"'test_past_n' returned values from 4 to 4; .* positions in \[0, N=4\)")]
    for name, rule, message in broken_rules:
        selection.register_rule(name, rule)
        try:
            with pytest.raises(ValueError, match=message):
                selection.select(name, rewards, 2)
        finally:
            selection._RULES.pop(name)


def test_indices_to_mask():
    idx = jnp.array([[3, 0], [1, 2]])
    mask = np.asarray(selection.indices_to_mask(idx, 5))
    assert mask.tolist() == [[True, False, False, True, False], [False, True, True, False, False]]
    with pytest.raises(ValueError, match="integer array"):
        selection.indices_to_mask(jnp.array([0.5]), 4)
    # Positions past a narrow index dtype's range do not wrap onto small indices.
    assert np.asarray(selection.indices_to_mask(jnp.array([[0, 1]], jnp.uint8), 300)).sum() == 2
    # Nor do host positions past int32 (JAX's conversion wraps 2**32 + 1 to 1), a uint64's top included.
    for wide in (np.array([2**32 + 1, 2]), np.array([2**64 - 1, 2], np.uint64), [2**40, 2]):
        assert np.asarray(selection.indices_to_mask(wide, 4)).tolist() == [False, False, True, False]
    # Negative and too large positions mark nothing (a scatter would wrap -1 onto N - 1).
    assert np.asarray(selection.indices_to_mask(jnp.array([[-1, 4, 1]]), 4)).tolist() == [[False, True, False, False]]
    assert not np.asarray(selection.indices_to_mask(jnp.zeros((3, 0), jnp.int32), 4)).any()  # M = 0: nothing
    # A batch axis sharded after the first, on a mesh of Explicit axes.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    idx = np.random.default_rng(8).integers(-1, 5, (2, 8, 3)).astype(np.int32)
    placed = jax.device_put(idx, NamedSharding(mesh, PartitionSpec(None, "data")))
    np.testing.assert_array_equal(np.asarray(selection.indices_to_mask(placed, 4)),
                                  np.asarray(selection.indices_to_mask(idx, 4)))


def test_indices_to_mask_holds_the_mask_not_a_comparison_of_every_index_with_every_position():
    # [P, M, N] booleans had been compared: 537 MB of scratch at P 64, M 2048, N 4096.
    p, m, n = 64, 2048, 4096
    compiled = jax.jit(lambda i: selection.indices_to_mask(i, n)).lower(
        jax.ShapeDtypeStruct((p, m), jnp.int32)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < p * m * n // 16


@pytest.mark.parametrize("m", [0, 5, -1])
def test_bad_m_raises_a_clear_error_at_trace_time(m):
    with pytest.raises(ValueError, match=rf"1 <= m <= N=4.*got m={m}"):
        MV(jnp.zeros(4), m)


def test_traced_m_and_scalar_rewards_raise_clear_errors():
    with pytest.raises(TypeError, match="m must be a static Python int"):
        jax.jit(selection.max_variance)(jnp.zeros(4), 2)
    with pytest.raises(ValueError, match="last axis of rollouts"):
        selection.max_variance(jnp.float32(1.0), 1)
    with pytest.raises(TypeError, match="m must be a static Python int.*got bool"):
        selection.max_variance(jnp.zeros(4), True)
    with pytest.raises(TypeError, match="rewards must be real numbers; got dtype complex64"):
        selection.max_variance(jnp.zeros(4, jnp.complex64), 2)
    with pytest.raises(TypeError, match="rewards must be real numbers; got <U1 values"):
        selection.max_variance(np.array([["a", "b"]]), 1)
    with pytest.raises(TypeError, match=r"key must be a PRNG key \(jax.random.key\(seed\)\); got 0"):
        selection.select("random", jnp.zeros((1, 4)), 2, key=0)
    assert selection.select("random", jnp.zeros((1, 4)), 2, key=jax.random.PRNGKey(0)).shape == (1, 2)  # legacy key
    for call in (lambda: selection.select_flat("max_variance", jnp.zeros(4), True, 1),
                 lambda: selection.flat_rows(jnp.zeros((1, 1), jnp.int32), True)):
        with pytest.raises(TypeError, match="n must be a static Python int.*got bool"):
            call()
    with pytest.raises(TypeError, match="needs_key must be True or False; got 'no'"):
        selection.register_rule("test_bad_flag", lambda r, m, key=None: r, needs_key="no")
    assert "test_bad_flag" not in selection.available_rules()
    with pytest.raises(ValueError, match=r"values must have a last axis \[..., N\]"):
        selection.sort_with_indices(jnp.float32(1.0))
    assert np.asarray(selection.sort_with_indices([3.0, 1.0, 2.0])[1]).tolist() == [1, 2, 0]


@pytest.mark.slow
def test_theorem1_holds_on_every_row_of_a_large_batch():
    # Many rows at once, as the benchmark runs it; check every row against brute force.
    rng = np.random.default_rng(6)
    for n in (5, 8, 10):
        rewards = np.where(rng.random((512, n)) < 0.3, rng.integers(0, 3, (512, n)), rng.normal(size=(512, n)))
        rewards = rewards.astype(np.float32)
        batch = np.tile(rewards, (2, 1))
        for m in range(1, n + 1):
            idx = np.asarray(MV(batch, m))[:512]
            combos = np.array(list(itertools.combinations(range(n), m)))
            best = np.var(rewards.astype(np.float64)[:, combos], axis=-1).max(axis=1)
            got = np.var(np.take_along_axis(rewards, idx, 1).astype(np.float64), axis=1)
            np.testing.assert_allclose(got, best, rtol=1e-5, atol=1e-7)
            assert all(len(set(row)) == m for row in idx.tolist())


def test_flat_rows_refuses_a_position_past_the_group_when_called_eagerly():
    assert selection.flat_rows(jnp.array([[0, 3], [1, 2]]), 4).tolist() == [0, 3, 5, 6]
    with pytest.raises(ValueError, match=r"indices must be positions in \[0, N=4\) of each group; got values from 0 to 5"):
        selection.flat_rows(jnp.array([[0, 5]]), 4)
    with pytest.raises(ValueError, match="from -1 to 1"):
        selection.flat_rows(jnp.array([[-1, 1]]), 4)
    for wide in (np.array([[0, 2**32 + 1]]), [[0, 2**40]]):  # JAX's conversion had wrapped them onto rows
        with pytest.raises(ValueError, match=rf"got values from 0 to {np.asarray(wide).max()}"):
            selection.flat_rows(wide, 4)
    assert selection.flat_rows([[3, 1]], 4, in_position_order=True).tolist() == [1, 3]

    def wide_rule(rewards, m, key=None):
        return np.full((*np.shape(rewards)[:-1], m), 2**32 + 1)
    selection.register_rule("test_wide_rule", wide_rule)
    try:
        with pytest.raises(ValueError, match=f"'test_wide_rule' returned values from {2**32 + 1}"):
            selection.select("test_wide_rule", jnp.zeros((1, 4)), 2)
    finally:
        selection._RULES.pop("test_wide_rule")
