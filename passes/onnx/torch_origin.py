"""What torch.onnx recorded about where an exported node came from (its metadata_props), for the export passes.

    pkg.torch.onnx.class_hierarchy  "[..., 'GPT2Attention', 'aten.scaled_dot_product_attention.default']"
                                    -> origin_op(node) = "scaled_dot_product_attention"
    pkg.torch.onnx.fx_node          "%scaled_dot_product_attention_1 : [num_users=1] = call_function[...]"
                                    -> origin_node_name(node) = "scaled_dot_product_attention_1"
The module path is canonicalize.module_path (from pkg.torch.onnx.name_scopes). None / the ONNX node's own
name when the file does not say (not exported from torch, or a node the exporter's optimizer made).
"""
from __future__ import annotations

import re

import onnx_ir as ir

from amp_compiler.passes.policy.op_aliases import canonical_op_name

_LAST_CLASS = re.compile(r"'([^']*)'\]$")
_FX_NODE = re.compile(r"%([\w.]+) ")


def origin_op(node: ir.Node) -> str | None:
    """The canonical op (op_policy's name) of the ATen op torch.onnx was writing out when it made `node`."""
    match = _LAST_CLASS.search(node.metadata_props.get("pkg.torch.onnx.class_hierarchy", ""))
    if match is None or not match.group(1).startswith("aten."):
        return None
    return canonical_op_name(match.group(1).split(".")[1])   # as the fx canonicalizer names it


def origin_node_name(node: ir.Node) -> str:
    """The name of the torch.export node `node` was written for (what force_* node-name patterns address)."""
    match = _FX_NODE.match(node.metadata_props.get("pkg.torch.onnx.fx_node", ""))
    return match.group(1) if match else node.name or ""
