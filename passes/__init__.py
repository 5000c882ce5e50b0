"""Graph passes of amp-compiler, installed as amp_compiler.passes: policy/ (what each op wants, the levels),
painting/ (the IR-neutral decide), fx/ and onnx/ (the passes of each IR). See README.md."""
