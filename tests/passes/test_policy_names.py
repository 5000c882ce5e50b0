"""policy/names.py: a name the user gives that is not a known name is an error listing the nearest ones."""
import pytest

from amp_compiler.passes.policy.names import check_known_names

KNOWN = ["softmax", "softmin", "log_softmax", "linear", "layer_norm"]


def test_known_names_pass():
    assert check_known_names("deny_ops", ["softmax", "linear"], KNOWN, kind="known ops") is None
    assert check_known_names("deny_ops", [], [], kind="known ops") is None


def test_an_unknown_name_is_an_error_with_its_nearest_known_names():
    with pytest.raises(ValueError) as error:
        check_known_names("deny_ops", ["softmx", "linear"], KNOWN, kind="known ops")
    message = str(error.value)
    assert message.startswith("deny_ops names ['softmx'], which are not known ops; nearest: softmx -> ")
    assert "'softmax'" in message and "'linear'" not in message.split("nearest:")[1]


def test_several_unknown_names_each_get_their_nearest_and_the_hint_comes_last():
    with pytest.raises(ValueError) as error:
        check_known_names("allow_ops", ["lnear", "layer_nrm"], KNOWN, kind="ops", hint="declare it with custom_ops")
    first, hint = str(error.value).split("\n")
    assert first == ("allow_ops names ['lnear', 'layer_nrm'], which are not ops; "
                     "nearest: lnear -> 'linear'; layer_nrm -> 'layer_norm'")
    assert hint == "declare it with custom_ops"


def test_case_is_ignored_only_to_find_the_nearest_names():
    with pytest.raises(ValueError, match="SOFTMAX -> 'softmax'"):
        check_known_names("deny_ops", ["SOFTMAX"], KNOWN, kind="known ops")


def test_a_name_with_nothing_near_says_so_without_a_nearest_list():
    with pytest.raises(ValueError) as error:
        check_known_names("node_block_list", ["zzzz"], KNOWN, kind="node names")
    assert str(error.value) == "node_block_list names ['zzzz'], which are not node names"
