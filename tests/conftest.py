"""Every test sees 8 CPU devices; the flag must be set before jax is imported.

On a GPU (or TPU) host the suite runs on the accelerator, except the modules that build
multi-device meshes: those are pinned to the 8 CPU devices (their default device,
``jax.devices()`` and child processes all see the CPU), so they test the same sharding.
"""

import os
import tempfile

from experiments.cli import host_device_flags  # noqa: E402
from experiments.usage import has_accelerator  # noqa: E402 - imports no JAX
from podsjax.gpu_topology import DEVICELESS_XLA_FLAGS  # noqa: E402 - imports no JAX

os.environ["XLA_FLAGS"] = host_device_flags(8, os.environ.get("XLA_FLAGS", ""))
if not has_accelerator():
    # No accelerator plugin probes for a device that is not there (pages of warnings), and
    # the programs compiled for GPUs from here use cuBLAS GEMMs, as the CLI's do.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] += " " + DEVICELESS_XLA_FLAGS
# CLI runs in tests keep their compiled programs out of the user's compile cache.
os.environ.setdefault("PODSJAX_CACHE_DIR", tempfile.mkdtemp(prefix="podsjax-test-compile-cache-"))
# Tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The CLI and the benchmarks keep freed host memory for reuse; tests run the same way.
from experiments import host_memory  # noqa: E402

host_memory.retain_freed_memory()

import jax  # noqa: E402
import pytest  # noqa: E402

if not has_accelerator():  # also when a plugin imported jax before the variable was set
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
from hypothesis import settings  # noqa: E402

# CI replays the same examples every run; locally hypothesis keeps exploring.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# fp32 parity tests need true fp32 matmuls (GPUs default to TF32).
jax.config.update("jax_default_matmul_precision", "highest")

# Modules whose tests build meshes of up to 8 devices (or run the CLI with --mesh).
CPU_MESH_MODULES = {
    "test_checkpoint", "test_dry_run", "test_experiments_cli", "test_loop", "test_mesh", "test_mesh_multihost",
    "test_multihost_cli",
    "test_models_io", "test_relaunch", "test_resume_killed", "test_sampling", "test_selection", "test_train",
    "test_train_memory", "test_train_multihost", "test_tiny",
}
ON_ACCELERATOR = jax.default_backend() != "cpu"

# Tests of several seconds each (end-to-end runs, subprocesses, compiles of real programs,
# long property searches): `pytest` runs them, `pytest -m "not slow"` leaves them out.
SLOW_MODULES = {
    "test_benchmarks", "test_mesh_multihost", "test_multihost_cli", "test_relaunch", "test_resume_killed",
    "test_train_multihost",
}
SLOW_TESTS = {
    "test_chemistry.py::test_chemistry_command_trains_and_evaluates_on_the_fixture",
    "test_dry_run.py::test_a_run_that_does_not_fit_fails_with_one_line",
    "test_dry_run.py::test_a_second_run_loads_its_programs_from_the_compile_cache",
    "test_dry_run.py::test_dry_run_reports_every_figure_from_config_json_alone",
    "test_dry_run.py::test_kv_cache_and_params_follow_the_shapes",
    "test_dry_run.py::test_qwen_0_5b_setting_a_update_fits_in_8_gb",
    "test_eval_protocol.py::test_sampled_passes_draw_their_own_keys_and_share_the_rollouts_decode_program",
    "test_experiments_cli.py::test_a_chat_template_that_fails_gives_one_line_and_exit_2",
    "test_experiments_cli.py::test_compare_runs_methods_over_seeds_and_reports_speedups",
    "test_experiments_cli.py::test_each_method_runs_on_the_tiny_preset_through_the_cli",
    "test_experiments_cli.py::test_real_checkpoint_run_on_mesh_8_then_resume",
    "test_faults_cli.py::test_a_full_disk_stops_with_one_line_and_resume_is_exact",
    "test_faults_orbax.py::test_a_full_disk_under_orbax_s_threads_is_one_line_and_its_reports_go_to_run_log",
    "test_faults_orbax.py::test_a_metrics_log_cut_before_the_last_checkpoint_stops_the_resume",
    "test_faults_orbax.py::test_every_checkpoint_damaged_is_one_line",
    "test_grpo.py::test_equal_rewards_give_exactly_zero_advantages",
    "test_loop.py::test_a_bf16_full_fine_tune_trains_fp32_master_weights_and_samples_their_bf16_copy",
    "test_loop.py::test_a_step_draws_past_prompts_that_do_not_fit_and_says_how_many",
    "test_loop.py::test_each_program_compiles_once_and_the_console_says_so",
    "test_loop.py::test_groups_per_prompt_draws_each_prompt_as_several_groups",
    "test_loop.py::test_steps_write_metrics_checkpoints_and_resume_exactly",
    "test_loop.py::test_the_best_evaluated_policy_is_kept_and_survives_a_resume",
    "test_loop.py::test_the_fit_check_compiles_what_the_first_step_runs",
    "test_loop.py::test_updates_that_stay_non_finite_stop_the_run_with_one_line",
    "test_models.py::test_lora_equals_merged_weights_and_base_is_lora_off",
    "test_models.py::test_optimized_program_size_does_not_grow_with_depth",
    "test_models.py::test_remat_gives_same_values_and_gradients",
    "test_models_io.py::test_export_merges_lora_and_shards",
    "test_models_io.py::test_sharded_load_of_200mb_model_keeps_host_memory_near_one_tensor",
    "test_models_io.py::test_sharded_prefill_and_decode_match_unsharded",
    "test_peft_export.py::test_peft_adapter_matches_the_merged_export",
    "test_readme.py::test_usage_example_runs",
    "test_rewards.py::test_pool_survives_hangs_crashes_and_memory_blowups",
    "test_rollout_pipeline.py::test_prompts_to_selected_advantages_on_gsm8k",
    "test_sampling.py::test_bf16_generation_runs_and_follows_the_bf16_forward",
    "test_sampling.py::test_greedy_and_sampled_rows_of_one_shape_share_the_decode_program",
    "test_sampling.py::test_sampled_logprobs_match_a_full_forward_pass",
    "test_sampling.py::test_sampled_token_frequencies_match_the_tempered_softmax",
    "test_sampling.py::test_sharded_generation_matches_single_device",
    "test_selection.py::test_indices_unique_and_in_range",
    "test_selection.py::test_jit_equals_no_jit_and_vmap_equals_loop",
    "test_selection.py::test_max_reward_keeps_the_highest",
    "test_selection.py::test_percentile_evenly_spaced_ranks_include_extremes",
    "test_selection.py::test_permutation_permutes_the_indices",
    "test_selection.py::test_shift_and_positive_scale_keep_the_subset",
    "test_selection.py::test_shift_and_scale_keep_the_subset_for_float_rewards",
    "test_selection.py::test_theorem1_holds_on_every_row_of_a_large_batch",
    "test_selection.py::test_theorem1_subset_is_top_k_plus_bottom_m_minus_k",
    "test_selection.py::test_theorem1_variance_equals_brute_force_maximum",
    "test_tiny.py::test_prefix_shared_loss_equals_the_full_sequence_loss",
    "test_tiny.py::test_short_warm_up_writes_a_cache_that_a_second_call_reuses",
    "test_train.py::test_build_batch_selects_and_normalizes_over_the_subset",
    "test_train.py::test_ga_micro_batches_equal_one_big_batch",
    "test_train.py::test_lora_step_leaves_base_params_bit_identical",
    "test_train.py::test_non_finite_loss_skips_the_update",
    "test_train.py::test_sharded_step_equals_single_device",
    "test_train_memory.py::test_pods_update_needs_the_memory_of_grpo_on_m_not_on_n",
    "test_user_rewards.py::test_a_chat_template_that_loops_is_one_line_before_anything_is_written",
    "test_user_rewards.py::test_a_reward_module_that_exits_or_hangs_at_import_is_one_line_naming_it",
    "test_user_rewards.py::test_the_cli_trains_on_your_dataset_with_your_reward_and_system_prompt",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_mesh: runs on the 8 CPU devices even when an accelerator is present")
    config.addinivalue_line("markers", "slow: takes seconds (an end-to-end run, a subprocess, a real compile)")
    cpus = jax.devices("cpu")
    assert len(cpus) == 8, f"expected 8 fake CPU devices, got {len(cpus)}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in CPU_MESH_MODULES:
            item.add_marker(pytest.mark.cpu_mesh)
        if module in SLOW_MODULES or f"{module}.py::{item.originalname}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _pin_mesh_tests_to_cpu(request, monkeypatch):
    if not ON_ACCELERATOR or request.node.get_closest_marker("cpu_mesh") is None:
        yield
        return
    real_devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: real_devices(backend or "cpu"))
    monkeypatch.setattr(jax, "device_count", lambda backend=None: len(real_devices(backend or "cpu")))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # CLI and worker subprocesses
    with jax.default_device(real_devices("cpu")[0]):
        yield


@pytest.fixture(scope="session")
def data_dir():
    """tests/data: real GSM8K and MATH-500 rows kept in the repository (see its README)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.fixture(scope="session")
def chemistry_dir():
    """data/chemistry: SciBench's 223 chemistry problems, the dataset users run setting d on."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "chemistry")
