import functools
import inspect
import os
import sys
from pathlib import Path

import pytest

# Tests import the model zoo (models/) from the repository root as `models` (installed: amp_compiler.models).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# transformers and timm import torchvision when it is installed; the wheel that matches the torch pin
# needs its missing op schemas defined first (see models/torchvision_ops.py).
import models.torchvision_ops  # noqa: E402,F401

# Markers, so the inner loop skips what is slow (README, "Tests": the fast command). CI runs everything.
# Most are found, not listed: a new test file is classified by what it uses.
#   real_models  the test, or a fixture it uses, names REAL_MODELS (tests/real_models.py: HF, timm, torchvision,
#                PyG, diffusers configs), or it is in test_real_models.py
#   distributed  its file imports distributed_testing (two gloo ranks in subprocesses)
#   browser      it is skipped without a browser (a skipif whose reason says "browser"): headless Chromium
#   slow         listed below, from a full run's timings (junit XML, 2 cores): a file whose tests are slow or
#                share a costly module fixture, or single tests; mark a new slow test @pytest.mark.slow
MARKERS = {
    "real_models": "builds models of tests/real_models.py (transformers, timm, torchvision, PyG, diffusers)",
    "distributed": "runs two torch.distributed ranks in subprocesses (tests/distributed_testing.py)",
    "browser": "drives a headless Chromium (skipped without one)",
    "slow": "a second or more on 2 busy cores (conftest.py lists them); the fast loop leaves it out",
}
SLOW_FILES = {
    "test_zoo_levels.py",           # every zoo model converted and trained at every level: 62 s
    "test_onnx_zoo.py",             # the zoo exported and run in ONNX Runtime: 25 s
    "test_runtime_dtypes.py",       # the zoo's ATen calls recorded at O1: 16 s
    "test_onnx_node_tests.py",      # 569 ONNX backend cases, generated at import (10 s before the first test)
    "test_onnx_package.py",         # fresh interpreters: 10 s
    "test_gpu_script.py",           # benchmarks/gpu.py's dry run: 8 s
}
SLOW_TESTS = {    # file -> test names (parameters left out): 0.6 s or more on 2 loaded cores, or 1.5 s in a full run
    "test_capture_once.py": ("test_export_onnx_captures_once",),
    "test_cast_placement.py": ("test_casts_move_to_the_small_side_with_the_same_outputs_and_gradients",
        "test_convert_onnx_places_casts_with_the_same_hook_and_fewer_bytes",),
    "test_checkpointing.py": ("test_o0_gradients_and_training_equal_the_unconverted_model",),
    "test_cli_demo.py": ("test_the_installed_command_runs_the_demo_from_any_folder",),
    "test_cli_insight.py": ("test_explain_filters_and_options_reach_convert",
        "test_render_draws_an_onnx_file_and_a_factory",),
    "test_compare.py": ("test_a_sound_conversion_passes_with_every_float_node_measured",
        "test_the_first_node_past_tolerance_comes_with_its_chain", "test_the_report_is_data_too",
        "test_validate_onnx_returns_the_same_report_type",),
    "test_compile.py": ("test_a_compiled_train_step_matches_the_eager_one",
        "test_a_converted_graph_compiles_without_graph_breaks",),
    "test_convert_capture.py": ("test_composite_torch_modules_are_traced_through",
        "test_converted_graph_survives_torch_save_and_deepcopy",),
    "test_convert_casts.py": ("test_a_cast_made_before_a_write_through_a_view_is_not_read_after_it",),
    "test_ddp.py": ("test_two_ranks_train_identically_and_skip_overflow_together",),
    "test_freeze.py": ("test_a_changed_weight_is_never_read_from_a_stale_copy",
        "test_a_frozen_call_compares_all_weights_in_one_operation_and_still_sees_a_write_through_data",
        "test_a_frozen_low_leaf_reads_cached_parameters_and_compare_still_replays_fp32",
        "test_an_inference_call_casts_no_weight_and_returns_the_same_values",
        "test_explain_verify_and_compare_read_a_frozen_graph",
        "test_freeze_without_value_samples_makes_no_comparison_and_still_sees_an_optimizer_step",
        "test_training_mode_casts_every_call_and_trains",),
    "test_frontend_capture.py": ("test_a_compiled_model_is_converted_through_its_original_and_left_working",
        "test_a_model_whose_own_forward_cannot_be_captured_converts_its_children",
        "test_export_path_dtypes_are_true_and_dims_stay_dynamic",),
    "test_fsdp.py": ("test_fully_shard_trains_like_one_process_and_skips_overflow_together",),
    "test_fused_attention_masks.py": ("test_hf_bert_reads_its_expanded_mask_through_the_helper_with_unchanged_outputs",),
    "test_hooks_and_modes.py": ("test_a_compiled_converted_module_follows_train_and_eval",
        "test_a_training_branch_follows_train_and_eval",),
    "test_keep_coordinates_fp32.py": ("test_a_second_image_size_and_step_count",
        "test_iterative_warp_keeps_positions_fp32_and_is_as_accurate_as_autocast",),
    "test_levels.py": ("test_o0_paints_nothing_on_fx_and_onnx",),
    "test_mixed_norms.py": ("test_layer_norm_as_a_mixed_kernel_misses_the_bar_on_bert_so_o1_keeps_it_fp32",
        "test_o1_mixed_norm_kernels_are_as_close_to_fp32_as_a_cast_pair",),
    "test_models_zoo.py": ("test_forward_backward_runs", "test_fp32_training_lowers_loss",),
    "test_moe.py": ("test_o2_routes_from_fp32_scores", "test_scatter_add_accumulates_in_fp32_at_o2",
        "test_the_choice_is_fp32s_at_o1",),
    "test_nonfinite_policy.py": ("test_a_clean_step_ends_the_run_and_rearms_the_warning",
        "test_a_custom_manager_is_held_to_the_same_limit",
        "test_every_manager_raises_past_its_bad_step_max_and_says_what_to_check",
        "test_no_manager_raises_after_bad_step_max_consecutive_skips_with_one_warning",),
    "test_onnx_cli.py": ("test_export_builds_the_factory_and_validates",
        "test_export_of_a_bare_module_takes_input_shapes",),
    "test_onnx_export.py": ("test_a_weight_beyond_fp16_is_exported_fp32_and_reported", "test_dynamic_batch",
        "test_an_embedding_table_is_stored_fp16_unless_fp16_cannot_hold_it",
        "test_keep_io_types_false_takes_and_returns_fp16", "test_o1_norm_stays_fp32",
        "test_o3_norm_weights_follow_the_fp16_data",
        "test_the_softmax_of_a_decomposed_attention_runs_fp32_unless_forced_low",),
    "test_onnx_export_inference.py": ("test_a_norm_named_by_a_force_pattern_is_not_folded",
        "test_export_folds_and_matches_the_model", "test_export_has_no_more_casts_and_weight_bytes_than_convert_onnx",),
    "test_onnx_files_and_inputs.py": ("test_a_killed_write_leaves_its_staging_file_where_the_docstring_says",),
    "test_onnx_report.py": ("test_export_onnx_progress_steps_through_export_passes_and_save",
        "test_export_onnx_report_has_islands_and_module_groups",
        "test_table_by_module_groups_rows_and_folds_the_repeated_block",),
    "test_onnx_validate.py": ("test_an_export_validates_against_its_module",),
    "test_policy_coverage.py": ("test_every_op_a_level_runs_low_has_a_cpu_kernel_or_stays_fp32_on_cpu",
        "test_torchvision_s3d_runs_at_o1_bf16_on_cpu_within_twice_autocasts_error",),
    "test_property.py": ("test_random_models_are_valid_and_close_to_fp32",),
    "test_render.py": ("test_a_model_run_as_written_shows_its_converted_children",
        "test_an_onnx_file_is_drawn_as_svg_too", "test_an_onnx_file_is_drawn_from_its_types_with_the_reports_rules",),
    "test_report.py": ("test_a_reloaded_module_explains_itself_when_its_decisions_were_preserved",),
    "test_runner.py": ("test_every_pass_keeps_the_invariants_on_fx_and_onnx",),
    "test_train_network.py": ("test_demo_training_default_starts_at_2_16_and_says_so_when_nothing_is_skipped",
        "test_demo_training_says_the_first_skips_are_the_scale_calibrating_itself",
        "test_eval_mode_of_the_model_is_followed",
        "test_gradients_below_fp16_range_train_like_fp32_only_with_dynamic_scaling",
        "test_injected_overflow_skips_the_step_and_leaves_everything_bit_identical",
        "test_new_shapes_are_traced_once_and_reused",
        "test_o0_step_matches_a_plain_fp32_loop_including_dropout_and_batchnorm",
        "test_zoo_trains_in_mixed_precision_like_fp32",),
}


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_ignore_collect(collection_path: Path, config):
    """Skip importing a file every test of which the -m expression leaves out (transformers, ONNX Runtime and
    the zoo take most of a fast run's time at import)."""
    expression = config.getoption("markexpr", "")
    if not expression or collection_path.suffix != ".py" or collection_path.name not in SLOW_FILES | _FILE_MARKED:
        return None
    markers = _file_markers(collection_path.name)
    return True if _excludes_whatever_else(expression, markers) else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in _markers_of(item):
            item.add_marker(name)


_FILE_MARKED = {"test_real_models.py"}   # files whose every test carries a marker without looking at it


def _file_markers(file: str) -> set[str]:
    return ({"slow"} if file in SLOW_FILES else set()) | ({"real_models"} if file == "test_real_models.py" else set())


def _markers_of(item) -> set[str]:
    file = item.path.name
    markers = set(_file_markers(file))
    if getattr(item, "originalname", item.name) in SLOW_TESTS.get(file, ()):
        markers.add("slow")
    if any("REAL_MODELS" in _source(function) for function in _functions(item)):
        markers.add("real_models")
    if "distributed_testing" in sys.modules and any(
            getattr(value, "__module__", None) == "distributed_testing" for value in vars(item.module).values()):
        markers.add("distributed")
    if any("browser" in str(mark.kwargs.get("reason", "")).lower() for mark in item.iter_markers("skipif")):
        markers.add("browser")
    return markers


def _functions(item) -> list:
    """The test function and the functions of the fixtures it uses (where a real model is usually built)."""
    fixtures = getattr(item, "_fixtureinfo", None)
    definitions = fixtures.name2fixturedefs.values() if fixtures is not None else ()
    return [item.function, *(d.func for defs in definitions for d in defs)]


@functools.cache
def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _excludes_whatever_else(expression: str, markers: set[str]) -> bool:
    """Whether `-m expression` deselects every test carrying `markers`, whatever other markers it has."""
    try:
        from _pytest.mark.expression import Expression
        compiled = Expression.compile(expression)
    except Exception:   # noqa: BLE001 - pytest's own error comes at selection; import the file meanwhile
        return False
    others = sorted(set(MARKERS) - markers)
    for mask in range(2 ** len(others)):
        extra = {name for bit, name in enumerate(others) if mask >> bit & 1}
        for unknown in (False, True):
            if compiled.evaluate(lambda name, **kwargs: name in markers | extra or (unknown and name not in MARKERS)):
                return False
    return True
