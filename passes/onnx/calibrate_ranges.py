"""Range calibration on ONNX: run the fp32 source with ONNX Runtime on sample inputs, every float value of
the main graph exposed as an output, and record every node's range (the record fx's calibration writes).

    convert_onnx("m.onnx", "m_fp16.onnx", calibration_data=[(x1,), (x2,), ...])
    facts(node)["range"] = {"samples": 16, "max_abs": 7.1e4, "overflows": 3, "read_max": ..., "read_from": ...,
                            "below_normal": 0.02}

Runs after the source is typed (infer_types:fill) and before anything is rewritten, on a serialised copy
(the model itself is not changed), on the CPU provider, one session for all samples. A sample is a tuple
of the graph's inputs in order (numpy arrays or tensors). Nodes inside Loop/If/Scan bodies are not
calibrated. painting/calibrate_ranges.py keeps the figures and turns them into decisions.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch

from amp_compiler.passes.onnx.spec import is_float_value
from amp_compiler.passes.painting.calibrate_ranges import (RangeTotals, calibration_sample, check_calibration_data,
                                                           progress, value_stats)
from amp_compiler.passes.runner import PassResult


def record_onnx_ranges(model: ir.Model, samples: Iterable, low_dtype: torch.dtype) -> PassResult:
    check_calibration_data(samples)
    exposed = [value for node in model.graph for value in node.outputs if is_float_value(value)]
    session = _session(model, exposed)
    inputs = [i.name for i in session.get_inputs()]
    producers = {value.name: node for node in model.graph for value in node.outputs}
    totals = RangeTotals(low_dtype)
    for index, sample in enumerate(progress(samples)):
        arrays = [_array(x) for x in calibration_sample(index, sample, len(inputs))]
        try:
            results = session.run(None, dict(zip(inputs, arrays)))
        except Exception as error:  # noqa: BLE001 - ONNX Runtime's message, with the sample that caused it
            shapes = ", ".join(f"{name}: {array.dtype}{list(array.shape)}" for name, array in zip(inputs, arrays))
            raise ValueError(f"calibration_data sample {index} ({shapes}) fails in ONNX Runtime: "
                             f"{str(error).strip().splitlines()[0][:200]}") from error
        values = dict(zip([o.name for o in session.get_outputs()], results))
        seen = {}
        for node in model.graph:
            tensors = [torch.from_numpy(np.asarray(values[v.name], dtype=np.float32))
                       for v in node.outputs if v.name in values and is_float_value(v)]
            if tensors:
                seen[node] = value_stats(tensors, totals.limits.tiny)
        totals.add_sample(seen, lambda node: [producers[v.name] for v in node.inputs
                                              if v is not None and v.name in producers])
    return PassResult(modified=False, counts=totals.record())


def _session(model: ir.Model, exposed: list[ir.Value]) -> ort.InferenceSession:
    proto = ir.serde.serialize_model(model)
    outputs = {o.name for o in proto.graph.output}
    for value in exposed:
        if value.name not in outputs:
            proto.graph.output.append(onnx.helper.make_tensor_value_info(value.name, int(value.dtype), None))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"])


def _array(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
