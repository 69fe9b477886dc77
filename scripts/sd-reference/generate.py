#!/usr/bin/env python3
"""Tiny random-weight Stable Diffusion fixtures and reference outputs for Sluice's diffusion worker.

No pretrained text-to-image weights can be installed on the project machines, so the Rust pipeline is
tested against the reference implementation (diffusers + Optimum's ONNX Runtime pipelines) on a
tiny SD 1.x-shaped model with random weights that this script builds from configs. Run it through
generate.sh (which makes the venv); it is a one-off developer tool, not part of CI.

Steps (one function each, in this order):
  A. tokenizer      the real CLIP BPE vocabulary (open_clip's bpe_simple_vocab_16e6.txt.gz) written as
                    the HF CLIPTokenizer files SD 1.x ships (vocab.json, merges.txt,
                    tokenizer_config.json, special_tokens_map.json); checked with the slow tokenizer.
  B. models         CLIPTextModel / UNet2DConditionModel / AutoencoderKL from tiny configs, seeded,
                    weights rounded to a coarse power-of-two grid per tensor so that the ONNX files
                    compress (still random: outputs depend on prompt, guidance and seed), saved as
                    diffusers pipelines and exported with optimum (`--task text-to-image`):
                      sd-tiny           StableDiffusionPipeline, PNDM scheduler config as SD 1.5 ships
                      sd-tiny-lcm       LatentConsistencyModelPipeline: the same weights plus
                                        time_cond_proj_dim=32 (ONNX unet input `timestep_cond`)
                      sd-tiny-external  sd-tiny with unet/model.onnx saved with external data
                                        (model.onnx + model.onnx_data, as real SD UNets are)
                    packed into integration-tests/fixtures/sd-tiny.tar.xz (xz -9e equivalent).
  C. schedulers     worker/src/models/diffusion/testdata/schedulers.json: timesteps, sigmas and full
                    denoising traces of diffusers' schedulers on synthetic data (no model).
  D. references     integration-tests/fixtures/sd-reference/: ORTStableDiffusionPipeline /
                    ORTLatentConsistencyModelPipeline runs on the unpacked tarball with fixed initial
                    latents and fixed per-step noise (cases.json, .npy, .png), tokens.json,
                    manifest.json (ONNX I/O, file sizes), README.md.
  E. rerun check    (--rerun-check) the whole script again in a fresh process into a scratch output
                    root; every output file is compared and the result goes into the README.

Determinism: every random draw is seeded (torch.manual_seed per model, numpy default_rng per case),
ONNX Runtime and torch run with one thread, the tarball has fixed order/mtime/owners, PNGs and JSON
are written deterministically. The rerun check reports whether a second run gave identical bytes.

Usage: generate.py --out REPO_ROOT [--work DIR] [--rerun-check]
Needs HF_HUB_OFFLINE=1 (set by generate.sh); never touches the network or a model hub.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import logging
import lzma
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

import diffusers  # noqa: E402
import transformers  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    LatentConsistencyModelPipeline,
    LCMScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer  # noqa: E402
from transformers.models.clip.tokenization_clip import bytes_to_unicode  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Fixed inputs
# --------------------------------------------------------------------------------------------------

PROMPT = "a photo of an astronaut riding a horse on mars"
PROMPT_IDS = [49406, 320, 1125, 539, 550, 18376, 6765, 320, 4558, 525, 7496, 49407]
NEGATIVE_PROMPT = "blurry, low quality"
LONG_PROMPT = (
    "a highly detailed oil painting of an old lighthouse on a rocky cliff above a stormy sea at dusk, "
    "dramatic clouds, crashing waves, seagulls circling the lantern room, warm light spilling from the "
    "windows, a small wooden boat pulled up on the pebble beach below, fishermen's nets drying on "
    "posts, wet rocks shining in the last light, by a romantic era landscape painter, museum quality, "
    "rich textures, visible brush strokes, golden hour, volumetric fog rolling in from the horizon"
)

TOKEN_PROMPTS = [
    PROMPT,
    "",
    "cat",
    "A Photo Of An ASTRONAUT",
    "a   photo    of  an\tastronaut\n riding",
    "  leading and trailing spaces  ",
    "don't stop, won't stop; it's fine",
    "hello, world! what's up?",
    "3 cats and 42 dogs in 1999 (version 2.0)",
    "1234567890",
    "a red apple + a green pear = fruit salad #food @home",
    "portrait, 8k, ultra-detailed, trending on artstation",
    "low-poly 3d render of a fox; isometric view",
    "\"quoted text\" and 'single quotes'",
    "snake_case_words and CamelCaseWords",
    "email me at someone@example.com or visit example.org/path?x=1",
    "<|startoftext|> literal special tokens <|endoftext|>",
    "...!!!???",
    NEGATIVE_PROMPT,
    " ".join([f"word{i}" if i % 7 == 0 else w for i, w in enumerate((
        "the quick brown fox jumps over the lazy dog while a gentle breeze moves the tall grass "
    ).split() * 10)][:100]),
    LONG_PROMPT,
]

# SD 1.5's scheduler/scheduler_config.json (PNDM), with prediction_type spelled out. No
# timestep_spacing key: each sampler class falls back to its own default.
SD15_SCHEDULER = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.6.0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}

# Scheduler configuration variants used by the scheduler fixtures and some pipeline cases.
SCHEDULER_CONFIGS = {
    "sd15": SD15_SCHEDULER,
    "sd15_linspace": {**SD15_SCHEDULER, "timestep_spacing": "linspace"},
    "sd15_leading": {**SD15_SCHEDULER, "timestep_spacing": "leading"},
    "sd15_trailing": {**SD15_SCHEDULER, "timestep_spacing": "trailing"},
    "vpred_zero_snr": {
        **SD15_SCHEDULER,
        "prediction_type": "v_prediction",
        "timestep_spacing": "trailing",
        "rescale_betas_zero_snr": True,
    },
    "sd21_vpred": {
        "_class_name": "DDIMScheduler",
        "_diffusers_version": "0.10.0.dev0",
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "clip_sample": False,
        "num_train_timesteps": 1000,
        "prediction_type": "v_prediction",
        "set_alpha_to_one": False,
        "skip_prk_steps": True,
        "steps_offset": 1,
        "timestep_spacing": "leading",
        "trained_betas": None,
    },
    "linear_betas": {
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "beta_start": 0.0001,
        "num_train_timesteps": 1000,
        "prediction_type": "epsilon",
        "steps_offset": 0,
    },
    "sd_turbo": {
        "_class_name": "EulerDiscreteScheduler",
        "_diffusers_version": "0.24.0.dev0",
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "clip_sample": False,
        "interpolation_type": "linear",
        "num_train_timesteps": 1000,
        "prediction_type": "epsilon",
        "sample_max_value": 1.0,
        "set_alpha_to_one": False,
        "skip_prk_steps": True,
        "steps_offset": 1,
        "timestep_spacing": "trailing",
        "trained_betas": None,
        "use_karras_sigmas": False,
    },
}

# LCM-distilled checkpoints ship an LCMScheduler config like this one.
LCM_SCHEDULER = {
    "_class_name": "LCMScheduler",
    "_diffusers_version": "0.22.0.dev0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "clip_sample_range": 1.0,
    "num_train_timesteps": 1000,
    "original_inference_steps": 50,
    "prediction_type": "epsilon",
    "rescale_betas_zero_snr": False,
    "set_alpha_to_one": True,
    "steps_offset": 1,
    "thresholding": False,
    "timestep_scaling": 10.0,
    "timestep_spacing": "leading",
    "trained_betas": None,
}

# sampler name -> (class, extra from_config kwargs, extra step kwargs)
SAMPLERS = {
    "euler": (EulerDiscreteScheduler, {}, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}, {}),
    "ddim": (DDIMScheduler, {}, {"eta": 0.0}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}, {}),
    "dpmpp_2m_karras": (
        DPMSolverMultistepScheduler,
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True},
        {},
    ),
    "lcm": (LCMScheduler, {}, {}),
}
NOISY_SAMPLERS = {"euler_a", "lcm"}
SCHEDULER_STEPS = [1, 2, 4, 20, 25]
TRACE_SHAPE = (2, 4, 2, 2)

# Tiny model configs (SD 1.x structure: VAE scale factor 8, cross-attention, CLIP text encoder).
TEXT_ENCODER_CONFIG = dict(
    vocab_size=49408,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    projection_dim=32,
    layer_norm_eps=1e-5,
    # as in SD 1.x's text_encoder/config.json (the legacy CLIP ids; the pooled output then takes the
    # argmax of input_ids, i.e. the first <|endoftext|>, which SD 1.x does not use anyway)
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
UNET_CONFIG = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=32,
)
LCM_TIME_COND_PROJ_DIM = 32
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 16, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=64,
    scaling_factor=0.18215,
)
# Weights are rounded to a grid of 2**round(log2(std/QUANT_DIVISOR)) per tensor.
QUANT_DIVISOR = 4.0

MODEL_NAMES = ["sd-tiny", "sd-tiny-lcm", "sd-tiny-external"]
TAR_MTIME = 1767225600  # 2026-01-01T00:00:00Z

log = logging.getLogger("sd-reference")


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def setup_determinism() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore")
    for name in ("diffusers", "transformers", "optimum", "torch.onnx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def json_clean(x):
    """Non-finite floats (e.g. DPMSolver's default lambda_min_clipped = -inf) as the strings
    "NaN" / "Infinity" / "-Infinity": strict JSON parsers (serde_json) reject bare NaN/Infinity."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {k: json_clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_clean(v) for v in x]
    return x


def write_json(path: Path, obj, indent: int | None = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_clean(obj), indent=indent, ensure_ascii=False, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def f32(values) -> list[float]:
    """float32 values as the Python floats of their shortest float32 decimal form, so that JSON holds
    e.g. 0.1 instead of 0.10000000149011612. Parsing the text as f64 and rounding to f32 (or parsing
    straight to f32) gives back exactly the float32 value; this is checked."""
    arr = np.asarray(values, dtype=np.float32).reshape(-1)
    out = [float(str(v)) for v in arr]
    back = np.array(out, dtype=np.float64).astype(np.float32)
    assert np.array_equal(back, arr, equal_nan=True)
    return out


def plain_config(config) -> dict:
    """A scheduler/model config as a plain JSON-able dict, without diffusers' bookkeeping keys."""
    out = {}
    for k, v in dict(config).items():
        if k == "_use_default_values":
            continue
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, np.ndarray):
            v = v.tolist()
        out[k] = v
    return dict(sorted(out.items()))


def onnx_io(path: Path) -> dict:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def describe(args):
        return [{"name": a.name, "type": a.type, "shape": list(a.shape)} for a in args]

    return {"inputs": describe(sess.get_inputs()), "outputs": describe(sess.get_outputs())}


def cpu_session_options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return so


# --------------------------------------------------------------------------------------------------
# A. Tokenizer
# --------------------------------------------------------------------------------------------------


def clip_bpe_merges() -> list[tuple[str, str]]:
    """The merges of CLIP's BPE, read exactly as CLIP's simple_tokenizer does."""
    import open_clip

    path = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    lines = gzip.open(path).read().decode("utf-8").split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]
    return [tuple(m.split()) for m in merges]


def build_tokenizer(out_dir: Path) -> dict:
    merges = clip_bpe_merges()
    assert len(merges) == 48894, len(merges)
    byte_symbols = list(bytes_to_unicode().values())
    vocab = byte_symbols + [s + "</w>" for s in byte_symbols] + ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab) == 49408 and len(set(vocab)) == 49408
    encoder = {tok: i for i, tok in enumerate(vocab)}
    assert encoder["<|startoftext|>"] == 49406 and encoder["<|endoftext|>"] == 49407

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(encoder, ensure_ascii=False), encoding="utf-8")
    with open(out_dir / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")

    def added(content):
        return {"content": content, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}

    # As SD 1.x (runwayml/stable-diffusion-v1-5, CompVis) ship them (hub names left out).
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "bos_token": {"__type": "AddedToken", **added("<|startoftext|>")},
            "do_lower_case": True,
            "eos_token": {"__type": "AddedToken", **added("<|endoftext|>")},
            "errors": "replace",
            "model_max_length": 77,
            "pad_token": "<|endoftext|>",
            "tokenizer_class": "CLIPTokenizer",
            "unk_token": {"__type": "AddedToken", **added("<|endoftext|>")},
        },
    )
    write_json(
        out_dir / "special_tokens_map.json",
        {
            "bos_token": added("<|startoftext|>"),
            "eos_token": added("<|endoftext|>"),
            "pad_token": "<|endoftext|>",
            "unk_token": added("<|endoftext|>"),
        },
    )

    tok = CLIPTokenizer.from_pretrained(str(out_dir))
    ids = tok(PROMPT).input_ids
    assert ids == PROMPT_IDS, ids
    assert tok.model_max_length == 77 and tok.pad_token_id == 49407 and tok.bos_token_id == 49406
    log.info("A. tokenizer: %d tokens, %d merges, %r -> %s", len(vocab), len(merges), PROMPT, ids)
    return {"vocab_size": len(vocab), "merges": len(merges)}


# --------------------------------------------------------------------------------------------------
# B. Models, export, packing
# --------------------------------------------------------------------------------------------------


def quantize_(module: torch.nn.Module) -> dict:
    """Rounds each parameter to a power-of-two grid near std/QUANT_DIVISOR (in place).

    Constant tensors (norm weights 1, zero biases) stay as they are; no tensor becomes all-zero.
    Random float32 weights don't compress; weights on a coarse grid compress ~6-8x with xz."""
    n_quant = n_const = 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            x = p.data
            std = float(x.float().std()) if x.numel() > 1 else 0.0
            if std == 0.0:
                n_const += 1
                continue
            q = 2.0 ** round(math.log2(std / QUANT_DIVISOR))
            y = torch.round(x / q) * q
            assert bool((y != 0).any()), f"{name} would become all-zero"
            p.data.copy_(y)
            n_quant += 1
    return {"quantized_tensors": n_quant, "constant_tensors": n_const}


def build_text_encoder() -> CLIPTextModel:
    torch.manual_seed(0)
    model = CLIPTextModel(CLIPTextConfig(**TEXT_ENCODER_CONFIG)).eval()
    quantize_(model)
    return model


def build_unet() -> UNet2DConditionModel:
    torch.manual_seed(1)
    model = UNet2DConditionModel(**UNET_CONFIG).eval()
    quantize_(model)
    return model


def build_lcm_unet(base: UNet2DConditionModel) -> UNet2DConditionModel:
    """The base UNet's weights plus a guidance-embedding projection (time_cond_proj_dim), as an
    LCM-distilled UNet has. Sharing the other weights keeps the tarball small (xz dedupes)."""
    model = UNet2DConditionModel(**UNET_CONFIG, time_cond_proj_dim=LCM_TIME_COND_PROJ_DIM).eval()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert missing == ["time_embedding.cond_proj.weight"] and not unexpected, (missing, unexpected)
    torch.manual_seed(3)
    with torch.no_grad():
        w = model.time_embedding.cond_proj.weight
        w.copy_(torch.randn_like(w) * (1.0 / math.sqrt(w.shape[1])))
    quantize_(model.time_embedding.cond_proj)
    return model


def build_vae() -> AutoencoderKL:
    torch.manual_seed(2)
    model = AutoencoderKL(**VAE_CONFIG).eval()
    quantize_(model)
    return model


def save_diffusers_pipelines(work: Path, tokenizer_dir: Path) -> dict[str, Path]:
    tokenizer = CLIPTokenizer.from_pretrained(str(tokenizer_dir))
    text_encoder = build_text_encoder()
    unet = build_unet()
    vae = build_vae()
    lcm_unet = build_lcm_unet(unet)
    common = dict(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, safety_checker=None, feature_extractor=None
    )
    dirs = {"sd-tiny": work / "diffusers" / "sd-tiny", "sd-tiny-lcm": work / "diffusers" / "sd-tiny-lcm"}
    StableDiffusionPipeline(
        **common, unet=unet, scheduler=PNDMScheduler.from_config(SD15_SCHEDULER), requires_safety_checker=False
    ).save_pretrained(str(dirs["sd-tiny"]))
    LatentConsistencyModelPipeline(
        **common, unet=lcm_unet, scheduler=LCMScheduler.from_config(LCM_SCHEDULER), requires_safety_checker=False
    ).save_pretrained(str(dirs["sd-tiny-lcm"]))
    n_params = {
        "text_encoder": sum(p.numel() for p in text_encoder.parameters()),
        "unet": sum(p.numel() for p in unet.parameters()),
        "unet_lcm": sum(p.numel() for p in lcm_unet.parameters()),
        "vae": sum(p.numel() for p in vae.parameters()),
    }
    log.info("B. diffusers pipelines saved; parameters: %s", n_params)
    return dirs


def export_onnx(diffusers_dir: Path, out_dir: Path) -> None:
    """`optimum-cli export onnx -m DIR --task text-to-image OUT`, through the Python API."""
    from optimum.exporters.onnx import main_export

    t0 = time.time()
    main_export(
        model_name_or_path=str(diffusers_dir),
        output=str(out_dir),
        task="text-to-image",
        library_name="diffusers",
        device="cpu",
        local_files_only=True,
        do_validation=True,
    )
    log.info("B. exported %s in %.1f s", out_dir.name, time.time() - t0)


def set_name_or_path(model_dir: Path) -> None:
    """The export writes the absolute path of the diffusers directory it read into `_name_or_path`;
    replace it by the model's name (keeps the fixtures free of build paths and reproducible)."""
    for path in [model_dir / "model_index.json", *sorted(model_dir.glob("*/config.json"))]:
        config = json.loads(path.read_text())
        if "_name_or_path" in config:
            sub = path.parent.relative_to(model_dir).as_posix()
            config["_name_or_path"] = model_dir.name if sub == "." else f"{model_dir.name}/{sub}"
            # diffusers' own formatting (ConfigMixin.to_json_string)
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def finish_layout(out_dir: Path, tokenizer_dir: Path, scheduler_config: dict) -> None:
    """Replaces what the export re-saved by the files the real checkpoints ship: the scheduler
    config (SD 1.5's has no timestep_spacing key, diffusers' save_pretrained writes every default)
    and the SD 1.x tokenizer files (transformers re-saves them in its newer format)."""
    write_json(out_dir / "scheduler" / "scheduler_config.json", scheduler_config)
    shutil.rmtree(out_dir / "tokenizer")
    shutil.copytree(tokenizer_dir, out_dir / "tokenizer")
    set_name_or_path(out_dir)


def make_external(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    set_name_or_path(dst)
    path = dst / "unet" / "model.onnx"
    model = onnx.load(str(path))
    path.unlink()
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx_data",
        size_threshold=0,
    )
    # same outputs as the inline model
    rng = np.random.default_rng(11)
    feed = {
        "sample": rng.standard_normal((2, 4, 8, 8), dtype=np.float32),
        "timestep": np.array(500.0, dtype=np.float32),
        "encoder_hidden_states": rng.standard_normal((2, 77, 32), dtype=np.float32),
    }
    a = ort.InferenceSession(str(src / "unet" / "model.onnx"), cpu_session_options(), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(path), cpu_session_options(), providers=["CPUExecutionProvider"])
    out_a, out_b = a.run(None, feed)[0], b.run(None, feed)[0]
    assert np.array_equal(out_a, out_b), float(np.abs(out_a - out_b).max())
    log.info("B. external-data unet: identical output to the inline one")


def pack_tarball(models_dir: Path, tar_path: Path, names: list[str] = MODEL_NAMES) -> list[dict]:
    """tar of the model directories `names` (generate.py's three by default; sdxl.py and images.py
    pack theirs), identical files next to each other, fixed metadata, compressed like `xz -9e`
    (single-threaded, so the bytes are reproducible)."""
    entries = []  # (sort key, arcname, path)
    for variant, name in enumerate(names):
        root = models_dir / name
        entries.append(((0, "", variant), name, root))
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            entries.append(((0 if p.is_dir() else 1, rel, variant), f"{name}/{rel}", p))
    entries.sort(key=lambda e: e[0])

    def info(arcname: str, path: Path) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(arcname)
        ti.mtime = TAR_MTIME
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        if path.is_dir():
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
        else:
            ti.size, ti.mode = path.stat().st_size, 0o644
        return ti

    tar_path.parent.mkdir(parents=True, exist_ok=True)
    listing = []
    with lzma.open(tar_path, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME) as xz:
        with tarfile.open(fileobj=xz, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
            for _, arcname, path in entries:
                ti = info(arcname, path)
                if path.is_dir():
                    tar.addfile(ti)
                else:
                    with open(path, "rb") as f:
                        tar.addfile(ti, f)
                    listing.append({"path": arcname, "size": ti.size, "sha256": sha256(path)})
    log.info("B. packed %s: %d bytes", tar_path, tar_path.stat().st_size)
    return listing


def build_models(work: Path, tar_path: Path) -> dict:
    tokenizer_dir = work / "tokenizer"
    tok_info = build_tokenizer(tokenizer_dir)
    diff_dirs = save_diffusers_pipelines(work, tokenizer_dir)
    onnx_root = work / "onnx"
    export_onnx(diff_dirs["sd-tiny"], onnx_root / "sd-tiny")
    export_onnx(diff_dirs["sd-tiny-lcm"], onnx_root / "sd-tiny-lcm")
    finish_layout(onnx_root / "sd-tiny", tokenizer_dir, SD15_SCHEDULER)
    finish_layout(onnx_root / "sd-tiny-lcm", tokenizer_dir, LCM_SCHEDULER)
    lcm_inputs = [i.name for i in ort.InferenceSession(str(onnx_root / "sd-tiny-lcm" / "unet" / "model.onnx")).get_inputs()]
    assert "timestep_cond" in lcm_inputs, lcm_inputs
    make_external(onnx_root / "sd-tiny", onnx_root / "sd-tiny-external")
    listing = pack_tarball(onnx_root, tar_path)

    # Everything downstream runs on the unpacked tarball, i.e. on exactly what is committed.
    unpacked = work / "unpacked"
    if unpacked.exists():
        shutil.rmtree(unpacked)
    unpacked.mkdir()
    with tarfile.open(tar_path, "r:xz") as tar:
        tar.extractall(unpacked, filter="data")
    return {"tokenizer": tok_info, "tar_listing": listing, "models_root": unpacked}


# --------------------------------------------------------------------------------------------------
# Noise injection (used by C and D)
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def injected_noise(scheduler_cls, noise: np.ndarray | None):
    """Replaces `randn_tensor` in the scheduler's module: the k-th draw returns noise[k].
    A draw beyond the supplied noise (or any draw when noise is None) fails loudly."""
    module = sys.modules[scheduler_cls.__module__]
    original = getattr(module, "randn_tensor", None)
    draws: list[tuple] = []

    def fake_randn(shape, generator=None, device=None, dtype=None, layout=None, **_kw):
        k = len(draws)
        if noise is None or k >= len(noise):
            raise AssertionError(f"{scheduler_cls.__name__}: unexpected noise draw #{k} of shape {tuple(shape)}")
        assert tuple(noise[k].shape) == tuple(shape), (noise[k].shape, shape)
        draws.append(tuple(shape))
        return torch.from_numpy(np.array(noise[k], dtype=np.float32)).to(dtype=dtype or torch.float32)

    if original is not None:
        module.randn_tensor = fake_randn
    try:
        yield draws
    finally:
        if original is not None:
            module.randn_tensor = original


# --------------------------------------------------------------------------------------------------
# C. Scheduler fixtures
# --------------------------------------------------------------------------------------------------


def scheduler_trace(sampler: str, config_name: str, steps: int, inputs: dict) -> dict:
    cls, extra, step_kwargs = SAMPLERS[sampler]
    config = SCHEDULER_CONFIGS[config_name]
    entry = {"sampler": sampler, "config_name": config_name, "steps": steps, "class": cls.__name__,
             "from_config_kwargs": extra, "step_kwargs": step_kwargs}
    try:
        sched = cls.from_config(config, **extra)
        cfg = dict(sched.config)
        entry["config"] = plain_config(cfg)
        entry["defaults_used"] = sorted(cfg.get("_use_default_values", []))
        accepted = set(cls._get_init_keys(cls))
        entry["ignored_config_keys"] = sorted(k for k in config if not k.startswith("_") and k not in accepted)
        sched.set_timesteps(steps)
        ts = sched.timesteps
        entry["timesteps_dtype"] = str(ts.dtype).replace("torch.", "")
        entry["timesteps"] = [float(t) if ts.is_floating_point() else int(t) for t in ts]
        if hasattr(sched, "sigmas") and sched.sigmas is not None:
            entry["sigmas"] = f32(sched.sigmas.numpy())
        entry["init_noise_sigma"] = float(sched.init_noise_sigma)
        entry["order"] = sched.order

        sample0 = torch.from_numpy(np.array(inputs["sample"], dtype=np.float32).reshape(TRACE_SHAPE))
        sample = sample0 * sched.init_noise_sigma  # as the pipeline's prepare_latents does
        entry["initial_sample"] = f32(sample.numpy())
        noise = np.array(inputs["noises"], dtype=np.float32).reshape((-1, *TRACE_SHAPE))
        trace = entry["trace"] = []  # kept up to the failing step if a step raises
        with injected_noise(cls, noise if sampler in NOISY_SAMPLERS else None) as draws:
            for i, t in enumerate(ts):
                scaled = sched.scale_model_input(sample, t)
                model_output = torch.from_numpy(np.array(inputs["model_outputs"][i], dtype=np.float32).reshape(TRACE_SHAPE))
                out = sched.step(model_output, t, sample, return_dict=True, **step_kwargs)
                step = {"t": float(t) if ts.is_floating_point() else int(t)}
                if not torch.equal(scaled, sample):
                    step["scaled_model_input"] = f32(scaled.numpy())
                step["prev_sample"] = f32(out.prev_sample.numpy())
                if getattr(out, "denoised", None) is not None:
                    step["denoised"] = f32(out.denoised.numpy())
                elif getattr(out, "pred_original_sample", None) is not None:
                    step["pred_original_sample"] = f32(out.pred_original_sample.numpy())
                trace.append(step)
                sample = out.prev_sample
        entry["noise_draws"] = len(draws)
        entry["finite"] = bool(all(np.isfinite(np.asarray(s["prev_sample"])).all() for s in trace))
    except Exception as e:  # a class rejecting a combination is a result too
        entry["error"] = f"{type(e).__name__}: {e}"
        if entry.get("trace"):
            entry["error"] += f" (at step {len(entry['trace'])}; the trace holds the steps before it)"
    return entry


def dump_compact(obj) -> str:
    """Compact JSON, one scheduler entry per line; non-finite floats become strings."""
    obj = json_clean(obj)
    lines = ["{"]
    for k, v in obj.items():
        if k != "entries":
            lines.append(json.dumps(k) + ":" + json.dumps(v, separators=(",", ":"), allow_nan=False) + ",")
    lines.append(json.dumps("entries") + ":[")
    entries = obj["entries"]
    for i, e in enumerate(entries):
        lines.append(json.dumps(e, separators=(",", ":"), allow_nan=False) + ("," if i + 1 < len(entries) else ""))
    lines.append("]}")
    return "\n".join(lines) + "\n"


def build_scheduler_fixtures(path: Path) -> dict:
    rng = np.random.default_rng(20260101)
    max_steps = max(SCHEDULER_STEPS)
    inputs = {
        "shape": list(TRACE_SHAPE),
        "sample": f32(rng.standard_normal(TRACE_SHAPE, dtype=np.float32)),
        "model_outputs": [f32(rng.standard_normal(TRACE_SHAPE, dtype=np.float32)) for _ in range(max_steps)],
        "noises": [f32(rng.standard_normal(TRACE_SHAPE, dtype=np.float32)) for _ in range(max_steps)],
    }
    entries = []
    for sampler in SAMPLERS:
        for config_name in SCHEDULER_CONFIGS:
            for steps in SCHEDULER_STEPS:
                entries.append(scheduler_trace(sampler, config_name, steps, inputs))
    alphas = {}
    for config_name, config in SCHEDULER_CONFIGS.items():
        alphas[config_name] = f32(DDIMScheduler.from_config(config).alphas_cumprod.numpy())
    doc = {
        "description": (
            "diffusers " + diffusers.__version__ + " scheduler references made by scripts/sd-reference/generate.py. "
            "Each entry: scheduler = Class.from_config(configs[config_name], **from_config_kwargs); "
            "set_timesteps(steps); sample = inputs.sample * init_noise_sigma (float32, = initial_sample); then for "
            "step i with timestep t: scaled_model_input = scale_model_input(sample, t) (omitted when it returns "
            "the sample unchanged), model_output = inputs.model_outputs[i], out = step(model_output, t, sample, "
            "**step_kwargs), sample = out.prev_sample. Ancestral/LCM noise: the k-th randn draw (in draw order) is "
            "inputs.noises[k]; noise_draws says how many were used. All tensors are float32 of shape inputs.shape, "
            "flattened row-major. 'denoised' is LCM's denoised output, 'pred_original_sample' the x0 estimate "
            "where the class returns one. 'config' is scheduler.config after from_config (defaults filled in), "
            "'defaults_used' the keys that took the class default, 'ignored_config_keys' the keys of the given "
            "config that the class does not accept (dropped silently by from_config). An entry with 'error' "
            "records that the class rejected the combination. alphas_cumprod[config_name] is DDIMScheduler's "
            "(no zero-SNR clamp). Non-finite floats are written as the strings \"NaN\", \"Infinity\", \"-Infinity\"."
        ),
        "diffusers_version": diffusers.__version__,
        "torch_version": torch.__version__,
        "configs": SCHEDULER_CONFIGS,
        "samplers": {k: {"class": v[0].__name__, "from_config_kwargs": v[1], "step_kwargs": v[2]} for k, v in SAMPLERS.items()},
        "inputs": inputs,
        "alphas_cumprod": alphas,
        "entries": entries,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_compact(doc), encoding="utf-8")
    errors = [(e["sampler"], e["config_name"], e["steps"], e["error"]) for e in entries if "error" in e]
    log.info("C. %s: %d entries, %d errors, %d bytes", path, len(entries), len(errors), path.stat().st_size)
    return {"entries": len(entries), "errors": errors,
            "noise_draws": {(e["sampler"], e["steps"]): e.get("noise_draws") for e in entries
                            if e["sampler"] in NOISY_SAMPLERS and e["config_name"] == "sd15"}}


# --------------------------------------------------------------------------------------------------
# D. Pipeline references
# --------------------------------------------------------------------------------------------------


def load_pipeline(model_dir: Path):
    from optimum.onnxruntime import ORTLatentConsistencyModelPipeline, ORTStableDiffusionPipeline

    index = json.loads((model_dir / "model_index.json").read_text())
    cls = ORTLatentConsistencyModelPipeline if index["_class_name"] == "LatentConsistencyModelPipeline" else ORTStableDiffusionPipeline
    pipe = cls.from_pretrained(str(model_dir), provider="CPUExecutionProvider", session_options=cpu_session_options(),
                               export=False, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class SessionRecorder:
    """Wraps InferenceSession.run of the pipeline's sessions to record the exact feeds."""

    def __init__(self, pipe):
        self.calls: dict[str, list[dict]] = {"text_encoder": [], "unet": [], "vae_decoder": []}
        self._restore = []
        for name in self.calls:
            part = getattr(pipe, name, None)
            if part is None:
                continue
            session = part.session
            original = session.run

            def run(output_names, feed, *args, _orig=original, _name=name, **kwargs):
                self.calls[_name].append({k: np.array(v, copy=True) for k, v in feed.items()})
                return _orig(output_names, feed, *args, **kwargs)

            session.run = run
            self._restore.append(session)

    def close(self):
        for session in self._restore:
            del session.run


def with_scheduler_override(model_dir: Path, override: dict | None) -> Path | None:
    """A temporary copy (by symlinks) of `model_dir` with `override` as its scheduler_config.json, or
    None without one; the caller removes it. Shared by generate.py and sdxl.py."""
    if override is None:
        return None
    tmp = Path(tempfile.mkdtemp(prefix="sd-ref-"))
    for item in model_dir.iterdir():
        (tmp / item.name).symlink_to(item.resolve())
    (tmp / "scheduler").unlink()
    write_json(tmp / "scheduler" / "scheduler_config.json", override)
    return tmp


def run_case(models_root: Path, case: dict) -> dict:
    """Runs one case twice (output_type "latent" and "np") and returns arrays + observations."""
    tmp = with_scheduler_override(models_root / case["model"], case["scheduler_config_override"])
    model_dir = tmp or models_root / case["model"]
    try:
        pipe = load_pipeline(model_dir)
        cls, extra, _ = SAMPLERS[case["sampler"]]
        pipe.scheduler = cls.from_config(pipe.scheduler.config, **extra)
        is_lcm_pipe = type(pipe).__name__ == "ORTLatentConsistencyModelPipeline"
        n, h, w = case["num_images"], case["height"], case["width"]
        latent_shape = (n, 4, h // 8, w // 8)
        rng = np.random.default_rng(case["seed"])
        latents_in = rng.standard_normal(latent_shape, dtype=np.float32)
        draws_expected = {"euler_a": case["steps"], "lcm": case["steps"] - 1}.get(case["sampler"], 0)
        noise_in = rng.standard_normal((draws_expected, *latent_shape), dtype=np.float32) if draws_expected else None

        kwargs = dict(prompt=case["prompt"], guidance_scale=case["guidance_scale"], num_inference_steps=case["steps"],
                      width=w, height=h, num_images_per_prompt=n)
        if not is_lcm_pipe:
            kwargs["negative_prompt"] = case["negative_prompt"]
        results = {}
        for output_type in ("latent", "np"):
            rec = SessionRecorder(pipe)
            with injected_noise(cls, noise_in) as draws:
                out = pipe(**kwargs, latents=torch.from_numpy(latents_in.copy()), output_type=output_type)
            rec.close()
            assert len(draws) == draws_expected, (case["name"], len(draws), draws_expected)
            img = out.images
            results[output_type] = {
                "images": img.numpy() if isinstance(img, torch.Tensor) else np.asarray(img),
                "calls": rec.calls,
                "timesteps": pipe.scheduler.timesteps.clone(),
                "init_noise_sigma": float(pipe.scheduler.init_noise_sigma),
                "draws": len(draws),
            }
        lat, npy = results["latent"], results["np"]
        expected_latents = lat["images"].astype(np.float32)
        images = npy["images"].astype(np.float32)
        # the "np" run decodes exactly latents / scaling_factor (the "latent" output is unscaled)
        scaling = float(pipe.vae.config.scaling_factor)
        decoded_in = npy["calls"]["vae_decoder"][0]["latent_sample"]
        assert np.array_equal(decoded_in, (torch.from_numpy(expected_latents) / scaling).numpy()), case["name"]
        # and both runs are identical up to the decoder
        for k in ("unet", "text_encoder"):
            assert len(lat["calls"][k]) == len(npy["calls"][k])
            for a, b in zip(lat["calls"][k], npy["calls"][k]):
                assert all(np.array_equal(a[x], b[x]) for x in a), (case["name"], k)

        te_calls = npy["calls"]["text_encoder"]
        prompt_ids = te_calls[0]["input_ids"]
        negative_ids = te_calls[1]["input_ids"] if len(te_calls) > 1 else None
        unet_calls = npy["calls"]["unet"]
        ts_fed = [u["timestep"] for u in unet_calls]
        obs = {
            "latents_in": latents_in,
            "noise_in": noise_in,
            "expected_latents": expected_latents,
            "images": images,
            "prompt_ids": prompt_ids[0].astype(int).tolist(),
            "negative_prompt_ids": None if negative_ids is None else negative_ids[0].astype(int).tolist(),
            "text_encoder_calls": len(te_calls),
            "text_encoder_input_ids_dtype": str(prompt_ids.dtype),
            "timesteps": [float(t) for t in npy["timesteps"]],
            "scheduler_timesteps_dtype": str(npy["timesteps"].dtype).replace("torch.", ""),
            "unet_timestep_feed": {"dtype": str(ts_fed[0].dtype), "shape": list(ts_fed[0].shape),
                                   "values": [float(t) for t in ts_fed]},
            "unet_batch": int(unet_calls[0]["sample"].shape[0]),
            "unet_calls": len(unet_calls),
            "timestep_cond": (None if "timestep_cond" not in unet_calls[0] else
                              {"shape": list(unet_calls[0]["timestep_cond"].shape),
                               "dtype": str(unet_calls[0]["timestep_cond"].dtype),
                               "values_row0": f32(unet_calls[0]["timestep_cond"][0])}),
            "init_noise_sigma": npy["init_noise_sigma"],
            "noise_draws": npy["draws"],
            "scheduler_config": plain_config(pipe.scheduler.config),
            "pipeline_class": type(pipe).__name__,
        }
        return obs
    finally:
        if tmp is not None:
            shutil.rmtree(tmp)


def reference_cases() -> list[dict]:
    base = dict(model="sd-tiny", scheduler_config_override=None, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT,
                guidance_scale=7.5, steps=4, width=64, height=64, num_images=1, seed=1000, notes="")
    cases = []
    for i, sampler in enumerate(SAMPLERS):
        cases.append({**base, "name": f"{sampler}", "sampler": sampler, "seed": 1000 + i})
    cases.append({**base, "name": "lcm_distilled", "model": "sd-tiny-lcm", "sampler": "lcm", "guidance_scale": 8.0,
                  "negative_prompt": None, "seed": 1100,
                  "notes": "LatentConsistencyModelPipeline: no classifier-free guidance (unet batch = num_images, "
                           "no negative prompt), the guidance enters as timestep_cond = "
                           "get_guidance_scale_embedding(w = guidance_scale - 1, embedding_dim=time_cond_proj_dim); "
                           "the final output is the scheduler's `denoised` of the last step."})
    euler_seed = 1000
    cases.append({**base, "name": "euler_guidance_1", "sampler": "euler", "guidance_scale": 1.0, "seed": euler_seed,
                  "notes": "guidance <= 1: no classifier-free guidance; the negative prompt is not encoded."})
    cases.append({**base, "name": "euler_empty_negative", "sampler": "euler", "negative_prompt": "", "seed": euler_seed,
                  "notes": "empty negative prompt: the unconditional half encodes \"\" (same as negative_prompt=None)."})
    cases.append({**base, "name": "euler_96x64_batch2", "sampler": "euler", "width": 96, "height": 64, "num_images": 2,
                  "seed": 1200, "notes": "width 96, height 64 (latents [2, 4, 8, 12]); two different initial latents."})
    for i, sampler in enumerate(SAMPLERS):
        cases.append({**base, "name": f"{sampler}_vpred_zero_snr", "sampler": sampler, "seed": 1300 + i,
                      "scheduler_config_override": SCHEDULER_CONFIGS["vpred_zero_snr"],
                      "notes": "sd-tiny with scheduler/scheduler_config.json replaced by scheduler_config_override "
                               "(v_prediction, trailing, rescale_betas_zero_snr); the model is epsilon-trained "
                               "random weights, only the arithmetic matters."})
    cases.append({**base, "name": "euler_a_sd_turbo_1step", "sampler": "euler_a", "steps": 1, "guidance_scale": 0.0,
                  "seed": 1400, "scheduler_config_override": SCHEDULER_CONFIGS["sd_turbo"],
                  "notes": "SD-Turbo style: trailing spacing, 1 step, guidance 0 (no CFG)."})
    cases.append({**base, "name": "dpmpp_2m_karras_20", "sampler": "dpmpp_2m_karras", "steps": 20, "seed": 1500})
    cases.append({**base, "name": "euler_long_prompt", "sampler": "euler", "prompt": LONG_PROMPT, "seed": 1600,
                  "notes": "prompt longer than 77 tokens: diffusers truncates to 77 (bos + 75 + eos) and warns."})
    cases.append({**base, "name": "euler_external_data", "model": "sd-tiny-external", "sampler": "euler",
                  "seed": euler_seed,
                  "notes": "unet/model.onnx with external data (model.onnx_data); outputs equal the `euler` case."})
    return cases


def save_png(image: np.ndarray, path: Path) -> None:
    # diffusers' numpy_to_pil: (images * 255).round().astype("uint8")
    Image.fromarray((image * 255).round().astype("uint8")).save(path, format="PNG")


def build_references(models_root: Path, out: Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cases = reference_cases()
    records, obs_by_name = [], {}
    for case in cases:
        t0 = time.time()
        obs = run_case(models_root, case)
        obs_by_name[case["name"]] = obs
        d = out / case["name"]
        d.mkdir()
        np.save(d / "latents_in.npy", obs["latents_in"])
        if obs["noise_in"] is not None:
            np.save(d / "noise_in.npy", obs["noise_in"])
        np.save(d / "expected_latents.npy", obs["expected_latents"])
        np.save(d / "expected_images.npy", obs["images"])
        pngs = []
        for i, img in enumerate(obs["images"]):
            save_png(img, d / f"image_{i}.png")
            pngs.append(f"{case['name']}/image_{i}.png")
        rec = {
            "name": case["name"],
            "model": case["model"],
            "scheduler_config_override": case["scheduler_config_override"],
            "sampler": case["sampler"],
            "scheduler_class": SAMPLERS[case["sampler"]][0].__name__,
            "scheduler_from_config_kwargs": SAMPLERS[case["sampler"]][1],
            "prompt": case["prompt"],
            "negative_prompt": case["negative_prompt"],
            "guidance_scale": case["guidance_scale"],
            "steps": case["steps"],
            "width": case["width"],
            "height": case["height"],
            "num_images": case["num_images"],
            "seed": case["seed"],
            "latents_in": f"{case['name']}/latents_in.npy",
            "noise_in": None if obs["noise_in"] is None else f"{case['name']}/noise_in.npy",
            "noise_draws": obs["noise_draws"],
            "expected_latents": f"{case['name']}/expected_latents.npy",
            "expected_images": pngs,
            "expected_images_f32": f"{case['name']}/expected_images.npy",
            "prompt_ids": obs["prompt_ids"],
            "negative_prompt_ids": obs["negative_prompt_ids"],
            "timesteps": obs["timesteps"],
            "init_noise_sigma": obs["init_noise_sigma"],
            "unet_timestep_feed": obs["unet_timestep_feed"],
            "unet_batch": obs["unet_batch"],
            "timestep_cond": obs["timestep_cond"],
            "pipeline_class": obs["pipeline_class"],
            "scheduler_config": obs["scheduler_config"],
            "notes": case["notes"],
        }
        records.append(rec)
        log.info("D. %-26s %5.2f s  timesteps %s  draws %d  unet batch %d", case["name"], time.time() - t0,
                 [round(t, 3) for t in obs["timesteps"]], obs["noise_draws"], obs["unet_batch"])

    # invariants
    e, ext = obs_by_name["euler"], obs_by_name["euler_external_data"]
    assert np.array_equal(e["expected_latents"], ext["expected_latents"]) and np.array_equal(e["images"], ext["images"])
    assert obs_by_name["euler_long_prompt"]["prompt_ids"][-1] == 49407
    # the guidance embedding fed as timestep_cond: diffusers' get_guidance_scale_embedding(w, 32), w = 8.0 - 1
    tc = np.asarray(obs_by_name["lcm_distilled"]["timestep_cond"]["values_row0"], dtype=np.float64)
    half = LCM_TIME_COND_PROJ_DIM // 2
    arg = (8.0 - 1.0) * 1000.0 * np.exp(-np.arange(half) * math.log(10000.0) / (half - 1))
    assert np.allclose(tc, np.concatenate([np.sin(arg), np.cos(arg)]), atol=2e-3), tc
    none_neg = run_case(models_root, {**cases[0], "name": "euler_none_negative", "negative_prompt": None})
    assert np.array_equal(none_neg["images"], obs_by_name["euler_empty_negative"]["images"])

    write_json(out / "cases.json", records)
    sensitivity = measure_sensitivity(models_root, cases[0], obs_by_name)
    return {"records": records, "obs": obs_by_name, "sensitivity": sensitivity}


def measure_sensitivity(models_root: Path, euler_case: dict, obs: dict) -> dict:
    base = obs["euler"]["images"]

    def delta(a, b):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        return {"mean_abs": float(d.mean()), "max_abs": float(d.max())}

    other_seed = run_case(models_root, {**euler_case, "seed": euler_case["seed"] + 77})["images"]
    other_prompt = run_case(models_root, {**euler_case, "prompt": "a watercolor of a lighthouse"})["images"]
    other_guidance = run_case(models_root, {**euler_case, "guidance_scale": 5.0})["images"]
    return {
        "negative_prompt ('blurry, low quality' -> '')": delta(base, obs["euler_empty_negative"]["images"]),
        "guidance (7.5 -> 1.0)": delta(base, obs["euler_guidance_1"]["images"]),
        "guidance (7.5 -> 5.0)": delta(base, other_guidance),
        "prompt (-> 'a watercolor of a lighthouse')": delta(base, other_prompt),
        "seed (other initial latents)": delta(base, other_seed),
    }


def build_tokens(tokenizer_dir: Path, path: Path) -> None:
    tok = CLIPTokenizer.from_pretrained(str(tokenizer_dir))
    items = []
    for text in TOKEN_PROMPTS:
        ids = tok(text, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
        untruncated = tok(text).input_ids
        items.append({"text": text, "ids": ids, "untruncated_length": len(untruncated), "truncated": len(untruncated) > 77})
    try:
        import ftfy  # noqa: F401
        cleanup = "ftfy.fix_text + whitespace_clean + lower (ftfy installed)"
    except ImportError:
        cleanup = "BasicTokenizer (ftfy not installed)"
    write_json(path, {
        "description": "transformers " + transformers.__version__ + " slow CLIPTokenizer on the fixture's tokenizer/ "
                       "files, called as the SD pipeline does: padding='max_length', max_length=77, truncation=True "
                       "(pad id 49407).",
        "text_cleanup": cleanup,
        "prompts": items,
    })


def build_manifest(models_root: Path, out_root: Path, tar_listing: list[dict], path: Path, extra: dict) -> None:
    sessions = {}
    for name in MODEL_NAMES:
        for part in ("text_encoder", "unet", "vae_decoder", "vae_encoder"):
            p = models_root / name / part / "model.onnx"
            if p.exists():
                m = onnx.load(str(p), load_external_data=False)
                sessions[f"{name}/{part}"] = {**onnx_io(p), "opset": [{"domain": o.domain, "version": o.version}
                                                                      for o in m.opset_import],
                                               "ir_version": m.ir_version}
    files = {}
    for rel in ("integration-tests/fixtures/sd-tiny.tar.xz", "worker/src/models/diffusion/testdata/schedulers.json"):
        files[rel] = {"size": (out_root / rel).stat().st_size, "sha256": sha256(out_root / rel)}
    ref = out_root / "integration-tests/fixtures/sd-reference"
    for p in sorted(ref.rglob("*")):
        if p.is_file() and p.name not in ("manifest.json", "README.md"):
            files[p.relative_to(out_root).as_posix()] = {"size": p.stat().st_size, "sha256": sha256(p)}
    write_json(path, {
        "generator": "scripts/sd-reference/generate.py",
        "versions": versions(),
        "onnx_sessions": sessions,
        "tarball_contents": tar_listing,
        "files": files,
        **extra,
    })


def versions() -> dict:
    from importlib.metadata import version

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "diffusers": diffusers.__version__,
           "transformers": transformers.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__,
           "numpy": np.__version__}
    for pkg in ("optimum", "optimum-onnx", "open_clip_torch", "pillow", "ftfy"):
        out[pkg] = version(pkg)
    return out


# --------------------------------------------------------------------------------------------------
# E. Rerun check and README
# --------------------------------------------------------------------------------------------------

OUTPUT_PATHS = [
    "integration-tests/fixtures/sd-tiny.tar.xz",
    "integration-tests/fixtures/sd-reference",
    "worker/src/models/diffusion/testdata/schedulers.json",
]


def rerun_check_of(script: str, out_root: Path, work: Path, output_paths: list[str], logger,
                   inputs: tuple[str, ...] = ()) -> dict:
    """`script` run again in a fresh process into `work`/rerun-out (with copies of the committed
    `inputs` it reads there), its `output_paths` compared with `out_root`'s (rerun_and_compare)."""
    other = work / "rerun-out"
    if other.exists():
        shutil.rmtree(other)
    for rel in inputs:
        (other / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out_root / rel, other / rel)
    return rerun_and_compare(script, out_root, other, work, output_paths, logger)


def rerun_lines(script: str, rr: dict | None, what: str = "fresh process, fresh export, same machine") -> list[str]:
    """The README's account of the rerun check of `script` (`rr`: rerun_and_compare's result, None
    when not run)."""
    if rr is None:
        return [f"Not checked in this run ({script} without --rerun-check)."]
    lines = [
        f"A second, independent run of {script} ({what}) gave "
        f"{rr['identical']} byte-identical files out of {rr['identical'] + len(rr['differing'])}"
        + ("." if not rr["differing"] else "; differing:")
    ]
    lines += [f"- `{rel}`: {why}" for rel, why in rr["differing"].items()]
    return lines


def script_start(doc: str, prefix: str) -> tuple[argparse.Namespace, Path, Path, float]:
    """What every reference script starts with: its command line (--out, --work, --rerun-check),
    logging, determinism, an emptied scratch directory. Returns (args, out_root, work, start time)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="repository root (outputs go below it)")
    ap.add_argument("--work", type=Path, help="scratch directory, kept (default: a temporary directory, removed)")
    ap.add_argument("--rerun-check", action="store_true", help="run everything a second time and compare")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    setup_determinism()
    work = (args.work or Path(tempfile.mkdtemp(prefix=prefix))).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return args, args.out.resolve(), work, time.time()


def rerun_and_compare(script: str, out_root: Path, other: Path, work: Path, output_paths: list[str],
                      logger: logging.Logger) -> dict:
    """`script` run again in a fresh process into `other`; every file under `output_paths` (README.md
    aside) compared with this run's: identical bytes, or how far apart (.npy, .png), or missing on a side.
    Shared by generate.py, sdxl.py and images.py."""
    t0 = time.time()
    subprocess.run([sys.executable, script, "--out", str(other), "--work", str(work / "rerun-work")], check=True,
                   env={**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")})

    def files(root: Path) -> dict:
        found = {}
        for rel in output_paths:
            p = root / rel
            for f in ([p] if p.is_file() else sorted(p.rglob("*"))):
                if f.is_file() and f.name != "README.md":
                    found[f.relative_to(root).as_posix()] = f
        return found

    files_a, files_b = files(out_root), files(other)
    identical, differing = [], {}
    for rel, fa in files_a.items():
        fb = files_b.get(rel)
        if fb is None:
            differing[rel] = "missing in rerun"
        elif fa.read_bytes() == fb.read_bytes():
            identical.append(rel)
        elif rel.endswith(".npy"):
            a, b = np.load(fa), np.load(fb)
            differing[rel] = f"max |diff| {float(np.abs(a.astype(np.float64) - b).max()):.3g}"
        elif rel.endswith(".png"):
            a = np.asarray(Image.open(fa)).astype(int)
            b = np.asarray(Image.open(fb)).astype(int)
            differing[rel] = f"max |diff| {int(np.abs(a - b).max())} levels"
        else:
            differing[rel] = "bytes differ"
    for rel in sorted(set(files_b) - set(files_a)):
        differing[rel] = "only in rerun"
    logger.info("E. rerun in %.0f s: %d identical files, %d differing", time.time() - t0, len(identical), len(differing))
    for rel, why in differing.items():
        logger.info("E.   %s: %s", rel, why)
    return {"identical": len(identical), "differing": differing, "seconds": round(time.time() - t0)}


def write_readme(path: Path, info: dict) -> None:
    v = info["versions"]
    sens = info["sensitivity"]
    rr = info.get("rerun")
    files = info["sizes"]
    lines = [
        "# Stable Diffusion reference outputs (tiny random-weight model)",
        "",
        "Made by `bash scripts/sd-reference/generate.sh` (a developer runs it once; the venv it needs is ~5 GB, so",
        "it is not part of CI). Do not edit these files by hand: rerun the script.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "## What is here",
        "- `../sd-tiny.tar.xz`: three Optimum ONNX layouts (`sd-tiny/`, `sd-tiny-lcm/`, `sd-tiny-external/`), built",
        "  from tiny configs with seeded random weights rounded to a per-tensor power-of-two grid (so they compress),",
        "  exported with `optimum-cli export onnx --task text-to-image` (Python API). `sd-tiny-lcm` is a",
        "  `LatentConsistencyModelPipeline` whose UNet has `time_cond_proj_dim` = 32 (ONNX input `timestep_cond`)",
        "  and otherwise the same weights; `sd-tiny-external` is `sd-tiny` with `unet/model.onnx` + `unet/model.onnx_data`.",
        "  The tokenizer is the real CLIP BPE vocabulary (49,408 tokens). Each `scheduler_config.json` is what real",
        "  checkpoints ship (SD 1.5's PNDM file without `timestep_spacing`; an LCM scheduler file for `sd-tiny-lcm`).",
        "- `cases.json`: one record per pipeline run (see below); per case a folder with `latents_in.npy`",
        "  (standard normal, passed as `latents=`; the pipeline multiplies it by `init_noise_sigma`), `noise_in.npy`",
        "  (euler_a / lcm: the per-step noise, `[draws, num_images, 4, h/8, w/8]`, in draw order),",
        "  `expected_latents.npy` (what `output_type=\"latent\"` returns: unscaled, i.e. before `/ scaling_factor`),",
        "  `expected_images.npy` (float32 NHWC in [0, 1], `output_type=\"np\"`) and `image_N.png`",
        "  (`(image * 255).round()` as diffusers' `numpy_to_pil`).",
        "- `tokens.json`: slow CLIPTokenizer ids for assorted prompts (padded/truncated to 77 as the pipeline does).",
        "- `manifest.json`: the ONNX I/O of every session as onnxruntime reports it, the tarball contents and the",
        "  size and sha256 of every fixture file.",
        "",
        "References are `ORTStableDiffusionPipeline` (or `ORTLatentConsistencyModelPipeline` for `sd-tiny-lcm`) on",
        "the unpacked tarball, CPU execution provider, one thread, with",
        "`pipe.scheduler = Class.from_config(pipe.scheduler.config, **scheduler_from_config_kwargs)`.",
        "`unet_timestep_feed` records the exact `timestep` array the pipeline fed to onnxruntime.",
        "",
        "## Sizes",
        "",
        "| file | bytes |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {val:,} |" for k, val in files.items()]
    lines += [
        "",
        "## Sensitivity of the images (mean / max |Δ| of float images in [0, 1], euler, 64×64, 4 steps)",
        "",
        "A change of any single input must move the image; tests can assert e.g. mean |Δ| > 0.005.",
        "",
        "| change | mean abs | max abs |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {d['mean_abs']:.4f} | {d['max_abs']:.4f} |" for k, d in sens.items()]
    lines += [
        "",
        "## What the reference pipeline does (diffusers " + v["diffusers"] + ", optimum-onnx " + v["optimum-onnx"] + ")",
        "",
        "- `latents=` is used as given and multiplied by `scheduler.init_noise_sigma` for every scheduler",
        "  (14.6146 for Euler/Euler-a with SD 1.5's config, 4096 with zero-SNR trailing, 1.0 for DDIM/DPM++/LCM).",
        "- Classifier-free guidance batches `[uncond, cond]` (unet batch 2 × num_images) when",
        "  `guidance_scale > 1` and the UNet has no `time_cond_proj_dim`; otherwise only the conditional half runs",
        "  and the negative prompt is not encoded (`negative_prompt_ids` is null then).",
        "  `noise = uncond + guidance_scale * (cond - uncond)`.",
        "- The timestep is fed to the ONNX UNet as a float32 scalar (shape `[]`) for every scheduler: Optimum casts",
        "  the scheduler's value (float32 for Euler/Euler-a, int64 for DDIM/DPM++/LCM) to the input's dtype.",
        "- `output_type=\"latent\"` returns the final latents unscaled; the image is",
        "  `vae_decoder(latents / scaling_factor)` → `(x / 2 + 0.5).clamp(0, 1)`; `scaling_factor` comes from",
        "  `vae_decoder/config.json`.",
        "- LCM-distilled UNet (`sd-tiny-lcm`, `LatentConsistencyModelPipeline`): no CFG and no negative prompt at",
        "  all (unet batch = num_images); the guidance goes in as `timestep_cond` [batch, 32] =",
        "  `get_guidance_scale_embedding(w, embedding_dim=time_cond_proj_dim)` with `w = guidance_scale - 1`:",
        "  `w *= 1000; half = dim // 2; f = exp(arange(half) * -(ln(10000) / (half - 1)));",
        "  emb = [sin(w * f), cos(w * f)]` (float32, sin then cos). The output (latent or decoded) is the scheduler's",
        "  `denoised` of the last step, not `prev_sample` (they are equal at the last LCM step anyway).",
        "  `StableDiffusionPipeline` with a UNet that has `time_cond_proj_dim` would do CFG *and* pass `timestep_cond`.",
        "- Noise draws (scheduler `randn_tensor`): Euler-a draws once per step, including the last (σ_up = 0",
        "  there); LCM once per step except the last; Euler (s_churn = 0), DDIM (eta = 0) and DPM++ 2M never.",
        "- Prompts over 77 tokens are truncated to `<|startoftext|>` + 75 tokens + `<|endoftext|>` (with a",
        "  warning), padding is `<|endoftext|>` (49407) up to 77.",
    ]
    lines += ["", "## Rerun determinism", ""]
    lines += rerun_lines("generate.py", rr)
    lines += [
        "",
        "ONNX Runtime runs with one thread here; on a CPU with other vector units (or another execution",
        "provider) its kernels may round differently in the last bits. Suggested tolerances for an independent",
        "implementation: latents 1e-4 absolute, float images 1e-4, PNG ±1 level. Scheduler traces",
        "(schedulers.json): an independent float64 Euler written while making this script matched diffusers'",
        "float32 traces within 3e-5 relative (8e-5 with zero-SNR sigmas up to 4096), so 1e-4 relative + 1e-5",
        "absolute is a fair bound.",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------------------------------


def main() -> None:
    args, out_root, work, t0 = script_start(__doc__, "sd-reference-")

    tar_path = out_root / "integration-tests/fixtures/sd-tiny.tar.xz"
    ref_dir = out_root / "integration-tests/fixtures/sd-reference"
    sched_path = out_root / "worker/src/models/diffusion/testdata/schedulers.json"

    built = build_models(work, tar_path)
    sched_info = build_scheduler_fixtures(sched_path)
    refs = build_references(built["models_root"], ref_dir)
    build_tokens(built["models_root"] / "sd-tiny" / "tokenizer", ref_dir / "tokens.json")
    build_manifest(built["models_root"], out_root, built["tar_listing"], ref_dir / "manifest.json",
                   {"sensitivity": refs["sensitivity"]})

    info = {"versions": versions(), "sensitivity": refs["sensitivity"]}
    info["sizes"] = {}
    for rel in ("integration-tests/fixtures/sd-tiny.tar.xz", "worker/src/models/diffusion/testdata/schedulers.json"):
        info["sizes"][rel] = (out_root / rel).stat().st_size
    info["sizes"]["integration-tests/fixtures/sd-reference/ (all files but README.md)"] = sum(
        p.stat().st_size for p in ref_dir.rglob("*") if p.is_file() and p.name != "README.md")
    if args.rerun_check:
        info["rerun"] = rerun_check_of(__file__, out_root, work, OUTPUT_PATHS, log)
    write_readme(ref_dir / "README.md", info)
    log.info("done in %.0f s; scheduler errors: %s", time.time() - t0, sched_info["errors"])
    log.info("noise draws (sd15 config): %s", sched_info["noise_draws"])
    for k, val in info["sizes"].items():
        log.info("  %10d  %s", val, k)
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
