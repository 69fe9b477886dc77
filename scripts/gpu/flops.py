"""FLOPs per image of the SD-1.5-shaped model, counted from its ONNX graphs.

FLOPs = 2 x multiply-accumulates of Conv, ConvTranspose, MatMul, Gemm and Einsum (attention's
QK^T and AV included; element-wise ops, norms and softmax left out). Shapes come from one pass
over each graph with the dynamic input dims bound: ONNX's per-node shape inference, plus numpy
evaluation (onnx.reference) of the small shape computations (Shape, Gather, Concat, ...) that
the TorchScript export feeds into Reshape, so every counted node has a static shape. Weights
are not read, so the skeleton directory is enough.

    python flops.py MODEL_DIR [--out flops.json]   (onnx + numpy; MODEL_DIR: sd15-skeleton/ or a materialized copy)

Cases: text encoder (2 sequences of 77 tokens: the prompt and the negative prompt of CFG), UNet
per denoising step with CFG (batch 2 per image) at latents 64x64 (512^2 images) and 128x128
(1024^2), VAE decoder per image at 512^2 and 1024^2; and the UNet at batch 1, 64x64 to compare
with published numbers (~339 GMACs). Prints a table and writes the JSON.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference
from onnx.reference import ReferenceEvaluator

COUNTED = {"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum"}
SMALL = 1 << 16  # elements: larger constants are not evaluated


def tensor_type(elem: int, shape) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(elem, list(shape))


def dims(t: onnx.TypeProto) -> list | None:
    """The static shape of `t`, or None while any dim is unknown."""
    if not t.tensor_type.HasField("shape"):
        return None
    d = [x.dim_value if x.HasField("dim_value") else None for x in t.tensor_type.shape.dim]
    return None if None in d else d


def macs(node: onnx.NodeProto, shape) -> int:
    """Multiply-accumulates of one counted node, from its input and output shapes."""
    ins, out = [shape(i) for i in node.input if i], shape(node.output[0])
    attr = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv":  # out [N, Cout, ...] x (Cin / group) x kernel
        return int(np.prod(out)) * int(np.prod(ins[1][1:]))
    if node.op_type == "ConvTranspose":  # in [N, Cin, ...] x (Cout / group) x kernel
        return int(np.prod(ins[0])) * int(np.prod(ins[1][1:]))
    if node.op_type == "MatMul":
        return int(np.prod(out)) * ins[0][-1]
    if node.op_type == "Gemm":
        return int(np.prod(out)) * ins[0][0 if attr.get("transA", 0) else 1]
    lhs = attr["equation"].replace(" ", "").split("->")[0].split(",")  # Einsum: product of all index sizes
    sizes = {c: d for term, s in zip(lhs, ins) for c, d in zip(term.replace("...", ""), s[-len(term.replace("...", "")):])}
    return int(np.prod(list(sizes.values())))


def count(path: Path, bind: dict) -> dict:
    """MACs by op type of the model at `path` with its dynamic dims bound to `bind`."""
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    types, values = {}, {}
    for t in g.initializer:
        types[t.name] = tensor_type(t.data_type, t.dims)
        if t.data_location != onnx.TensorProto.EXTERNAL and np.prod(t.dims) <= SMALL:
            values[t.name] = numpy_helper.to_array(t)
    for i in g.input:
        shape = [bind[d.dim_param] if d.dim_param else d.dim_value for d in i.type.tensor_type.shape.dim]
        types[i.name] = tensor_type(i.type.tensor_type.elem_type, shape)
    opset = {o.domain: o.version for o in model.opset_import}
    result = {}
    for node in g.node:
        ins = [i for i in node.input if i]
        shape = dims(types[ins[0]]) if node.op_type == "Shape" else None
        if shape is not None:
            attr = {a.name: a.i for a in node.attribute}
            out = {node.output[0]: np.array(shape[attr.get("start", 0):attr.get("end", len(shape))], np.int64)}
        elif node.op_type not in COUNTED and all(i in values for i in ins):
            out = dict(zip(node.output, ReferenceEvaluator(node).run(None, {i: values[i] for i in ins})))
        else:
            out = {}
        for name, v in out.items():
            values[name] = np.asarray(v)
            types[name] = tensor_type(helper.np_dtype_to_tensor_dtype(values[name].dtype), values[name].shape)
        if len(out) < len(node.output):
            schema = onnx.defs.get_schema(node.op_type, opset[node.domain], node.domain)
            data = {i: numpy_helper.from_array(values[i]) for i in ins if i in values}
            inferred = shape_inference.infer_node_outputs(schema, node, {i: types[i] for i in ins}, data, model.opset_import)
            types.update({k: v for k, v in inferred.items() if k not in out})
        if node.op_type in COUNTED:
            result[node.op_type] = result.get(node.op_type, 0) + macs(node, lambda n: dims(types[n]))
    for o in g.output:
        assert dims(types[o.name]) is not None, f"{path}: output {o.name} has no static shape"
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--out", type=Path, default=Path("flops.json"))
    a = ap.parse_args()
    seq = 77
    cases = [  # (model, key in per_image or None, case, bound dims); each call is one image's
        ("text_encoder", "text_encoder", "2 x 77 tokens (CFG)", dict(batch_size=2, sequence_length=seq)),
        ("unet", "unet_per_step", "512^2, CFG (batch 2)", dict(batch_size=2, height=64, width=64, sequence_length=seq)),
        ("unet", "unet_per_step", "1024^2, CFG (batch 2)", dict(batch_size=2, height=128, width=128, sequence_length=seq)),
        ("unet", None, "512^2, batch 1 (reference)", dict(batch_size=1, height=64, width=64, sequence_length=seq)),
        ("vae_decoder", "vae_decoder", "512^2", dict(batch_size=1, latent_height=64, latent_width=64)),
        ("vae_decoder", "vae_decoder", "1024^2", dict(batch_size=1, latent_height=128, latent_width=128)),
    ]
    rows, summary = [], {res: {} for res in ("512^2", "1024^2")}
    print(f"{'model':<13} {'case':<28} {'GFLOPs':>8} {'GMACs':>8}  by op (GFLOPs)")
    for name, key, case, bind in cases:
        by_op = {k: 2 * v for k, v in count(a.model_dir / name / "model.onnx", bind).items()}
        total = sum(by_op.values())
        rows.append(dict(model=name, case=case, inputs=bind, flops=total, by_op=by_op))
        for res in summary if name == "text_encoder" else [case.split(",")[0]] if key else []:
            summary[res][key] = total
        ops = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(by_op.items()))
        print(f"{name:<13} {case:<28} {total / 1e9:>8.1f} {total / 2e9:>8.1f}  {ops}")
    doc = " ".join(__doc__.split("\n\n")[1].split())
    per_image = {res: v | {"total": "text_encoder + steps * unet_per_step + vae_decoder"} for res, v in summary.items()}
    a.out.write_text(json.dumps(dict(definition=doc, per_image=per_image, cases=rows), indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
