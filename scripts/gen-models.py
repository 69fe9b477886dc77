"""Generates small ONNX models for tests and benchmarks, with PyPI's `onnx` only.

terrain-tiny: the terrain model's interface (noisy [B,1,128,128], sigma [B], difficulty [B] ->
denoised [B,1,128,128]) with almost no compute (a 3x3 convolution and a few element-wise ops), so
that a benchmark through Kafka and S3 measures the pipeline, not the model: on a GPU the real
model is about this fast.

Usage: python gen-models.py OUT_DIR   (writes OUT_DIR/terrain-tiny/model.onnx)
"""

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def terrain_tiny() -> onnx.ModelProto:
    batch = "batch"
    noisy = helper.make_tensor_value_info("noisy", TensorProto.FLOAT, [batch, 1, 128, 128])
    sigma = helper.make_tensor_value_info("sigma", TensorProto.FLOAT, [batch])
    difficulty = helper.make_tensor_value_info("difficulty", TensorProto.FLOAT, [batch])
    denoised = helper.make_tensor_value_info("denoised", TensorProto.FLOAT, [batch, 1, 128, 128])
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal((1, 1, 3, 3)) * 0.2).astype(np.float32), "w")
    shape = numpy_helper.from_array(np.array([-1, 1, 1, 1], dtype=np.int64), "shape")
    nodes = [
        helper.make_node("Reshape", ["sigma", "shape"], ["sigma4"]),
        helper.make_node("Reshape", ["difficulty", "shape"], ["difficulty4"]),
        helper.make_node("Div", ["noisy", "sigma4"], ["scaled"]),
        helper.make_node("Conv", ["scaled", "w"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["conv", "difficulty4"], ["shifted"]),
        helper.make_node("Tanh", ["shifted"], ["denoised"]),
    ]
    graph = helper.make_graph(nodes, "terrain_tiny", [noisy, sigma, difficulty], [denoised], [weight, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="sluice-gen-models")
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def main() -> None:
    out = sys.argv[1]
    path = os.path.join(out, "terrain-tiny", "model.onnx")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save(terrain_tiny(), path)
    print(path)


if __name__ == "__main__":
    main()
