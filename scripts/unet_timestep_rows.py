"""Gives a Stable Diffusion UNet export a timestep per row, so that rows at different denoising
steps share one UNet call (step-level batching without a UNet call per step the rows are at).

Optimum exports the UNet's `timestep` as a float32 scalar: diffusers' forward broadcasts it to
the batch (`timesteps.expand(sample.shape[0])`), traced as Unsqueeze(axis 0) -> Cast -> Expand.
This edit makes the input a vector with one value a row and the Unsqueeze an Identity; the
Expand to the batch is then a no-op, and nothing else in the graph changes. The weights
(`model.onnx_data` beside it) are not touched or read.

    python scripts/unet_timestep_rows.py MODEL_DIR [MODEL_DIR ...]

edits MODEL_DIR/unet/model.onnx in place (an Optimum Stable Diffusion or SDXL export); a UNet
already edited is left as it is. A UNet whose timestep is not the traced scalar this expects is
refused, unchanged. The worker reads the input's shape when it loads the model and then runs the
rows of a call in one UNet call, each at its own timestep (docs/batching.md).
"""

import argparse
import sys
from pathlib import Path

import onnx
from onnx import numpy_helper


class NotThisExport(Exception):
    """The UNet's timestep is not the scalar -> Unsqueeze(0) -> Cast -> Expand this edits."""


def unsqueeze_axes(graph: onnx.GraphProto, node: onnx.NodeProto) -> list[int] | None:
    """The axes of an Unsqueeze: its attribute (opset < 13) or its constant second input."""
    for attr in node.attribute:
        if attr.name == "axes":
            return list(attr.ints)
    if len(node.input) < 2:
        return None
    name = node.input[1]
    for init in graph.initializer:
        if init.name == name:
            return [int(v) for v in numpy_helper.to_array(init).reshape(-1)]
    for n in graph.node:
        if n.op_type == "Constant" and name in n.output:
            for attr in n.attribute:
                if attr.name == "value":
                    return [int(v) for v in numpy_helper.to_array(attr.t).reshape(-1)]
    return None


def edit(path: Path) -> bool:
    """Edits the UNet at `path`; False when it already takes a timestep per row."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inputs = [i for i in graph.input if i.name == "timestep"]
    if not inputs:
        raise NotThisExport("no `timestep` input")
    dims = inputs[0].type.tensor_type.shape.dim
    if len(dims) == 1 and dims[0].dim_param == "timestep_rows":
        return False
    if len(dims) != 0:
        raise NotThisExport(f"`timestep` has rank {len(dims)}, not the scalar this edits")
    consumers = [n for n in graph.node if "timestep" in n.input]
    if len(consumers) != 1 or consumers[0].op_type != "Unsqueeze":
        raise NotThisExport(f"`timestep` feeds {[n.op_type for n in consumers]}, not one Unsqueeze")
    unsqueeze = consumers[0]
    if unsqueeze_axes(graph, unsqueeze) != [0]:
        raise NotThisExport("`timestep`'s Unsqueeze is not on axis 0")
    # Its [1] must be broadcast to the batch within a Cast: that is what makes [rows] equivalent.
    by_input: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            by_input.setdefault(i, []).append(n)
    frontier, reaches_expand = list(unsqueeze.output), False
    for _ in range(2):
        nodes = [n for out in frontier for n in by_input.get(out, [])]
        if any(n.op_type == "Expand" for n in nodes):
            reaches_expand = True
            break
        if len(nodes) != 1 or nodes[0].op_type != "Cast":
            break
        frontier = list(nodes[0].output)
    if not reaches_expand:
        raise NotThisExport("`timestep` is not broadcast to the batch by an Expand")

    dims.add().dim_param = "timestep_rows"
    identity = onnx.helper.make_node("Identity", ["timestep"], list(unsqueeze.output), name=unsqueeze.name)
    at = list(graph.node).index(unsqueeze)
    graph.node.remove(unsqueeze)
    graph.node.insert(at, identity)
    # Tensors kept outside (model.onnx_data) stay where they are: no data was loaded to write.
    onnx.save_model(model, str(path))
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dirs", nargs="+", type=Path)
    args = parser.parse_args()
    for d in args.model_dirs:
        path = d / "unet" / "model.onnx"
        try:
            changed = edit(path)
        except NotThisExport as e:
            print(f"{path}: left unchanged: {e}", file=sys.stderr)
            return 1
        print(f"{path}: {'a timestep per row' if changed else 'already takes a timestep per row'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
