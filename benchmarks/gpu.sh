#!/usr/bin/env bash
# One command on a CUDA machine: benchmarks/gpu.py (train, inference, ONNX Runtime vs autocast), one table, < 8 min.
exec python "$(dirname "$0")/gpu.py" "$@"
