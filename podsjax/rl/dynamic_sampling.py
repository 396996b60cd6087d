"""DAPO's dynamic sampling around PODS's selection: which groups of several draws a step trains.

A group whose n rewards all agree has zero advantage everywhere, so it adds rows to the
update but no gradient. Dynamic sampling drops such groups and draws more prompts until the
step's groups are full; PODS then selects m of n inside each group that is kept. The step's
shapes never change: when the draws run out, dropped groups fill the remaining places.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from podsjax.rl.step_data import Scored


def zero_variance(rewards_GN: np.ndarray) -> np.ndarray:
    """[G] bool: the groups whose rewards are all equal (no group-relative signal; TRL's
    ``frac_reward_zero_std`` counts them)."""
    rewards_GN = np.asarray(rewards_GN)
    if rewards_GN.ndim != 2:
        raise ValueError(f"rewards must be [groups, n]; got shape {rewards_GN.shape}")
    return np.all(rewards_GN == rewards_GN[:, :1], axis=1)


def choose_groups(zero_G: np.ndarray, wanted: int) -> tuple[np.ndarray, int]:
    """The ``wanted`` groups to train, in draw order, and how many of them fill in for a shortfall.

    The first ``wanted`` groups with reward variance are taken; when fewer were drawn, the
    earliest zero-variance groups fill the rest.
    """
    zero_G = np.asarray(zero_G, bool)
    if isinstance(wanted, bool) or not isinstance(wanted, (int, np.integer)) or wanted < 0:
        raise ValueError(f"wanted must be an integer >= 0; got {wanted!r}")  # -1 had taken all but the last
    if len(zero_G) < wanted:
        raise ValueError(f"{len(zero_G)} groups drawn cannot fill {wanted}")
    informative, flat = np.flatnonzero(~zero_G), np.flatnonzero(zero_G)
    filled = max(0, wanted - len(informative))
    chosen = np.concatenate([informative[:wanted], flat[:filled]])
    return np.sort(chosen), filled


def group_rows(groups: np.ndarray, n: int) -> np.ndarray:
    """Row indices [len(groups) * n] of the rollouts of ``groups`` (row g*n + j is rollout j of group g)."""
    return (np.asarray(groups)[:, None] * n + np.arange(n)).reshape(-1)


def take_scored(rounds: Sequence[Scored], rows: np.ndarray) -> Scored:
    """The scored rows ``rows`` of the rounds' scores laid end to end; failure counts are summed."""
    def joined(field):
        return np.concatenate([field(r) for r in rounds])[rows]

    first = rounds[0]
    return Scored(joined(lambda r: r.total), joined(lambda r: r.length), joined(lambda r: r.truncated),
                  {name: joined(lambda r, name=name: r.per_function[name]) for name in first.per_function},
                  {name: float(sum(r.failures[name] for r in rounds)) for name in first.failures})


@jax.jit
def _take_rows(parts: Sequence[jax.Array], rows: jax.Array) -> jax.Array:  # the compile label
    return jnp.take(jnp.concatenate(parts), rows, axis=0)


def take_rows(parts: Sequence[Any], rows: np.ndarray) -> Any:
    """Rows ``rows`` of device arrays laid end to end, placed as the first part is (None stays None)."""
    if parts[0] is None:
        return None
    taken = _take_rows(list(parts), jnp.asarray(rows, jnp.int32))
    return jax.device_put(taken, parts[0].sharding)
