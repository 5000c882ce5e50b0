"""Graph passes of amp-compiler, installed as amp_compiler.passes. See README.md."""
import sys

if __name__ == "passes":   # the previous release's name, found in a source checkout: answer with the real one
    import amp_compiler.passes
    sys.modules[__name__] = amp_compiler.passes
else:
    from amp_compiler.passes.pass_result import PassResult

    __all__ = ["PassResult"]
