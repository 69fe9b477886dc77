"""Numerics of the CUDA path against diffusers' CPU reference, per family and CUDA setting.

Runs `sluice-worker generate` on recorded reference cases (the same prompt, steps, guidance and
starting latents diffusers used) under each CUDA numerics setting, and reports the largest
difference of the final latents from diffusers' (and of the PNGs, in levels, when Pillow is
there). Exits non-zero when a family exceeds the tolerance this file states for a setting.

    python3 numerics.py WORKER_BIN FIXTURES_DIR MODELS_DIR OUT_DIR

The device comes from SLUICE_DEVICE (cuda on a GPU node; on the CPU the CUDA settings change
nothing and every row must match the reference as the CPU tests do: the script's own rehearsal).
SLUICE_NUMERICS_QUICK=1 runs the first setting only.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np

# (fixture set, case, family)
CASES = [
    ("sd-reference", "euler", "sd"),
    ("sdxl-reference", "euler", "sdxl"),
    ("flow-reference", "dev_64_4step_g35", "flux-dev"),
    ("flow-reference", "sd3_64_4step_cfg5_neg", "sd3"),
]

# (name, generate flags, {family: tolerance of max |latents - diffusers|}); a setting without a
# tolerance for a family is measured, not checked.
SETTINGS = [
    ("tf32 on (default)", [], {"sd": 1.5e-1, "sdxl": 2e-2, "flux-dev": 1e-3, "sd3": 5e-3}),
    ("tf32 off", ["--cuda-tf32", "false"], {"sd": 1e-3, "sdxl": 1e-3, "flux-dev": 1e-3, "sd3": 1e-3}),
    ("tf32 off, deterministic", ["--cuda-tf32", "false", "--cuda-deterministic"], {}),
    ("tf32 off, conv search exhaustive", ["--cuda-tf32", "false", "--cudnn-conv-algo-search", "exhaustive"], {}),
    ("tf32 on, conv search default", ["--cudnn-conv-algo-search", "default"], {}),
]
CPU_TOLERANCE = 1e-3
SD_ONLY_AFTER = 2  # settings past the first two run on SD 1.x only (the family that differs most)


def generate_args(case, model_dir, out):
    def number(key):
        return str(case[key])

    args = ["generate", "--model-path", model_dir, "--prompt", case["prompt"], "--steps", number("steps"),
            "--guidance-scale", number("guidance_scale"), "--sampler", case["sampler"],
            "--width", number("width"), "--height", number("height"), "--num-images", number("num_images"),
            "--out", os.path.join(out, "x.png"), "--latents-out", os.path.join(out, "x.npy")]
    if case.get("negative_prompt"):
        args += ["--negative-prompt", case["negative_prompt"]]
    if case.get("max_sequence_length"):
        args += ["--t5-max-length", number("max_sequence_length")]
    return args


def png_levels(a, b):
    try:
        from PIL import Image
    except ImportError:
        return None
    x = np.asarray(Image.open(a), dtype=np.int32)
    y = np.asarray(Image.open(b), dtype=np.int32)
    return int(np.abs(x - y).max())


def main():
    worker, fixtures, models, out = sys.argv[1:5]
    cuda = os.environ.get("SLUICE_DEVICE") == "cuda"
    settings = SETTINGS[:1] if os.environ.get("SLUICE_NUMERICS_QUICK") else SETTINGS
    rows, failures = [], []
    for index, (name, flags, tolerances) in enumerate(settings):
        for fixture, case_name, family in CASES:
            if index >= SD_ONLY_AFTER and family != "sd":
                continue
            cases = json.load(open(os.path.join(fixtures, fixture, "cases.json")))
            case = next(c for c in cases if c["name"] == case_name)
            work = os.path.join(out, f"{index}-{family}")
            os.makedirs(work, exist_ok=True)
            args = generate_args(case, os.path.join(models, case["model"]), work)
            args += ["--latents-in", os.path.join(fixtures, fixture, case["latents_in"])]
            if cuda:
                args += ["--device", "cuda", "--require-gpu"]
            started = time.monotonic()
            subprocess.run([worker] + args + flags, check=True, stdout=subprocess.DEVNULL)
            seconds = time.monotonic() - started
            got = np.load(os.path.join(work, "x.npy"))
            want = np.load(os.path.join(fixtures, fixture, case["expected_latents"]))
            err = float(np.abs(got.astype(np.float64) - want).max())
            scale = float(np.abs(want).max())
            levels = png_levels(os.path.join(work, "x.png"), os.path.join(fixtures, fixture, case["expected_images"][0]))
            tolerance = tolerances.get(family) if cuda else CPU_TOLERANCE
            ok = tolerance is None or err <= tolerance
            rows.append({"setting": name, "family": family, "case": case_name, "max_abs_latents": err, "max_abs_reference": scale,
                         "png_levels": levels, "tolerance": tolerance, "ok": ok, "seconds": round(seconds, 1)})
            if not ok:
                failures.append(f"{family} under '{name}': {err:.2e} > {tolerance:.0e}")
    device = "CUDA" if cuda else "CPU"
    print(f"| setting ({device}) | family | max abs latents vs diffusers (CPU) | relative to max abs latent | PNG levels | tolerance |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        tol = "measured" if r["tolerance"] is None else f"{r['tolerance']:.0e}"
        levels = "-" if r["png_levels"] is None else r["png_levels"]
        relative = r["max_abs_latents"] / r["max_abs_reference"]
        print(f"| {r['setting']} | {r['family']} | {r['max_abs_latents']:.2e} | {relative:.1e} | {levels} | {tol}{'' if r['ok'] else ' FAILED'} |")
    json.dump(rows, open(os.path.join(out, "numerics.json"), "w"), indent=1)
    if failures:
        sys.exit("numerics outside their tolerance: " + "; ".join(failures))


if __name__ == "__main__":
    main()
