"""Selection on flat [P*N] layouts and in position order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podsjax.core import selection

RULES = ("max_variance", "max_reward", "percentile", "random")
PROPERTY = settings(max_examples=40, deadline=None)
# Jitted once and shared, so each shape compiles once.
JITTED_SELECT_FLAT = jax.jit(selection.select_flat, static_argnames=("rule", "n", "m", "in_position_order"))
JITTED_SELECT = jax.jit(selection.select, static_argnames=("rule", "m", "in_position_order"))
JITTED_FLAT_ROWS = jax.jit(selection.flat_rows, static_argnames=("n", "in_position_order"))


# A few (P, N, M), so the properties search values and compile each shape once.
SHAPES = [(1, 1, 1), (1, 5, 2), (2, 4, 2), (3, 6, 3), (2, 8, 8), (4, 3, 1)]


@st.composite
def flat_batch(draw):
    """(rewards [P*N] float32, P, N, M, a seed) with ties drawn often."""
    p, n, m = draw(st.sampled_from(SHAPES))
    values = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(-10, 10, allow_subnormal=False, width=32))
    rewards = draw(st.lists(values, min_size=p * n, max_size=p * n))
    return np.asarray(rewards, np.float32), p, n, m, draw(st.integers(0, 2**31 - 1))


def grouped_reference(rule, rewards, n, m, key):
    """Rows from select on the [P, N] reshape, written out in NumPy."""
    idx_PM = np.asarray(JITTED_SELECT(rule, rewards.reshape(-1, n), m, key=key))
    return np.concatenate([p * n + row for p, row in enumerate(idx_PM)])


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
@PROPERTY
@given(flat_batch())
def test_select_flat_picks_the_rows_of_select_on_the_grouped_view(rule, case):
    rewards, p, n, m, seed = case
    key = jax.random.key(seed)
    rows = np.asarray(JITTED_SELECT_FLAT(rule, rewards, n, m, key=key))
    assert rows.dtype == np.int32 and rows.shape == (p * m,)
    assert rows.tolist() == grouped_reference(rule, rewards, n, m, key).tolist()
    # Gathering flat rows gives what take_along_axis gives on the grouped view.
    idx_PM = np.asarray(JITTED_SELECT(rule, rewards.reshape(p, n), m, key=key))
    assert np.array_equal(rewards[rows], np.take_along_axis(rewards.reshape(p, n), idx_PM, 1).ravel())


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
@PROPERTY
@given(flat_batch())
def test_position_order_keeps_the_subset_and_sorts_each_group(rule, case):
    rewards, p, n, m, seed = case
    key = jax.random.key(seed)
    default = np.asarray(JITTED_SELECT_FLAT(rule, rewards, n, m, key=key)).reshape(p, m)
    ordered = np.asarray(JITTED_SELECT_FLAT(rule, rewards, n, m, key=key, in_position_order=True)).reshape(p, m)
    assert np.array_equal(np.sort(default, axis=1), ordered)
    assert (np.diff(ordered, axis=1) > 0).all()  # strictly ascending: no rollout twice
    assert ((ordered >= np.arange(p)[:, None] * n) & (ordered < np.arange(1, p + 1)[:, None] * n)).all()
    grouped = np.asarray(JITTED_SELECT(rule, rewards.reshape(p, n), m, key=key, in_position_order=True))
    assert np.array_equal(grouped + np.arange(p)[:, None] * n, ordered)


@pytest.mark.slow
@PROPERTY
@given(flat_batch())
def test_flat_rows_over_leading_axes_match_a_loop(case):
    rewards, p, n, m, _ = case
    rewards_XPN = np.stack([rewards, rewards[::-1]]).reshape(2, p, n)
    idx_XPM = np.asarray(JITTED_SELECT("max_variance", rewards_XPN, m))
    rows = np.asarray(JITTED_FLAT_ROWS(idx_XPM, n))
    assert rows.shape == (2, p * m)
    for x in range(2):
        expected = [g * n + int(i) for g in range(p) for i in idx_XPM[x, g]]
        assert rows[x].tolist() == expected


@pytest.mark.slow
@PROPERTY
@given(flat_batch())
def test_the_mask_of_the_selection_marks_exactly_the_flat_rows(case):
    rewards, p, n, m, _ = case
    idx_PM = JITTED_SELECT("max_variance", rewards.reshape(p, n), m)
    mask = np.asarray(selection.indices_to_mask(idx_PM, n)).reshape(p * n)
    rows = np.asarray(JITTED_SELECT_FLAT("max_variance", rewards, n, m, in_position_order=True))
    assert np.flatnonzero(mask).tolist() == rows.tolist()


def test_jit_equals_no_jit_and_vmap_equals_loop():
    rewards_XR = jax.random.normal(jax.random.key(0), (3, 4 * 6))
    eager = np.asarray(selection.select_flat("max_variance", rewards_XR, 6, 2, in_position_order=True))
    jitted = np.asarray(JITTED_SELECT_FLAT("max_variance", rewards_XR, 6, 2, in_position_order=True))
    vmapped = np.asarray(jax.vmap(lambda r: selection.select_flat("max_variance", r, 6, 2, in_position_order=True))(
        rewards_XR))
    looped = np.stack([np.asarray(JITTED_SELECT_FLAT("max_variance", r, 6, 2, in_position_order=True))
                       for r in rewards_XR])
    assert eager.shape == (3, 8)
    assert np.array_equal(eager, jitted) and np.array_equal(eager, vmapped) and np.array_equal(eager, looped)


def test_second_call_with_new_values_does_not_recompile():
    fn = jax.jit(lambda rewards: selection.select_flat("max_variance", rewards, 4, 2, in_position_order=True))
    fn(jnp.arange(8.0))
    fn(jnp.arange(8.0)[::-1])
    assert fn._cache_size() == 1


def test_known_flat_batch():
    # Two prompts, n = 4: max variance keeps one 0 and one 1 of each (lowest index among the 0s,
    # highest among the 1s); position order sorts within each group only.
    rewards = jnp.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    assert selection.select_flat("max_variance", rewards, 4, 2).tolist() == [1, 2, 4, 6]
    assert selection.select_flat("max_reward", rewards, 4, 2).tolist() == [2, 0, 6, 5]
    assert selection.select_flat("max_reward", rewards, 4, 2, in_position_order=True).tolist() == [0, 2, 5, 6]


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: selection.select_flat("max_variance", jnp.zeros(7), 4, 2), "flat \\[..., P\\*N\\] with N=4"),
        (lambda: selection.select_flat("max_variance", jnp.zeros(8), 0, 1), "n must be >= 1"),
        (lambda: selection.select_flat("max_variance", jnp.zeros(8), 4, 5), "1 <= m <= N=4"),
        (lambda: selection.flat_rows(jnp.zeros(3, jnp.int32), 4), "integer array \\[..., P, M\\]"),
        (lambda: selection.flat_rows(jnp.zeros((2, 3)), 4), "integer array \\[..., P, M\\]"),
    ],
)
def test_bad_input_is_one_line_value_error(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_n_must_be_static():
    with pytest.raises(TypeError, match="n must be a static Python int"):
        jax.jit(lambda r, n: selection.select_flat("max_variance", r, n, 1))(jnp.zeros(4), 2)
