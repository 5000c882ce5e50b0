"""fx/module_tree_edits.py: look up and replace modules by path; a fresh copy shares tensors, not dicts."""
import torch
from torch import nn

from amp_compiler.passes.fx.module_tree_edits import fresh_copy, get_module, set_module


def tree() -> nn.Module:
    return nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), nn.ReLU())


def test_get_module_follows_a_dotted_path_and_answers_none_for_a_missing_one():
    root = tree()
    assert get_module(root, "0.1") is root[0][1] and get_module(root, "") is root
    assert get_module(root, "0.0.weight") is root[0][0].weight   # an attribute too
    assert get_module(root, "0.7") is None and get_module(root, "2") is None


def test_set_module_replaces_only_the_module_at_the_path():
    root = tree()
    conv, relu = root[0][0], root[1]
    set_module(root, "0.1", nn.Identity())
    assert isinstance(root[0][1], nn.Identity) and root[0][0] is conv and root[1] is relu
    set_module(root, "1", nn.GELU())   # a top-level child
    assert isinstance(root[1], nn.GELU)


def test_a_fresh_copy_shares_tensors_but_not_the_dicts_that_hold_them():
    conv = nn.Conv2d(3, 4, 3)
    clone = fresh_copy(conv)
    assert type(clone) is nn.Conv2d and clone is not conv
    assert clone.weight is conv.weight and clone.kernel_size == conv.kernel_size
    clone.weight = nn.Parameter(conv.weight.detach().half())
    clone.register_buffer("extra", conv.weight.detach())
    clone.padding = (1, 1)
    assert conv.weight.dtype == torch.float32 and conv.weight is not clone.weight
    assert "extra" not in conv._buffers and conv.padding == (0, 0)
    assert conv._parameters is not clone._parameters and conv._forward_hooks is not clone._forward_hooks
