#!/usr/bin/env python3
"""Tiny random-weight Stable Diffusion XL fixture and reference outputs for Sluice's diffusion worker.

The SDXL counterpart of generate.py (whose helpers it imports: tokenizer files, quantize_, the optimum
export, set_name_or_path, injected_noise, deterministic tar packing, JSON/float helpers). Run it through
`bash scripts/sd-reference/generate.sh --sdxl` (which makes the venv); a one-off developer tool, not CI.

Steps:
  A. tokenizers     tokenizer/ as SD 1.x ships it (generate.build_tokenizer: pad `<|endoftext|>` = 49407)
                    and tokenizer_2/ with the same vocabulary and merges but pad_token "!" (id 0), as
                    SDXL's tokenizer_2 (OpenCLIP bigG) ships it. In transformers the pad token is a
                    special token, so a "!" in a prompt becomes id 0 in tokenizer_2 (not "!</w>" = 256).
  B. model          text_encoder   CLIPTextModel (generate.py's config and seed: hidden 32, 2 layers)
                    text_encoder_2 CLIPTextModelWithProjection (hidden 32, 2 layers, gelu, projection 32)
                    unet           UNet2DConditionModel shaped like SDXL's: addition_embed_type "text_time",
                                   addition_time_embed_dim 8, projection_class_embeddings_input_dim 6*8+32,
                                   cross_attention_dim 64 (= 32 + 32), linear projections, first block
                                   without attention
                    vae            generate.py's AutoencoderKL config with scaling_factor 0.13025
                    weights rounded like generate.py's (quantize_), saved as a StableDiffusionXLPipeline
                    (SDXL base's EulerDiscreteScheduler config, force_zeros_for_empty_prompt true), exported
                    with optimum (`--task text-to-image`) into the Optimum layout `sdxl-tiny/`, packed into
                    integration-tests/fixtures/sdxl-tiny.tar.xz (generate.pack_tarball: fixed order/mtime/owners,
                    xz -9e, single-threaded).
  D. references     integration-tests/fixtures/sdxl-reference/: ORTStableDiffusionXLPipeline on the unpacked
                    tarball (CPU, one thread) with fixed initial latents and fixed per-step noise: cases.json,
                    per case .npy/.png plus the text embeddings and the first UNet feed (first_unet_feed.npz),
                    tokens.json (both tokenizers), manifest.json (ONNX I/O, sizes, sha256), README.md.
  E. rerun check    (--rerun-check) the whole script again in a fresh process into a scratch output root;
                    every output file is compared and the result goes into the README.

Determinism: every random draw is seeded (torch.manual_seed per model, numpy default_rng per case), ONNX
Runtime and torch run with one thread, the tarball has fixed metadata, .npz files are written with fixed zip
timestamps, PNGs and JSON deterministically.

Usage: sdxl.py --out REPO_ROOT [--work DIR] [--rerun-check]
Needs HF_HUB_OFFLINE=1 (set by generate.sh); never touches the network or a model hub.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import sys
import tarfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate as g  # noqa: E402  (sets the offline/verbosity environment before the heavy imports)

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

import transformers  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Fixed inputs
# --------------------------------------------------------------------------------------------------

MODEL_NAME = "sdxl-tiny"
TARBALL = "integration-tests/fixtures/sdxl-tiny.tar.xz"
REF_DIR = "integration-tests/fixtures/sdxl-reference"
OUTPUT_PATHS = [TARBALL, REF_DIR]

PROMPT = g.PROMPT
NEGATIVE_PROMPT = g.NEGATIVE_PROMPT
BANG_PROMPT = "an astronaut riding a horse on mars! wow!!"
PARTS = ("text_encoder", "text_encoder_2", "unet", "vae_decoder", "vae_encoder")

# stabilityai/stable-diffusion-xl-base-1.0 scheduler/scheduler_config.json
SDXL_SCHEDULER = {
    "_class_name": "EulerDiscreteScheduler",
    "_diffusers_version": "0.19.0.dev0",
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
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}
# stabilityai/sdxl-turbo scheduler/scheduler_config.json
SDXL_TURBO_SCHEDULER = {
    **SDXL_SCHEDULER,
    "_class_name": "EulerAncestralDiscreteScheduler",
    "_diffusers_version": "0.24.0.dev0",
    "timestep_spacing": "trailing",
}

# text_encoder: generate.py's CLIPTextModel (config and seed). text_encoder_2 as SDXL's OpenCLIP bigG
# config (gelu, legacy bos/eos/pad ids 0/2/1, so the pooled token is argmax(input_ids) = the first
# <|endoftext|>), tiny.
TEXT_ENCODER_2_CONFIG = {**g.TEXT_ENCODER_CONFIG, "hidden_act": "gelu", "projection_dim": 32}
TEXT_ENCODER_2_SEED = 10
ADDITION_TIME_EMBED_DIM = 8
UNET_XL_CONFIG = dict(
    sample_size=32,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    cross_attention_dim=g.TEXT_ENCODER_CONFIG["hidden_size"] + TEXT_ENCODER_2_CONFIG["hidden_size"],
    addition_embed_type="text_time",
    addition_time_embed_dim=ADDITION_TIME_EMBED_DIM,
    projection_class_embeddings_input_dim=6 * ADDITION_TIME_EMBED_DIM + TEXT_ENCODER_2_CONFIG["projection_dim"],
    norm_num_groups=32,
)
UNET_XL_SEED = 11
VAE_XL_CONFIG = {**g.VAE_CONFIG, "scaling_factor": 0.13025}
VAE_XL_SEED = 12

log = logging.getLogger("sdxl-reference")


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------

NPZ_DATE = (2026, 1, 1, 0, 0, 0)


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez's format (a zip of NAME.npy members, stored uncompressed) with fixed timestamps:
    np.savez stamps each member with the current time, so two runs would differ."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            buf = io.BytesIO()
            arr = np.asarray(arrays[name])  # (np.ascontiguousarray would turn a 0-d timestep into shape [1])
            np.lib.format.write_array(buf, arr if arr.flags.c_contiguous else arr.copy(order="C"), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=NPZ_DATE)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def save_npz_checked(path: Path, arrays: dict[str, np.ndarray], case: str) -> None:
    """save_npz, then read back: every member with its dtype, shape and values."""
    save_npz(path, arrays)
    with np.load(path) as z:
        assert sorted(z.files) == sorted(arrays)
        for k, v in arrays.items():
            assert z[k].dtype == v.dtype and z[k].shape == v.shape and np.array_equal(z[k], v), (case, k)


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), g.cpu_session_options(), providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------------------------------
# A. Tokenizers
# --------------------------------------------------------------------------------------------------


def build_tokenizer_2(tokenizer_dir: Path, out_dir: Path) -> None:
    """SDXL's tokenizer_2: the same BPE files, pad_token "!" (as stabilityai ships it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((tokenizer_dir / name).read_text(encoding="utf-8"))
        config["pad_token"] = "!"
        g.write_json(out_dir / name, config)
    tok = CLIPTokenizer.from_pretrained(str(out_dir))
    assert tok.pad_token_id == 0 and tok.convert_ids_to_tokens(0) == "!", tok.pad_token_id
    ids = tok(PROMPT, padding="max_length", max_length=77).input_ids
    assert ids == g.PROMPT_IDS + [0] * (77 - len(g.PROMPT_IDS)), ids
    log.info("A. tokenizer_2: pad %r = id %d", tok.pad_token, tok.pad_token_id)


def build_tokens(model_dir: Path, path: Path) -> dict:
    toks = {name: CLIPTokenizer.from_pretrained(str(model_dir / name)) for name in ("tokenizer", "tokenizer_2")}
    prompts = list(g.TOKEN_PROMPTS) + [BANG_PROMPT, "!", "wow!! really!?", "a!b", "!!!"]
    items = []
    for text in prompts:
        item = {"text": text}
        for key, name in (("ids", "tokenizer"), ("ids_2", "tokenizer_2")):
            tok = toks[name]
            item[key] = tok(text, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
        untruncated = toks["tokenizer"](text).input_ids
        item["untruncated_length"] = len(untruncated)
        item["truncated"] = len(untruncated) > 77
        items.append(item)
    differ = [it["text"] for it in items
              if [i for i in it["ids"] if i != 49407] != [i for i in it["ids_2"] if i not in (0, 49407)]]
    g.write_json(path, {
        "description": "transformers " + transformers.__version__ + " slow CLIPTokenizer on the fixture's tokenizer/ "
                       "(ids, pad <|endoftext|> 49407) and tokenizer_2/ (ids_2, pad \"!\" 0) files, called as the "
                       "SDXL pipeline does: padding='max_length', max_length=77, truncation=True. The pad token is "
                       "a special token in transformers, so a literal \"!\" in a prompt is split out and becomes "
                       "id 0 in tokenizer_2 (in tokenizer it is BPE'd: \"!</w>\" 256, \"!!</w>\", ...).",
        "prompts_where_the_non_pad_ids_differ": differ,
        "prompts": items,
    })
    bang = next(it for it in items if it["text"] == BANG_PROMPT)
    return {"bang_prompt": BANG_PROMPT, "ids": bang["ids"][:14], "ids_2": bang["ids_2"][:14], "differ": differ}


# --------------------------------------------------------------------------------------------------
# B. Model, export, packing
# --------------------------------------------------------------------------------------------------


def build_text_encoder_2() -> CLIPTextModelWithProjection:
    torch.manual_seed(TEXT_ENCODER_2_SEED)
    model = CLIPTextModelWithProjection(CLIPTextConfig(**TEXT_ENCODER_2_CONFIG)).eval()
    g.quantize_(model)
    return model


def build_unet_xl() -> UNet2DConditionModel:
    torch.manual_seed(UNET_XL_SEED)
    model = UNet2DConditionModel(**UNET_XL_CONFIG).eval()
    g.quantize_(model)
    return model


def build_vae_xl() -> AutoencoderKL:
    torch.manual_seed(VAE_XL_SEED)
    model = AutoencoderKL(**VAE_XL_CONFIG).eval()
    g.quantize_(model)
    return model


def save_diffusers_pipeline(work: Path, tok_dirs: dict[str, Path]) -> tuple[Path, dict]:
    text_encoder = g.build_text_encoder()
    text_encoder_2 = build_text_encoder_2()
    unet = build_unet_xl()
    vae = build_vae_xl()
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=CLIPTokenizer.from_pretrained(str(tok_dirs["tokenizer"])),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(tok_dirs["tokenizer_2"])),
        unet=unet,
        scheduler=EulerDiscreteScheduler.from_config(SDXL_SCHEDULER),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    out = work / "diffusers" / MODEL_NAME
    pipe.save_pretrained(str(out))
    n_params = {name: sum(p.numel() for p in m.parameters())
                for name, m in (("text_encoder", text_encoder), ("text_encoder_2", text_encoder_2), ("unet", unet),
                                ("vae", vae))}
    log.info("B. diffusers SDXL pipeline saved; parameters: %s", n_params)
    return out, n_params


def finish_layout(out_dir: Path, tok_dirs: dict[str, Path]) -> None:
    """The shipped scheduler config and tokenizer files instead of what the export re-saved."""
    g.write_json(out_dir / "scheduler" / "scheduler_config.json", SDXL_SCHEDULER)
    for name, src in tok_dirs.items():
        if (out_dir / name).exists():
            shutil.rmtree(out_dir / name)
        shutil.copytree(src, out_dir / name)
    g.set_name_or_path(out_dir)
    index = json.loads((out_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline", index
    assert index.get("force_zeros_for_empty_prompt") is True, index
    for part in PARTS + ("tokenizer", "tokenizer_2", "scheduler"):
        assert (out_dir / part).is_dir(), part


def check_text_encoders(diffusers_dir: Path, model_dir: Path) -> dict:
    """ONNX text encoders against torch, and what `text_embeds` is."""
    tok = CLIPTokenizer.from_pretrained(str(model_dir / "tokenizer"))
    ids = np.array([tok(PROMPT, padding="max_length", max_length=77).input_ids], dtype=np.int64)
    facts = {}
    with torch.no_grad():
        for name, cls in (("text_encoder", transformers.CLIPTextModel), ("text_encoder_2", CLIPTextModelWithProjection)):
            model = cls.from_pretrained(str(diffusers_dir / name)).eval()
            ref = model(torch.from_numpy(ids), output_hidden_states=True)
            sess = session(model_dir / name / "model.onnx")
            names = [o.name for o in sess.get_outputs()]
            outs = dict(zip(names, sess.run(None, {"input_ids": ids})))
            diffs = {}
            for i in range(len(ref.hidden_states)):
                diffs[f"hidden_states.{i}"] = float(np.abs(outs[f"hidden_states.{i}"] - ref.hidden_states[i].numpy()).max())
            diffs["last_hidden_state"] = float(np.abs(outs["last_hidden_state"] - ref.last_hidden_state.numpy()).max())
            eos_pos = int(ids[0].argmax())
            if name == "text_encoder_2":
                diffs["text_embeds"] = float(np.abs(outs["text_embeds"] - ref.text_embeds.numpy()).max())
                # text_embeds = text_projection(last_hidden_state[argmax(input_ids)]) (no bias)
                proj = outs["last_hidden_state"][0, eos_pos] @ model.text_projection.weight.numpy().T
                diffs["text_embeds vs text_projection(last_hidden_state[eos])"] = float(np.abs(outs["text_embeds"][0] - proj).max())
                assert model.text_projection.bias is None
            else:
                diffs["pooler_output"] = float(np.abs(outs["pooler_output"] - ref.pooler_output.numpy()).max())
                diffs["pooler_output vs last_hidden_state[eos]"] = float(
                    np.abs(outs["pooler_output"][0] - outs["last_hidden_state"][0, eos_pos]).max())
            # the final layer norm sits between hidden_states.L and last_hidden_state
            L = model.config.num_hidden_layers
            diffs[f"hidden_states.{L} vs last_hidden_state"] = float(
                np.abs(outs[f"hidden_states.{L}"] - outs["last_hidden_state"]).max())
            # ONNX = torch and the pooled/projection identities; hidden_states.L differs (final layer norm)
            assert all(v < 1e-4 for k, v in diffs.items() if not k.startswith(f"hidden_states.{L} vs")), (name, diffs)
            assert diffs[f"hidden_states.{L} vs last_hidden_state"] > 1e-3, (name, diffs)
            facts[name] = {"output_order": names, "max_abs_diff_onnx_vs_torch": diffs, "eos_position": eos_pos}
    log.info("B. text encoders: ONNX = torch; outputs %s / %s", facts["text_encoder"]["output_order"],
             facts["text_encoder_2"]["output_order"])
    return facts


def probe_unet_sizes(model_dir: Path) -> dict:
    """Which latent sizes the exported UNet accepts (one down/upsample: even sizes expected)."""
    so = g.cpu_session_options()
    so.log_severity_level = 4  # the failing sizes are expected; keep onnxruntime's error log quiet
    sess = ort.InferenceSession(str(model_dir / "unet" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    out = {}
    for lh, lw in ((8, 8), (8, 12), (12, 8), (9, 8), (8, 9), (10, 10), (7, 7)):
        feed = {
            "sample": rng.standard_normal((1, 4, lh, lw), dtype=np.float32),
            "timestep": np.array(500.0, dtype=np.float32),
            "encoder_hidden_states": rng.standard_normal((1, 77, 64), dtype=np.float32),
            "text_embeds": rng.standard_normal((1, 32), dtype=np.float32),
            "time_ids": np.array([[8 * lh, 8 * lw, 0, 0, 8 * lh, 8 * lw]], dtype=np.float32),
        }
        try:
            sess.run(None, feed)
            ok = "ok"
        except Exception as e:  # noqa: BLE001
            ok = "fails: " + str(e).splitlines()[0][:160]
        out[f"{8 * lw}x{8 * lh} (latent {lh}x{lw})"] = ok
    log.info("B. unet size probe: %s", out)
    return out


def build_models(work: Path, tar_path: Path) -> dict:
    tok_dirs = {"tokenizer": work / "tokenizer", "tokenizer_2": work / "tokenizer_2"}
    tok_info = g.build_tokenizer(tok_dirs["tokenizer"])
    build_tokenizer_2(tok_dirs["tokenizer"], tok_dirs["tokenizer_2"])
    diff_dir, n_params = save_diffusers_pipeline(work, tok_dirs)
    onnx_root = work / "onnx"
    g.export_onnx(diff_dir, onnx_root / MODEL_NAME)
    finish_layout(onnx_root / MODEL_NAME, tok_dirs)
    listing = g.pack_tarball(onnx_root, tar_path, [MODEL_NAME])

    unpacked = work / "unpacked"
    if unpacked.exists():
        shutil.rmtree(unpacked)
    unpacked.mkdir()
    with tarfile.open(tar_path, "r:xz") as tar:
        tar.extractall(unpacked, filter="data")
    model_dir = unpacked / MODEL_NAME
    facts = {
        "parameters": n_params,
        "tokenizer": tok_info,
        "text_encoders": check_text_encoders(diff_dir, model_dir),
        "unet_size_probe": probe_unet_sizes(model_dir),
    }
    return {"tar_listing": listing, "models_root": unpacked, "diffusers_dir": diff_dir, "facts": facts}


# --------------------------------------------------------------------------------------------------
# D. Pipeline references
# --------------------------------------------------------------------------------------------------


def load_pipeline(model_dir: Path):
    from optimum.onnxruntime import ORTStableDiffusionXLPipeline

    pipe = ORTStableDiffusionXLPipeline.from_pretrained(
        str(model_dir), provider="CPUExecutionProvider", session_options=g.cpu_session_options(), export=False,
        local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert getattr(pipe, "watermark", None) is None, "invisible-watermark must not be active"
    return pipe


class Recorder:
    """Wraps InferenceSession.run of the pipeline's sessions: records feeds and outputs (by name)."""

    def __init__(self, pipe, parts=("text_encoder", "text_encoder_2", "unet", "vae_decoder")):
        self.calls: dict[str, list[dict]] = {}
        self._restore = []
        for name in parts:
            self.calls[name] = []
            sess = getattr(pipe, name).session
            original = sess.run
            all_names = [o.name for o in sess.get_outputs()]

            def run(output_names, feed, *args, _orig=original, _name=name, _all=all_names, **kwargs):
                outs = _orig(output_names, feed, *args, **kwargs)
                self.calls[_name].append({
                    "feed": {k: np.array(v, copy=True) for k, v in feed.items()},
                    "out": {n: np.array(o, copy=True) for n, o in zip(output_names or _all, outs)},
                })
                return outs

            sess.run = run
            self._restore.append(sess)

    def close(self):
        for sess in self._restore:
            del sess.run


def run_case(models_root: Path, case: dict) -> dict:
    """Runs one case twice (output_type "latent" and "np") and returns arrays + observations."""
    tmp = g.with_scheduler_override(models_root / case["model"], case["scheduler_config_override"])
    model_dir = tmp or models_root / case["model"]
    try:
        pipe = load_pipeline(model_dir)
        cls, extra, _ = g.SAMPLERS[case["sampler"]]
        pipe.scheduler = cls.from_config(pipe.scheduler.config, **extra)
        n, h, w = case["num_images"], case["height"], case["width"]
        latent_shape = (n, 4, h // 8, w // 8)
        rng = np.random.default_rng(case["seed"])
        latents_in = rng.standard_normal(latent_shape, dtype=np.float32)
        draws_expected = {"euler_a": case["steps"], "lcm": case["steps"] - 1}.get(case["sampler"], 0)
        noise_in = rng.standard_normal((draws_expected, *latent_shape), dtype=np.float32) if draws_expected else None

        kwargs = dict(prompt=case["prompt"], negative_prompt=case["negative_prompt"],
                      guidance_scale=case["guidance_scale"], num_inference_steps=case["steps"], width=w, height=h,
                      num_images_per_prompt=n)
        results = {}
        for output_type in ("latent", "np"):
            rec = Recorder(pipe)
            # the scheduler's draws come from noise_in; any draw in the pipeline module fails loudly
            with g.injected_noise(cls, noise_in) as draws, g.injected_noise(StableDiffusionXLPipeline, None):
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
        scaling = float(pipe.vae.config.scaling_factor)
        assert scaling == VAE_XL_CONFIG["scaling_factor"], scaling
        decoded_in = npy["calls"]["vae_decoder"][0]["feed"]["latent_sample"]
        assert np.array_equal(decoded_in, (torch.from_numpy(expected_latents) / scaling).numpy()), case["name"]
        for k in ("unet", "text_encoder", "text_encoder_2"):
            assert len(lat["calls"][k]) == len(npy["calls"][k])
            for a, b in zip(lat["calls"][k], npy["calls"][k]):
                assert all(np.array_equal(a["feed"][x], b["feed"][x]) for x in a["feed"]), (case["name"], k)

        cfg = case["guidance_scale"] > 1.0
        # the embeddings as the pipeline computes them (encode_prompt), checked against the UNet feed
        with torch.no_grad():
            pe, npe, ppe, nppe = pipe.encode_prompt(
                prompt=case["prompt"], device=torch.device("cpu"), num_images_per_prompt=n,
                do_classifier_free_guidance=cfg, negative_prompt=case["negative_prompt"])
        embeds = {"prompt_embeds": pe, "negative_prompt_embeds": npe, "pooled_prompt_embeds": ppe,
                  "negative_pooled_prompt_embeds": nppe}
        embeds = {k: (None if v is None else v.numpy().astype(np.float32)) for k, v in embeds.items()}

        te1, te2 = npy["calls"]["text_encoder"], npy["calls"]["text_encoder_2"]
        unet_calls = npy["calls"]["unet"]
        feed0 = unet_calls[0]["feed"]
        # prompt_embeds = concat(hidden_states.{L-1} of both encoders), pooled = text_encoder_2's text_embeds
        pen1 = f"hidden_states.{pipe.text_encoder.config.num_hidden_layers - 1}"
        pen2 = f"hidden_states.{pipe.text_encoder_2.config.num_hidden_layers - 1}"
        joined = np.concatenate([te1[0]["out"][pen1], te2[0]["out"][pen2]], -1)
        assert np.array_equal(np.repeat(joined, n, 0), embeds["prompt_embeds"]), case["name"]
        assert np.array_equal(np.repeat(te2[0]["out"]["text_embeds"], n, 0), embeds["pooled_prompt_embeds"])
        ehs, txt = feed0["encoder_hidden_states"], feed0["text_embeds"]
        if cfg:
            assert np.array_equal(ehs[:n], embeds["negative_prompt_embeds"]) and np.array_equal(ehs[n:], embeds["prompt_embeds"])
            assert np.array_equal(txt[:n], embeds["negative_pooled_prompt_embeds"])
            assert np.array_equal(txt[n:], embeds["pooled_prompt_embeds"])
            if len(te1) > 1:
                njoined = np.concatenate([te1[1]["out"][pen1], te2[1]["out"][pen2]], -1)
                assert np.array_equal(np.repeat(njoined, n, 0), embeds["negative_prompt_embeds"])
                assert np.array_equal(np.repeat(te2[1]["out"]["text_embeds"], n, 0),
                                      embeds["negative_pooled_prompt_embeds"])
        else:
            assert embeds["negative_prompt_embeds"] is None
            assert np.array_equal(ehs, embeds["prompt_embeds"]) and np.array_equal(txt, embeds["pooled_prompt_embeds"])
        # the same time_ids / text_embeds / encoder_hidden_states at every step
        for u in unet_calls[1:]:
            for k in ("encoder_hidden_states", "text_embeds", "time_ids"):
                assert np.array_equal(u["feed"][k], feed0[k]), (case["name"], k)

        ts_fed = [u["feed"]["timestep"] for u in unet_calls]
        obs = {
            "latents_in": latents_in,
            "noise_in": noise_in,
            "expected_latents": expected_latents,
            "images": images,
            "embeds": embeds,
            "first_unet_feed": {k: np.asarray(v) for k, v in feed0.items()},
            "prompt_ids": te1[0]["feed"]["input_ids"][0].astype(int).tolist(),
            "negative_prompt_ids": None if len(te1) < 2 else te1[1]["feed"]["input_ids"][0].astype(int).tolist(),
            "prompt_ids_2": te2[0]["feed"]["input_ids"][0].astype(int).tolist(),
            "negative_prompt_ids_2": None if len(te2) < 2 else te2[1]["feed"]["input_ids"][0].astype(int).tolist(),
            "text_encoder_calls": [len(te1), len(te2)],
            "timesteps": [float(t) for t in npy["timesteps"]],
            "unet_timestep_feed": {"dtype": str(ts_fed[0].dtype), "shape": list(ts_fed[0].shape),
                                   "values": [float(t) for t in ts_fed]},
            "unet_batch": int(feed0["sample"].shape[0]),
            "unet_calls": len(unet_calls),
            "unet_feed_dtypes": {k: str(v.dtype) for k, v in sorted(feed0.items())},
            "unet_feed_shapes": {k: list(v.shape) for k, v in sorted(feed0.items())},
            "time_ids": [[float(x) for x in row] for row in feed0["time_ids"]],
            "init_noise_sigma": npy["init_noise_sigma"],
            "noise_draws": npy["draws"],
            "scheduler_config": g.plain_config(pipe.scheduler.config),
            "pipeline_class": type(pipe).__name__,
            "force_zeros_for_empty_prompt": bool(pipe.config.force_zeros_for_empty_prompt),
            "vae_scaling_factor": scaling,
            "tokenizer_classes": [type(pipe.tokenizer).__name__, type(pipe.tokenizer_2).__name__],
        }
        return obs
    finally:
        if tmp is not None:
            shutil.rmtree(tmp)


def reference_cases() -> list[dict]:
    base = dict(model=MODEL_NAME, scheduler_config_override=None, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT,
                sampler="euler", guidance_scale=5.0, steps=4, width=64, height=64, num_images=1, seed=2000, notes="")
    return [
        {**base, "name": "euler",
         "notes": "SDXL base scheduler config (Euler, leading spacing, steps_offset 1); CFG batches [uncond, cond]."},
        {**base, "name": "euler_absent_negative", "negative_prompt": None,
         "notes": "negative_prompt absent (None) with force_zeros_for_empty_prompt: the unconditional "
                  "encoder_hidden_states and text_embeds are all zeros and the negative prompt is not encoded "
                  "(negative ids null). Same seed as `euler`."},
        {**base, "name": "euler_empty_negative", "negative_prompt": "",
         "notes": "negative_prompt \"\" is encoded (not zeroed: force_zeros applies to None only). Same seed as `euler`."},
        {**base, "name": "euler_a", "sampler": "euler_a", "seed": 2001,
         "notes": "per-step noise from noise_in (one draw per step, also the last)."},
        {**base, "name": "ddim", "sampler": "ddim", "seed": 2002,
         "notes": "DDIM (eta 0) from SDXL's config: leading spacing 751, 501, 251, 1; init_noise_sigma 1."},
        {**base, "name": "dpmpp_2m", "sampler": "dpmpp_2m", "seed": 2003,
         "notes": "DPM++ 2M from SDXL's config: DPMSolver's leading spacing divides by steps + 1, so 4 steps "
                  "are 801, 601, 401, 201 (not 751..1 as Euler/DDIM); init_noise_sigma 1."},
        {**base, "name": "euler_guidance_1", "guidance_scale": 1.0,
         "notes": "guidance <= 1: no classifier-free guidance (unet batch = num_images); the negative prompt is "
                  "not encoded. Same seed as `euler`."},
        {**base, "name": "euler_96x64_batch2", "width": 96, "height": 64, "num_images": 2, "seed": 2100,
         "notes": "width 96, height 64 (latents [2, 4, 8, 12]; time_ids (64, 96, 0, 0, 64, 96): height first); "
                  "two different initial latents, unet batch 4 = [uncond x2, cond x2]."},
        {**base, "name": "euler_long_prompt", "prompt": g.LONG_PROMPT, "seed": 2200,
         "notes": "prompt longer than 77 tokens: both tokenizers truncate to bos + 75 + eos (diffusers warns)."},
        {**base, "name": "euler_bang_prompt", "prompt": BANG_PROMPT, "seed": 2300,
         "notes": "prompt with '!': tokenizer_2's pad token \"!\" is a special token in transformers, so each '!' "
                  "becomes id 0 in prompt_ids_2 while tokenizer BPEs it ('!</w>', '!!</w>')."},
        {**base, "name": "turbo_euler_a_1step", "sampler": "euler_a", "steps": 1, "guidance_scale": 0.0,
         "negative_prompt": None, "seed": 2400, "scheduler_config_override": SDXL_TURBO_SCHEDULER,
         "notes": "SDXL-Turbo style: its EulerAncestralDiscreteScheduler config (trailing spacing), 1 step, "
                  "guidance 0 (no CFG, unet batch 1), negative prompt absent."},
    ]


def build_references(models_root: Path, out: Path, diffusers_dir: Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cases = reference_cases()
    records, obs_by_name = [], {}
    for case in cases:
        t0 = time.time()
        obs = run_case(models_root, case)
        obs_by_name[case["name"]] = obs
        name = case["name"]
        d = out / name
        d.mkdir()
        np.save(d / "latents_in.npy", obs["latents_in"])
        if obs["noise_in"] is not None:
            np.save(d / "noise_in.npy", obs["noise_in"])
        np.save(d / "expected_latents.npy", obs["expected_latents"])
        np.save(d / "expected_images.npy", obs["images"])
        embed_files = {}
        for k, v in obs["embeds"].items():
            if v is not None:
                np.save(d / f"{k}.npy", v)
            embed_files[k] = None if v is None else f"{name}/{k}.npy"
        save_npz_checked(d / "first_unet_feed.npz", obs["first_unet_feed"], name)
        pngs = []
        for i, img in enumerate(obs["images"]):
            g.save_png(img, d / f"image_{i}.png")
            pngs.append(f"{name}/image_{i}.png")
        rec = {
            "name": name,
            "model": case["model"],
            "scheduler_config_override": case["scheduler_config_override"],
            "sampler": case["sampler"],
            "scheduler_class": g.SAMPLERS[case["sampler"]][0].__name__,
            "scheduler_from_config_kwargs": g.SAMPLERS[case["sampler"]][1],
            "prompt": case["prompt"],
            "negative_prompt": case["negative_prompt"],
            "guidance_scale": case["guidance_scale"],
            "steps": case["steps"],
            "width": case["width"],
            "height": case["height"],
            "num_images": case["num_images"],
            "seed": case["seed"],
            "latents_in": f"{name}/latents_in.npy",
            "noise_in": None if obs["noise_in"] is None else f"{name}/noise_in.npy",
            "noise_draws": obs["noise_draws"],
            "expected_latents": f"{name}/expected_latents.npy",
            "expected_images": pngs,
            "expected_images_f32": f"{name}/expected_images.npy",
            "prompt_ids": obs["prompt_ids"],
            "negative_prompt_ids": obs["negative_prompt_ids"],
            "prompt_ids_2": obs["prompt_ids_2"],
            "negative_prompt_ids_2": obs["negative_prompt_ids_2"],
            "timesteps": obs["timesteps"],
            "init_noise_sigma": obs["init_noise_sigma"],
            "unet_timestep_feed": obs["unet_timestep_feed"],
            "unet_batch": obs["unet_batch"],
            "timestep_cond": None,
            "force_zeros_for_empty_prompt": obs["force_zeros_for_empty_prompt"],
            "time_ids": obs["time_ids"],
            "vae_scaling_factor": obs["vae_scaling_factor"],
            **embed_files,
            "first_unet_feed": f"{name}/first_unet_feed.npz",
            "first_unet_feed_dtypes": obs["unet_feed_dtypes"],
            "first_unet_feed_shapes": obs["unet_feed_shapes"],
            "pipeline_class": obs["pipeline_class"],
            "scheduler_config": obs["scheduler_config"],
            "notes": case["notes"],
        }
        records.append(rec)
        log.info("D. %-22s %5.2f s  timesteps %s  draws %d  unet batch %d  te calls %s", name, time.time() - t0,
                 [round(t, 3) for t in obs["timesteps"]], obs["noise_draws"], obs["unet_batch"],
                 obs["text_encoder_calls"])

    # invariants
    o = obs_by_name
    absent = o["euler_absent_negative"]
    assert absent["negative_prompt_ids"] is None and absent["negative_prompt_ids_2"] is None
    assert not absent["embeds"]["negative_prompt_embeds"].any()
    assert not absent["embeds"]["negative_pooled_prompt_embeds"].any()
    empty = o["euler_empty_negative"]
    assert empty["negative_prompt_ids"] == [49406] + [49407] * 76
    assert empty["negative_prompt_ids_2"] == [49406, 49407] + [0] * 75
    assert empty["embeds"]["negative_prompt_embeds"].any()
    assert o["euler_guidance_1"]["unet_batch"] == 1 and o["euler_guidance_1"]["negative_prompt_ids"] is None
    assert o["euler_96x64_batch2"]["unet_batch"] == 4
    assert o["euler_96x64_batch2"]["time_ids"] == [[64.0, 96.0, 0.0, 0.0, 64.0, 96.0]] * 4
    assert o["euler"]["time_ids"] == [[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * 2
    for k in ("prompt_ids", "prompt_ids_2"):
        assert o["euler_long_prompt"][k][-1] == 49407 and 0 not in o["euler_long_prompt"][k][1:-1]
    assert 0 in o["euler_bang_prompt"]["prompt_ids_2"][:12]
    assert o["turbo_euler_a_1step"]["unet_batch"] == 1 and o["turbo_euler_a_1step"]["noise_draws"] == 1
    assert not np.array_equal(absent["images"], empty["images"])

    torch_check = torch_vs_ort(diffusers_dir, cases[0], o["euler"])
    write_json_cases(out / "cases.json", records)
    sensitivity = measure_sensitivity(models_root, cases[0], o)
    return {"records": records, "obs": o, "sensitivity": sensitivity, "torch_vs_ort": torch_check}


def write_json_cases(path: Path, records: list[dict]) -> None:
    g.write_json(path, records)


def torch_vs_ort(diffusers_dir: Path, case: dict, obs: dict) -> dict:
    """The torch StableDiffusionXLPipeline on the diffusers directory the export was made from, same inputs."""
    pipe = StableDiffusionXLPipeline.from_pretrained(str(diffusers_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    cls, extra, _ = g.SAMPLERS[case["sampler"]]
    pipe.scheduler = cls.from_config(pipe.scheduler.config, **extra)
    with torch.no_grad():
        lat = pipe(prompt=case["prompt"], negative_prompt=case["negative_prompt"], guidance_scale=case["guidance_scale"],
                   num_inference_steps=case["steps"], width=case["width"], height=case["height"],
                   latents=torch.from_numpy(obs["latents_in"].copy()), output_type="latent").images
    d = float(np.abs(lat.numpy() - obs["expected_latents"]).max())
    log.info("D. torch vs ORT (euler): max |latent diff| %.3g", d)
    assert d < 1e-3, d
    return {"case": case["name"], "max_abs_latent_diff": float(f"{d:.2g}")}


def measure_sensitivity(models_root: Path, euler_case: dict, obs: dict) -> dict:
    base = obs["euler"]["images"]

    def delta(a, b):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        return {"mean_abs": float(d.mean()), "max_abs": float(d.max())}

    other_seed = run_case(models_root, {**euler_case, "seed": euler_case["seed"] + 77})["images"]
    other_prompt = run_case(models_root, {**euler_case, "prompt": "a watercolor of a lighthouse"})["images"]
    other_guidance = run_case(models_root, {**euler_case, "guidance_scale": 7.5})["images"]
    return {
        "negative_prompt ('blurry, low quality' -> None, zeroed)": delta(base, obs["euler_absent_negative"]["images"]),
        "negative_prompt ('blurry, low quality' -> '')": delta(base, obs["euler_empty_negative"]["images"]),
        "negative_prompt (None -> '')": delta(obs["euler_absent_negative"]["images"], obs["euler_empty_negative"]["images"]),
        "guidance (5.0 -> 1.0)": delta(base, obs["euler_guidance_1"]["images"]),
        "guidance (5.0 -> 7.5)": delta(base, other_guidance),
        "prompt (-> 'a watercolor of a lighthouse')": delta(base, other_prompt),
        "seed (other initial latents)": delta(base, other_seed),
    }


def build_manifest(models_root: Path, out_root: Path, tar_listing: list[dict], path: Path, extra: dict) -> dict:
    sessions = {}
    for part in PARTS:
        p = models_root / MODEL_NAME / part / "model.onnx"
        m = onnx.load(str(p), load_external_data=False)
        sessions[f"{MODEL_NAME}/{part}"] = {**g.onnx_io(p), "opset": [{"domain": o.domain, "version": o.version}
                                                                      for o in m.opset_import],
                                           "ir_version": m.ir_version}
    files = {TARBALL: {"size": (out_root / TARBALL).stat().st_size, "sha256": g.sha256(out_root / TARBALL)}}
    ref = out_root / REF_DIR
    for p in sorted(ref.rglob("*")):
        if p.is_file() and p.name not in ("manifest.json", "README.md"):
            files[p.relative_to(out_root).as_posix()] = {"size": p.stat().st_size, "sha256": g.sha256(p)}
    g.write_json(path, {
        "generator": "scripts/sd-reference/sdxl.py",
        "versions": g.versions(),
        "onnx_sessions": sessions,
        "tarball_contents": tar_listing,
        "files": files,
        **extra,
    })
    return sessions


# --------------------------------------------------------------------------------------------------
# E. Rerun check and README
# --------------------------------------------------------------------------------------------------


def io_table(sessions: dict) -> list[str]:
    lines = ["| session | inputs | outputs (in session order) |", "|---|---|---|"]

    def fmt(args):
        return "<br>".join(f"`{a['name']}` {a['type'].replace('tensor(', '').rstrip(')')} "
                           f"[{', '.join(str(s) for s in a['shape'])}]" for a in args)

    for name, s in sessions.items():
        lines.append(f"| {name.split('/', 1)[1]} | {fmt(s['inputs'])} | {fmt(s['outputs'])} |")
    return lines


def write_readme(path: Path, info: dict) -> None:
    v = info["versions"]
    rr = info.get("rerun")
    te = info["facts"]["text_encoders"]
    lines = [
        "# Stable Diffusion XL reference outputs (tiny random-weight model)",
        "",
        "Made by `bash scripts/sd-reference/generate.sh --sdxl` (runs `scripts/sd-reference/sdxl.py`; a developer",
        "runs it once, the venv it needs is ~5 GB, so it is not part of CI). Do not edit these files by hand: rerun",
        "the script.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "## What is here",
        "- `../sdxl-tiny.tar.xz`: one Optimum ONNX layout `sdxl-tiny/` (`model_index.json`, `scheduler/`,",
        "  `tokenizer/`, `tokenizer_2/`, `text_encoder/`, `text_encoder_2/`, `unet/`, `vae_decoder/`, `vae_encoder/`),",
        "  built from tiny configs with seeded random weights rounded to a per-tensor power-of-two grid, exported",
        "  with `optimum-cli export onnx --task text-to-image` (Python API `main_export`). `model_index.json` has",
        "  `force_zeros_for_empty_prompt: true`; `scheduler/scheduler_config.json` is SDXL base 1.0's",
        "  (EulerDiscreteScheduler, `timestep_spacing` \"leading\", `steps_offset` 1); `vae_decoder/config.json` has",
        "  `scaling_factor` 0.13025.",
        "  - `text_encoder`: CLIPTextModel, hidden 32, 2 layers, quick_gelu (the same weights as sd-tiny's).",
        "  - `text_encoder_2`: CLIPTextModelWithProjection, hidden 32, 2 layers, gelu, `projection_dim` 32.",
        "  - `unet`: UNet2DConditionModel shaped like SDXL's: `addition_embed_type` \"text_time\",",
        "    `addition_time_embed_dim` 8, `projection_class_embeddings_input_dim` 80 (= 6·8 + 32),",
        "    `cross_attention_dim` 64 (= 32 + 32), blocks (32, 64) = (DownBlock2D, CrossAttnDownBlock2D),",
        "    `transformer_layers_per_block` (1, 2), linear projections, `sample_size` 32.",
        "  - `tokenizer/`: SD 1.x's CLIP files (pad `<|endoftext|>` 49407). `tokenizer_2/`: the same `vocab.json` and",
        "    `merges.txt`, `pad_token` \"!\" (id 0) in `tokenizer_config.json` and `special_tokens_map.json`, as",
        "    SDXL's tokenizer_2 ships. No `tokenizer.json` (Optimum copies none).",
        "- `cases.json`: one record per pipeline run, in sd-reference's format plus the SDXL keys `prompt_ids_2`,",
        "  `negative_prompt_ids_2` (tokenizer_2 ids; null where not encoded), `force_zeros_for_empty_prompt`,",
        "  `time_ids` (the rows the UNet got, one per batch row), `vae_scaling_factor`, and paths to",
        "  `prompt_embeds.npy` [n, 77, 64], `negative_prompt_embeds.npy`, `pooled_prompt_embeds.npy` [n, 32],",
        "  `negative_pooled_prompt_embeds.npy` (what `pipe.encode_prompt` returns, already repeated per image; null",
        "  without CFG) and `first_unet_feed.npz` (the exact ONNX feed of the UNet's first call: `sample`,",
        "  `timestep`, `encoder_hidden_states`, `text_embeds`, `time_ids`; a plain stored zip of .npy files).",
        "  `negative_prompt` is JSON null where the pipeline got `negative_prompt=None`.",
        "  Per case also `latents_in.npy` (standard normal from `numpy.random.default_rng(seed)`, passed as",
        "  `latents=`; the pipeline multiplies it by `init_noise_sigma`), `noise_in.npy` (euler_a: the per-step",
        "  noise `[draws, n, 4, h/8, w/8]`, drawn after the latents from the same generator), `expected_latents.npy`",
        "  (`output_type=\"latent\"`: unscaled), `expected_images.npy` (float32 NHWC in [0, 1]) and `image_N.png`.",
        "- `tokens.json`: slow CLIPTokenizer ids of both tokenizers (`ids`, `ids_2`) for assorted prompts.",
        "- `manifest.json`: the ONNX I/O of every session, the tarball contents, size and sha256 of every file,",
        "  ONNX-vs-torch checks of the text encoders, the UNet size probe and the image sensitivity table.",
        "",
        "References are `ORTStableDiffusionXLPipeline` on the unpacked tarball, CPU execution provider, one thread,",
        "`pipe.scheduler = Class.from_config(pipe.scheduler.config, **scheduler_from_config_kwargs)`; the torch",
        f"`StableDiffusionXLPipeline` on the same weights gave the `euler` latents within "
        f"{info['torch_vs_ort']['max_abs_latent_diff']:g}.",
        "",
        "## ONNX sessions (as onnxruntime reports them)",
        "",
    ]
    lines += io_table(info["sessions"])
    lines += [
        "",
        "`text_embeds` of `text_encoder_2` is the *projected* pooled output: `text_projection(last_hidden_state[i])`",
        "(no bias) with `i = argmax(input_ids)` = the first `<|endoftext|>` (legacy eos id 2 in the config);",
        f"checked: max |Δ| {te['text_encoder_2']['max_abs_diff_onnx_vs_torch']['text_embeds vs text_projection(last_hidden_state[eos])']:.2g}.",
        "`hidden_states.0` is the embedding output, `hidden_states.k` the output of layer k, `hidden_states.2`",
        "(last layer) is *before* the final layer norm, `last_hidden_state` after it. The output order differs",
        "between the two encoders (`text_embeds` first in `text_encoder_2`; diffusers relies on it: it takes",
        "output 0 as the pooled embedding when it is 2-D). Look outputs up by name.",
        "",
        "## Cases",
        "",
        "| case | sampler | guidance | negative | size | n | what it checks |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in info["records"]:
        neg = "None" if r["negative_prompt"] is None else json.dumps(r["negative_prompt"])
        lines.append(f"| `{r['name']}` | {r['sampler']} × {r['steps']} | {r['guidance_scale']} | {neg} | "
                     f"{r['width']}×{r['height']} | {r['num_images']} | {r['notes'] or '-'} |")
    lines += [
        "",
        "## What the reference pipeline does (diffusers " + v["diffusers"] + ", optimum-onnx " + v["optimum-onnx"] + ")",
        "",
        "- Each prompt goes through both tokenizers (padding to 77, truncation to bos + 75 + eos) and both",
        "  encoders. `prompt_embeds` = concat on the last axis of `hidden_states[-2]` of each encoder, which on",
        "  the ONNX outputs is `hidden_states.{L-1}` (`L` = `num_hidden_layers`: `hidden_states.1` here,",
        "  `hidden_states.11` / `hidden_states.31` for real SDXL's CLIP-L / bigG): 32 + 32 = 64 wide.",
        "  The pooled embedding is `text_encoder_2`'s `text_embeds`; `text_encoder`'s `pooler_output` is unused.",
        "- CFG (`guidance_scale > 1`) batches `[uncond × n, cond × n]` for `sample`, `encoder_hidden_states`,",
        "  `text_embeds` and `time_ids`. Negative prompt **None** with `force_zeros_for_empty_prompt`: the uncond",
        "  `encoder_hidden_states` and `text_embeds` are zeros and the negative prompt is not encoded. Negative",
        "  prompt `\"\"` is encoded like any other text (so None and \"\" differ in SDXL, unlike SD 1.x).",
        "- `time_ids` = (original h, original w, crop top, crop left, target h, target w) = (h, w, 0, 0, h, w),",
        "  float32 [batch, 6], the same for the uncond and cond rows: 64×64 → (64, 64, 0, 0, 64, 64);",
        "  width 96 height 64 → (64, 96, 0, 0, 64, 96).",
        "- `timestep` is a float32 scalar (shape `[]`) for every scheduler; `latents=` is multiplied by",
        "  `init_noise_sigma`; `output_type=\"latent\"` returns the final latents unscaled and the image is",
        "  `vae_decoder(latents / 0.13025)` → `(x / 2 + 0.5).clamp(0, 1)`. No watermark is applied",
        "  (invisible-watermark is not installed; the pipeline checks it is off).",
        "- Euler with SDXL's leading spacing and `steps_offset` 1: 4 steps = 751, 501, 251, 1 and",
        "  `init_noise_sigma` = sqrt(σ(751)² + 1) = 4.2364 (the *schedule's* first σ, not the training σ_max:",
        "  diffusers uses sqrt(σ² + 1) for leading spacing, σ for linspace/trailing). DPM++ 2M with the same",
        "  config: 801, 601, 401, 201. Turbo's trailing Euler-a at 1 step: timestep 999, init σ 14.6146, one",
        "  noise draw.",
        "- The tiny UNet down/upsamples once, so latent sides must be even (image sides multiples of 16); odd",
        "  latent sides fail in onnxruntime (see `unet_size_probe` in manifest.json). Real SDXL's UNet",
        "  downsamples twice: latent sides multiple of 4, image sides of 32.",
        "",
        "## Sensitivity of the images (mean / max |Δ| of float images in [0, 1], euler, 64×64, 4 steps)",
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
        "within 1e-3, PNGs ±1 level; token ids and `time_ids` exact; the embeddings (`prompt_embeds.npy` etc.)",
        "within 1e-4. Same-machine reproducibility: see below.",
        "",
        "## Rerun determinism",
        "",
    ]
    lines += g.rerun_lines("sdxl.py", rr)
    lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------------------------------


def main() -> None:
    args, out_root, work, t0 = g.script_start(__doc__, "sdxl-reference-")

    tar_path = out_root / TARBALL
    ref_dir = out_root / REF_DIR
    built = build_models(work, tar_path)
    model_dir = built["models_root"] / MODEL_NAME
    refs = build_references(built["models_root"], ref_dir, built["diffusers_dir"])
    tokens = build_tokens(model_dir, ref_dir / "tokens.json")
    facts = {**built["facts"], "tokenizer_2_bang": tokens, "torch_vs_ort": refs["torch_vs_ort"]}
    sessions = build_manifest(built["models_root"], out_root, built["tar_listing"], ref_dir / "manifest.json",
                              {"facts": facts, "sensitivity": refs["sensitivity"]})

    info = {"versions": g.versions(), "sensitivity": refs["sensitivity"], "sessions": sessions, "facts": facts,
            "records": refs["records"], "torch_vs_ort": refs["torch_vs_ort"]}
    if args.rerun_check:
        info["rerun"] = g.rerun_check_of(__file__, out_root, work, OUTPUT_PATHS, log)
    write_readme(ref_dir / "README.md", info)
    log.info("done in %.0f s", time.time() - t0)
    log.info("  %10d  %s", tar_path.stat().st_size, TARBALL)
    log.info("  %10d  %s/ (all files but README.md)", sum(
        p.stat().st_size for p in ref_dir.rglob("*") if p.is_file() and p.name != "README.md"), REF_DIR)
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
