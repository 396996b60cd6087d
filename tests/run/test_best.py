"""The best policy's folder: a fresh run clears only what runs write there, and a NaN evaluation is never the best."""

import jax.numpy as jnp
import numpy as np

from podsjax.run.best import BEST_DIRNAME, BestPolicy


def test_a_fresh_start_clears_old_bests_but_no_other_file(tmp_path):
    # It had removed the whole folder, a user's files in it too.
    best = tmp_path / BEST_DIRNAME
    (best / "3").mkdir(parents=True)
    (best / "3" / "state").write_text("a killed first attempt's best")
    (best / "notes.txt").write_text("mine")
    BestPolicy(str(tmp_path), (None, None), resumed_step=None)
    assert sorted(p.name for p in best.iterdir()) == ["notes.txt"]


def test_a_nan_evaluation_is_never_the_best(tmp_path):
    # A NaN had stayed the best for good: no later accuracy compares greater than it.
    policy = BestPolicy(str(tmp_path), (None, None), resumed_step=None)
    params = {"w": jnp.ones(3)}
    assert not policy.offer(0, float("nan"), params)
    assert policy.offer(1, np.float32(0.5), params) and policy.offer(2, 0.75, params)  # a NumPy float too
    assert not policy.offer(3, 0.75, params)
    assert (policy.step, policy.accuracy) == (2, 0.75)
    resumed = BestPolicy(str(tmp_path / "old"), (0, float("nan")), resumed_step=None)  # an older run's record
    assert resumed.offer(1, 0.1, params)


def test_the_eval_history_is_strict_json(tmp_path):
    # A NaN accuracy had been written as a bare NaN, and a NumPy float32 had stopped the run.
    import json

    from podsjax.run import run_files

    run_files.append_history(str(tmp_path), {"eval/accuracy": float("nan"), "eval/examples": np.int64(4),
                                             "step": 3, "eval/mean": np.float32(0.5)})
    line = (tmp_path / run_files.HISTORY_FILE).read_text()
    assert json.loads(line, parse_constant=lambda c: 1 / 0) == {"eval/accuracy": None, "eval/examples": 4,
                                                               "step": 3, "eval/mean": 0.5}
    back = run_files.read_history(str(tmp_path))[0]  # read back as the run wrote it: NaN again
    assert np.isnan(back["eval/accuracy"]) and back["eval/mean"] == 0.5


def test_a_resume_keeps_the_best_saved_at_its_checkpoint_s_own_step(tmp_path):
    # The run's last evaluation and its end checkpoint at one step: a resume with a larger
    # budget had deleted that best (only later ones belong to no checkpoint) and warned.
    params = {"w": jnp.ones(3)}
    first = BestPolicy(str(tmp_path), (None, None), resumed_step=None)
    assert first.offer(2, 0.25, params) and first.offer(4, 0.5, params)
    warnings = []
    resumed = BestPolicy(str(tmp_path), (4, 0.5), resumed_step=4, warn=warnings.append)
    assert (resumed.step, resumed.accuracy) == (4, 0.5) and not warnings
    assert (tmp_path / BEST_DIRNAME / "4").is_dir() and not (tmp_path / BEST_DIRNAME / "2").exists()
