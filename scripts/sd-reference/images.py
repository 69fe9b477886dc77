#!/usr/bin/env python3
"""Image-to-image and inpainting reference fixtures for Sluice's diffusion worker.

The img2img / inpainting counterpart of generate.py and sdxl.py (whose helpers it imports: tiny model
configs and builders, quantize_, tokenizer files, set_name_or_path/finish_layout, deterministic tar packing,
JSON/float helpers, save_npz). Run it through `bash scripts/sd-reference/generate.sh --images` (which makes
the venv); a one-off developer tool, not CI.

Steps:
  A. inputs         deterministic RGB init images (smooth gradients + shapes drawn with numpy from a fixed
                    seed) and an inpainting mask (mode L: 255 = repaint, 0 = keep; a rectangle, an ellipse and
                    a few single pixels that probe the binarize threshold and the nearest-neighbour
                    downsampling), written as PNG into the fixture directory and read back from there.
  B. model          sd-tiny-inpaint: generate.py's tiny SD 1.x configs with a 9-channel UNet
                    (conv_in = sd-tiny's 4 input channels + 5 seeded extra ones; every other weight is
                    sd-tiny's), sd-tiny's tokenizer, text encoder and VAE, saved as a
                    StableDiffusionInpaintPipeline with SD 1.5's scheduler config and exported with optimum
                    (`--task inpainting`), packed into integration-tests/fixtures/inpaint-tiny.tar.xz
                    (generate.pack_tarball). sd-tiny (which has vae_encoder/) and sdxl-tiny come unchanged from
                    the committed sd-tiny.tar.xz / sdxl-tiny.tar.xz.
  D. references     integration-tests/fixtures/image-reference/: Optimum's ORT img2img / inpaint pipelines
                    (SD 1.x and SDXL) on the unpacked tarballs, CPU, one thread. Every random draw of the
                    pipeline (VAE encoder sample, prepare_latents noise, ancestral step noise) is replaced by
                    a fixed array, and the order of the draws is recorded and checked. cases.json, per case
                    .npy/.npz/.png, manifest.json (ONNX I/O, sizes, sha256, facts), README.md.
  E. rerun check    (--rerun-check) the whole script again in a fresh process into a scratch output root;
                    every output file is compared and the result goes into the README.

Usage: images.py --out REPO_ROOT [--work DIR] [--rerun-check]
Needs HF_HUB_OFFLINE=1 (set by generate.sh); never touches the network or a model hub.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate as g  # noqa: E402  (sets the offline/verbosity environment before the heavy imports)
import sdxl  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

import diffusers  # noqa: E402
import diffusers.utils.torch_utils  # noqa: E402
from diffusers import (  # noqa: E402
    PNDMScheduler,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    UNet2DConditionModel,
)
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution  # noqa: E402
from optimum.onnxruntime import (  # noqa: E402
    ORTStableDiffusionImg2ImgPipeline,
    ORTStableDiffusionInpaintPipeline,
    ORTStableDiffusionXLImg2ImgPipeline,
    ORTStableDiffusionXLInpaintPipeline,
)
from transformers import CLIPTokenizer  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Fixed inputs
# --------------------------------------------------------------------------------------------------

INPAINT_MODEL = "sd-tiny-inpaint"
TARBALL = "integration-tests/fixtures/inpaint-tiny.tar.xz"
SD_TARBALL = "integration-tests/fixtures/sd-tiny.tar.xz"
SDXL_TARBALL = "integration-tests/fixtures/sdxl-tiny.tar.xz"
REF_DIR = "integration-tests/fixtures/image-reference"
OUTPUT_PATHS = [TARBALL, REF_DIR]
PARTS = ("text_encoder", "unet", "vae_decoder", "vae_encoder")

PROMPT = g.PROMPT
NEGATIVE_PROMPT = g.NEGATIVE_PROMPT

# extra conv_in input channels of the 9-channel UNet (mask 1 + masked-image latents 4), seeded
INPAINT_CONV_IN_SEED = 4

# input images (PNG files in the fixture directory)
INIT_64 = "inputs/init_64x64.png"
INIT_96x64 = "inputs/init_96x64.png"
MASK_64 = "inputs/mask_64x64.png"
MASK_64_FLIPPED = "inputs/mask_64x64_flipped.png"  # only for the sensitivity table
IMAGE_SEED = 7

PIPELINES = {
    ("img2img", False): ORTStableDiffusionImg2ImgPipeline,
    ("inpaint", False): ORTStableDiffusionInpaintPipeline,
    ("img2img", True): ORTStableDiffusionXLImg2ImgPipeline,
    ("inpaint", True): ORTStableDiffusionXLInpaintPipeline,
}

log = logging.getLogger("image-reference")


# --------------------------------------------------------------------------------------------------
# A. Input images
# --------------------------------------------------------------------------------------------------


def make_init_image(width: int, height: int, seed: int) -> np.ndarray:
    """RGB uint8 [h, w, 3]: smooth gradients plus a disc, a rectangle and a triangle, mild noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    u, v = x / (width - 1), y / (height - 1)
    img = np.stack([
        0.15 + 0.7 * u,
        0.2 + 0.6 * v,
        0.5 + 0.35 * np.sin(2.0 * math.pi * (0.6 * u + 0.4 * v)),
    ], axis=-1)
    # a disc
    cx, cy, r = rng.uniform(0.25, 0.45) * width, rng.uniform(0.3, 0.6) * height, 0.18 * min(width, height)
    img[(x - cx) ** 2 + (y - cy) ** 2 <= r * r] = rng.uniform(0.0, 1.0, 3)
    # a rectangle
    x0, y0 = int(rng.integers(width // 2, width - 20)), int(rng.integers(4, height // 3))
    img[y0:y0 + 14, x0:x0 + 17] = rng.uniform(0.0, 1.0, 3)
    # a triangle (three half-planes)
    ax, ay, bx, by, qx, qy = 0.55 * width, 0.9 * height, 0.95 * width, 0.95 * height, 0.8 * width, 0.55 * height

    def side(px, py, sx, sy, tx, ty):
        return (tx - sx) * (py - sy) - (ty - sy) * (px - sx)

    s1, s2, s3 = side(x, y, ax, ay, bx, by), side(x, y, bx, by, qx, qy), side(x, y, qx, qy, ax, ay)
    inside = ((s1 >= 0) & (s2 >= 0) & (s3 >= 0)) | ((s1 <= 0) & (s2 <= 0) & (s3 <= 0))
    img[inside] = rng.uniform(0.0, 1.0, 3)
    img += rng.normal(0.0, 0.01, img.shape)
    return np.clip(np.round(img * 255.0), 0, 255).astype(np.uint8)


def make_mask(width: int, height: int) -> np.ndarray:
    """Mode-L uint8 [h, w]: 255 = repaint, 0 = keep. A rectangle and an ellipse whose edges are not on the
    8-pixel grid, plus probes of the pipeline's binarize threshold (>= 0.5 after /255, i.e. >= 128) and of
    the nearest-neighbour downsampling to the latent grid (which reads pixel (8i, 8j) of each 8×8 block)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    m = np.zeros((height, width), dtype=np.uint8)
    m[10:29, 36:59] = 255  # rectangle rows 10..28, cols 36..58
    m[((x - 21.3) / 13.6) ** 2 + ((y - 41.7) / 10.2) ** 2 <= 1.0] = 255  # ellipse
    # threshold probes on sampled pixels: 128 -> repaint (latent 1), 127 -> keep (latent 0)
    m[56, 0] = 128
    m[56, 8] = 127
    m[0, 56] = 200
    # a block that is white except its sampled top-left pixel: latent 0 (nearest, not area/any)
    m[49:56, 41:48] = 255
    m[48, 40] = 0
    m[48, 41:48] = 255
    m[49:56, 40] = 255
    # a block with only its sampled pixel white: latent 1
    m[0, 0] = 255
    return m


def write_png(path: Path, array: np.ndarray, mode: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array, mode=mode).save(path, format="PNG")


def load_png(path: Path, mode: str) -> Image.Image:
    img = Image.open(path)
    img.load()
    assert img.mode == mode, (path, img.mode)
    return img


def build_inputs(ref_dir: Path) -> dict:
    write_png(ref_dir / INIT_64, make_init_image(64, 64, IMAGE_SEED), "RGB")
    write_png(ref_dir / INIT_96x64, make_init_image(96, 64, IMAGE_SEED + 1), "RGB")
    mask = make_mask(64, 64)
    write_png(ref_dir / MASK_64, mask, "L")
    write_png(ref_dir / MASK_64_FLIPPED, np.ascontiguousarray(mask[:, ::-1]), "L")
    m = np.asarray(load_png(ref_dir / MASK_64, "L"))
    binary = (m.astype(np.float32) / 255.0 >= 0.5).astype(np.float32)
    latent = binary[::8, ::8]
    facts = {
        "mask_repaint_fraction_pixels": float(binary.mean()),
        "mask_repaint_fraction_latents": float(latent.mean()),
        "mask_latent_nearest": latent.astype(int).tolist(),
        "mask_latent_if_block_mean_ge_0.5": (binary.reshape(8, 8, 8, 8).mean(axis=(1, 3)) >= 0.5).astype(int).tolist(),
    }
    assert latent[7, 0] == 1 and latent[7, 1] == 0 and latent[0, 7] == 1 and latent[6, 5] == 0 and latent[0, 0] == 1
    log.info("A. inputs written; mask latent (nearest):\n%s", "\n".join("".join(str(v) for v in row) for row in facts["mask_latent_nearest"]))
    return facts


# --------------------------------------------------------------------------------------------------
# B. sd-tiny-inpaint
# --------------------------------------------------------------------------------------------------


def build_inpaint_unet(base: UNet2DConditionModel) -> UNet2DConditionModel:
    """sd-tiny's UNet with in_channels 9: conv_in's first 4 input channels are sd-tiny's, the 5 extra ones
    (mask, masked-image latents) seeded random on the same power-of-two grid; all other weights shared."""
    model = UNet2DConditionModel(**{**g.UNET_CONFIG, "in_channels": 9}).eval()
    state = base.state_dict()
    w_base = state.pop("conv_in.weight")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["conv_in.weight"] and not unexpected, (missing, unexpected)
    std = float(w_base.float().std())
    q = 2.0 ** round(math.log2(std / g.QUANT_DIVISOR))
    torch.manual_seed(INPAINT_CONV_IN_SEED)
    extra = torch.round(torch.randn(w_base.shape[0], 5, *w_base.shape[2:]) * std / q) * q
    with torch.no_grad():
        model.conv_in.weight.copy_(torch.cat([w_base, extra], dim=1))
    return model


def save_inpaint_pipeline(work: Path, tokenizer_dir: Path) -> Path:
    unet = build_inpaint_unet(g.build_unet())
    pipe = StableDiffusionInpaintPipeline(
        vae=g.build_vae(), text_encoder=g.build_text_encoder(), tokenizer=CLIPTokenizer.from_pretrained(str(tokenizer_dir)),
        unet=unet, scheduler=PNDMScheduler.from_config(g.SD15_SCHEDULER), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    out = work / "diffusers" / INPAINT_MODEL
    pipe.save_pretrained(str(out))
    log.info("B. diffusers StableDiffusionInpaintPipeline saved (unet in_channels %d)", unet.config.in_channels)
    return out


def export_inpainting(diffusers_dir: Path, out_dir: Path) -> None:
    """`optimum-cli export onnx -m DIR --task inpainting OUT`, through the Python API."""
    from optimum.exporters.onnx import main_export

    t0 = time.time()
    main_export(model_name_or_path=str(diffusers_dir), output=str(out_dir), task="inpainting",
                library_name="diffusers", device="cpu", local_files_only=True, do_validation=True)
    log.info("B. exported %s in %.1f s", out_dir.name, time.time() - t0)


def unpack(tar_path: Path, dest: Path) -> None:
    with tarfile.open(tar_path, "r:xz") as tar:
        tar.extractall(dest, filter="data")


def onnx_initializers(path: Path) -> dict[str, np.ndarray]:
    m = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def compare_shared_parts(inpaint_dir: Path, sd_dir: Path) -> dict:
    """Are sd-tiny-inpaint's text encoder / VAE (and tokenizer) the committed sd-tiny's?"""
    out = {}
    for part in ("text_encoder", "vae_encoder", "vae_decoder", "tokenizer"):
        a, b = inpaint_dir / part, sd_dir / part
        files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
        same = {f: (b / f).is_file() and (a / f).read_bytes() == (b / f).read_bytes() for f in files}
        entry = {"byte_identical_files": sorted(f for f, s in same.items() if s),
                 "differing_files": sorted(f for f, s in same.items() if not s)}
        if part != "tokenizer" and not same.get("model.onnx"):
            ia, ib = onnx_initializers(a / "model.onnx"), onnx_initializers(b / "model.onnx")
            va, vb = sorted(v.tobytes() for v in ia.values()), sorted(v.tobytes() for v in ib.values())
            entry["model.onnx_same_initializer_values"] = va == vb
            assert va == vb, part
        out[part] = entry
    # the UNet: every initializer of sd-tiny's UNet appears in sd-tiny-inpaint's but conv_in
    ia = onnx_initializers(inpaint_dir / "unet" / "model.onnx")
    ib = onnx_initializers(sd_dir / "unet" / "model.onnx")
    vals_a = {v.tobytes() for v in ia.values()}
    not_shared = sorted(k for k, v in ib.items() if v.tobytes() not in vals_a)
    out["unet"] = {"sd-tiny initializers not found in sd-tiny-inpaint": not_shared}
    assert all("conv_in" in k for k in not_shared), not_shared
    log.info("B. shared parts vs committed sd-tiny: %s", {k: ("identical" if not v.get("differing_files") else
                                                            v["differing_files"]) for k, v in out.items() if k != "unet"})
    return out


def build_models(work: Path, out_root: Path) -> dict:
    tokenizer_dir = work / "tokenizer"
    g.build_tokenizer(tokenizer_dir)
    diffusers_dir = save_inpaint_pipeline(work, tokenizer_dir)
    onnx_root = work / "onnx"
    export_inpainting(diffusers_dir, onnx_root / INPAINT_MODEL)
    g.finish_layout(onnx_root / INPAINT_MODEL, tokenizer_dir, g.SD15_SCHEDULER)
    index = json.loads((onnx_root / INPAINT_MODEL / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionInpaintPipeline", index
    for part in PARTS + ("tokenizer", "scheduler"):
        assert (onnx_root / INPAINT_MODEL / part).is_dir(), part
    tar_path = out_root / TARBALL
    listing = g.pack_tarball(onnx_root, tar_path, [INPAINT_MODEL])

    # everything downstream runs on the unpacked tarballs, i.e. on exactly what is committed
    unpacked = work / "unpacked"
    if unpacked.exists():
        shutil.rmtree(unpacked)
    unpacked.mkdir()
    unpack(tar_path, unpacked)
    unpack(out_root / SD_TARBALL, unpacked)
    unpack(out_root / SDXL_TARBALL, unpacked)
    for name in ("sd-tiny", "sdxl-tiny"):
        assert (unpacked / name / "vae_encoder" / "model.onnx").is_file(), name
    shared = compare_shared_parts(unpacked / INPAINT_MODEL, unpacked / "sd-tiny")
    return {"tar_listing": listing, "models_root": unpacked, "diffusers_dir": diffusers_dir, "shared": shared}


# --------------------------------------------------------------------------------------------------
# Draw injection and recording
# --------------------------------------------------------------------------------------------------

ORIGINAL_RANDN = diffusers.utils.torch_utils.randn_tensor


@contextlib.contextmanager
def injected_draws(image_noise: np.ndarray, latents: np.ndarray, step_noise: np.ndarray | None):
    """Replaces `randn_tensor` in every loaded module that imported it (pipelines, schedulers, the VAE's
    DiagonalGaussianDistribution). Each draw is classified by its call site:
      image_noise  DiagonalGaussianDistribution.sample (VAE encoder): always `image_noise`
      latents      <pipeline>.prepare_latents: `latents`
      step_noise   <scheduler>.step: step_noise[k] for the k-th such draw
    Any other draw, or a shape mismatch, fails loudly. Yields the list of (role, shape, site)."""
    modules = [m for m in list(sys.modules.values())
               if m is not None and getattr(m, "__dict__", {}).get("randn_tensor") is ORIGINAL_RANDN]
    seen: list[tuple[str, tuple, str]] = []

    def fake_randn(shape, generator=None, device=None, dtype=None, layout=None, **_kw):
        frame = sys._getframe(1)
        fn, mod = frame.f_code.co_name, frame.f_globals.get("__name__", "")
        if fn == "sample" and mod == "diffusers.models.autoencoders.vae":
            role, arr = "image_noise", image_noise
        elif fn == "prepare_latents" and mod.startswith("diffusers.pipelines."):
            role, arr = "latents", latents
        elif fn == "step" and mod.startswith("diffusers.schedulers."):
            k = sum(1 for r, _, _ in seen if r == "step_noise")
            if step_noise is None or k >= len(step_noise):
                raise AssertionError(f"unexpected step noise draw #{k} of shape {tuple(shape)} in {mod}")
            role, arr = "step_noise", step_noise[k]
        else:
            raise AssertionError(f"unexpected randn_tensor call from {mod}.{fn} shape {tuple(shape)}")
        assert tuple(arr.shape) == tuple(shape), (role, arr.shape, tuple(shape))
        seen.append((role, tuple(int(s) for s in shape), f"{mod.rsplit('.', 1)[-1]}.{fn}"))
        return torch.from_numpy(np.array(arr, dtype=np.float32)).to(dtype=dtype or torch.float32)

    for m in modules:
        m.randn_tensor = fake_randn
    try:
        yield seen
    finally:
        for m in modules:
            m.randn_tensor = ORIGINAL_RANDN


class Recorder:
    """Wraps InferenceSession.run of every session of the pipeline (feeds and outputs by name), the
    scheduler's add_noise (inputs and output) and, for inpainting, prepare_mask_latents' result."""

    def __init__(self, pipe):
        self.calls: dict[str, list[dict]] = {}
        self.add_noise: list[dict] = []
        self.mask_latents: list[tuple[np.ndarray, np.ndarray | None]] = []
        self._restore = []
        for name in ("text_encoder", "text_encoder_2", "unet", "vae_encoder", "vae_decoder"):
            part = getattr(pipe, name, None)
            if part is None:
                continue
            self.calls[name] = []
            sess = part.session
            original = sess.run
            all_names = [o.name for o in sess.get_outputs()]

            def run(output_names, feed, *args, _orig=original, _name=name, _all=all_names, **kwargs):
                call = {"feed": {k: np.array(v, copy=True) for k, v in feed.items()}, "out": None}
                self.calls[_name].append(call)  # before running: a failing call is recorded too
                outs = _orig(output_names, feed, *args, **kwargs)
                call["out"] = {n: np.array(o, copy=True) for n, o in zip(output_names or _all, outs)}
                return outs

            sess.run = run
            self._restore.append(sess)
        sched = pipe.scheduler
        orig_add_noise = sched.add_noise

        def add_noise(original_samples, noise, timesteps, _orig=orig_add_noise, _s=sched):
            out = _orig(original_samples, noise, timesteps)
            self.add_noise.append({
                "original_samples": original_samples.detach().numpy().copy(),
                "noise": noise.detach().numpy().copy(),
                "timesteps": [float(t) for t in timesteps.reshape(-1)],
                "step_index": _s.step_index if hasattr(_s, "step_index") else None,
                "begin_index": _s.begin_index if hasattr(_s, "begin_index") else None,
                "out": out.detach().numpy().copy(),
            })
            return out

        sched.add_noise = add_noise
        self._pipe = pipe
        if hasattr(pipe, "prepare_mask_latents"):
            orig_pml = pipe.prepare_mask_latents

            def prepare_mask_latents(*args, _orig=orig_pml, **kwargs):
                mask, mil = _orig(*args, **kwargs)
                self.mask_latents.append((mask.detach().numpy().copy(),
                                          None if mil is None else mil.detach().numpy().copy()))
                return mask, mil

            pipe.prepare_mask_latents = prepare_mask_latents

    def close(self):
        for sess in self._restore:
            del sess.run
        del self._pipe.scheduler.add_noise
        if "prepare_mask_latents" in self._pipe.__dict__:
            del self._pipe.prepare_mask_latents


# --------------------------------------------------------------------------------------------------
# D. Pipeline references
# --------------------------------------------------------------------------------------------------


def load_pipeline(models_root: Path, case: dict):
    cls = PIPELINES[(case["mode"], case["sdxl"])]
    pipe = cls.from_pretrained(str(models_root / case["model"]), provider="CPUExecutionProvider",
                               session_options=g.cpu_session_options(), export=False, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if case["sdxl"]:
        assert getattr(pipe, "watermark", None) is None, "invisible-watermark must not be active"
    sched_cls, extra, _ = g.SAMPLERS[case["sampler"]]
    pipe.scheduler = sched_cls.from_config(pipe.scheduler.config, **extra)
    return pipe


def steps_run(steps: int, strength: float) -> int:
    """diffusers' get_timesteps: init_timestep = min(int(num_inference_steps * strength), steps) (Python
    float, i.e. f64 multiply then truncation toward zero)."""
    return min(int(steps * strength), steps)


def expected_draw_order(case: dict, n_steps: int) -> list[str]:
    step = ["step_noise"] * (n_steps if case["sampler"] == "euler_a" else 0)
    if case["mode"] == "img2img":
        return ["image_noise", "latents"] + step
    encodes_init = case["unet_in_channels"] == 4 or case["strength"] != 1.0
    return (["image_noise"] if encodes_init else []) + ["latents", "image_noise"] + step


def case_inputs(case: dict) -> dict:
    n, h, w = case["num_images"], case["height"], case["width"]
    lat = (h // 8, w // 8)
    rng = np.random.default_rng(case["seed"])
    image_noise = rng.standard_normal((1, 4, *lat), dtype=np.float32)
    latents = rng.standard_normal((n, 4, *lat), dtype=np.float32)
    k = steps_run(case["steps"], case["strength"])
    noise = rng.standard_normal((k, n, 4, *lat), dtype=np.float32) if case["sampler"] == "euler_a" else None
    return {"image_noise_in": image_noise, "latents_in": latents, "noise_in": noise}


def preprocess_image(img: Image.Image) -> np.ndarray:
    """VaeImageProcessor.preprocess for an RGB PIL image at the target size: /255, to NCHW, 2x - 1."""
    a = np.asarray(img).astype(np.float32) / 255.0
    return (2.0 * a.transpose(2, 0, 1)[None] - 1.0).astype(np.float32)


def preprocess_mask(img: Image.Image) -> np.ndarray:
    """The mask processor: convert("L"), /255, binarize (< 0.5 -> 0, >= 0.5 -> 1), [1, 1, h, w]."""
    a = np.asarray(img.convert("L")).astype(np.float32) / 255.0
    return (a >= 0.5).astype(np.float32)[None, None]


def run_case(models_root: Path, ref_dir: Path, case: dict, inputs: dict | None = None, mask_path: str | None = None) -> dict:
    """Runs one case twice (output_type "latent" and "np") with all draws injected; returns arrays and
    observations, after checking the recipe (preprocessing, encoder sampling, add_noise, mask latents)."""
    pipe = load_pipeline(models_root, case)
    inputs = inputs or case_inputs(case)
    n, h, w = case["num_images"], case["height"], case["width"]
    init_img = load_png(ref_dir / case["init_image"], "RGB")
    assert init_img.size == (w, h), (init_img.size, w, h)
    mask_rel = mask_path or case["mask_image"]
    mask_img = None if mask_rel is None else load_png(ref_dir / mask_rel, "L")
    kwargs = dict(prompt=case["prompt"], negative_prompt=case["negative_prompt"], image=init_img,
                  strength=case["strength"], num_inference_steps=case["steps"],
                  guidance_scale=case["guidance_scale"], num_images_per_prompt=n)
    if case["mode"] == "inpaint":
        kwargs.update(mask_image=mask_img, height=h, width=w)
    kwargs.update(case.get("extra_kwargs", {}))
    k_run = steps_run(case["steps"], case["strength"])

    results = {}
    for output_type in ("latent", "np"):
        rec = Recorder(pipe)
        with injected_draws(inputs["image_noise_in"], inputs["latents_in"], inputs["noise_in"]) as draws:
            out = pipe(**kwargs, output_type=output_type)
        rec.close()
        img = out.images
        results[output_type] = {
            "images": img.numpy() if isinstance(img, torch.Tensor) else np.asarray(img),
            "rec": rec, "draws": list(draws),
            "schedule_timesteps": pipe.scheduler.timesteps.clone(),
            "init_noise_sigma": float(pipe.scheduler.init_noise_sigma),
            "begin_index": getattr(pipe.scheduler, "begin_index", None),
            "sigmas": None if getattr(pipe.scheduler, "sigmas", None) is None else pipe.scheduler.sigmas.clone(),
        }
    lat, npy = results["latent"], results["np"]
    name = case["name"]
    expected_latents = lat["images"].astype(np.float32)
    images = npy["images"].astype(np.float32)
    scaling = float(pipe.vae.config.scaling_factor)
    rl, rn = lat["rec"], npy["rec"]
    # both runs identical up to the decoder
    assert lat["draws"] == npy["draws"], name
    for k in rl.calls:
        if k == "vae_decoder":
            continue
        assert len(rl.calls[k]) == len(rn.calls[k]), (name, k)
        for a, b in zip(rl.calls[k], rn.calls[k]):
            assert all(np.array_equal(a["feed"][x], b["feed"][x]) for x in a["feed"]), (name, k)
    assert len(rl.calls["vae_decoder"]) == 0 and len(rn.calls["vae_decoder"]) == 1, name
    decoded_in = rn.calls["vae_decoder"][0]["feed"]["latent_sample"]
    assert np.array_equal(decoded_in, (torch.from_numpy(expected_latents) / scaling).numpy()), name

    # the draws: order and roles
    roles = [r for r, _, _ in npy["draws"]]
    assert roles == expected_draw_order(case, k_run), (name, roles)

    # timesteps actually run = scheduler.timesteps[t_start * order:], t_start = steps - steps_run
    sched_ts = npy["schedule_timesteps"]
    order = pipe.scheduler.order
    t_start = case["steps"] - k_run
    run_ts = sched_ts[t_start * order:]
    unet_calls = rn.calls["unet"]
    ts_fed = [u["feed"]["timestep"] for u in unet_calls]
    assert len(unet_calls) == len(run_ts) == k_run, (name, len(unet_calls), len(run_ts), k_run)
    assert [float(np.float32(t)) for t in run_ts] == [float(t) for t in ts_fed], name
    has_begin = hasattr(pipe.scheduler, "set_begin_index")  # DDIM has none: it indexes by timestep value
    assert npy["begin_index"] == (t_start * order if has_begin else None), (name, npy["begin_index"])

    # preprocessing: the encoder's inputs are the init image and (inpainting) the masked image
    x_init = preprocess_image(init_img)
    enc = rn.calls["vae_encoder"]
    enc_inputs = []
    mask_px = None if mask_img is None else preprocess_mask(mask_img)
    x_masked = None if mask_px is None else (x_init * (mask_px < 0.5)).astype(np.float32)
    for c in enc:
        s = c["feed"]["sample"]
        if np.array_equal(s, x_init):
            enc_inputs.append("init_image")
        elif x_masked is not None and np.array_equal(s, x_masked):
            enc_inputs.append("masked_image")
        else:
            raise AssertionError(f"{name}: unexpected vae_encoder input")
    assert len(enc) == roles.count("image_noise"), name

    def sample_latents(params: np.ndarray) -> np.ndarray:
        # what the pipeline computes: DiagonalGaussianDistribution(params).sample() * scaling_factor
        dist = DiagonalGaussianDistribution(torch.from_numpy(params))
        x = dist.mean + dist.std * torch.from_numpy(inputs["image_noise_in"])
        return (scaling * x).numpy()

    params_by_input = {which: c["out"]["latent_parameters"] for which, c in zip(enc_inputs, enc)}
    init_params = params_by_input.get("init_image")
    image_latents = None if init_params is None else sample_latents(init_params)

    # add_noise calls: the first one (if any) noises the image latents at the first timestep run
    an = rn.add_noise
    latents_feed0 = None
    if case["mode"] == "img2img" or case["strength"] != 1.0:
        first = an[0]
        assert first["step_index"] is None and first["begin_index"] == npy["begin_index"], (name, first)
        assert np.array_equal(first["original_samples"], np.repeat(image_latents, n, 0)), name
        assert np.array_equal(first["noise"], inputs["latents_in"]), name
        assert first["timesteps"] == [float(run_ts[0])] * n, (name, first["timesteps"])
        latents_feed0 = first["out"]
        blend = an[1:]
    else:
        blend = an
    # 4-channel inpainting: one add_noise per step but the last, at timesteps[i + 1], for the blend-back
    if case["mode"] == "inpaint" and case["unet_in_channels"] == 4:
        assert len(blend) == k_run - 1, (name, len(blend))
        for i, b in enumerate(blend):
            assert b["timesteps"] == [float(run_ts[i + 1])], (name, i, b["timesteps"])
            assert b["step_index"] == t_start * order + i + 1, (name, i, b["step_index"])
            assert np.array_equal(b["original_samples"], np.repeat(image_latents, n, 0)), name
            assert np.array_equal(b["noise"], inputs["latents_in"]), name
    else:
        assert not blend, (name, len(blend))

    # mask latents (inpainting): nearest downsampling of the binarized mask, masked-image latents
    mask_latents = masked_image_latents = masked_params = None
    if case["mode"] == "inpaint":
        assert len(rn.mask_latents) == 1, name
        mask_b, mil_b = rn.mask_latents[0]
        cfg_rows = mask_b.shape[0]
        assert all(np.array_equal(mask_b[i], mask_b[0]) for i in range(cfg_rows)), name
        mask_latents = mask_b[:1]
        assert np.array_equal(mask_latents, mask_px[:, :, ::8, ::8]), name
        masked_params = params_by_input["masked_image"]
        masked_image_latents = sample_latents(masked_params)
        assert all(np.array_equal(mil_b[i], masked_image_latents[0]) for i in range(mil_b.shape[0])), name

    # the first UNet feed
    feed0 = unet_calls[0]["feed"]
    cfg = case["guidance_scale"] > 1.0
    s0 = feed0["sample"]
    assert s0.shape[1] == case["unet_in_channels"] and s0.shape[0] == (2 * n if cfg else n), (name, s0.shape)
    if case["mode"] == "inpaint" and case["strength"] == 1.0:
        start = inputs["latents_in"] * npy["init_noise_sigma"]
    else:
        start = latents_feed0
    scaled = pipe.scheduler.__class__.from_config(pipe.scheduler.config)  # fresh copy for scale_model_input
    scaled.set_timesteps(case["steps"])
    if has_begin:
        scaled.set_begin_index(t_start * order)
    lat_in = torch.from_numpy(np.concatenate([start] * 2) if cfg else start)
    expect_s0 = scaled.scale_model_input(lat_in, run_ts[0]).numpy()
    assert np.array_equal(s0[:, :4], expect_s0), (name, float(np.abs(s0[:, :4] - expect_s0).max()))
    if case["unet_in_channels"] == 9:
        rows = s0.shape[0]
        assert np.array_equal(s0[:, 4:5], np.repeat(mask_latents, rows, 0)), name
        assert np.array_equal(s0[:, 5:], np.repeat(masked_image_latents, rows, 0)), name

    # 4-channel inpainting: the kept region of the final latents is exactly the image latents
    if case["mode"] == "inpaint" and case["unet_in_channels"] == 4:
        keep = np.repeat(mask_latents, 4, 1) == 0
        keep = np.repeat(keep, n, 0)
        assert np.array_equal(expected_latents[keep], np.repeat(image_latents, n, 0)[keep]), name

    te1 = rn.calls["text_encoder"]
    te2 = rn.calls.get("text_encoder_2")
    obs = {
        **inputs,
        "expected_latents": expected_latents,
        "images": images,
        "init_latent_parameters": init_params,
        "image_latents": image_latents,
        "mask_latents": mask_latents,
        "masked_image_latent_parameters": masked_params,
        "masked_image_latents": masked_image_latents,
        "first_unet_feed": {k: np.asarray(v) for k, v in feed0.items()},
        "draws": [{"role": r, "shape": list(s), "site": site} for r, s, site in npy["draws"]],
        "vae_encoder_inputs": enc_inputs,
        "prompt_ids": te1[0]["feed"]["input_ids"][0].astype(int).tolist(),
        "negative_prompt_ids": None if len(te1) < 2 else te1[1]["feed"]["input_ids"][0].astype(int).tolist(),
        "prompt_ids_2": None if te2 is None else te2[0]["feed"]["input_ids"][0].astype(int).tolist(),
        "negative_prompt_ids_2": None if te2 is None or len(te2) < 2 else te2[1]["feed"]["input_ids"][0].astype(int).tolist(),
        "schedule_timesteps": [float(t) for t in sched_ts],
        "timesteps": [float(t) for t in run_ts],
        "steps_run": k_run,
        "begin_index": npy["begin_index"],
        "sigmas": None if npy["sigmas"] is None else g.f32(npy["sigmas"].numpy()),
        "init_noise_sigma": npy["init_noise_sigma"],
        "add_noise_calls": [{"timesteps": a["timesteps"], "step_index": a["step_index"]} for a in an],
        "unet_timestep_feed": {"dtype": str(ts_fed[0].dtype), "shape": list(ts_fed[0].shape),
                               "values": [float(t) for t in ts_fed]},
        "unet_batch": int(s0.shape[0]),
        "unet_feed_dtypes": {k: str(v.dtype) for k, v in sorted(feed0.items())},
        "unet_feed_shapes": {k: list(v.shape) for k, v in sorted(feed0.items())},
        "time_ids": None if "time_ids" not in feed0 else [[float(x) for x in row] for row in feed0["time_ids"]],
        "noise_draws": roles.count("step_noise"),
        "scheduler_config": g.plain_config(pipe.scheduler.config),
        "pipeline_class": type(pipe).__name__,
        "vae_scaling_factor": scaling,
        "force_zeros_for_empty_prompt": bool(pipe.config.force_zeros_for_empty_prompt) if case["sdxl"] else None,
        "requires_aesthetics_score": bool(pipe.config.requires_aesthetics_score) if case["sdxl"] else None,
    }
    if case["sdxl"]:
        for u in unet_calls[1:]:
            for k in ("encoder_hidden_states", "text_embeds", "time_ids"):
                assert np.array_equal(u["feed"][k], feed0[k]), (name, k)
    return obs


def reference_cases() -> list[dict]:
    sd = dict(model="sd-tiny", sdxl=False, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, guidance_scale=7.5,
              steps=4, width=64, height=64, num_images=1, init_image=INIT_64, mask_image=None, unet_in_channels=4,
              notes="")
    xl = {**sd, "model": "sdxl-tiny", "sdxl": True, "guidance_scale": 5.0}
    img = dict(mode="img2img")
    inp = dict(mode="inpaint", mask_image=MASK_64)
    inp9 = {**inp, "model": INPAINT_MODEL, "unet_in_channels": 9}
    c = [
        # SD 1.x img2img on sd-tiny
        {**sd, **img, "name": "sd_img2img_euler_s0.3", "sampler": "euler", "strength": 0.3, "seed": 3000,
         "notes": "int(4 * 0.3) = 1 step: only the last timestep (0) runs; add_noise at sigma(0) = 0.0292."},
        {**sd, **img, "name": "sd_img2img_euler_s0.75", "sampler": "euler", "strength": 0.75, "seed": 3001,
         "notes": "3 of 4 steps (666, 333, 0); image latents + sigma(666) * latents_in."},
        {**sd, **img, "name": "sd_img2img_euler_s1.0", "sampler": "euler", "strength": 1.0, "seed": 3002,
         "notes": "all 4 steps; the encoded image is still noised (image latents + sigma(999) * latents_in), "
                  "unlike text-to-image (latents_in * init_noise_sigma)."},
        {**sd, **img, "name": "sd_img2img_euler_a_s0.75", "sampler": "euler_a", "strength": 0.75, "seed": 3003,
         "notes": "Euler ancestral: one step-noise draw per step run (3), after the encoder sample and the latents."},
        {**sd, **img, "name": "sd_img2img_ddim_s0.75", "sampler": "ddim", "strength": 0.75, "seed": 3004,
         "notes": "DDIM (leading, steps_offset 1: 751, 501, 251, 1): runs 501, 251, 1; add_noise = "
                  "sqrt(abar_t) x + sqrt(1 - abar_t) noise at t = 501."},
        {**sd, **img, "name": "sd_img2img_dpmpp_2m_s0.75", "sampler": "dpmpp_2m", "strength": 0.75, "seed": 3005,
         "notes": "DPM++ 2M (order 1 in diffusers' sense, so t_start = steps - steps_run): add_noise = "
                  "alpha_t x + sigma_t noise with alpha_t = 1/sqrt(sigma^2+1), sigma_t = sigma alpha_t; the first "
                  "step run is first order (no history), the last is first order (final_sigmas_type zero)."},
        {**sd, **img, "name": "sd_img2img_euler_s0.75_guidance1", "sampler": "euler", "strength": 0.75,
         "guidance_scale": 1.0, "seed": 3001,
         "notes": "guidance 1.0: no CFG (unet batch = num_images, negative prompt not encoded). Same draws as "
                  "`sd_img2img_euler_s0.75`."},
        {**sd, **img, "name": "sd_img2img_euler_s0.75_96x64_batch2", "sampler": "euler", "strength": 0.75,
         "width": 96, "height": 64, "num_images": 2, "init_image": INIT_96x64, "seed": 3007,
         "notes": "width 96, height 64 (the size comes from the init image: StableDiffusionImg2ImgPipeline has no "
                  "height/width arguments), 2 images: the image is encoded once ([1, 8, 8, 12] parameters, one "
                  "image_noise_in [1, 4, 8, 12]) and its latents repeated; latents_in [2, 4, 8, 12]."},
        {**sd, **img, "name": "sd_img2img_euler_s0.29_100steps", "sampler": "euler", "strength": 0.29, "steps": 100,
         "seed": 3008,
         "notes": "steps_run = int(100 * 0.29) = int(28.999999999999996) = 28, not 29: the product is a Python "
                  "(f64) float and truncated. Runs the last 28 of 100 Euler timesteps."},
        # SDXL img2img on sdxl-tiny
        {**xl, **img, "name": "sdxl_img2img_euler_s0.75", "sampler": "euler", "strength": 0.75, "seed": 3100,
         "notes": "SDXL base config (leading, steps_offset 1: 751, 501, 251, 1): runs 501, 251, 1. time_ids "
                  "(h, w, 0, 0, h, w): requires_aesthetics_score is false, aesthetic_score is ignored."},
        {**xl, **img, "name": "sdxl_img2img_euler_a_s1.0", "sampler": "euler_a", "strength": 1.0, "seed": 3101,
         "notes": "strength 1.0 with Euler ancestral: image latents + sigma(751) * latents_in (add_noise uses the "
                  "schedule sigma, not init_noise_sigma = sqrt(sigma^2 + 1)); 4 step-noise draws."},
        {**xl, **img, "name": "sdxl_img2img_euler_s0.75_absent_negative", "sampler": "euler", "strength": 0.75,
         "negative_prompt": None, "seed": 3100,
         "notes": "negative prompt absent (None) with force_zeros_for_empty_prompt: zero uncond embeddings. Same "
                  "draws as `sdxl_img2img_euler_s0.75`."},
        # 9-channel inpainting on sd-tiny-inpaint
        {**sd, **inp9, "name": "sd_inpaint9_euler_s1.0", "sampler": "euler", "strength": 1.0, "seed": 3200,
         "notes": "9-channel UNet, strength 1.0: latents = latents_in * init_noise_sigma; the init image is not "
                  "encoded, only the masked image (draws: latents, image_noise)."},
        {**sd, **inp9, "name": "sd_inpaint9_euler_s0.75", "sampler": "euler", "strength": 0.75, "seed": 3201,
         "notes": "9-channel UNet, strength 0.75: the init image is encoded and noised like img2img; the masked "
                  "image is encoded too (draws: image_noise, latents, image_noise; the same image_noise_in both "
                  "times)."},
        {**sd, **inp9, "name": "sd_inpaint9_euler_a_s1.0", "sampler": "euler_a", "strength": 1.0, "seed": 3202,
         "notes": "Euler ancestral: 4 step-noise draws after latents and the masked-image encoder sample."},
        {**sd, **inp9, "name": "sd_inpaint9_euler_s1.0_batch2", "sampler": "euler", "strength": 1.0, "num_images": 2,
         "seed": 3203,
         "notes": "2 images: mask and masked-image latents repeated per image (unet batch 4 = [uncond x2, cond x2], "
                  "each row [latents, mask, masked-image latents])."},
        # 4-channel inpainting on sd-tiny
        {**sd, **inp, "name": "sd_inpaint4_euler_s0.75", "sampler": "euler", "strength": 0.75, "seed": 3300,
         "notes": "4-channel UNet: no mask input; after every step latents = (1 - m) * x_known + m * latents with "
                  "m the nearest-downsampled mask, x_known = add_noise(image_latents, latents_in, t[i+1]) or the "
                  "plain image latents after the last step. The masked image is still encoded (its latents unused)."},
        {**sd, **inp, "name": "sd_inpaint4_euler_s1.0", "sampler": "euler", "strength": 1.0, "seed": 3301,
         "notes": "4-channel UNet, strength 1.0: starts from latents_in * init_noise_sigma, but the init image is "
                  "still encoded (for the blend-back): draws image_noise, latents, image_noise."},
        # SDXL 4-channel inpainting on sdxl-tiny
        {**xl, **inp, "name": "sdxl_inpaint4_euler_s0.75", "sampler": "euler", "strength": 0.75, "seed": 3400,
         "notes": "StableDiffusionXLInpaintPipeline with SDXL's 4-channel UNet: blend-back as in "
                  "`sd_inpaint4_euler_s0.75`; time_ids (h, w, 0, 0, h, w)."},
    ]
    for case in c:
        case.setdefault("extra_kwargs", {})
        assert case["mode"] == "img2img" or case["height"] == case["width"] == 64
    return c


def save_case(out: Path, case: dict, obs: dict) -> dict:
    name = case["name"]
    d = out / name
    d.mkdir()

    def save(key, arr):
        if arr is None:
            return None
        np.save(d / f"{key}.npy", np.ascontiguousarray(arr, dtype=np.float32))
        return f"{name}/{key}.npy"

    paths = {k: save(k, obs[k]) for k in ("image_noise_in", "latents_in", "noise_in", "init_latent_parameters",
                                          "image_latents", "mask_latents", "masked_image_latent_parameters",
                                          "masked_image_latents", "expected_latents")}
    paths["expected_images_f32"] = save("expected_images", obs["images"])
    sdxl.save_npz_checked(d / "first_unet_feed.npz", obs["first_unet_feed"], name)
    pngs = []
    for i, img in enumerate(obs["images"]):
        g.save_png(img, d / f"image_{i}.png")
        pngs.append(f"{name}/image_{i}.png")
    rec = {
        "name": name,
        "mode": case["mode"],
        "model": case["model"],
        "scheduler_config_override": None,
        "sampler": case["sampler"],
        "scheduler_class": g.SAMPLERS[case["sampler"]][0].__name__,
        "scheduler_from_config_kwargs": g.SAMPLERS[case["sampler"]][1],
        "prompt": case["prompt"],
        "negative_prompt": case["negative_prompt"],
        "guidance_scale": case["guidance_scale"],
        "steps": case["steps"],
        "strength": case["strength"],
        "steps_run": obs["steps_run"],
        "width": case["width"],
        "height": case["height"],
        "num_images": case["num_images"],
        "seed": case["seed"],
        "init_image": case["init_image"],
        "mask_image": case["mask_image"],
        "unet_in_channels": case["unet_in_channels"],
        "image_noise_in": paths["image_noise_in"],
        "latents_in": paths["latents_in"],
        "noise_in": paths["noise_in"],
        "noise_draws": obs["noise_draws"],
        "draw_order": [d_["role"] for d_ in obs["draws"]],
        "draws": obs["draws"],
        "vae_encoder_inputs": obs["vae_encoder_inputs"],
        "init_latent_parameters": paths["init_latent_parameters"],
        "image_latents": paths["image_latents"],
        "mask_latents": paths["mask_latents"],
        "masked_image_latent_parameters": paths["masked_image_latent_parameters"],
        "masked_image_latents": paths["masked_image_latents"],
        "expected_latents": paths["expected_latents"],
        "expected_images": pngs,
        "expected_images_f32": paths["expected_images_f32"],
        "prompt_ids": obs["prompt_ids"],
        "negative_prompt_ids": obs["negative_prompt_ids"],
        "timesteps": obs["timesteps"],
        "schedule_timesteps": obs["schedule_timesteps"],
        "begin_index": obs["begin_index"],
        "sigmas": obs["sigmas"],
        "init_noise_sigma": obs["init_noise_sigma"],
        "add_noise_calls": obs["add_noise_calls"],
        "unet_timestep_feed": obs["unet_timestep_feed"],
        "unet_batch": obs["unet_batch"],
        "timestep_cond": None,
        "vae_scaling_factor": obs["vae_scaling_factor"],
        "first_unet_feed": f"{name}/first_unet_feed.npz",
        "first_unet_feed_dtypes": obs["unet_feed_dtypes"],
        "first_unet_feed_shapes": obs["unet_feed_shapes"],
        "pipeline_class": obs["pipeline_class"],
        "scheduler_config": obs["scheduler_config"],
        "notes": case["notes"],
    }
    if case["sdxl"]:
        rec.update({
            "prompt_ids_2": obs["prompt_ids_2"],
            "negative_prompt_ids_2": obs["negative_prompt_ids_2"],
            "force_zeros_for_empty_prompt": obs["force_zeros_for_empty_prompt"],
            "requires_aesthetics_score": obs["requires_aesthetics_score"],
            "time_ids": obs["time_ids"],
        })
    return rec


def build_references(models_root: Path, out: Path, diffusers_dir: Path) -> dict:
    cases = reference_cases()
    records, obs_by_name = [], {}
    for case in cases:
        t0 = time.time()
        obs = run_case(models_root, out, case)
        obs_by_name[case["name"]] = obs
        records.append(save_case(out, case, obs))
        log.info("D. %-38s %5.2f s  steps_run %d  timesteps %s  draws %s  unet batch %d", case["name"],
                 time.time() - t0, obs["steps_run"], [round(t, 3) for t in obs["timesteps"]],
                 [d["role"][0] if d["role"] != "step_noise" else "s" for d in obs["draws"]], obs["unet_batch"])

    o = obs_by_name
    # invariants across cases
    assert o["sd_img2img_euler_s0.75_guidance1"]["unet_batch"] == 1
    assert o["sd_img2img_euler_s0.75_guidance1"]["negative_prompt_ids"] is None
    assert np.array_equal(o["sd_img2img_euler_s0.75_guidance1"]["image_latents"], o["sd_img2img_euler_s0.75"]["image_latents"])
    assert o["sd_img2img_euler_s0.29_100steps"]["steps_run"] == 28
    assert o["sdxl_img2img_euler_s0.75"]["time_ids"] == [[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * 2
    assert o["sdxl_img2img_euler_s0.75_absent_negative"]["negative_prompt_ids"] is None
    assert not o["sdxl_img2img_euler_s0.75_absent_negative"]["first_unet_feed"]["encoder_hidden_states"][:1].any()
    assert o["sd_inpaint9_euler_s1.0_batch2"]["unet_batch"] == 4
    # the same init image gives the same encoder output in every SD 1.x case (sd-tiny and sd-tiny-inpaint share
    # the VAE)
    p = o["sd_img2img_euler_s0.75"]["init_latent_parameters"]
    for k in ("sd_inpaint9_euler_s0.75", "sd_inpaint4_euler_s0.75"):
        assert np.array_equal(o[k]["init_latent_parameters"], p), k

    torch_check = torch_vs_ort(diffusers_dir, models_root, out, cases, o)
    aesthetics = aesthetic_check(models_root, out, next(c for c in cases if c["name"] == "sdxl_img2img_euler_s0.75"),
                                 o["sdxl_img2img_euler_s0.75"])
    zero = zero_steps_check(models_root, out, cases[0])
    g.write_json(out / "cases.json", records)
    sensitivity = measure_sensitivity(models_root, out, cases, o)
    return {"records": records, "obs": o, "torch_vs_ort": torch_check, "aesthetics": aesthetics,
            "zero_steps": zero, "sensitivity": sensitivity}


def torch_vs_ort(diffusers_dir: Path, models_root: Path, ref_dir: Path, cases: list[dict], obs: dict) -> dict:
    """The torch pipelines on the same weights and draws: StableDiffusionInpaintPipeline from the diffusers
    directory sd-tiny-inpaint was exported from, and StableDiffusionImg2ImgPipeline / the 4-channel
    StableDiffusionInpaintPipeline on sd-tiny's weights rebuilt by generate.py's builders (in memory)."""
    out = {}
    tok = CLIPTokenizer.from_pretrained(str(models_root / "sd-tiny" / "tokenizer"))
    common = dict(vae=g.build_vae(), text_encoder=g.build_text_encoder(), tokenizer=tok, safety_checker=None,
                  feature_extractor=None, requires_safety_checker=False)
    sd_unet = g.build_unet()
    pipes = {
        "sd_inpaint9_euler_s0.75": StableDiffusionInpaintPipeline.from_pretrained(str(diffusers_dir), local_files_only=True),
        "sd_img2img_euler_s0.75": StableDiffusionImg2ImgPipeline(
            **common, unet=sd_unet, scheduler=PNDMScheduler.from_config(g.SD15_SCHEDULER)),
        "sd_inpaint4_euler_s0.75": StableDiffusionInpaintPipeline(
            **common, unet=sd_unet, scheduler=PNDMScheduler.from_config(g.SD15_SCHEDULER)),
    }
    for name, pipe in pipes.items():
        case = next(c for c in cases if c["name"] == name)
        o = obs[name]
        pipe.set_progress_bar_config(disable=True)
        cls, extra, _ = g.SAMPLERS[case["sampler"]]
        # the scheduler file of the ONNX layout (save_pretrained would have written every default, e.g.
        # timestep_spacing "leading", which changes Euler's timesteps)
        shipped = json.loads((models_root / case["model"] / "scheduler" / "scheduler_config.json").read_text())
        pipe.scheduler = cls.from_config(shipped, **extra)
        kwargs = dict(prompt=case["prompt"], negative_prompt=case["negative_prompt"],
                      image=load_png(ref_dir / case["init_image"], "RGB"), strength=case["strength"],
                      num_inference_steps=case["steps"], guidance_scale=case["guidance_scale"],
                      num_images_per_prompt=case["num_images"], output_type="latent")
        if case["mode"] == "inpaint":
            kwargs.update(mask_image=load_png(ref_dir / case["mask_image"], "L"), height=case["height"],
                          width=case["width"])
        with torch.no_grad(), injected_draws(o["image_noise_in"], o["latents_in"], o["noise_in"]) as draws:
            lat = pipe(**kwargs).images
        assert [d[0] for d in draws] == [d["role"] for d in o["draws"]], name
        d = float(np.abs(lat.numpy() - o["expected_latents"]).max())
        log.info("D. torch vs ORT (%s): max |latent diff| %.3g", name, d)
        assert d < 1e-3, (name, d)
        out[name] = float(f"{d:.2g}")
    return out


def aesthetic_check(models_root: Path, ref_dir: Path, case: dict, base: dict) -> dict:
    """What aesthetic_score / requires_aesthetics_score do to SDXL img2img's time_ids."""
    facts = {}
    inputs = {k: base[k] for k in ("image_noise_in", "latents_in", "noise_in")}
    other = run_case(models_root, ref_dir, {**case, "extra_kwargs": {"aesthetic_score": 9.0,
                                                                     "negative_aesthetic_score": 1.0}}, inputs)
    facts["aesthetic_score 9.0 / negative 1.0 with requires_aesthetics_score false"] = (
        "identical latents and time_ids" if np.array_equal(other["expected_latents"], base["expected_latents"])
        and other["time_ids"] == base["time_ids"] else "differs")
    assert facts["aesthetic_score 9.0 / negative 1.0 with requires_aesthetics_score false"].startswith("identical")
    # requires_aesthetics_score true: time_ids become (h, w, top, left, score): 5 values; the UNet wants 6
    pipe = load_pipeline(models_root, case)
    pipe.register_to_config(requires_aesthetics_score=True)
    rec = Recorder(pipe)
    try:
        with injected_draws(base["image_noise_in"], base["latents_in"], base["noise_in"]):
            pipe(prompt=case["prompt"], negative_prompt=case["negative_prompt"],
                 image=load_png(ref_dir / case["init_image"], "RGB"), strength=case["strength"],
                 num_inference_steps=case["steps"], guidance_scale=case["guidance_scale"], output_type="latent")
        result = "ran"
    except Exception as e:  # noqa: BLE001
        result = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        rec.close()
    fed = rec.calls["unet"][0]["feed"]["time_ids"] if rec.calls["unet"] else None
    facts["requires_aesthetics_score true (aesthetic_score 6.0, negative 2.5 defaults)"] = {
        "time_ids_fed": None if fed is None else [[float(x) for x in row] for row in fed],
        "result": result,
    }
    log.info("D. aesthetics: %s", facts)
    return facts


def zero_steps_check(models_root: Path, ref_dir: Path, case: dict) -> dict:
    """img2img with int(steps * strength) = 0: what diffusers does (no draws injected: any draw fails)."""
    pipe = load_pipeline(models_root, case)
    try:
        out = pipe(prompt=case["prompt"], image=load_png(ref_dir / case["init_image"], "RGB"), strength=0.1,
                   num_inference_steps=4, guidance_scale=case["guidance_scale"], output_type="latent")
        result = f"no error: output_type latent returned shape {list(out.images.shape)}"
    except Exception as e:  # noqa: BLE001
        result = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    log.info("D. img2img strength 0.1 x 4 steps (0 steps run): %s", result)
    return {"ORTStableDiffusionImg2ImgPipeline strength 0.1, 4 steps (steps_run 0)": result}


def measure_sensitivity(models_root: Path, ref_dir: Path, cases: list[dict], obs: dict) -> dict:
    """How much the final latents move when one input changes (mean / max |Δ|)."""
    by_name = {c["name"]: c for c in cases}

    def delta(a, b):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        return {"mean_abs": float(d.mean()), "max_abs": float(d.max())}

    out = {}
    for name in ("sd_img2img_euler_s0.75", "sd_inpaint9_euler_s0.75", "sd_inpaint4_euler_s0.75",
                 "sdxl_img2img_euler_s0.75"):
        base = obs[name]
        inputs = {k: base[k] for k in ("image_noise_in", "latents_in", "noise_in")}
        zero = run_case(models_root, ref_dir, by_name[name], {**inputs, "image_noise_in": np.zeros_like(inputs["image_noise_in"])})
        out[f"{name}: image_noise_in -> 0 (encoder mean instead of a sample)"] = delta(base["expected_latents"], zero["expected_latents"])
        rng = np.random.default_rng(99)
        other = run_case(models_root, ref_dir, by_name[name], {**inputs, "latents_in": rng.standard_normal(
            inputs["latents_in"].shape, dtype=np.float32)})
        out[f"{name}: other latents_in"] = delta(base["expected_latents"], other["expected_latents"])
        if by_name[name]["mode"] == "inpaint":
            flipped = run_case(models_root, ref_dir, by_name[name], inputs, mask_path=MASK_64_FLIPPED)
            out[f"{name}: mask flipped left-right"] = delta(base["expected_latents"], flipped["expected_latents"])
    a, b = obs["sd_img2img_euler_s0.75"], obs["sd_img2img_euler_s0.75_guidance1"]
    out["sd_img2img_euler_s0.75: guidance 7.5 -> 1.0"] = delta(a["expected_latents"], b["expected_latents"])
    for k, v in out.items():
        log.info("D. sensitivity %-80s mean %.4f max %.4f", k, v["mean_abs"], v["max_abs"])
    return out


# --------------------------------------------------------------------------------------------------
# Manifest, rerun check, README
# --------------------------------------------------------------------------------------------------


def build_manifest(models_root: Path, out_root: Path, tar_listing: list[dict], path: Path, extra: dict) -> dict:
    sessions = {}
    for part in PARTS:
        p = models_root / INPAINT_MODEL / part / "model.onnx"
        m = onnx.load(str(p), load_external_data=False)
        sessions[f"{INPAINT_MODEL}/{part}"] = {**g.onnx_io(p), "opset": [{"domain": o.domain, "version": o.version}
                                                                         for o in m.opset_import],
                                              "ir_version": m.ir_version}
    files = {}
    for rel in (TARBALL, SD_TARBALL, SDXL_TARBALL):
        files[rel] = {"size": (out_root / rel).stat().st_size, "sha256": g.sha256(out_root / rel)}
    ref = out_root / REF_DIR
    for p in sorted(ref.rglob("*")):
        if p.is_file() and p.name not in ("manifest.json", "README.md"):
            files[p.relative_to(out_root).as_posix()] = {"size": p.stat().st_size, "sha256": g.sha256(p)}
    g.write_json(path, {
        "generator": "scripts/sd-reference/images.py",
        "versions": g.versions(),
        "inputs_used": {SD_TARBALL: files[SD_TARBALL], SDXL_TARBALL: files[SDXL_TARBALL]},
        "onnx_sessions": sessions,
        "tarball_contents": tar_listing,
        "files": files,
        **extra,
    })
    return sessions


def write_readme(path: Path, info: dict) -> None:
    v = info["versions"]
    rr = info.get("rerun")
    recs = info["records"]
    sizes = info["sizes"]
    mf = info["mask_facts"]
    lines = [
        "# Image-to-image and inpainting reference outputs (tiny random-weight models)",
        "",
        "Made by `bash scripts/sd-reference/generate.sh --images` (runs `scripts/sd-reference/images.py`; a developer",
        "runs it once, the venv it needs is ~5 GB, so it is not part of CI). Do not edit these files by hand: rerun",
        "the script.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "## What is here",
        "",
        "- `../inpaint-tiny.tar.xz`: one Optimum ONNX layout `sd-tiny-inpaint/` (`model_index.json` with",
        "  `_class_name` StableDiffusionInpaintPipeline, `scheduler/` = SD 1.5's PNDM file as in sd-tiny,",
        "  `tokenizer/`, `text_encoder/`, `unet/`, `vae_decoder/`, `vae_encoder/`), exported with",
        "  `optimum-cli export onnx --task inpainting` (Python API `main_export`). Its UNet is generate.py's tiny",
        "  SD 1.x UNet with `in_channels` 9: `conv_in` = sd-tiny's weights for input channels 0-3 plus 5 seeded",
        "  random channels (mask, masked-image latents) on the same power-of-two grid; every other UNet weight,",
        "  the text encoder, the VAE and the tokenizer are sd-tiny's (checked against the committed",
        "  `../sd-tiny.tar.xz`, see `facts.shared_with_sd_tiny` in manifest.json).",
        "- The img2img and 4-channel inpainting cases run on the committed `../sd-tiny.tar.xz` (`sd-tiny/`, which",
        "  has `vae_encoder/`) and `../sdxl-tiny.tar.xz` (`sdxl-tiny/`), unchanged (their sha256 in manifest.json",
        "  `inputs_used`).",
        "- `inputs/`: the input images, made with numpy (no files from elsewhere) and written as PNG:",
        "  `init_64x64.png` and `init_96x64.png` (mode **RGB**, 8 bit: gradients, a disc, a rectangle, a",
        "  triangle, mild noise), `mask_64x64.png` (mode **L**, 8 bit: 255 = repaint, 0 = keep; a rectangle, an",
        "  ellipse and single-pixel probes, see below), `mask_64x64_flipped.png` (only used for the sensitivity",
        "  table). The pipelines got the PIL images read back from these files, at exactly the target size.",
        "- `cases.json`: one record per pipeline run in sdxl-reference's format plus:",
        "  `mode` (\"img2img\" | \"inpaint\"), `init_image`, `mask_image` (PNG paths relative to this directory; null",
        "  for img2img), `strength`, `steps_run`, `unet_in_channels`, `timesteps` (**the timesteps run**, not the",
        "  whole schedule as in sd-reference; that is `schedule_timesteps`), `begin_index` (index of the first",
        "  timestep run), `sigmas` (the scheduler's full sigma table where it has one), `draw_order` / `draws` (every",
        "  `randn_tensor` call, in order, with its role, shape and call site), `vae_encoder_inputs` (which image",
        "  each vae_encoder call got), `add_noise_calls` (timesteps and scheduler step_index of each",
        "  `scheduler.add_noise` call), and paths to:",
        "  - `image_noise_in.npy` [1, 4, h/8, w/8]: the VAE encoder's latent sampling draw",
        "    (`DiagonalGaussianDistribution.sample`); the **same** array is used for every encoder sample of the run",
        "    (init image and masked image);",
        "  - `latents_in.npy` [n, 4, h/8, w/8]: the noise of `prepare_latents`;",
        "  - `noise_in.npy` [draws, n, 4, h/8, w/8]: Euler-ancestral step noise in draw order (null otherwise);",
        "  - `init_latent_parameters.npy` [1, 8, h/8, w/8]: the vae_encoder's output `latent_parameters` for the init",
        "    image (null where the pipeline does not encode it: 9-channel inpainting at strength 1.0);",
        "  - `image_latents.npy` [1, 4, h/8, w/8]: `scaling_factor * (mean + std * image_noise_in)` of the init",
        "    image, as the pipeline computed it (null where not computed);",
        "  - `mask_latents.npy` [1, 1, h/8, w/8] (inpainting): the binarized mask downsampled to the latent grid;",
        "  - `masked_image_latent_parameters.npy` [1, 8, h/8, w/8] and `masked_image_latents.npy` [1, 4, h/8, w/8]",
        "    (inpainting): the same for the masked image (used by the 9-channel UNet only, computed by both);",
        "  - `first_unet_feed.npz`: the exact ONNX feed of the UNet's first call (`sample` with 9 channels for the",
        "    inpainting UNet, `timestep`, `encoder_hidden_states`, SDXL's `text_embeds` and `time_ids`);",
        "  - `expected_latents.npy` (`output_type=\"latent\"`: final latents, unscaled), `expected_images.npy`",
        "    (float32 NHWC in [0, 1]) and `image_N.png`.",
        "  SDXL cases also have `prompt_ids_2`, `negative_prompt_ids_2`, `force_zeros_for_empty_prompt`,",
        "  `requires_aesthetics_score` and `time_ids` (the rows the UNet got).",
        "- `manifest.json`: ONNX I/O of sd-tiny-inpaint's sessions, the tarball contents, size and sha256 of every",
        "  file, the checks against torch and sd-tiny, the SDXL aesthetic-score experiment, the sensitivity table.",
        "",
        "References are Optimum's `ORTStableDiffusionImg2ImgPipeline`, `ORTStableDiffusionInpaintPipeline`,",
        "`ORTStableDiffusionXLImg2ImgPipeline` and `ORTStableDiffusionXLInpaintPipeline` on the unpacked tarballs,",
        "CPU execution provider, one thread, `pipe.scheduler = Class.from_config(pipe.scheduler.config, **kwargs)`",
        "(generate.py's SAMPLERS table). Optimum's inpaint pipeline accepts the 4-channel sd-tiny UNet (diffusers'",
        "pipeline handles both 4 and 9 channels). The torch pipelines on the same weights and draws gave",
        "the same final latents within: " + ", ".join(f"`{k}` {val:g}" for k, val in info["torch_vs_ort"].items()) + ".",
        "",
        "## ONNX sessions of sd-tiny-inpaint (as onnxruntime reports them)",
        "",
    ]
    lines += sdxl.io_table(info["sessions"])
    lines += [
        "",
        "## Cases",
        "",
        "| case | mode | model | sampler | strength | steps run | timesteps run | guidance | size | n | draws | what it checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    abbrev = {"image_noise": "E", "latents": "L", "step_noise": "S"}
    for r in recs:
        ts = ", ".join(f"{t:g}" for t in r["timesteps"]) if len(r["timesteps"]) <= 6 else \
            f"{r['timesteps'][0]:g} … {r['timesteps'][-1]:g}"
        draws = "".join(abbrev[x] for x in r["draw_order"])
        lines.append(f"| `{r['name']}` | {r['mode']} | {r['model']} | {r['sampler']} × {r['steps']} | {r['strength']} | "
                     f"{r['steps_run']} | {ts} | {r['guidance_scale']} | {r['width']}×{r['height']} | {r['num_images']} | "
                     f"{draws} | {r['notes']} |")
    lines += [
        "",
        "Draws: E = VAE encoder sample (`image_noise_in`), L = `prepare_latents` noise (`latents_in`), S = step noise",
        "(`noise_in[k]`). Prompt \"" + PROMPT + "\", negative \"" + NEGATIVE_PROMPT + "\" (null = absent) everywhere.",
        "",
        "## Recipe: what diffusers " + v["diffusers"] + " does (checked by assertions in images.py)",
        "",
        "### Preprocessing",
        "- Image (`VaeImageProcessor`, `do_normalize`): PIL RGB → `np.array(img).astype(float32) / 255` → NCHW →",
        "  `2x - 1`. No RGB conversion (`do_convert_rgb` false: pass RGB). Resizing: sizes are floored to multiples",
        "  of 8 and the image is resized (Lanczos) to (height, width) only if it differs; these inputs are exactly the",
        "  target size, so no resize happens. SD/SDXL img2img take **no** height/width: the output size is the init",
        "  image's size.",
        "- Mask (`VaeImageProcessor(do_normalize=False, do_binarize=True, do_convert_grayscale=True)`):",
        "  `convert(\"L\")` → `/ 255` (float32) → binarize: `< 0.5 → 0`, `>= 0.5 → 1` (8-bit: 0..127 keep, 128..255",
        "  repaint) → [1, 1, h, w]. 1 = repaint.",
        "- Masked image: `init_image_normalized * (mask < 0.5)`: the repaint region becomes 0 (mid-grey in [-1, 1]).",
        "- Mask latents: `torch.nn.functional.interpolate(mask, size=(h/8, w/8))`, default mode **nearest**: latent",
        "  (i, j) = mask pixel (8i, 8j), the top-left pixel of each 8×8 block (not an average, not \"any\").",
        "  `mask_64x64.png` has probes, as (row, column): pixel (56, 0) = 128 → latent (7, 0) = 1; pixel (56, 8) =",
        "  127 → latent (7, 1) = 0; pixel (0, 56) = 200 → latent (0, 7) = 1; the block of latent (6, 5) is white",
        "  except its pixel (48, 40) → 0; the block of latent (0, 0) is black except its pixel (0, 0) → 1.",
        "  Latent mask (nearest), rows top to bottom:",
        "",
        "```",
    ]
    lines += ["".join(str(x) for x in row) for row in mf["mask_latent_nearest"]]
    lines += [
        "```",
        "",
        "### VAE encode",
        "- `vae_encoder(sample)` → `latent_parameters` [b, 8, h/8, w/8] = the raw encoder moments; channels 0-3 are",
        "  the mean, 4-7 the log-variance. `logvar = clamp(logvar, -30, 20)`, `std = exp(0.5 * logvar)`,",
        "  `x = mean + std * eps` with `eps` = `image_noise_in` (`randn_tensor(mean.shape)`, [1, 4, h/8, w/8]),",
        "  image latents = `scaling_factor * x` (0.18215 SD 1.x, 0.13025 SDXL, from vae_decoder/config.json; the",
        "  SDXL VAE has no latents_mean/std). Encoded once per image (batch 1), then repeated to n images.",
        "  With these random VAEs std is large (see the sensitivity table: using the mean instead of a sample moves",
        "  the final latents a lot); real SD VAEs have a small std but diffusers samples all the same.",
        "- The encoder is called for the init image (img2img always; inpainting when strength < 1 or the UNet",
        "  has 4 channels) and, for inpainting, for the masked image (always, also with a 4-channel UNet, whose",
        "  pipeline then does not use the result). Every call samples with the same `image_noise_in` here.",
        "",
        "### Timesteps and strength",
        "- `set_timesteps(steps)` as for text-to-image, then `steps_run = min(int(steps * strength), steps)`",
        "  (Python float: f64 multiply, truncation), `t_start = steps - steps_run`, timesteps run =",
        "  `scheduler.timesteps[t_start * order:]` (order 1 for Euler, Euler-a, DDIM and DPM++ 2M here), and",
        "  `scheduler.set_begin_index(t_start * order)`: the sigma/step index starts at `t_start`. Examples (4 steps):",
        "  Euler/Euler-a with SD 1.5's config (linspace) 999, 666, 333, 0 → 0.75 runs 666, 333, 0; 0.3 runs 0 only;",
        "  SDXL's Euler (leading, offset 1) 751, 501, 251, 1 → 0.75 runs 501, 251, 1; DDIM (leading) 751, 501,",
        "  251, 1 → 501, 251, 1; DPM++ 2M with SD 1.5's config (DPMSolver's default linspace spacing) — see",
        "  `sd_img2img_dpmpp_2m_s0.75` (`schedule_timesteps`, `timesteps`). DPM++ 2M keeps no history from the",
        "  skipped steps: the first step run is first order, then second order, the last step first order",
        "  (`final_sigmas_type` \"zero\"). Euler-a draws one step noise per step run.",
        "- `steps_run` < 1 is a ValueError in the inpaint pipelines; the img2img pipeline does not check it: "
        + info["zero_steps"]["ORTStableDiffusionImg2ImgPipeline strength 0.1, 4 steps (steps_run 0)"]
        + " (an empty batch: the first-timestep tensor is empty). Reject it.",
        "- Defaults if a caller leaves `strength` out: SD img2img 0.8, SDXL img2img 0.3, SD inpaint 1.0, SDXL",
        "  inpaint **0.9999** (so 4 steps run int(3.9996) = 3 and the latents start from the noised image, not",
        "  from pure noise). Every case here passes `strength` explicitly.",
        "",
        "### img2img (SD and SDXL)",
        "- `latents = scheduler.add_noise(image_latents, latents_in, t_first)`, also at strength 1.0 (no",
        "  multiplication by `init_noise_sigma`). With the scheduler's begin index set, add_noise uses",
        "  `sigmas[begin_index]`:",
        "  Euler / Euler-a: `x + sigma * noise`; DPM++: `alpha_t x + sigma_t noise`, `alpha_t = 1 / sqrt(sigma² + 1)`,",
        "  `sigma_t = sigma * alpha_t`; DDIM: `sqrt(abar_t) x + sqrt(1 - abar_t) noise` at the integer timestep.",
        "- Then the usual loop over the timesteps run: `scale_model_input` (Euler: `/ sqrt(sigma² + 1)`), CFG",
        "  batch `[uncond, cond]`, `step`. SDXL: `time_ids` = (h, w, 0, 0, h, w) with h, w from the latents × 8,",
        "  as in text-to-image.",
        "- SDXL `aesthetic_score` / `negative_aesthetic_score`: ignored while `requires_aesthetics_score` is false",
        "  (the pipeline's default; sdxl-tiny's model_index.json has no such key). With it true (a",
        "  model_index.json that sets it), time_ids = (orig h, orig w, top, left, aesthetic_score) and the",
        "  negative rows (…, negative_aesthetic_score): 5 values instead of 6, the embedding input shrinks by",
        "  `addition_time_embed_dim`, and sdxl-tiny's UNet (built for 6) fails in onnxruntime: see",
        "  `facts.sdxl_aesthetics` in manifest.json (time_ids fed [[64, 64, 0, 0, 2.5], [64, 64, 0, 0, 6]]).",
        "",
        "### Inpainting, 9-channel UNet",
        "- strength 1.0: `latents = latents_in * init_noise_sigma` (the init image is not encoded); strength < 1:",
        "  `latents = add_noise(image_latents, latents_in, t_first)` as img2img.",
        "- Each step: `x = scale_model_input(cat([latents] * 2 if CFG))`, UNet `sample` = `cat([x, mask_latents,",
        "  masked_image_latents], dim=1)` → channels 0-3 scaled latents, 4 the mask (1 = repaint), 5-8 the",
        "  masked-image latents (**not** scaled by `scale_model_input`); mask and masked-image latents are repeated",
        "  per image and doubled for CFG like the latents. No blending: `latents = step(...)`.",
        "",
        "### Inpainting, 4-channel UNet (SD and SDXL)",
        "- The init image is always encoded (`image_latents`), at any strength. strength 1.0:",
        "  `latents = latents_in * init_noise_sigma`; otherwise `add_noise(image_latents, latents_in, t_first)`.",
        "- Each step i (of the steps run) after `latents = step(...)`:",
        "  `x_known = add_noise(image_latents, latents_in, timesteps_run[i + 1])` for all but the last step (the",
        "  scheduler's step_index is then i + 1 of the run, i.e. `sigmas[begin_index + i + 1]`), `x_known =",
        "  image_latents` after the last step; `latents = (1 - m) * x_known + m * latents` with m =",
        "  `mask_latents` (first n rows; the CFG-doubled copy is halved). The same `latents_in` is the noise of",
        "  every add_noise. So the final latents equal `image_latents` exactly where m = 0 (asserted).",
        "- The decoded image is not pasted back onto the init image (diffusers only does that with",
        "  `padding_mask_crop`).",
        "",
        "## Sensitivity of the final latents (mean / max |Δ|)",
        "",
        "| change | mean abs | max abs |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {d['mean_abs']:.4f} | {d['max_abs']:.4f} |" for k, d in info["sensitivity"].items()]
    lines += [
        "",
        "## Tolerances",
        "",
        "For an independent implementation (Rust, onnxruntime): final latents within 1e-3 absolute, float images",
        "within 1e-3, PNGs ±1 level; token ids, timesteps run, `steps_run`, `time_ids` and `mask_latents` exact;",
        "`image_latents`, `masked_image_latents` and the first UNet feed within 1e-4.",
        "",
        "## Sizes",
        "",
        "| file | bytes |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {val:,} |" for k, val in sizes.items()]
    lines += ["", "## Rerun determinism", ""]
    lines += g.rerun_lines("images.py", rr)
    lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------------------------------


def main() -> None:
    args, out_root, work, t0 = g.script_start(__doc__, "image-reference-")
    for rel in (SD_TARBALL, SDXL_TARBALL):
        assert (out_root / rel).is_file(), f"{rel} missing: run generate.sh (and --sdxl) first"

    ref_dir = out_root / REF_DIR
    if ref_dir.exists():
        shutil.rmtree(ref_dir)
    ref_dir.mkdir(parents=True)
    mask_facts = build_inputs(ref_dir)
    built = build_models(work, out_root)
    refs = build_references(built["models_root"], ref_dir, built["diffusers_dir"])
    facts = {"shared_with_sd_tiny": built["shared"], "torch_vs_ort_max_abs_latent_diff": refs["torch_vs_ort"],
             "sdxl_aesthetics": refs["aesthetics"], "img2img_zero_steps": refs["zero_steps"], "mask": mask_facts}
    sessions = build_manifest(built["models_root"], out_root, built["tar_listing"], ref_dir / "manifest.json",
                              {"facts": facts, "sensitivity": refs["sensitivity"]})
    sizes = {TARBALL: (out_root / TARBALL).stat().st_size,
             REF_DIR + "/ (all files but README.md)": sum(p.stat().st_size for p in ref_dir.rglob("*")
                                                          if p.is_file() and p.name != "README.md")}
    info = {"versions": g.versions(), "records": refs["records"], "torch_vs_ort": refs["torch_vs_ort"],
            "sessions": sessions, "sensitivity": refs["sensitivity"], "sizes": sizes, "mask_facts": mask_facts,
            "zero_steps": refs["zero_steps"]}
    if args.rerun_check:
        # The rerun reads the committed sd-tiny / sdxl-tiny tarballs from copies in its output root.
        info["rerun"] = g.rerun_check_of(__file__, out_root, work, OUTPUT_PATHS, log, (SD_TARBALL, SDXL_TARBALL))
    write_readme(ref_dir / "README.md", info)
    log.info("done in %.0f s", time.time() - t0)
    for k, val in sizes.items():
        log.info("  %10d  %s", val, k)
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
