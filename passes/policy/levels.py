"""The optimisation levels as data: one entry per level, read by everything that depends on the level.

    O0  no change, no cast            O1  the op policy (allow/infer/deny/clear painting), mixed-kernel norms
    O2  all low except norms/losses, dynamic loss scaling          O3  all low, no loss scaling
Adding a level is one entry here. `rules.PrecisionRules` re-classifies the policy table with it,
`convert`/`convert_onnx` skip painting where `paints` is False, `config` takes the norm default from it,
and `loss_scale.default_loss_scale_manager` the training default.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    name: str
    says: str                           # one line for reports and --help
    paints: bool                        # False: the graph is left as traced (no painting, no cast)
    lowers: tuple[str, ...]             # policy classes re-classified "allow" (everything runs low)
    keeps_losses_fp32: bool             # losses stay fp32 even where `lowers` would take them low
    keep_norm_fp32: bool                # the default of keep_batchnorm_fp32
    loss_scaling: str | None            # build_train_network's default manager: "dynamic" (fp16; bf16 scale 1) or None
    master_weights: str = "fp32"        # what the optimizer updates: the fp32 parameters, at every level
    # The class of batch/layer/group norms with keep_batchnorm_fp32: torch runs them as mixed kernels (low
    # activations in, fp32 weights and statistics, fp32 accumulation: tests/test_mixed_norms.py measures them as
    # close to fp32 as the norm between two casts). "allow": a conv -> bn -> relu -> conv chain needs no cast
    # ("infer" left a cast pair around an fp16 dropout between an fp32 embedding sum and the first norm of
    # GPT-2). ONNX has no mixed LayerNormalization: its scale follows the data. None: the policy's class (fp32).
    mixed_norms: str | None = None


LEVELS: dict[str, Level] = {level.name: level for level in (
    Level("O0", "no change, no cast", paints=False, lowers=(), keeps_losses_fp32=True, keep_norm_fp32=True,
          loss_scaling=None),
    Level("O1", "the op policy (allow/infer/deny/clear painting)", paints=True, lowers=(),
          keeps_losses_fp32=True, keep_norm_fp32=True, loss_scaling=None, mixed_norms="allow"),
    Level("O2", "all low except norms and losses, dynamic loss scaling", paints=True, lowers=("deny", "infer"),
          keeps_losses_fp32=True, keep_norm_fp32=True, loss_scaling="dynamic", mixed_norms="allow"),
    Level("O3", "all low, no loss scaling", paints=True, lowers=("deny", "infer"), keeps_losses_fp32=False,
          keep_norm_fp32=False, loss_scaling=None, mixed_norms="allow"),
)}


def level_of(name: str) -> Level:
    if name not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)} or 'auto', got {name!r}")
    return LEVELS[name]
