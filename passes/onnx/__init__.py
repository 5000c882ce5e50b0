"""The ONNX passes on onnx_ir models, and the ONNX spec facts they share (spec.py)."""
