#!/usr/bin/env python3
"""Tiny random-weight FLUX.1 (schnell-like, dev-like) and Stable Diffusion 3.5-like fixtures and reference
outputs for Sluice's diffusion worker (flow-matching models).

The flow-matching counterpart of generate.py / sdxl.py (whose helpers it imports: CLIP tokenizer files,
quantize_, the optimum export, set_name_or_path, injected_noise, deterministic tar packing, JSON/float/npz
helpers). Run it through `bash scripts/sd-reference/generate.sh --flow` (which makes the venv); a one-off
developer tool, not CI.

Steps:
  A. tokenizers     tokenizer/ (CLIP-L, generate.build_tokenizer: pad `<|endoftext|>` 49407), SD3's
                    tokenizer_2/ (CLIP-G: the same BPE files, pad "!" = id 0, sdxl.build_tokenizer_2) and a T5
                    tokenizer built locally: a SentencePiece unigram model (vocab 1000, T5's special ids pad 0,
                    eos 1, unk 2, no bos, nmt_nfkc normalization) trained single-threaded on a deterministic
                    corpus (the prompts plus sentences drawn from the CLIP vocabulary's words), loaded as
                    T5Tokenizer (100 `<extra_id_N>` tokens) and converted by transformers to T5TokenizerFast,
                    saved with `save_pretrained` (tokenizer.json, spiece.model, tokenizer_config.json,
                    special_tokens_map.json). tokenizer.json is T5 v1.1's structure: Precompiled charsmap
                    normalizer + whitespace handling, Metaspace pre-tokenizer, Unigram model, TemplateProcessing
                    appending `</s>`.
  B. models         text_encoder    CLIP-L: generate.py's CLIPTextModel (FLUX) / the same weights as
                                    CLIPTextModelWithProjection plus a seeded projection (SD3)
                    text_encoder_2  FLUX: T5EncoderModel (gated-gelu like T5 v1.1); SD3: sdxl.py's
                                    CLIPTextModelWithProjection (CLIP-G)
                    text_encoder_3  SD3: the same T5EncoderModel as FLUX's
                    transformer     FluxTransformer2DModel (guidance_embeds false = schnell-like, true = dev-like)
                                    / SD3Transformer2DModel (SD3.5-like: qk_norm rms_norm, one dual-attention layer)
                    vae             AutoencoderKL with 16 latent channels, no quant convs (FLUX: scaling 0.3611,
                                    shift 0.1159; SD3: 1.5305, 0.0609)
                    weights rounded like generate.py's (quantize_), saved as FluxPipeline /
                    StableDiffusion3Pipeline with the real checkpoints' scheduler configs, exported with optimum
                    (`--task text-to-image`) into `flux-schnell-tiny/`, `flux-dev-tiny/`, `sd3-tiny/`, packed into
                    integration-tests/fixtures/flow-tiny.tar.xz (generate.pack_tarball).
  D. references     integration-tests/fixtures/flow-reference/: ORTFluxPipeline / ORTStableDiffusion3Pipeline on
                    the unpacked tarball (CPU, one thread) with fixed initial latents: cases.json, per case
                    .npy/.npz/.png, tokens.json, manifest.json (ONNX I/O, sizes, sha256, torch-vs-ORT), README.md.
  E. rerun check    (--rerun-check) the whole script again in a fresh process into a scratch output root; every
                    output file is compared and the result goes into the README.

Usage: flow.py --out REPO_ROOT [--work DIR] [--rerun-check]
Needs HF_HUB_OFFLINE=1 (set by generate.sh); never touches the network or a model hub.
"""

from __future__ import annotations

import functools
import io
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
import torch  # noqa: E402

import transformers  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (  # noqa: E402
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    T5TokenizerFast,
)

# --------------------------------------------------------------------------------------------------
# Fixed inputs
# --------------------------------------------------------------------------------------------------

SCHNELL, DEV, SD3 = "flux-schnell-tiny", "flux-dev-tiny", "sd3-tiny"
MODEL_NAMES = [SCHNELL, DEV, SD3]
TARBALL = "integration-tests/fixtures/flow-tiny.tar.xz"
REF_DIR = "integration-tests/fixtures/flow-reference"
OUTPUT_PATHS = [TARBALL, REF_DIR]

PROMPT = g.PROMPT
NEGATIVE_PROMPT = g.NEGATIVE_PROMPT
LONG_PROMPT = g.LONG_PROMPT
FLUX_PARTS = ("text_encoder", "text_encoder_2", "transformer", "vae_decoder", "vae_encoder")
SD3_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder", "vae_encoder")

# black-forest-labs/FLUX.1-schnell scheduler/scheduler_config.json
FLUX_SCHNELL_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.29.0.dev0",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
}
# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json
FLUX_DEV_SCHEDULER = {
    **FLUX_SCHNELL_SCHEDULER,
    "_diffusers_version": "0.30.0.dev0",
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
# stabilityai/stable-diffusion-3.5-large (and -medium, SD3 medium) scheduler/scheduler_config.json
SD35_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.31.0.dev0",
    "num_train_timesteps": 1000,
    "shift": 3.0,
}

# --- T5 tokenizer (SentencePiece unigram trained here) ---
T5_SPM_VOCAB = 1000
T5_EXTRA_IDS = 100
T5_MODEL_MAX_LENGTH = 512
T5_CORPUS_SEED = 77
T5_CORPUS_SENTENCES = 6000
# A few non-ASCII words so that the vocabulary has some accented letters (CJK, emoji etc. stay <unk>).
T5_CORPUS_EXTRA = ["café", "naïve", "über", "façade", "jalapeño", "crème brûlée", "smörgåsbord", "Zürich", "São Paulo",
                   "El Niño", "résumé", "piñata", "Ångström", "déjà vu", "fiancée", "Москва"]

# --- models ---
T5_CONFIG = dict(
    vocab_size=1152,  # 1100 tokenizer ids rounded up to a multiple of 128 (T5 v1.1: 32100 -> 32128)
    d_model=96,       # > 32 + 32 (SD3 zero-pads the concatenated CLIP embeddings up to the T5 width)
    d_kv=16,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=2,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",  # T5 v1.1 (dense_act_fn gelu_new, gated)
    is_encoder_decoder=True,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
T5_SEED = 20
CLIP_L_PROJECTION_SEED = 21  # SD3's CLIP-L: generate.py's CLIPTextModel weights + a seeded text_projection
FLUX_TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=T5_CONFIG["d_model"],
    pooled_projection_dim=g.TEXT_ENCODER_CONFIG["hidden_size"],
    axes_dims_rope=(4, 6, 6),
)
FLUX_SCHNELL_SEED, FLUX_DEV_SEED = 30, 31
SD3_TRANSFORMER_CONFIG = dict(
    sample_size=8,  # default 64x64 images
    patch_size=2,
    in_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=T5_CONFIG["d_model"],
    caption_projection_dim=32,  # = num_attention_heads * attention_head_dim
    pooled_projection_dim=g.TEXT_ENCODER_CONFIG["projection_dim"] + sdxl.TEXT_ENCODER_2_CONFIG["projection_dim"],
    out_channels=16,
    pos_embed_max_size=16,  # patches per side: 96-pixel side = 12 latents = 6 patches
    dual_attention_layers=(0,),  # SD3.5 medium style (SD3.5 large: none)
    qk_norm="rms_norm",  # SD3.5
)
SD3_TRANSFORMER_SEED = 32
# generate.py's tiny VAE with FLUX's and SD3's 16 latent channels and no (post-)quant convs; each
# family sets its own scaling and shift factors below.
VAE_FLOW_BASE = {**g.VAE_CONFIG, "latent_channels": 16, "use_quant_conv": False, "use_post_quant_conv": False}
FLUX_VAE_CONFIG = {**VAE_FLOW_BASE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
SD3_VAE_CONFIG = {**VAE_FLOW_BASE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
FLUX_VAE_SEED, SD3_VAE_SEED = 40, 41

T5_TOKEN_PROMPTS = [
    "café naïve über Zürich",
    "東京の夜景 and a 🚀 rocket",
    "tabs\tand\nnewlines\r\nmixed",
    "a    lot     of      spaces",
    "trailing space ",
    " leading space",
    "<extra_id_0> and </s> and <pad> as text",
    "UPPER lower MiXeD 12345 3.14159",
    "ﬁ ligature, full-width ＡＢＣ, ① circled",
    "hyphen-ated, under_scored, dot.ted",
]

log = logging.getLogger("flow-reference")


def very_long_prompt() -> str:
    """~600 words (more than 512 T5 tokens)."""
    words = ("the quick brown fox jumps over the lazy dog near a quiet river under a pale moon while "
             "distant mountains glow softly in the evening light").split()
    return " ".join(words[i % len(words)] for i in range(600))


# --------------------------------------------------------------------------------------------------
# A. Tokenizers
# --------------------------------------------------------------------------------------------------


def t5_corpus() -> list[str]:
    """Deterministic training text: the fixture prompts plus sentences of words from CLIP's vocabulary."""
    merges = g.clip_bpe_merges()
    words = []
    seen = set()
    for a, b in merges:
        tok = a + b
        if tok.endswith("</w>"):
            w = tok[:-4]
            if w.isalpha() and w.isascii() and len(w) > 1 and w not in seen:
                seen.add(w)
                words.append(w)
        if len(words) >= 6000:
            break
    rng = np.random.default_rng(T5_CORPUS_SEED)
    weights = 1.0 / (np.arange(len(words)) + 20.0)
    weights /= weights.sum()
    punct = [".", ",", "!", "?", ";", ":", "", "", ""]
    lines = []
    for _ in range(T5_CORPUS_SENTENCES):
        k = int(rng.integers(4, 16))
        idx = rng.choice(len(words), size=k, p=weights)
        sent = [words[i] for i in idx]
        if rng.random() < 0.3:
            sent[0] = sent[0].capitalize()
        if rng.random() < 0.1:
            sent.insert(int(rng.integers(0, k)), str(int(rng.integers(0, 2000))))
        if rng.random() < 0.05:
            sent.insert(int(rng.integers(0, k)), T5_CORPUS_EXTRA[int(rng.integers(0, len(T5_CORPUS_EXTRA)))])
        lines.append(" ".join(sent) + punct[int(rng.integers(0, len(punct)))])
    prompts = list(g.TOKEN_PROMPTS) + [PROMPT, NEGATIVE_PROMPT, LONG_PROMPT] + T5_CORPUS_EXTRA
    return lines + prompts * 5


def train_spm(out_path: Path) -> dict:
    import sentencepiece as spm

    corpus = t5_corpus()
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=buf,
        model_type="unigram",
        vocab_size=T5_SPM_VOCAB,
        character_coverage=1.0,
        normalization_rule_name="nmt_nfkc",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    out_path.write_bytes(buf.getvalue())
    return {"corpus_sentences": len(corpus), "corpus_chars": sum(len(s) for s in corpus),
            "spm_vocab_size": T5_SPM_VOCAB, "spm_model_sha256": g.sha256(out_path)}


def build_t5_tokenizer(out_dir: Path, work: Path) -> dict:
    """A T5 v1.1-structured tokenizer: spiece.model trained here, T5Tokenizer -> T5TokenizerFast."""
    work.mkdir(parents=True, exist_ok=True)
    spm_path = work / "spiece.model"
    info = train_spm(spm_path)
    # legacy=True and add_prefix_space=True as FLUX.1's tokenizer_2/tokenizer_config.json (Metaspace prepends
    # "▁" to the text: prepend_scheme "always"); without add_prefix_space the converter writes "never".
    slow = T5Tokenizer(vocab_file=str(spm_path), extra_ids=T5_EXTRA_IDS, legacy=True, add_prefix_space=True,
                       model_max_length=T5_MODEL_MAX_LENGTH)
    fast = T5TokenizerFast(vocab_file=str(spm_path), extra_ids=T5_EXTRA_IDS, legacy=True, add_prefix_space=True,
                           from_slow=True, model_max_length=T5_MODEL_MAX_LENGTH)
    assert len(fast) == T5_SPM_VOCAB + T5_EXTRA_IDS, len(fast)
    assert fast.pad_token_id == 0 and fast.eos_token_id == 1 and fast.unk_token_id == 2
    assert fast.convert_tokens_to_ids("<extra_id_0>") == len(fast) - 1
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # no hub names / build paths in the saved config
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.pop("name_or_path", None)
    g.write_json(cfg_path, cfg)
    tj = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))
    structure = {
        "normalizer": [n["type"] for n in tj["normalizer"]["normalizers"]] if tj["normalizer"]["type"] == "Sequence"
        else [tj["normalizer"]["type"]],
        "normalizer_replace": [n for n in tj["normalizer"].get("normalizers", []) if n["type"] != "Precompiled"],
        "pre_tokenizer": tj["pre_tokenizer"],
        "post_processor": tj["post_processor"]["type"],
        "decoder": tj["decoder"],
        "model": tj["model"]["type"],
        "unk_id": tj["model"]["unk_id"],
        "vocab_size": len(tj["model"]["vocab"]),
        "byte_fallback": tj["model"].get("byte_fallback"),
    }
    assert structure["model"] == "Unigram" and structure["post_processor"] == "TemplateProcessing", structure
    assert structure["normalizer"][0] == "Precompiled", structure
    reloaded = T5TokenizerFast.from_pretrained(str(out_dir))
    ids = reloaded(PROMPT).input_ids
    assert ids[-1] == 1 and 2 not in ids, ids
    assert ids == slow(PROMPT).input_ids, (ids, slow(PROMPT).input_ids)
    log.info("A. T5 tokenizer: %d ids, %r -> %s; tokenizer.json %s", len(reloaded), PROMPT, ids, structure["normalizer"])
    return {**info, "tokenizer_json_structure": structure, "files": sorted(p.name for p in out_dir.iterdir())}


def build_tokenizers(work: Path) -> tuple[dict[str, Path], dict]:
    dirs = {"clip_l": work / "tokenizer", "clip_g": work / "tokenizer_clip_g", "t5": work / "tokenizer_t5"}
    info = {"clip": g.build_tokenizer(dirs["clip_l"])}
    sdxl.build_tokenizer_2(dirs["clip_l"], dirs["clip_g"])
    info["t5"] = build_t5_tokenizer(dirs["t5"], work / "spm")
    return dirs, info


# --------------------------------------------------------------------------------------------------
# B. Models, export, packing
# --------------------------------------------------------------------------------------------------


def build_t5() -> T5EncoderModel:
    torch.manual_seed(T5_SEED)
    model = T5EncoderModel(T5Config(**T5_CONFIG)).eval()
    g.quantize_(model)
    return model


def build_clip_l_with_projection(clip_l: CLIPTextModel) -> CLIPTextModelWithProjection:
    """SD3's text_encoder: the same CLIP-L weights (as the real SD3/FLUX checkpoints share CLIP-L) with a
    text_projection (SD3 uses `text_embeds` as the pooled embedding)."""
    model = CLIPTextModelWithProjection(CLIPTextConfig(**g.TEXT_ENCODER_CONFIG)).eval()
    missing, unexpected = model.load_state_dict(clip_l.state_dict(), strict=False)
    assert missing == ["text_projection.weight"] and not unexpected, (missing, unexpected)
    torch.manual_seed(CLIP_L_PROJECTION_SEED)
    with torch.no_grad():
        w = model.text_projection.weight
        w.copy_(torch.randn_like(w) * (1.0 / math.sqrt(w.shape[1])))
    g.quantize_(model.text_projection)
    return model


def build_flux_transformer(seed: int, guidance_embeds: bool) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**FLUX_TRANSFORMER_CONFIG, guidance_embeds=guidance_embeds).eval()
    g.quantize_(model)
    return model


def build_sd3_transformer() -> SD3Transformer2DModel:
    torch.manual_seed(SD3_TRANSFORMER_SEED)
    model = SD3Transformer2DModel(**SD3_TRANSFORMER_CONFIG).eval()
    g.quantize_(model)
    return model


def build_vae(config: dict, seed: int) -> AutoencoderKL:
    torch.manual_seed(seed)
    model = AutoencoderKL(**config).eval()
    g.quantize_(model)
    return model


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def save_diffusers_pipelines(work: Path, tok_dirs: dict[str, Path]) -> tuple[dict[str, Path], dict]:
    clip_l = g.build_text_encoder()
    t5 = build_t5()
    flux_vae = build_vae(FLUX_VAE_CONFIG, FLUX_VAE_SEED)
    tok_l = CLIPTokenizer.from_pretrained(str(tok_dirs["clip_l"]))
    tok_g = CLIPTokenizer.from_pretrained(str(tok_dirs["clip_g"]))
    tok_t5 = T5TokenizerFast.from_pretrained(str(tok_dirs["t5"]))
    dirs = {name: work / "diffusers" / name for name in MODEL_NAMES}
    params = {"clip_l": n_params(clip_l), "t5": n_params(t5), "flux_vae": n_params(flux_vae)}
    for name, seed, guidance, sched in ((SCHNELL, FLUX_SCHNELL_SEED, False, FLUX_SCHNELL_SCHEDULER),
                                        (DEV, FLUX_DEV_SEED, True, FLUX_DEV_SCHEDULER)):
        transformer = build_flux_transformer(seed, guidance)
        params[f"{name}/transformer"] = n_params(transformer)
        FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(sched), vae=flux_vae, text_encoder=clip_l,
            tokenizer=tok_l, text_encoder_2=t5, tokenizer_2=tok_t5, transformer=transformer,
        ).save_pretrained(str(dirs[name]))
    clip_l_proj = build_clip_l_with_projection(clip_l)
    clip_g = sdxl.build_text_encoder_2()
    # CLIP-G gets CLIP-L's token embedding table (49408 x 32, most of each encoder's weights): xz then stores it
    # once, which keeps the tarball under 3 MB. All other CLIP-G weights are its own (sdxl.py's seed).
    with torch.no_grad():
        clip_g.text_model.embeddings.token_embedding.weight.copy_(clip_l.text_model.embeddings.token_embedding.weight)
    sd3_transformer = build_sd3_transformer()
    sd3_vae = build_vae(SD3_VAE_CONFIG, SD3_VAE_SEED)
    params.update({"clip_g": n_params(clip_g), f"{SD3}/transformer": n_params(sd3_transformer),
                   "sd3_vae": n_params(sd3_vae)})
    StableDiffusion3Pipeline(
        transformer=sd3_transformer, scheduler=FlowMatchEulerDiscreteScheduler.from_config(SD35_SCHEDULER),
        vae=sd3_vae, text_encoder=clip_l_proj, tokenizer=tok_l, text_encoder_2=clip_g, tokenizer_2=tok_g,
        text_encoder_3=t5, tokenizer_3=tok_t5,
    ).save_pretrained(str(dirs[SD3]))
    log.info("B. diffusers pipelines saved; parameters: %s", params)
    return dirs, params


def finish_layout(out_dir: Path, tok_dirs: dict[str, Path], scheduler: dict, family: str) -> dict:
    """The shipped scheduler config and the tokenizer files built in A instead of what the export re-saved."""
    g.write_json(out_dir / "scheduler" / "scheduler_config.json", scheduler)
    wanted = ({"tokenizer": tok_dirs["clip_l"], "tokenizer_2": tok_dirs["t5"]} if family == "flux" else
              {"tokenizer": tok_dirs["clip_l"], "tokenizer_2": tok_dirs["clip_g"], "tokenizer_3": tok_dirs["t5"]})
    exported = {}
    for name, src in wanted.items():
        exported[name] = sorted(p.name for p in (out_dir / name).iterdir()) if (out_dir / name).exists() else None
        if (out_dir / name).exists():
            shutil.rmtree(out_dir / name)
        shutil.copytree(src, out_dir / name)
    g.set_name_or_path(out_dir)
    index = json.loads((out_dir / "model_index.json").read_text())
    want_cls = "FluxPipeline" if family == "flux" else "StableDiffusion3Pipeline"
    assert index["_class_name"] == want_cls, index
    parts = FLUX_PARTS if family == "flux" else SD3_PARTS
    for part in parts + tuple(wanted) + ("scheduler",):
        assert (out_dir / part).is_dir(), part
    return {"tokenizer_files_as_exported": exported}


def check_t5_onnx(diffusers_dir: Path, model_dir: Path, part: str) -> dict:
    tok = T5TokenizerFast.from_pretrained(str(model_dir / ("tokenizer_2" if part == "text_encoder_2" else "tokenizer_3")))
    ids = np.array([tok(PROMPT, padding="max_length", max_length=64, truncation=True).input_ids], dtype=np.int64)
    model = T5EncoderModel.from_pretrained(str(diffusers_dir / part)).eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).last_hidden_state.numpy()
    sess = sdxl.session(model_dir / part / "model.onnx")
    out = sess.run(None, {"input_ids": ids})[0]
    d = float(np.abs(out - ref).max())
    assert d < 1e-4, d
    return {"max_abs_diff_onnx_vs_torch": d, "outputs": [o.name for o in sess.get_outputs()]}


def build_models(work: Path, tar_path: Path) -> dict:
    tok_dirs, tok_info = build_tokenizers(work)
    diff_dirs, params = save_diffusers_pipelines(work, tok_dirs)
    onnx_root = work / "onnx"
    layout = {}
    for name, sched, family in ((SCHNELL, FLUX_SCHNELL_SCHEDULER, "flux"), (DEV, FLUX_DEV_SCHEDULER, "flux"),
                                (SD3, SD35_SCHEDULER, "sd3")):
        g.export_onnx(diff_dirs[name], onnx_root / name)
        layout[name] = finish_layout(onnx_root / name, tok_dirs, sched, family)
    listing = g.pack_tarball(onnx_root, tar_path, MODEL_NAMES)

    unpacked = work / "unpacked"
    if unpacked.exists():
        shutil.rmtree(unpacked)
    unpacked.mkdir()
    with tarfile.open(tar_path, "r:xz") as tar:
        tar.extractall(unpacked, filter="data")
    facts = {
        "parameters": params,
        "tokenizers": tok_info,
        "layout": layout,
        "t5_onnx_vs_torch": {
            SCHNELL: check_t5_onnx(diff_dirs[SCHNELL], unpacked / SCHNELL, "text_encoder_2"),
            SD3: check_t5_onnx(diff_dirs[SD3], unpacked / SD3, "text_encoder_3"),
        },
    }
    return {"tar_listing": listing, "models_root": unpacked, "diffusers_dirs": diff_dirs, "facts": facts}


# --------------------------------------------------------------------------------------------------
# D. Pipeline references
# --------------------------------------------------------------------------------------------------


def load_pipeline(model_dir: Path):
    from optimum.onnxruntime import ORTFluxPipeline, ORTStableDiffusion3Pipeline

    index = json.loads((model_dir / "model_index.json").read_text())
    cls = ORTFluxPipeline if index["_class_name"] == "FluxPipeline" else ORTStableDiffusion3Pipeline
    pipe = cls.from_pretrained(str(model_dir), provider="CPUExecutionProvider", session_options=g.cpu_session_options(),
                               export=False, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class TimestepSpy:
    """Records the keyword arguments of scheduler.set_timesteps (the pipeline's sigmas= and mu=)."""

    def __init__(self, scheduler):
        self.kwargs = []
        original = scheduler.set_timesteps

        @functools.wraps(original)  # the pipeline inspects the signature (accepts sigmas=?)
        def set_timesteps(*args, **kwargs):
            self.kwargs.append({"args": args, **kwargs})
            return original(*args, **kwargs)

        scheduler.set_timesteps = set_timesteps


def np_or_none(x):
    return None if x is None else (x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)).astype(np.float32)


def run_case(models_root: Path, case: dict) -> dict:
    pipe = load_pipeline(models_root / case["model"])
    flux = case["family"] == "flux"
    n, h, w = case["num_images"], case["height"], case["width"]
    lh, lw = h // 8, w // 8
    rng = np.random.default_rng(case["seed"])
    latents_in = rng.standard_normal((n, 16, lh, lw), dtype=np.float32)
    msl = case["max_sequence_length"]
    parts = FLUX_PARTS[:-1] if flux else SD3_PARTS[:-1]
    if flux:
        feed_latents = FluxPipeline._pack_latents(torch.from_numpy(latents_in.copy()), n, 16, lh, lw)
        kwargs = dict(prompt=case["prompt"], guidance_scale=case["guidance_scale"], num_inference_steps=case["steps"],
                      width=w, height=h, num_images_per_prompt=n, max_sequence_length=msl)
        pipe_module_cls = FluxPipeline
    else:
        feed_latents = torch.from_numpy(latents_in.copy())
        kwargs = dict(prompt=case["prompt"], negative_prompt=case["negative_prompt"],
                      guidance_scale=case["guidance_scale"], num_inference_steps=case["steps"], width=w, height=h,
                      num_images_per_prompt=n, max_sequence_length=msl)
        pipe_module_cls = StableDiffusion3Pipeline
    results = {}
    for output_type in ("latent", "np"):
        rec = sdxl.Recorder(pipe, parts)
        spy = TimestepSpy(pipe.scheduler)
        # flow-matching Euler draws no noise; any draw in the scheduler or pipeline module fails loudly
        with g.injected_noise(FlowMatchEulerDiscreteScheduler, None), g.injected_noise(pipe_module_cls, None):
            out = pipe(**kwargs, latents=feed_latents.clone(), output_type=output_type)
        rec.close()
        del pipe.scheduler.set_timesteps
        img = out.images
        results[output_type] = {
            "images": img.numpy() if isinstance(img, torch.Tensor) else np.asarray(img),
            "calls": rec.calls,
            "timesteps": pipe.scheduler.timesteps.clone(),
            "sigmas": pipe.scheduler.sigmas.clone(),
            "set_timesteps": spy.kwargs,
        }
    lat, npy = results["latent"], results["np"]
    for k in parts[:-1]:  # all but the vae_decoder (not run for output_type "latent")
        assert len(lat["calls"][k]) == len(npy["calls"][k]), (case["name"], k)
        for a, b in zip(lat["calls"][k], npy["calls"][k]):
            assert all(np.array_equal(a["feed"][x], b["feed"][x]) for x in a["feed"]), (case["name"], k)
    scaling = float(pipe.vae.config.scaling_factor)
    shift = float(pipe.vae.config.shift_factor)
    final = torch.from_numpy(lat["images"].astype(np.float32))
    if flux:
        unpacked = FluxPipeline._unpack_latents(final, h, w, pipe.vae_scale_factor)
    else:
        unpacked = final
    expected_latents = unpacked.numpy().astype(np.float32)
    assert expected_latents.shape == (n, 16, lh, lw), expected_latents.shape
    decoded_in = npy["calls"]["vae_decoder"][0]["feed"]["latent_sample"]
    assert np.array_equal(decoded_in, ((unpacked / scaling) + shift).numpy()), case["name"]
    images = npy["images"].astype(np.float32)

    tr_calls = npy["calls"]["transformer"]
    feed0 = tr_calls[0]["feed"]
    sti = npy["set_timesteps"]
    assert len(sti) == 1, sti
    obs = {
        "latents_in": latents_in,
        "expected_latents": expected_latents,
        "images": images,
        "first_transformer_feed": {k: np.asarray(v) for k, v in feed0.items()},
        "transformer_calls": len(tr_calls),
        "transformer_feed_dtypes": {k: str(v.dtype) for k, v in sorted(feed0.items())},
        "transformer_feed_shapes": {k: list(v.shape) for k, v in sorted(feed0.items())},
        "transformer_timestep_feed": [g.f32(c["feed"]["timestep"]) for c in tr_calls],
        "timesteps": g.f32(npy["timesteps"].numpy()),
        "sigmas": g.f32(npy["sigmas"].numpy()),
        "vae_scaling_factor": scaling,
        "vae_shift_factor": shift,
        "scheduler_config": g.plain_config(pipe.scheduler.config),
        "pipeline_class": type(pipe).__name__,
        "tokenizer_classes": [type(pipe.tokenizer).__name__, type(pipe.tokenizer_2).__name__]
        + ([type(pipe.tokenizer_3).__name__] if not flux else []),
    }
    sigmas_passed = sti[0].get("sigmas")
    obs["set_timesteps_kwargs"] = {
        "num_inference_steps": sti[0]["args"][0] if sti[0]["args"] else sti[0].get("num_inference_steps"),
        "sigmas": None if sigmas_passed is None else [float(s) for s in np.asarray(sigmas_passed, dtype=np.float64)],
        "mu": None if sti[0].get("mu") is None else float(sti[0]["mu"]),
    }
    # the packed latents given are the first transformer input as is
    assert np.array_equal(feed0["hidden_states"][:n] if not flux else feed0["hidden_states"],
                          feed_latents.numpy()), case["name"]
    with torch.no_grad():
        if flux:
            te1, te2 = npy["calls"]["text_encoder"], npy["calls"]["text_encoder_2"]
            assert len(te1) == 1 and len(te2) == 1, (len(te1), len(te2))
            pe, ppe, text_ids = pipe.encode_prompt(prompt=case["prompt"], prompt_2=None, device=torch.device("cpu"),
                                                   num_images_per_prompt=n, max_sequence_length=msl)
            embeds = {"prompt_embeds": np_or_none(pe), "pooled_prompt_embeds": np_or_none(ppe),
                      "negative_prompt_embeds": None, "negative_pooled_prompt_embeds": None}
            assert np.array_equal(feed0["encoder_hidden_states"], embeds["prompt_embeds"])
            assert np.array_equal(feed0["pooled_projections"], embeds["pooled_prompt_embeds"])
            assert np.array_equal(np.repeat(te1[0]["out"]["pooler_output"], n, 0), embeds["pooled_prompt_embeds"])
            assert np.array_equal(np.repeat(te2[0]["out"]["last_hidden_state"], n, 0), embeds["prompt_embeds"])
            assert np.array_equal(feed0["txt_ids"], np.zeros((msl, 3), np.float32))
            obs.update({
                "clip_ids": te1[0]["feed"]["input_ids"][0].astype(int).tolist(),
                "clip_g_ids": None,
                "t5_ids": te2[0]["feed"]["input_ids"][0].astype(int).tolist(),
                "negative_clip_ids": None, "negative_clip_g_ids": None, "negative_t5_ids": None,
                "mu": obs["set_timesteps_kwargs"]["mu"],
                "transformer_batch": int(feed0["hidden_states"].shape[0]),
                "guidance_feed": None if "guidance" not in feed0 else g.f32(feed0["guidance"]),
            })
        else:
            te1, te2, te3 = (npy["calls"][k] for k in ("text_encoder", "text_encoder_2", "text_encoder_3"))
            cfg = case["guidance_scale"] > 1.0
            assert len(te1) == len(te2) == len(te3) == (2 if cfg else 1), (len(te1), len(te2), len(te3))
            pe, npe, ppe, nppe = pipe.encode_prompt(
                prompt=case["prompt"], prompt_2=None, prompt_3=None, device=torch.device("cpu"),
                num_images_per_prompt=n, do_classifier_free_guidance=cfg, negative_prompt=case["negative_prompt"],
                max_sequence_length=msl)
            embeds = {"prompt_embeds": np_or_none(pe), "pooled_prompt_embeds": np_or_none(ppe),
                      "negative_prompt_embeds": np_or_none(npe), "negative_pooled_prompt_embeds": np_or_none(nppe)}
            # prompt_embeds = [pad(concat(CLIP-L hidden_states[-2], CLIP-G hidden_states[-2]), T5 width) ; T5]
            pen1 = f"hidden_states.{pipe.text_encoder.config.num_hidden_layers - 1}"
            pen2 = f"hidden_states.{pipe.text_encoder_2.config.num_hidden_layers - 1}"

            def assemble(i):
                clip = np.concatenate([te1[i]["out"][pen1], te2[i]["out"][pen2]], -1)
                t5 = te3[i]["out"]["last_hidden_state"]
                clip = np.pad(clip, ((0, 0), (0, 0), (0, t5.shape[-1] - clip.shape[-1])))
                pooled = np.concatenate([te1[i]["out"]["text_embeds"], te2[i]["out"]["text_embeds"]], -1)
                return np.repeat(np.concatenate([clip, t5], -2), n, 0), np.repeat(pooled, n, 0)

            joined, pooled = assemble(0)
            assert np.array_equal(joined, embeds["prompt_embeds"]), case["name"]
            assert np.array_equal(pooled, embeds["pooled_prompt_embeds"]), case["name"]
            ehs, pp = feed0["encoder_hidden_states"], feed0["pooled_projections"]
            if cfg:
                njoined, npooled = assemble(1)
                assert np.array_equal(njoined, embeds["negative_prompt_embeds"])
                assert np.array_equal(npooled, embeds["negative_pooled_prompt_embeds"])
                assert np.array_equal(ehs[:n], embeds["negative_prompt_embeds"]) and np.array_equal(ehs[n:], joined)
                assert np.array_equal(pp[:n], embeds["negative_pooled_prompt_embeds"]) and np.array_equal(pp[n:], pooled)
                assert np.array_equal(feed0["hidden_states"][n:], feed_latents.numpy())
            else:
                assert embeds["negative_prompt_embeds"] is None
                assert np.array_equal(ehs, joined) and np.array_equal(pp, pooled)
            ids = lambda calls, i: None if i >= len(calls) else calls[i]["feed"]["input_ids"][0].astype(int).tolist()  # noqa: E731
            obs.update({
                "clip_ids": ids(te1, 0), "clip_g_ids": ids(te2, 0), "t5_ids": ids(te3, 0),
                "negative_clip_ids": ids(te1, 1), "negative_clip_g_ids": ids(te2, 1), "negative_t5_ids": ids(te3, 1),
                "mu": None,
                "transformer_batch": int(feed0["hidden_states"].shape[0]),
                "guidance_feed": None,
            })
    obs["embeds"] = embeds
    for c in tr_calls[1:]:
        for k in feed0:
            if k not in ("hidden_states", "timestep"):
                assert np.array_equal(c["feed"][k], feed0[k]), (case["name"], k)
    return obs


def reference_cases() -> list[dict]:
    flux = dict(family="flux", negative_prompt=None, prompt=PROMPT, width=64, height=64, num_images=1,
                max_sequence_length=512, notes="")
    schnell = dict(flux, model=SCHNELL, guidance_scale=0.0)
    dev = dict(flux, model=DEV)
    sd3 = dict(family="sd3", model=SD3, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, guidance_scale=5.0, steps=4,
               width=64, height=64, num_images=1, max_sequence_length=256, notes="")
    return [
        {**schnell, "name": "schnell_64_1step", "steps": 1, "seed": 3000,
         "notes": "FLUX.1-schnell config (shift 1, no dynamic shifting): one step from sigma 1 to 0."},
        {**schnell, "name": "schnell_64_4step", "steps": 4, "seed": 3001,
         "notes": "sigmas = linspace(1, 1/4, 4) + [0] unshifted; guidance_scale is ignored (no guidance input)."},
        {**schnell, "name": "schnell_96x64_4step_batch2", "steps": 4, "width": 96, "height": 64, "num_images": 2,
         "seed": 3002,
         "notes": "width 96 height 64: latents [2, 16, 8, 12], packed [2, 24, 64]; img_ids [24, 3] (row, col) "
                  "of the 4x6 patch grid; the two images share the text embeddings."},
        {**schnell, "name": "schnell_long_prompt", "steps": 2, "prompt": LONG_PROMPT, "seed": 3003,
         "notes": "prompt longer than 77 CLIP tokens: CLIP truncates to bos + 75 + eos; T5 (512) does not truncate."},
        {**schnell, "name": "schnell_long_prompt_t5_truncated", "steps": 2, "prompt": LONG_PROMPT,
         "max_sequence_length": 64, "seed": 3004,
         "notes": "max_sequence_length 64: T5 truncates to 63 tokens + </s> (txt_ids [64, 3], encoder_hidden_states "
                  "[1, 64, 96]); CLIP truncates too."},
        {**dev, "name": "dev_64_4step_g35", "steps": 4, "guidance_scale": 3.5, "seed": 3100,
         "notes": "FLUX.1-dev config (use_dynamic_shifting, mu from the packed sequence length 16); guidance 3.5 "
                  "goes in as the float32 `guidance` input [batch] (not multiplied by 1000 in the pipeline)."},
        {**dev, "name": "dev_96x64_2step_g5_batch2", "steps": 2, "guidance_scale": 5.0, "width": 96, "height": 64,
         "num_images": 2, "seed": 3101,
         "notes": "dev at width 96 height 64, two images, guidance 5.0: image_seq_len 24 for mu."},
        {**sd3, "name": "sd3_64_4step_cfg5_neg", "seed": 3200,
         "notes": "CFG batches [uncond, cond]; the negative prompt goes through all three encoders."},
        {**sd3, "name": "sd3_guidance_1", "guidance_scale": 1.0, "seed": 3200,
         "notes": "guidance <= 1: no CFG (transformer batch = num_images), the negative prompt is not encoded. "
                  "Same seed as sd3_64_4step_cfg5_neg."},
        {**sd3, "name": "sd3_96x64_batch2", "width": 96, "height": 64, "num_images": 2, "seed": 3201,
         "notes": "width 96 height 64, two images: transformer batch 4 = [uncond x2, cond x2]."},
        {**sd3, "name": "sd3_1step", "steps": 1, "seed": 3202,
         "notes": "one step: sigmas [1, 0]."},
        {**sd3, "name": "sd3_absent_negative", "negative_prompt": None, "seed": 3200,
         "notes": "negative_prompt None with CFG: encoded as \"\" by all three encoders (SD3 has no "
                  "force_zeros_for_empty_prompt). Same seed as sd3_64_4step_cfg5_neg."},
        {**sd3, "name": "sd3_long_prompt", "prompt": LONG_PROMPT, "steps": 2, "seed": 3203,
         "notes": "prompt longer than 77 CLIP tokens (both CLIPs truncate); T5 at 256 does not."},
    ]


def build_references(models_root: Path, out: Path, diffusers_dirs: dict[str, Path]) -> dict:
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
        np.save(d / "expected_latents.npy", obs["expected_latents"])
        np.save(d / "expected_images.npy", obs["images"])
        embed_files = {}
        for k, v in obs["embeds"].items():
            if v is not None:
                np.save(d / f"{k}.npy", v)
            embed_files[k] = None if v is None else f"{name}/{k}.npy"
        sdxl.save_npz_checked(d / "first_transformer_feed.npz", obs["first_transformer_feed"], name)
        pngs = []
        for i, img in enumerate(obs["images"]):
            g.save_png(img, d / f"image_{i}.png")
            pngs.append(f"{name}/image_{i}.png")
        rec = {
            "name": name,
            "model": case["model"],
            "family": case["family"],
            "sampler": "flow_euler",
            "scheduler_class": "FlowMatchEulerDiscreteScheduler",
            "prompt": case["prompt"],
            "negative_prompt": case["negative_prompt"],
            "guidance_scale": case["guidance_scale"],
            "steps": case["steps"],
            "width": case["width"],
            "height": case["height"],
            "num_images": case["num_images"],
            "seed": case["seed"],
            "max_sequence_length": case["max_sequence_length"],
            "latents_in": f"{name}/latents_in.npy",
            "noise_in": None,
            "noise_draws": 0,
            "expected_latents": f"{name}/expected_latents.npy",
            "expected_images": pngs,
            "expected_images_f32": f"{name}/expected_images.npy",
            "clip_ids": obs["clip_ids"],
            "clip_g_ids": obs["clip_g_ids"],
            "t5_ids": obs["t5_ids"],
            "negative_clip_ids": obs["negative_clip_ids"],
            "negative_clip_g_ids": obs["negative_clip_g_ids"],
            "negative_t5_ids": obs["negative_t5_ids"],
            "mu": obs["mu"],
            "sigmas": obs["sigmas"],
            "timesteps": obs["timesteps"],
            "set_timesteps_kwargs": obs["set_timesteps_kwargs"],
            "transformer_timestep_feed": obs["transformer_timestep_feed"],
            "guidance_feed": obs["guidance_feed"],
            "transformer_batch": obs["transformer_batch"],
            "transformer_calls": obs["transformer_calls"],
            "vae_scaling_factor": obs["vae_scaling_factor"],
            "vae_shift_factor": obs["vae_shift_factor"],
            "first_transformer_feed": f"{name}/first_transformer_feed.npz",
            "first_transformer_feed_dtypes": obs["transformer_feed_dtypes"],
            "first_transformer_feed_shapes": obs["transformer_feed_shapes"],
            **embed_files,
            "pipeline_class": obs["pipeline_class"],
            "tokenizer_classes": obs["tokenizer_classes"],
            "scheduler_config": obs["scheduler_config"],
            "notes": case["notes"],
        }
        records.append(rec)
        log.info("D. %-34s %5.2f s  sigmas %s  mu %s  batch %d", name, time.time() - t0,
                 [round(s, 4) for s in obs["sigmas"]], obs["mu"], obs["transformer_batch"])

    o = obs_by_name
    # invariants
    assert o["sd3_guidance_1"]["transformer_batch"] == 1 and o["sd3_guidance_1"]["negative_clip_ids"] is None
    assert o["sd3_96x64_batch2"]["transformer_batch"] == 4
    assert o["sd3_absent_negative"]["negative_clip_ids"] == [49406] + [49407] * 76
    assert o["sd3_absent_negative"]["negative_t5_ids"] == [1] + [0] * 255
    assert o["schnell_long_prompt_t5_truncated"]["t5_ids"][-1] == 1 and 0 not in o["schnell_long_prompt_t5_truncated"]["t5_ids"]
    assert len(o["schnell_long_prompt_t5_truncated"]["t5_ids"]) == 64
    assert o["schnell_long_prompt"]["t5_ids"].count(1) == 1 and o["schnell_long_prompt"]["t5_ids"][-1] == 0
    assert o["dev_64_4step_g35"]["guidance_feed"] == [3.5]
    assert o["schnell_64_4step"]["guidance_feed"] is None
    assert not np.array_equal(o["sd3_absent_negative"]["images"], o["sd3_64_4step_cfg5_neg"]["images"])
    assert not np.array_equal(o["sd3_guidance_1"]["images"], o["sd3_64_4step_cfg5_neg"]["images"])

    torch_check = {
        "schnell_64_4step": torch_vs_ort(diffusers_dirs[SCHNELL], cases[1], o["schnell_64_4step"]),
        "dev_64_4step_g35": torch_vs_ort(diffusers_dirs[DEV], cases[5], o["dev_64_4step_g35"]),
        "sd3_64_4step_cfg5_neg": torch_vs_ort(diffusers_dirs[SD3], cases[7], o["sd3_64_4step_cfg5_neg"]),
    }
    g.write_json(out / "cases.json", records)
    return {"records": records, "obs": o, "torch_vs_ort": torch_check}


def torch_vs_ort(diffusers_dir: Path, case: dict, obs: dict) -> dict:
    """The torch pipeline on the diffusers directory the export was made from, same inputs."""
    n, h, w = case["num_images"], case["height"], case["width"]
    latents = torch.from_numpy(obs["latents_in"].copy())
    if case["family"] == "flux":
        pipe = FluxPipeline.from_pretrained(str(diffusers_dir), local_files_only=True)
        kwargs = dict(latents=FluxPipeline._pack_latents(latents, n, 16, h // 8, w // 8))
    else:
        pipe = StableDiffusion3Pipeline.from_pretrained(str(diffusers_dir), local_files_only=True)
        kwargs = dict(latents=latents, negative_prompt=case["negative_prompt"])
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        lat = pipe(prompt=case["prompt"], guidance_scale=case["guidance_scale"], num_inference_steps=case["steps"],
                   width=w, height=h, num_images_per_prompt=n, max_sequence_length=case["max_sequence_length"],
                   output_type="latent", **kwargs).images
        img = pipe(prompt=case["prompt"], guidance_scale=case["guidance_scale"], num_inference_steps=case["steps"],
                   width=w, height=h, num_images_per_prompt=n, max_sequence_length=case["max_sequence_length"],
                   output_type="np", **kwargs).images
    if case["family"] == "flux":
        lat = FluxPipeline._unpack_latents(lat, h, w, pipe.vae_scale_factor)
    d = float(np.abs(lat.numpy() - obs["expected_latents"]).max())
    di = float(np.abs(np.asarray(img, dtype=np.float32) - obs["images"]).max())
    log.info("D. torch vs ORT (%s): max |latent diff| %.3g, max |image diff| %.3g", case["name"], d, di)
    assert d < 1e-3, d
    return {"case": case["name"], "pipeline": type(pipe).__name__, "max_abs_latent_diff": float(f"{d:.2g}"),
            "max_abs_image_diff": float(f"{di:.2g}")}


def build_tokens(models_root: Path, path: Path) -> dict:
    tok_l = CLIPTokenizer.from_pretrained(str(models_root / SD3 / "tokenizer"))
    tok_g = CLIPTokenizer.from_pretrained(str(models_root / SD3 / "tokenizer_2"))
    t5_dir = models_root / SCHNELL / "tokenizer_2"
    t5 = T5TokenizerFast.from_pretrained(str(t5_dir))
    t5_slow = T5Tokenizer.from_pretrained(str(t5_dir))
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(t5_dir / "tokenizer.json"))
    long_text = very_long_prompt()
    prompts = list(g.TOKEN_PROMPTS) + T5_TOKEN_PROMPTS + [long_text]
    items, slow_differs = [], []
    for text in prompts:
        untr = t5(text).input_ids
        raw_ids = raw.encode(text).ids
        assert raw_ids == untr, (text, raw_ids, untr)
        slow_ids = t5_slow(text).input_ids
        if slow_ids != untr:
            slow_differs.append({"text": text, "fast": untr, "slow": slow_ids})
        item = {
            "text": text,
            "clip_ids": tok_l(text, padding="max_length", max_length=77, truncation=True).input_ids,
            "clip_g_ids": tok_g(text, padding="max_length", max_length=77, truncation=True).input_ids,
            "clip_untruncated_length": len(tok_l(text).input_ids),
            "t5_ids": t5(text, padding="max_length", max_length=512, truncation=True).input_ids,
            "t5_ids_256": t5(text, padding="max_length", max_length=256, truncation=True).input_ids,
            "t5_untruncated_ids": untr,
            "t5_tokens": t5.convert_ids_to_tokens(untr),
            "t5_untruncated_length": len(untr),
        }
        items.append(item)
    t5_items = [it for it in items if it["text"] in T5_TOKEN_PROMPTS]
    g.write_json(path, {
        "description": "Token ids for assorted prompts. clip_ids: slow CLIPTokenizer of tokenizer/ (pad <|endoftext|> "
                       "49407), clip_g_ids: SD3's tokenizer_2/ (pad \"!\" 0), both padding='max_length', max_length=77, "
                       "truncation=True. t5_ids / t5_ids_256: T5TokenizerFast (transformers " + transformers.__version__
                       + ") of flux-*/tokenizer_2 = sd3-tiny/tokenizer_3 (identical files) called as the pipelines do: "
                       "padding='max_length', truncation=True, max_length=512 (FLUX default) / 256 (SD3 default); pad "
                       "<pad> 0, </s> 1 appended, truncation keeps max_length-1 tokens + </s>. t5_untruncated_ids: "
                       "no padding/truncation; equal to `tokenizers` " + __import__("tokenizers").__version__
                       + " Tokenizer.from_file(tokenizer.json).encode(text).ids for every prompt (checked).",
        "t5_slow_tokenizer_differs": slow_differs,
        "prompts": items,
    })
    return {"t5_unk_prompts": [it["text"] for it in t5_items if 2 in it["t5_untruncated_ids"]],
            "slow_differs": [d["text"] for d in slow_differs],
            "very_long_prompt_t5_length": items[-1]["t5_untruncated_length"]}


def build_manifest(models_root: Path, out_root: Path, tar_listing: list[dict], path: Path, extra: dict) -> dict:
    sessions = {}
    for name in MODEL_NAMES:
        for part in (FLUX_PARTS if name != SD3 else SD3_PARTS):
            p = models_root / name / part / "model.onnx"
            m = onnx.load(str(p), load_external_data=False)
            sessions[f"{name}/{part}"] = {**g.onnx_io(p), "opset": [{"domain": o.domain, "version": o.version}
                                                                   for o in m.opset_import],
                                         "ir_version": m.ir_version}
    files = {TARBALL: {"size": (out_root / TARBALL).stat().st_size, "sha256": g.sha256(out_root / TARBALL)}}
    ref = out_root / REF_DIR
    for p in sorted(ref.rglob("*")):
        if p.is_file() and p.name not in ("manifest.json", "README.md"):
            files[p.relative_to(out_root).as_posix()] = {"size": p.stat().st_size, "sha256": g.sha256(p)}
    g.write_json(path, {
        "generator": "scripts/sd-reference/flow.py",
        "versions": versions(),
        "onnx_sessions": sessions,
        "tarball_contents": tar_listing,
        "files": files,
        **extra,
    })
    return sessions


def versions() -> dict:
    from importlib.metadata import version

    v = g.versions()
    v["sentencepiece"] = version("sentencepiece")
    v["tokenizers"] = version("tokenizers")
    return v


# --------------------------------------------------------------------------------------------------
# E. Rerun check and README
# --------------------------------------------------------------------------------------------------


def io_table(sessions: dict) -> list[str]:
    lines = ["| session | inputs | outputs (in session order) |", "|---|---|---|"]

    def fmt(args):
        return "<br>".join(f"`{a['name']}` {a['type'].replace('tensor(', '').rstrip(')')} "
                           f"[{', '.join(str(s) for s in a['shape'])}]" for a in args)

    for name, s in sessions.items():
        lines.append(f"| {name} | {fmt(s['inputs'])} | {fmt(s['outputs'])} |")
    return lines


def write_readme(path: Path, info: dict) -> None:
    v = info["versions"]
    rr = info.get("rerun")
    f = info["facts"]
    t5s = f["tokenizers"]["t5"]["tokenizer_json_structure"]
    tv = info["torch_vs_ort"]
    lines = [
        "# FLUX.1 / Stable Diffusion 3.5 reference outputs (tiny random-weight models)",
        "",
        "Made by `bash scripts/sd-reference/generate.sh --flow` (runs `scripts/sd-reference/flow.py`; a developer",
        "runs it once, the venv it needs is ~5 GB, so it is not part of CI). Do not edit these files by hand: rerun",
        "the script.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "## What is here",
        "- `../flow-tiny.tar.xz`: three Optimum ONNX layouts, exported with `optimum-cli export onnx --task",
        "  text-to-image` (Python API `main_export`) from diffusers pipelines built from tiny configs with seeded",
        "  random weights rounded to a per-tensor power-of-two grid:",
        "  - `flux-schnell-tiny/` (FluxPipeline; `model_index.json`, `scheduler/`, `tokenizer/`, `tokenizer_2/`,",
        "    `text_encoder/`, `text_encoder_2/`, `transformer/`, `vae_decoder/`, `vae_encoder/`): transformer",
        "    `guidance_embeds` false; scheduler = FLUX.1-schnell's file (shift 1.0, `use_dynamic_shifting` false).",
        "  - `flux-dev-tiny/`: the same layout, its own transformer weights with `guidance_embeds` true (ONNX input",
        "    `guidance`); scheduler = FLUX.1-dev's file (shift 3.0, `use_dynamic_shifting` true, base/max image seq",
        "    len 256/4096, base/max shift 0.5/1.15). Text encoders, tokenizers and VAE are identical to schnell's",
        "    (as in the real checkpoints).",
        "  - `sd3-tiny/` (StableDiffusion3Pipeline; plus `tokenizer_3/`, `text_encoder_3/`): scheduler = SD3.5's",
        "    file (`FlowMatchEulerDiscreteScheduler`, `num_train_timesteps` 1000, `shift` 3.0, nothing else: so",
        "    `use_dynamic_shifting` false).",
        "  Components:",
        "  - CLIP-L `text_encoder`: generate.py's CLIPTextModel (hidden 32, 2 layers, quick_gelu, legacy eos id 2 so",
        "    the pooled token is argmax(input_ids) = the first `<|endoftext|>`). FLUX: CLIPTextModel (outputs",
        "    `last_hidden_state`, `pooler_output`). SD3: the same weights as CLIPTextModelWithProjection with a seeded",
        "    `text_projection` (32 → 32), exported with all hidden states.",
        "  - SD3 `text_encoder_2` (CLIP-G): sdxl.py's CLIPTextModelWithProjection (hidden 32, gelu, projection 32).",
        "    `tokenizer_2/` pads with \"!\" (id 0) as SD3/SD3.5's (and SDXL's) tokenizer_2 ships.",
        f"  - T5 (`text_encoder_2` of FLUX, `text_encoder_3` of SD3, identical files): T5EncoderModel, d_model"
        f" {T5_CONFIG['d_model']}, {T5_CONFIG['num_layers']} layers, {T5_CONFIG['num_heads']} heads, d_kv"
        f" {T5_CONFIG['d_kv']}, d_ff {T5_CONFIG['d_ff']}, gated-gelu (T5 v1.1), vocab {T5_CONFIG['vocab_size']}.",
        "    d_model is 96, not 32: SD3 zero-pads the concatenated CLIP embeddings (32 + 32 = 64 wide) up to the T5",
        "    width, so it must exceed 64 (real: 768 + 1280 = 2048 padded to 4096); FLUX's `joint_attention_dim` is",
        "    then 96 too.",
        f"  - T5 tokenizer (`tokenizer_2/` of FLUX, `tokenizer_3/` of SD3): a SentencePiece unigram model (vocab"
        f" {T5_SPM_VOCAB}, pad 0 / eos 1 / unk 2, no bos, nmt_nfkc) trained here on"
        f" {f['tokenizers']['t5']['corpus_sentences']} deterministic sentences, + {T5_EXTRA_IDS} `<extra_id_N>`",
        f"    tokens (`<extra_id_0>` = {T5_SPM_VOCAB + T5_EXTRA_IDS - 1}, counting down), converted by transformers to",
        "    T5TokenizerFast (legacy=True, model_max_length 512). Files: " + ", ".join(
            f"`{x}`" for x in f["tokenizers"]["t5"]["files"]) + ".",
        "    `tokenizer.json`: normalizer " + " → ".join(t5s["normalizer"]) + " ("
        + "; ".join(json.dumps(r, ensure_ascii=False) for r in t5s["normalizer_replace"]) + "), pre-tokenizer "
        + json.dumps(t5s["pre_tokenizer"], ensure_ascii=False) + ", Unigram (unk_id 2, no byte fallback),",
        "    TemplateProcessing `$A </s>`; `tokenizer_config.json` has `legacy` true, `add_prefix_space` true,",
        "    `model_max_length` 512. Special/added tokens (`<pad>`, `</s>`, `<unk>`, `<extra_id_N>`) are matched in",
        "    the raw text (see tokens.json). The tokenizer directories in the tarball are the ones built here (Optimum's",
        "    export re-saves them, T5's with a `tokenizer.json` too; those copies are replaced, as for sd-tiny/sdxl-tiny).",
        f"  - FLUX transformer: FluxTransformer2DModel {json.dumps(FLUX_TRANSFORMER_CONFIG)}.",
        f"  - SD3 transformer: SD3Transformer2DModel {json.dumps(SD3_TRANSFORMER_CONFIG)} (SD3.5-like: RMS qk-norm and"
        " a dual-attention first layer as in SD3.5 medium).",
        "  - VAE: AutoencoderKL, 16 latent channels, 4 blocks (8, 16, 16, 16) so vae_scale_factor 8, no",
        "    quant_conv/post_quant_conv; FLUX `scaling_factor` 0.3611 `shift_factor` 0.1159, SD3 1.5305 / 0.0609",
        "    (in `vae_decoder/config.json` and `vae_encoder/config.json`).",
        "- `cases.json`: one record per pipeline run. Per case a folder with `latents_in.npy` (standard normal",
        "  `[n, 16, h/8, w/8]` from `numpy.random.default_rng(seed)`, unpacked layout; FLUX gets",
        "  `latents=FluxPipeline._pack_latents(latents_in, n, 16, h/8, w/8)`, SD3 gets it as is; no scaling by any",
        "  init sigma), `expected_latents.npy` (`output_type=\"latent\"`, FLUX's unpacked with `_unpack_latents`:",
        "  `[n, 16, h/8, w/8]`, *before* the VAE's scaling/shift), `expected_images.npy` (float32 NHWC in [0, 1]),",
        "  `image_N.png`, `prompt_embeds.npy` / `pooled_prompt_embeds.npy` (and SD3 with CFG",
        "  `negative_prompt_embeds.npy` / `negative_pooled_prompt_embeds.npy`): what `pipe.encode_prompt` returned,",
        "  already repeated per image; `first_transformer_feed.npz`: the exact ONNX feed of the first transformer",
        "  call (a plain stored zip of .npy files). Token ids: `clip_ids` (CLIP-L), `clip_g_ids` (SD3's tokenizer_2),",
        "  `t5_ids` (padded to `max_sequence_length`), `negative_*` (SD3 with CFG). `sigmas`/`timesteps`: the",
        "  scheduler's after `set_timesteps` (sigmas with the final 0); `set_timesteps_kwargs`: what the pipeline",
        "  passed; `mu` (FLUX); `transformer_timestep_feed`: the `timestep` input of every transformer call;",
        "  `guidance_feed`: dev's `guidance` input.",
        "- `tokens.json`: CLIP-L, CLIP-G and T5 ids for assorted prompts (unicode, repeated spaces, tabs/newlines,",
        "  literal special tokens, empty, > 77 CLIP tokens, > 512 T5 tokens).",
        "- `manifest.json`: the ONNX I/O of every session, the tarball contents, size and sha256 of every file,",
        "  torch-vs-ORT checks, T5 ONNX-vs-torch checks and the tokenizer facts.",
        "",
        "References are `ORTFluxPipeline` / `ORTStableDiffusion3Pipeline` (optimum-onnx) on the unpacked tarball, CPU",
        "execution provider, one thread, with the scheduler each model ships. The torch pipelines on the same weights",
        "(the diffusers directories the export was made from) gave: " + "; ".join(
            f"`{k}` max |Δ latents| {c['max_abs_latent_diff']:g}, max |Δ image| {c['max_abs_image_diff']:g}"
            for k, c in tv.items()) + ".",
        "",
        "## ONNX sessions (as onnxruntime reports them)",
        "",
    ]
    lines += io_table(info["sessions"])
    lines += [
        "",
        "The transformers' `timestep` input is named with a `step` axis but is per batch row ([batch]). Look",
        "outputs up by name. SD3's CLIP encoders output `text_embeds` first, then `last_hidden_state` and",
        "`hidden_states.0..L` (`hidden_states.0` = embeddings, `hidden_states.L` = last layer *before* the final",
        "layer norm); FLUX's CLIP-L only `last_hidden_state` and `pooler_output`.",
        "",
        "## Cases",
        "",
        "| case | model | steps | guidance | negative | size | n | max_seq | what it checks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in info["records"]:
        neg = "-" if r["family"] == "flux" else ("None" if r["negative_prompt"] is None else json.dumps(r["negative_prompt"]))
        lines.append(f"| `{r['name']}` | {r['model']} | {r['steps']} | {r['guidance_scale']} | {neg} | "
                     f"{r['width']}×{r['height']} | {r['num_images']} | {r['max_sequence_length']} | {r['notes'] or '-'} |")
    o = info["obs"]
    dev = o["dev_64_4step_g35"]
    lines += [
        "",
        "## What the FLUX pipeline does (diffusers " + v["diffusers"] + ", optimum-onnx " + v["optimum-onnx"] + ")",
        "",
        "- Text: CLIP-L ids (77, pad 49407) → `text_encoder` → `pooler_output` [1, 32] = `pooled_projections`",
        "  (the hidden states are unused). T5 ids (`padding=\"max_length\"`, `max_length=max_sequence_length`",
        "  (default 512), truncation keeps max_length − 1 tokens + `</s>`, pad 0) → `text_encoder_2` →",
        "  `last_hidden_state` [1, L, 96] = `encoder_hidden_states`. No attention mask. Repeated per image.",
        "  No classifier-free guidance (`true_cfg_scale` 1, no negative prompt): one transformer call per step,",
        "  batch = num_images.",
        "- Latents: 16 channels at h/8 × w/8, *packed* 2×2: `[n, 16, H, W] → view [n, 16, H/2, 2, W/2, 2] →",
        "  permute (0, 2, 4, 1, 3, 5) → [n, (H/2)(W/2), 64]` (channel-major within a patch: index c·4 + dy·2 + dx).",
        "  Unpacking is the inverse. `latents=` is used as given (no init-sigma scaling: flow matching starts at",
        "  pure noise, σ = 1).",
        "- `img_ids` [(H/2)(W/2), 3]: row r·(W/2) + c = (0, r, c) (row-major over the packed grid); `txt_ids`",
        "  [max_sequence_length, 3] all zeros. Both 2-D (no batch axis; diffusers ≥ 0.31). The pipeline makes",
        "  them float32, but the exported ONNX inputs are **int64** (Optimum's export traced them so) and",
        "  ORTTransformer casts the feed to the session's input dtype: `first_transformer_feed.npz` holds int64.",
        "- Timesteps: `sigmas = np.linspace(1.0, 1/N, N)` passed to `set_timesteps(sigmas=..., mu=mu)`; `mu =",
        "  calculate_shift(image_seq_len)` with `image_seq_len = (H/2)(W/2)` (packed length), `m = (max_shift −",
        "  base_shift) / (max_image_seq_len − base_image_seq_len)`, `mu = image_seq_len·m + base_shift −",
        "  m·base_image_seq_len` (computed in Python float64; 16 tokens at 64×64: mu = "
        f"{dev['mu']!r}). With `use_dynamic_shifting` (dev):",
        "  `σ' = e^mu / (e^mu + (1/σ − 1))` (time_shift 'exponential', exponent 1), computed in float32 on the",
        "  float32-cast linspace (`math.exp(mu)` is a Python float; NumPy 2 keeps the float32 array dtype);",
        "  without (schnell): `σ' = shift·σ / (1 + (shift − 1)·σ)` with shift 1 = σ exactly (mu is computed and",
        "  passed but ignored). `timesteps = σ'·1000` (float32), sigmas get a final 0.",
        "- The transformer's `timestep` input is `t / 1000` (i.e. σ') as float32 [batch], `guidance` (dev only) is",
        "  `guidance_scale` as float32 [batch] (the ONNX model multiplies both by 1000 inside, as diffusers' model",
        f"  does): e.g. dev 64×64 4 steps: timestep feeds {dev['transformer_timestep_feed']}, guidance"
        f" {dev['guidance_feed']}.",
        "- Step: `latents = latents + (σ_next − σ)·v` (FlowMatchEulerDiscreteScheduler.step: `dt = σ_next − σ` in",
        "  float32 from the float32 sigmas, sample upcast to float32), v = the transformer's `out_hidden_states`",
        "  (packed). No noise is drawn (checked: any randn in the scheduler or pipeline fails the run).",
        "- Decode: `latents = unpack(latents) / scaling_factor + shift_factor` → `vae_decoder` →",
        "  `(x / 2 + 0.5).clamp(0, 1)`.",
        "",
        "## What the SD3 pipeline does",
        "",
        "- Each prompt goes through CLIP-L (`tokenizer`, pad 49407), CLIP-G (`tokenizer_2`, pad \"!\" = 0), both",
        "  77 tokens with truncation, with `output_hidden_states=True`: the pipeline takes `hidden_states[-2]` =",
        "  ONNX output `hidden_states.{L-1}` (`hidden_states.1` here; penultimate layer, no final layer norm) and",
        "  the pooled `text_embeds` (output 0, projected). And through T5 (`tokenizer_3`, `max_sequence_length`",
        "  default 256, pad 0, `</s>` appended) → `last_hidden_state` [1, 256, 96].",
        "- `prompt_embeds = concat_seq( pad_last(concat_last(clipL_h, clipG_h), T5 width with zeros), t5 )`:",
        "  [1, 77, 64] zero-padded to [1, 77, 96], then [1, 77 + 256, 96] = [1, 333, 96].",
        "  `pooled_prompt_embeds = concat_last(clipL text_embeds, clipG text_embeds)` [1, 64].",
        "- CFG when `guidance_scale > 1`: the negative prompt (None → \"\") is encoded the same way (all three",
        "  encoders: the \"\" ids are CLIP [49406, 49407, pad...], T5 [1, 0, ...]); the transformer gets batch",
        "  `[uncond × n, cond × n]` for `hidden_states`, `encoder_hidden_states`, `pooled_projections`,",
        "  `timestep`; `v = v_uncond + guidance_scale·(v_cond − v_uncond)`. guidance ≤ 1: no CFG, batch n, and the",
        "  negative prompt is not encoded.",
        "- Timesteps: the pipeline passes nothing (`sigmas=None`, no mu since `use_dynamic_shifting` is off).",
        "  At construction the scheduler shifts its 1000 training sigmas (float32 `linspace(1, 1000, 1000)[::-1] /",
        "  1000`, `3σ / (1 + 2σ)`), so σ_max = 1.0 and σ_min = `3·0.001 / (1 + 2·0.001)` = 0.002994012087583542",
        "  (the float32 value). `set_timesteps(N)`: `t = np.linspace(σ_max·1000, σ_min·1000, N)` (float64), `σ =",
        "  t / 1000` and shifted *again* `σ' = 3σ / (1 + 2σ)` in float64, then cast to float32; `timesteps = σ'·1000`",
        "  (float32); final σ 0. (So the last sigma before 0 is ~0.0089, not 0: the double shift is diffusers'",
        "  behaviour and is reproduced here as is.)",
        "  E.g. 4 steps: sigmas " + str(o["sd3_64_4step_cfg5_neg"]["sigmas"]) + ".",
        "- The transformer's `timestep` input is the scheduler's timestep (σ'·1000, *not* divided by 1000) as",
        "  float32 [batch]. Latents `[n, 16, h/8, w/8]` unpacked (the model patchifies itself, patch 2).",
        "- Step as FLUX's; decode `latents / 1.5305 + 0.0609` → `vae_decoder` → `(x / 2 + 0.5).clamp(0, 1)`.",
        "",
        "## Tolerances",
        "",
        "For an independent implementation (Rust, onnxruntime): final latents within 1e-3 absolute, float images",
        "within 1e-3, PNGs ±1 level; token ids, `img_ids`/`txt_ids`, sigmas/timesteps (float32) exact or within",
        "1e-6; the embeddings within 1e-4. The torch pipelines agree with ORT to the numbers above.",
        "",
        "## Rerun determinism",
        "",
    ]
    lines += g.rerun_lines("flow.py", rr, "fresh process, fresh tokenizer training and export, same machine")
    lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------------------------------


def main() -> None:
    args, out_root, work, t0 = g.script_start(__doc__, "flow-reference-")

    tar_path = out_root / TARBALL
    ref_dir = out_root / REF_DIR
    built = build_models(work, tar_path)
    refs = build_references(built["models_root"], ref_dir, built["diffusers_dirs"])
    tokens = build_tokens(built["models_root"], ref_dir / "tokens.json")
    facts = {**built["facts"], "tokens": tokens, "torch_vs_ort": refs["torch_vs_ort"]}
    sessions = build_manifest(built["models_root"], out_root, built["tar_listing"], ref_dir / "manifest.json",
                              {"facts": facts})
    info = {"versions": versions(), "sessions": sessions, "facts": facts, "records": refs["records"],
            "obs": refs["obs"], "torch_vs_ort": refs["torch_vs_ort"]}
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
