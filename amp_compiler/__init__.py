"""amp-compiler: automatic mixed precision as fx graph passes, with every decision explained."""
from amp_compiler.config import AmpConfig, make_config
from amp_compiler.convert import convert
from amp_compiler.frontend import TracingError
from amp_compiler.loss_scale import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager
from amp_compiler.onnx_convert import convert_onnx
from amp_compiler.onnx_export import export_onnx
from amp_compiler.onnx_report import OnnxConversionReport
from amp_compiler.onnx_validate import ValidationReport, validate_onnx
from amp_compiler.report import PrecisionReport, explain
from amp_compiler.train import TrainStep, build_train_network
from passes.op_policy import default_lists

__all__ = ["convert", "explain", "PrecisionReport", "TracingError", "AmpConfig", "make_config",
           "default_lists"]
__all__ += ["LossScaleManager", "FixedLossScaleManager", "DynamicLossScaleManager", "build_train_network",
            "TrainStep"]
__all__ += ["export_onnx", "convert_onnx", "validate_onnx", "OnnxConversionReport", "ValidationReport"]
__version__ = "0.1.0"
