"""convert_onnx on the ONNX backend node tests, generated here from the installed onnx package (issue 9).

A representative slice: every float op type of the suite once (its first single-node case), plus the
expanded function bodies and sequence/optional/Loop/If cases that were refused or not idempotent before;
each at O1 and O3, and at O3 again with its float inputs turned into weights (the node tests have no
initializers, so that is where "nothing clipped" is checked). The whole suite, ~1,400 cases that ONNX
Runtime can run, goes through `python benchmarks/survey_onnx_node_tests.py`.
"""
import pytest

from onnx_node_cases import SourceNotRunnable, cases_by_op_type, check_conversion, float_cases

pytestmark = pytest.mark.slow  # 569 ONNX backend cases, generated at import (10 s before the first test)

# Cases convert_onnx refused or changed on a second conversion before issue 9, and cases whose floats live
# only in sequences, optionals or subgraphs.
NAMED = ("test_affine_grid_2d_expanded", "test_affine_grid_3d_align_corners_expanded", "test_mvn",
         "test_mvn_expanded", "test_layer_normalization_4d_axis0_expanded", "test_resize_upsample_scales_nearest",
         "test_attention_4d_gqa_causal_nonpad_decode_expanded", "test_identity_sequence", "test_identity_opt",
         "test_if_seq", "test_if_opt", "test_loop13_seq", "test_loop16_seq_none",
         "test_optional_has_element_tensor_input", "test_sequence_map_add_2_sequences_expanded",
         "test_range_float_type_positive_delta_expanded")

CASES = float_cases()
SLICE = {**cases_by_op_type(CASES), **{name: [name] for name in NAMED if name in CASES}}


def test_the_slice_covers_the_suite():
    # Guards the generator: a new onnx release that registers its cases elsewhere must not empty the slice.
    assert len(CASES) > 1000 and len(SLICE) > 150
    assert set(NAMED) <= set(CASES), sorted(set(NAMED) - set(CASES))


def check_first_runnable(key: str, level: str, folder, *, weights: bool = False) -> dict:
    """check_conversion on the first case of `key` that ONNX Runtime runs in fp32 (skip if none does)."""
    for name in SLICE[key]:
        try:
            return check_conversion(CASES[name], level, str(folder), weights=weights)
        except SourceNotRunnable:
            continue
    pytest.skip(f"ONNX Runtime runs none of {key}'s {len(SLICE[key])} cases in fp32")


@pytest.mark.parametrize("level", ["O1", "O3"])
@pytest.mark.parametrize("key", sorted(SLICE))
def test_node_case_converts_runs_and_is_idempotent(key, level, tmp_path):
    checked = check_first_runnable(key, level, tmp_path)
    assert checked["report"].destination.endswith(f"{level}.onnx")


@pytest.mark.parametrize("key", sorted(SLICE))
def test_node_case_with_weights_keeps_every_weight_exact(key, tmp_path):
    check_first_runnable(key, "O3", tmp_path, weights=True)


def test_weights_are_checked_at_all(tmp_path):
    # The clipping check must see fp16 weights: Gemm's inputs become initializers stored in fp16.
    checked = check_first_runnable("Gemm", "O3", tmp_path, weights=True)
    assert checked["weights_checked"] >= 2 and checked["outputs_compared"] == 1
