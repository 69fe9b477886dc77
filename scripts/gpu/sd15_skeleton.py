"""Builds an SD-1.5-shaped random-weight model as ONNX graphs without their weights (a "skeleton").

Random init (torch.manual_seed) of the CLIP text encoder, the UNet and the VAE decoder with Stable
Diffusion 1.5's configs, exported with torch.onnx.export (the TorchScript exporter, opset 18) to
the Optimum ONNX layout Sluice reads (the one of integration-tests/fixtures/sd-tiny.tar.xz:
same files, input/output names, dtypes and dynamic axes; no vae_encoder/, which txt2img does
not need). Every float initializer over 1 KiB that is a model parameter goes to external data
(`model.onnx_data`, offsets 4096-aligned); everything else stays inline. Each model directory gets
`weights.json` listing the external tensors (name, offset, length, dtype, shape, mean, std of the
exported init); the data files themselves are not kept. `materialize.py` writes them back.

Run once, on any CPU machine with network (export ~2 min):
    python3 -m venv ~/.cache/sluice/venv-gpu-bench && ~/.cache/sluice/venv-gpu-bench/bin/pip install \
        torch==2.11.0 diffusers==0.39.0 transformers==5.24.0 onnx==1.23.1 onnxscript numpy
    python sd15_skeleton.py [--out /tmp/sd15] [--seed 0]
        [--tar integration-tests/fixtures/sd15-skeleton.tar.xz] [--tiny integration-tests/fixtures/sd-tiny.tar.xz]
Writes OUT/sd15-skeleton/ and packs it as the --tar file.
"""

import argparse
import json
import shutil
import tarfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from onnx import TensorProto, numpy_helper
from transformers import CLIPTextConfig, CLIPTextModel

REPO = Path(__file__).resolve().parents[2]
OPSET = 18
INLINE_MAX = 1024  # bytes; larger float parameters go to external data
ALIGN = 4096
FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}

CLIP = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, layer_norm_eps=1e-5,
            bos_token_id=0, eos_token_id=2, pad_token_id=1)
UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768, attention_head_dim=8, act_fn="silu", norm_num_groups=32, norm_eps=1e-5,
            flip_sin_to_cos=True, freq_shift=0, downsample_padding=1, center_input_sample=False)
VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           act_fn="silu", norm_num_groups=32, sample_size=512, scaling_factor=0.18215)


class TextEncoder(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        out = self.m(input_ids=input_ids)
        return out.last_hidden_state, out.pooler_output


class Unet(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.m(sample, timestep, encoder_hidden_states, return_dict=False)[0]


class VaeDecoder(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, latent_sample):
        return self.m.decode(latent_sample, return_dict=False)[0]


def export(name, module, args, inputs, outputs, axes, work: Path, skel: Path) -> dict:
    """Exports `module` to work/name/model.onnx, then writes skel/name/{model.onnx, weights.json}."""
    t0 = time.time()
    (work / name).mkdir(parents=True, exist_ok=True)
    path = work / name / "model.onnx"
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs, dynamic_axes=axes,
                          opset_version=OPSET, do_constant_folding=True, dynamo=False)
    exported = time.time() - t0
    # Exported initializers that are parameters (possibly transposed, as MatMul weights are):
    # found by (numel, min, max), which a transpose keeps and random tensors do not share.
    params = {(p.numel(), p.min().item(), p.max().item()) for p in module.parameters()}
    model = onnx.load(str(path))
    weights, offset, kept = [], 0, 0
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t)
        if t.data_type not in FLOATS or a.nbytes <= INLINE_MAX or (a.size, a.min().item(), a.max().item()) not in params:
            kept += a.nbytes
            t.CopyFrom(numpy_helper.from_array(a, t.name))  # inline (drops any external reference)
            continue
        offset = -(-offset // ALIGN) * ALIGN
        weights.append(dict(name=t.name, offset=offset, length=a.nbytes, dtype=str(a.dtype), shape=list(a.shape),
                            mean=float(a.mean(dtype=np.float64)), std=float(a.std(dtype=np.float64))))
        del t.external_data[:]
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", "model.onnx_data"), ("offset", str(offset)), ("length", str(a.nbytes))):
            t.external_data.add(key=k, value=v)
        offset += a.nbytes
    out = skel / name
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "model.onnx"))
    (out / "weights.json").write_text(json.dumps(dict(file="model.onnx_data", size=offset, tensors=weights), indent=1))
    shutil.rmtree(work / name)  # the exported weights are not kept
    info = dict(export_s=round(exported, 1), total_s=round(time.time() - t0, 1), external_tensors=len(weights),
                external_bytes=offset, inline_bytes=kept, graph_bytes=(out / "model.onnx").stat().st_size)
    print(name, info, flush=True)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/sd15", type=Path)
    ap.add_argument("--seed", default=0, type=int)
    ap.add_argument("--tar", default=REPO / "integration-tests/fixtures/sd15-skeleton.tar.xz", type=Path)
    ap.add_argument("--tiny", default=REPO / "integration-tests/fixtures/sd-tiny.tar.xz", type=Path)
    a = ap.parse_args()
    skel, work = a.out / "sd15-skeleton", a.out / "export"
    shutil.rmtree(a.out, ignore_errors=True)
    skel.mkdir(parents=True)
    torch.manual_seed(a.seed)

    # Configs, scheduler and tokenizer as sd-tiny has them (its scheduler file is SD 1.5's).
    with tarfile.open(a.tiny) as tar:
        tar.extractall(work / "tiny", members=[m for m in tar.getmembers() if m.name.startswith("sd-tiny/")])
    tiny = work / "tiny/sd-tiny"
    index = json.loads((tiny / "model_index.json").read_text()) | {"_name_or_path": "sd15-random"}
    (skel / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    for d in ("scheduler", "tokenizer"):
        shutil.copytree(tiny / d, skel / d)

    clip_cfg = CLIPTextConfig(**CLIP)
    clip = CLIPTextModel(clip_cfg).eval()
    (skel / "text_encoder").mkdir()
    te_cfg = clip_cfg.to_dict() | {"architectures": ["CLIPTextModel"], "export_model_type": "clip-text"}
    (skel / "text_encoder/config.json").write_text(json.dumps(te_cfg, indent=2, sort_keys=True) + "\n")
    unet = UNet2DConditionModel(**UNET).eval()
    unet.save_config(skel / "unet")
    vae = AutoencoderKL(**VAE).eval()
    vae.save_config(skel / "vae_decoder")

    info = {}
    info["text_encoder"] = export("text_encoder", TextEncoder(clip), (torch.randint(0, 49408, (2, 77)),),
                                  ["input_ids"], ["last_hidden_state", "pooler_output"],
                                  {"input_ids": {0: "batch_size", 1: "sequence_length"},
                                   "last_hidden_state": {0: "batch_size", 1: "sequence_length"},
                                   "pooler_output": {0: "batch_size"}}, work, skel)
    del clip
    info["vae_decoder"] = export("vae_decoder", VaeDecoder(vae), (torch.randn(1, 4, 32, 32),), ["latent_sample"], ["sample"],
                                 {"latent_sample": {0: "batch_size", 2: "latent_height", 3: "latent_width"},
                                  "sample": {0: "batch_size", 2: "latent_height * 8", 3: "latent_width * 8"}}, work, skel)
    del vae
    info["unet"] = export("unet", Unet(unet), (torch.randn(2, 4, 32, 32), torch.tensor(999.0), torch.randn(2, 77, 768)),
                          ["sample", "timestep", "encoder_hidden_states"], ["out_sample"],
                          {"sample": {0: "batch_size", 2: "height", 3: "width"},
                           "encoder_hidden_states": {0: "batch_size", 1: "sequence_length"},
                           "out_sample": {0: "batch_size", 2: "height", 3: "width"}}, work, skel)
    (skel / "export.json").write_text(json.dumps(dict(seed=a.seed, opset=OPSET, torch=torch.__version__,
                                                      onnx=onnx.__version__, models=info), indent=1) + "\n")
    shutil.rmtree(work)
    t0 = time.time()
    with tarfile.open(a.tar, "w:xz", preset=9) as tar:
        tar.add(skel, arcname="sd15-skeleton")
    print(f"{a.tar}: {a.tar.stat().st_size} bytes ({time.time() - t0:.0f} s to pack)")


if __name__ == "__main__":
    main()
