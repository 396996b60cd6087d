"""The optimizer the config builds: clipping, weight decay and the cosine schedule's shape."""

import math

import jax.numpy as jnp
import numpy as np
import optax

from podsjax.update import algorithms


def _one_update(config, params, grads):
    optimizer = algorithms.make_optimizer(config)
    updates, state = optimizer.update(grads, optimizer.init(params), params)
    return optax.apply_updates(params, updates), state


def test_gradients_are_clipped_to_max_grad_norm_before_adam():
    config = algorithms.AlgorithmConfig(max_grad_norm=0.1, learning_rate=1e-3)
    params = {"w": jnp.zeros(4)}
    _, (_, (adam, *_)) = _one_update(config, params, {"w": jnp.full(4, 5.0)})  # global norm 10
    # Adam's first moment after one step is (1 - b1) x the clipped gradient, 5 x 0.1 / 10 each.
    np.testing.assert_allclose(adam.mu["w"], (1 - config.adam_b1) * 0.05, rtol=1e-6)


def test_weight_decay_is_applied_decoupled():
    config = algorithms.AlgorithmConfig(learning_rate=1e-2, weight_decay=0.1)
    new, _ = _one_update(config, {"w": jnp.ones(3)}, {"w": jnp.zeros(3)})  # zero gradient: only the decay moves w
    np.testing.assert_allclose(new["w"], 1 - 1e-2 * 0.1, rtol=1e-6)


def test_cosine_schedule_spans_total_steps_after_its_warmup():
    # transformers' get_cosine_schedule_with_warmup: the cosine runs from the warm-up's end to total_steps.
    config = algorithms.AlgorithmConfig(schedule="cosine", total_steps=100, warmup_ratio=0.1, learning_rate=1.0)
    schedule = algorithms.learning_rate_schedule(config)
    expected = {0: 0.0, 5: 0.5, 10: 1.0, 55: 0.5, 90: 0.5 * (1 + math.cos(math.pi * 80 / 90)), 100: 0.0}
    for step, lr in expected.items():
        np.testing.assert_allclose(float(schedule(step)), lr, atol=1e-6, err_msg=f"step {step}")
