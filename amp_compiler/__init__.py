"""amp-compiler: automatic mixed precision as fx graph passes, with every decision explained."""
from amp_compiler.train.bad_steps import NonFiniteGradientsError
from amp_compiler.config import AmpConfig, make_config
from amp_compiler.convert import convert
from amp_compiler.frozen import freeze, frozen_bytes
from amp_compiler.frontend import TracingError
from amp_compiler.train.grad_scaler import GradScaler
from amp_compiler.train.loss_scale import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager
from amp_compiler.insight.report import PrecisionReport, diff, explain
from amp_compiler.insight.compare import ComparisonReport, compare
from amp_compiler.insight.render import render
from amp_compiler.insight.report_diff import PrecisionDiff
from amp_compiler.train.step_outcome import Overflow
from amp_compiler.train.network import TrainStep, build_train_network
from amp_compiler.train.low_weights import LowWeights, low_weights
from amp_compiler.insight.verify import DtypeMismatch, verify
from amp_compiler.passes.policy.op_policy import default_lists
from amp_compiler.passes.fx.constant_range import FP16RangeWarning
from amp_compiler.frontend.hooks import HookWarning
from amp_compiler.dynamo import compile  # noqa: A004  (TorchDynamo capture: amp_compiler/dynamo/)
from amp_compiler.dynamo.in_place import restore

__all__ = ["convert", "explain", "PrecisionReport", "TracingError", "AmpConfig", "make_config",
           "default_lists", "verify", "DtypeMismatch"]
__all__ += ["LossScaleManager", "FixedLossScaleManager", "DynamicLossScaleManager", "build_train_network",
            "TrainStep", "low_weights", "LowWeights"]
__all__ += ["GradScaler", "Overflow", "NonFiniteGradientsError"]
__all__ += ["diff", "PrecisionDiff", "render", "compare", "ComparisonReport", "FP16RangeWarning", "HookWarning"]
__all__ += ["freeze", "frozen_bytes", "restore"]
__all__ += ["initialize", "scale_loss", "master_params", "state_dict", "load_state_dict"]
__all__ += ["export_onnx", "convert_onnx", "validate_onnx", "OnnxConversionReport"]
__version__ = "0.2.0"

# The ONNX names load onnx, onnx_ir and onnxruntime on first use, not with the package (PEP 562); the Apex
# names load on first use too.
_ONNX_NAMES = {"export_onnx": "onnx.export", "convert_onnx": "onnx.convert", "validate_onnx": "onnx.validate",
               "OnnxConversionReport": "onnx.report",
               # Apex's amp API (apex.py), for code migrating from `from apex import amp`
               "initialize": "apex", "scale_loss": "apex", "master_params": "apex", "state_dict": "apex",
               "load_state_dict": "apex"}


def __getattr__(name: str):
    if name in _ONNX_NAMES:
        import importlib
        value = getattr(importlib.import_module(f"amp_compiler.{_ONNX_NAMES[name]}"), name)
        globals()[name] = value   # later lookups skip this function
        return value
    raise AttributeError(f"module 'amp_compiler' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
