"""The optimisation levels as data: one entry per level, read by everything that depends on the level.

    O0  no change, no cast            O1  the op policy (allow/infer/deny/clear painting), mixed batch/group norms
    O2  all low except norms/losses, dynamic loss scaling          O3  all low, no loss scaling
Adding a level is one entry here. `rules.PrecisionRules` re-classifies the policy table with it,
`convert`/`convert_onnx` skip painting where `paints` is False, `config` takes the norm default from it,
`loss_scale.default_loss_scale_manager` the training default, build_train_network whether weights are
stored low (`stores_weights_low`), and the CLI's --level help each `says`.
Master weights are fp32 at every level (build_train_network refuses low ones): not a level's choice.
    fp8 O1 in bfloat16, and the decided-low linear/matmul/mm run as float8 matmuls (passes/fx/lower_fp8_matmuls.py:
        e4m3 forward, e5m2 gradients, per-tensor current scaling). A level, not a dtype on O1/O2: everything but
        `fp8_matmuls` is O1's entry, the painting is O1's, and the option keys (fp8_min_dim, fp8_margin, fp8_keep)
        belong to it alone.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    name: str
    says: str                           # one line for the CLI's --level help
    paints: bool                        # False: the graph is left as traced (no painting, no cast)
    lowers: tuple[str, ...]             # policy classes re-classified "allow" (everything runs low)
    keeps_losses_fp32: bool             # losses stay fp32 even where `lowers` would take them low
    keep_norm_fp32: bool                # the default of keep_batchnorm_fp32
    loss_scaling: str | None            # build_train_network's default manager: "dynamic" (fp16; bf16 scale 1) or None
    # Norms that run as mixed kernels with keep_batchnorm_fp32: low activations in, fp32 weights and statistics,
    # fp32 accumulation, painted "allow" (a conv -> bn -> relu -> conv chain needs no cast pair). O1 takes batch
    # and group norm only: tests/convert/test_mixed_norms.py finds them as close to fp32 as the norm between two casts,
    # but not a post-norm LayerNorm, whose output is the residual stream (HF BERT at O1 fp16: 100x autocast's
    # error). ONNX has no mixed LayerNormalization: its scale follows the data.
    mixed_norms: tuple[str, ...] = ()
    fp8_matmuls: bool = False           # decided-low linear/matmul/mm become float8 matmuls (bfloat16 levels only)
    stores_weights_low: bool = False    # build_train_network's default: the graph reads low weight copies, the
                                        # optimizer steps fp32 masters (train/low_weights.py; O2 as Apex has it)


ALL_MIXED = ("batch_norm", "layer_norm", "group_norm")   # the norms torch has mixed kernels for
LEVELS: dict[str, Level] = {level.name: level for level in (
    Level("O0", "no change, no cast", paints=False, lowers=(), keeps_losses_fp32=True, keep_norm_fp32=True,
          loss_scaling=None),
    Level("O1", "the op policy (allow/infer/deny/clear painting)", paints=True, lowers=(),
          keeps_losses_fp32=True, keep_norm_fp32=True, loss_scaling=None, mixed_norms=("batch_norm", "group_norm")),
    Level("O2", "all low except norms and losses, dynamic loss scaling", paints=True, lowers=("deny", "infer"),
          keeps_losses_fp32=True, keep_norm_fp32=True, loss_scaling="dynamic", mixed_norms=ALL_MIXED, stores_weights_low=True),
    Level("O3", "all low, no loss scaling", paints=True, lowers=("deny", "infer"), keeps_losses_fp32=False,
          keep_norm_fp32=False, loss_scaling=None, mixed_norms=ALL_MIXED, stores_weights_low=True),
    Level("fp8", "O1 in bfloat16, its low linear/matmul/mm as float8 matmuls (e4m3, e5m2 gradients)", paints=True,
          lowers=(), keeps_losses_fp32=True, keep_norm_fp32=True, loss_scaling=None,
          mixed_norms=("batch_norm", "group_norm"), fp8_matmuls=True),
)}


def level_of(name: str) -> Level:
    if name not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)} or 'auto', got {name!r}")
    return LEVELS[name]
