"""Flax's lifted layer stacks are built once, one thread at a time: a run's start traces the
decoder on several threads, and Flax's lifting edits the base classes it reads."""

import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import kw_only_dataclasses

import podsjax.models as pm
from podsjax.models import decoder, lifted, shared_prefix

TINY = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8)


def test_tracing_the_decoder_builds_no_flax_class_once_its_modules_are_imported(monkeypatch):
    built = []
    original = kw_only_dataclasses._process_class
    monkeypatch.setattr(kw_only_dataclasses, "_process_class", lambda *a, **k: built.append(a[0]) or original(*a, **k))
    ids = jnp.ones((1, 4), jnp.int32)
    for remat in decoder.REMAT_POLICIES:
        model = pm.Decoder(TINY, remat=remat)
        params = jax.eval_shape(model.init, jax.random.key(0), ids, ids > 0)
        jax.eval_shape(model.apply, params, ids, ids > 0)
        shared_prefix.scanned_blocks(remat, shared_prefix.PrefixBlock, shared_prefix._PREFIX_IN_AXES)
    assert built == []
    assert decoder.scanned_blocks("full") is decoder.scanned_blocks("full")
    assert decoder.scanned_blocks("full") is not decoder.scanned_blocks("dots")


def test_threads_lifting_at_once_lift_one_at_a_time(monkeypatch):
    spans, flax_scan = [], nn.scan

    def slow_scan(*args, **kwargs):
        start = time.perf_counter()
        time.sleep(0.05)  # long enough for every other thread to reach the lift meanwhile
        lifted_class = flax_scan(*args, **kwargs)
        spans.append((start, time.perf_counter()))
        return lifted_class

    monkeypatch.setattr(nn, "scan", slow_scan)
    blocks = [type(f"Block{i}", (decoder.Block,), {}) for i in range(4)]
    results = {}
    threads = [threading.Thread(target=lambda b=b: results.update({b: lifted.layer_scan(b, (0, 0, nn.broadcast, nn.broadcast),
                                                                                          True)}))
               for b in blocks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(results) == set(blocks) and len(spans) == 4
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
