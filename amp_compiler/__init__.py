"""amp-compiler: automatic mixed precision as fx graph passes, with every decision explained."""
from amp_compiler.config import AmpConfig, make_config
from amp_compiler.convert import convert
from amp_compiler.frontend import TracingError
from amp_compiler.report import PrecisionReport, explain
from passes.op_policy import default_lists

__all__ = ["convert", "explain", "PrecisionReport", "TracingError", "AmpConfig", "make_config",
           "default_lists"]
__version__ = "0.1.0"
