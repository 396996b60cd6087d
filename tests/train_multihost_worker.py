"""One process of the 2-process train-step test in test_train_multihost.py (not a test file).

Run as a script, it joins a 2-process JAX run (PODSJAX_* env vars, gloo), feeds its own
half of the prompts through ``host_batches.host_batch_to_global`` and takes one train step; process 0
saves the gathered params, metrics and global batch to ``sys.argv[1]``. Imported, it only
offers ``setup`` / ``local_batch`` so the test builds the 1-process reference identically.
"""

import os
import sys

if __name__ == "__main__":  # before jax is imported: 4 local devices, 2 processes -> 8
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import podsjax.models as pm  # noqa: E402
from host_batches import host_batch_to_global  # noqa: E402
from podsjax.devices import mesh as mesh_lib  # noqa: E402
from podsjax.update import algorithms, train_step  # noqa: E402
from experiments import paper_settings  # noqa: E402

MODEL = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=True)
# PODS with 2 micro-batches: selection, the scan and cross-device reductions all take part.
# lr 1e-3: Adam's first step is ~lr * sign(g), so float noise in near-zero grads stays < 1e-6.
ALGO = paper_settings.method_config("pods", n=8, m=4, grad_accum=2, learning_rate=1e-3, max_grad_norm=1e6)
MESH = "data=2,fsdp=2,tensor=2"  # params split over fsdp/tensor, so every step talks across hosts
P, LP, T = 4, 6, 5  # 4 prompts in all: 2 per host


def rollouts():
    """The same prompts, completions and rewards on every process (fixed seed)."""
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(1, 64, (P, LP)).astype(np.int32)
    prompt_mask = np.ones((P, LP), np.int32)
    prompt_mask[::2, :2] = 0  # left padding on some prompts, on both hosts
    tokens = rng.integers(1, 64, (P, ALGO.n, T)).astype(np.int32)
    mask = np.arange(T) < rng.integers(1, T + 1, (P, ALGO.n))[..., None]
    rewards = (rng.integers(0, 2, (P, ALGO.n)) + rng.normal(0, 0.1, (P, ALGO.n))).astype(np.float32)
    return prompt_ids, prompt_mask, tokens, mask, rewards


def local_batch(prompts: slice) -> train_step.TrainBatch:
    """The update rows of the given prompts, as numpy: selection is per prompt, so a host needs only its own."""
    batch, _ = jax.jit(train_step.build_batch, static_argnames="config")(*(x[prompts] for x in rollouts()), config=ALGO)
    return jax.tree.map(np.asarray, batch)


def setup(mesh):
    """(jitted step, initial state) on ``mesh``; params are born sharded from a fixed key."""
    model = pm.Decoder(MODEL, mesh=mesh)
    params = pm.init_params(model, jax.random.key(0), mesh)
    policy, reference = train_step.full_apply_fn(model)
    optimizer = algorithms.make_optimizer(ALGO)
    state = jax.jit(lambda p: train_step.init_state(p, optimizer))(params)  # one compile, not one per op
    return jax.jit(train_step.make_train_step(policy, optimizer, ALGO, reference)), state


def flat(tree, prefix):
    return {prefix + jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def main(out_path):
    from jax.experimental import multihost_utils

    assert mesh_lib.initialize_distributed()  # PODSJAX_* from the environment
    assert jax.process_count() == 2 and jax.local_device_count() == 4 and jax.device_count() == 8
    mesh = mesh_lib.make_mesh(MESH)
    step, state = setup(mesh)
    half = P // 2
    me = jax.process_index()
    # The real multi-host path: this host holds only its own prompts' rows.
    batch = host_batch_to_global(local_batch(slice(me * half, (me + 1) * half)), mesh)
    new_state, metrics = step(state, batch, None)
    gathered = multihost_utils.process_allgather(
        {"params": new_state.params, "metrics": metrics, "batch": batch}, tiled=True)
    if me == 0:
        np.savez(out_path, **flat(gathered["params"], "params"), **flat(gathered["metrics"], "metrics"),
                 **flat(gathered["batch"], "batch"))
    print(f"process {me}: loss={float(metrics.loss):.9g}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
