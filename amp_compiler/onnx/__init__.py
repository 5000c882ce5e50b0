"""ONNX: convert_onnx (a file to mixed precision), export_onnx (a model to fp16 ONNX), validate_onnx."""
