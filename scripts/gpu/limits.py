"""How close each row of `sluice-bench pipeline model` comes to the GPU's physical limit.

    python3 limits.py FLOPS_JSON PIPELINE_MD

FLOPs per image come from the graphs (flops.json, written by flops.py: text encoder with CFG +
steps × UNet with CFG + VAE decoder); images/s from the benchmark's table (raw and end to end).
Achieved TFLOP/s is their product; the share is against the GPU's dense peak for float32 on
CUDA cores and for TF32 on tensor cores (ONNX Runtime's CUDA provider runs float32 convolutions
and matrix products on TF32 tensor cores unless SLUICE_CUDA_TF32=false).
"""

import json
import re
import sys

# Dense peaks, TFLOP/s: (float32 CUDA cores, TF32 tensor cores), from NVIDIA's data sheets.
PEAKS = {
    "H200": (67.0, 494.7),
    "H100 80GB HBM3": (67.0, 494.7),  # SXM
    "H100 PCIe": (51.0, 378.0),
    "H100 NVL": (60.0, 417.5),
    "A100": (19.5, 156.0),
}


def peak_of(device):
    for name, peak in PEAKS.items():
        if name in device:
            return peak
    return None


def main():
    flops = json.load(open(sys.argv[1]))["per_image"]
    text = open(sys.argv[2]).read()
    device = re.search(r"one worker, (.+)$", text, re.M)
    device = device.group(1).strip() if device else "unknown"
    peak = peak_of(device)
    print(f"\n## share of the physical limit ({device})\n")
    print("| model | batch | GFLOPs per image | raw TFLOP/s | end-to-end TFLOP/s | raw share of FP32 / TF32 peak |")
    print("|---|---|---|---|---|---|")
    for line in text.splitlines():
        m = re.match(r"\| (\S+) (\d+)x(\d+), (\d+) steps \| (\d+) \| \d+ \| ([\d.]+) \| ([\d.]+) \|", line)
        if not m:
            continue
        model, size, steps, batch = m.group(1), int(m.group(2)), int(m.group(4)), m.group(5)
        raw, e2e = float(m.group(6)), float(m.group(7))
        per = flops.get(f"{size}^2")
        if per is None:
            print(f"| {model} {size}x{size} | {batch} | (no FLOPs for this size in flops.json) | | | |")
            continue
        image = per["text_encoder"] + steps * per["unet_per_step"] + per["vae_decoder"]
        raw_t, e2e_t = raw * image / 1e12, e2e * image / 1e12
        share = "-" if peak is None else f"{raw_t / peak[0]:.0%} / {raw_t / peak[1]:.0%}"
        print(f"| {model} {size}x{size}, {steps} steps | {batch} | {image / 1e9:,.0f} | {raw_t:.1f} | {e2e_t:.1f} | {share} |")
    if peak is None:
        print(f"\n(no peak figures for {device}; shares left out)")
    else:
        print(f"\nPeaks used: {peak[0]} TFLOP/s float32, {peak[1]} TFLOP/s TF32 (dense).")


if __name__ == "__main__":
    main()
