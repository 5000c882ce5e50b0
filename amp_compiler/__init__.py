"""amp-compiler: automatic mixed precision as fx graph passes, with every decision explained."""
from typing import TYPE_CHECKING

__all__ = ["convert", "compile", "explain", "PrecisionReport", "TracingError", "AmpConfig", "make_config",
           "default_lists", "verify", "DtypeMismatch"]
__all__ += ["LossScaleManager", "FixedLossScaleManager", "DynamicLossScaleManager", "build_train_network",
            "TrainStep", "low_weights", "LowWeights"]
__all__ += ["GradScaler", "Overflow", "NonFiniteGradientsError"]
__all__ += ["diff", "PrecisionDiff", "render", "compare", "ComparisonReport", "FP16RangeWarning", "HookWarning"]
__all__ += ["freeze", "frozen_bytes", "restore"]
__all__ += ["initialize", "scale_loss", "master_params", "state_dict", "load_state_dict"]
__all__ += ["export_onnx", "convert_onnx", "validate_onnx", "OnnxConversionReport"]
__version__ = "0.2.0"

# Every public name loads its module on first use (PEP 562): `import amp_compiler` imports no torch, so
# `amp-compiler --help` and `--version` answer at once. (The module behind convert() is convert_model.py: a
# submodule named `convert` would replace the function on the package when imported.)
_MODULE_OF = {
    "convert": "convert_model", "AmpConfig": "config", "make_config": "config", "TracingError": "frontend",
    "HookWarning": "frontend.hooks", "freeze": "frozen", "frozen_bytes": "frozen", "restore": "dynamo.in_place",
    "compile": "dynamo", "default_lists": "passes.policy.op_policy", "FP16RangeWarning": "passes.fx.constant_range",
    "explain": "insight.report", "PrecisionReport": "insight.report", "diff": "insight.report",
    "PrecisionDiff": "insight.report_diff", "compare": "insight.compare", "ComparisonReport": "insight.compare",
    "render": "insight.render", "verify": "insight.verify", "DtypeMismatch": "insight.verify",
    "GradScaler": "train.grad_scaler", "LossScaleManager": "train.loss_scale",
    "FixedLossScaleManager": "train.loss_scale", "DynamicLossScaleManager": "train.loss_scale",
    "NonFiniteGradientsError": "train.bad_steps", "Overflow": "train.step_outcome",
    "build_train_network": "train.network", "TrainStep": "train.network", "low_weights": "train.low_weights",
    "LowWeights": "train.low_weights",
    "export_onnx": "onnx.export", "convert_onnx": "onnx.convert", "validate_onnx": "onnx.validate",
    "OnnxConversionReport": "onnx.report",
    # Apex's amp API (apex.py), for code migrating from `from apex import amp`
    "initialize": "apex", "scale_loss": "apex", "master_params": "apex", "state_dict": "apex",
    "load_state_dict": "apex"}


if TYPE_CHECKING:   # the same names for type checkers and the API reference's static reader (griffe)
    from amp_compiler.convert_model import convert
    from amp_compiler.config import AmpConfig, make_config
    from amp_compiler.frontend import TracingError
    from amp_compiler.frontend.hooks import HookWarning
    from amp_compiler.frozen import freeze, frozen_bytes
    from amp_compiler.dynamo.in_place import restore
    from amp_compiler.dynamo import compile  # noqa: A004
    from amp_compiler.passes.policy.op_policy import default_lists
    from amp_compiler.passes.fx.constant_range import FP16RangeWarning
    from amp_compiler.insight.report import PrecisionReport, diff, explain
    from amp_compiler.insight.report_diff import PrecisionDiff
    from amp_compiler.insight.compare import ComparisonReport, compare
    from amp_compiler.insight.render import render
    from amp_compiler.insight.verify import DtypeMismatch, verify
    from amp_compiler.train.grad_scaler import GradScaler
    from amp_compiler.train.loss_scale import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager
    from amp_compiler.train.bad_steps import NonFiniteGradientsError
    from amp_compiler.train.step_outcome import Overflow
    from amp_compiler.train.network import TrainStep, build_train_network
    from amp_compiler.train.low_weights import LowWeights, low_weights
    from amp_compiler.onnx.export import export_onnx
    from amp_compiler.onnx.convert import convert_onnx
    from amp_compiler.onnx.validate import validate_onnx
    from amp_compiler.onnx.report import OnnxConversionReport
    from amp_compiler.apex import initialize, load_state_dict, master_params, scale_loss, state_dict


def __getattr__(name: str):
    import importlib
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f"amp_compiler.{_MODULE_OF[name]}"), name)
        globals()[name] = value   # later lookups skip this function
        return value
    if not name.startswith("__"):   # a submodule not imported yet (`amp_compiler.config.X` after `import amp_compiler`)
        try:
            return importlib.import_module(f"amp_compiler.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"amp_compiler.{name}":
                raise
    raise AttributeError(f"module 'amp_compiler' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
