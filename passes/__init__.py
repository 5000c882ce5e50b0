"""Graph passes of amp-compiler, installed as amp_compiler.passes: policy/ (what each op wants, the levels),
painting/ (the IR-neutral decide), fx/ and onnx/ (the passes of each IR). See README.md."""
import sys

if __name__ == "passes":   # the previous release's name, found in a source checkout: answer with the real one
    import amp_compiler.passes
    sys.modules[__name__] = amp_compiler.passes
