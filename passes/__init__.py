"""Graph passes of amp-compiler; each module is one pass returning a PassResult. See README.md."""
from passes.pass_result import PassResult

__all__ = ["PassResult"]
