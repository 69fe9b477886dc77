//! `sluice-worker generate`: one Stable Diffusion run from the command line — no Kafka, no S3.
//! What an operator uses to check a model before serving it, and what reproduces a reference
//! run from its initial latents and noise.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Parser;
use sluice_worker::config::DeviceArgs;
use sluice_worker::engine::{Call, CallTask, Runtime};
use sluice_worker::models::ModelAdapter;
use sluice_worker::models::diffusion::npy::{self, Array};
use sluice_worker::models::diffusion::request::SdRequest;
use sluice_worker::models::diffusion::schedulers::{Sampler, Schedule};
use sluice_worker::models::diffusion::{StableDiffusion, sampler_names};

/// Generates images with a Stable Diffusion model in the Optimum ONNX layout.
#[derive(Debug, Parser)]
#[command(name = "sluice-worker generate")]
pub struct GenerateArgs {
    /// The model directory (model_index.json, tokenizer/, text_encoder/, unet/, vae_decoder/,
    /// scheduler/; SDXL also tokenizer_2/, text_encoder_2/). The family is read from it.
    #[arg(long, env = "SLUICE_GENERATE_MODEL_PATH")]
    model_path: PathBuf,
    #[arg(long, env = "SLUICE_GENERATE_PROMPT")]
    prompt: String,
    /// Absent is not empty: for SDXL (force_zeros_for_empty_prompt) an absent negative prompt
    /// gives all-zero unconditional embeddings and `""` encodes the empty string, as diffusers.
    #[arg(long, env = "SLUICE_GENERATE_NEGATIVE_PROMPT")]
    negative_prompt: Option<String>,
    #[arg(long, env = "SLUICE_GENERATE_STEPS", default_value_t = 4)]
    steps: usize,
    #[arg(long, env = "SLUICE_GENERATE_GUIDANCE_SCALE", default_value_t = 7.5)]
    guidance_scale: f32,
    /// euler, euler_a, ddim, dpmpp_2m, dpmpp_2m_karras or lcm.
    #[arg(long, env = "SLUICE_GENERATE_SAMPLER", default_value = "euler")]
    sampler: String,
    #[arg(long, env = "SLUICE_GENERATE_WIDTH", default_value_t = 64)]
    width: usize,
    #[arg(long, env = "SLUICE_GENERATE_HEIGHT", default_value_t = 64)]
    height: usize,
    #[arg(long, env = "SLUICE_GENERATE_NUM_IMAGES", default_value_t = 1)]
    num_images: usize,
    /// Seed of the worker's own noise (drawn and printed when absent).
    #[arg(long, env = "SLUICE_GENERATE_SEED")]
    seed: Option<u64>,
    /// Standard-normal initial latents [num_images, 4, h/8, w/8] (.npy, float32), scaled by the
    /// scheduler's initial sigma as diffusers' `latents=`.
    #[arg(long, env = "SLUICE_GENERATE_LATENTS_IN")]
    latents_in: Option<PathBuf>,
    /// Per-step noise of ancestral and LCM samplers, draws stacked on axis 0:
    /// [draws, num_images, 4, h/8, w/8] (.npy, float32).
    #[arg(long, env = "SLUICE_GENERATE_NOISE_IN")]
    noise_in: Option<PathBuf>,
    /// The PNG to write; with --num-images N, `x.png` becomes `x_0.png` … `x_{N-1}.png`.
    #[arg(long, env = "SLUICE_GENERATE_OUT")]
    out: PathBuf,
    /// Writes the final latents (unscaled, before the VAE) as .npy.
    #[arg(long, env = "SLUICE_GENERATE_LATENTS_OUT")]
    latents_out: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
}

/// The file of image `i` of `n`.
fn image_path(out: &Path, i: usize, n: usize) -> PathBuf {
    if n == 1 {
        return out.to_owned();
    }
    let stem = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let ext = out.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    out.with_file_name(format!("{stem}_{i}{ext}"))
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let sampler = Sampler::parse(&args.sampler).with_context(|| format!("--sampler {:?}: one of {}", args.sampler, sampler_names()))?;
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(0..(1 << 53)));
    let request = SdRequest {
        prompt: args.prompt.clone(),
        negative_prompt: args.negative_prompt.clone(),
        steps: args.steps,
        guidance_scale: args.guidance_scale,
        sampler,
        width: args.width,
        height: args.height,
        num_images: args.num_images,
        seed,
    };
    let runtime = Arc::new(Runtime::init(&args.device.runtime_options())?);
    let model = StableDiffusion::open(runtime, "generate", &args.model_path)?;
    let layout = model.layout();
    let schedule: Schedule = request.check(layout).map_err(anyhow::Error::msg)?;
    let draws = schedule.noise_draws();
    let (mut latents, mut noise) = request.seeded_noise(layout, draws);
    let dims = request.latent_dims(layout);
    let n = request.num_images;
    if let Some(path) = &args.latents_in {
        let a = npy::read(path).map_err(anyhow::Error::msg)?;
        let want = [n, dims[0], dims[1], dims[2]];
        if a.shape != want {
            bail!("--latents-in {}: shape {:?}, expected {want:?}", path.display(), a.shape);
        }
        latents = a.data;
    }
    match (&args.noise_in, draws) {
        (Some(path), 0) => bail!("--noise-in {}: sampler {} draws no noise", path.display(), sampler.name()),
        (Some(path), _) => {
            let a = npy::read(path).map_err(anyhow::Error::msg)?;
            let want = [draws, n, dims[0], dims[1], dims[2]];
            if a.shape != want {
                bail!(
                    "--noise-in {}: shape {:?}, expected {want:?} (draws, images, latent)",
                    path.display(),
                    a.shape
                );
            }
            // Draw-major on disk, image-major in the model inputs.
            let per: usize = dims.iter().product();
            for d in 0..draws {
                for i in 0..n {
                    noise[(i * draws + d) * per..][..per].copy_from_slice(&a.data[(d * n + i) * per..][..per]);
                }
            }
        }
        (None, _) => {}
    }
    let (bucket, prepared) = model
        .prepare_request(&request, Some((latents, noise)))
        .map_err(anyhow::Error::msg)?;
    let mut backend = model.load(&args.model_path, &args.device.session_options())?;
    let call = Call {
        key: bucket.key.clone(),
        inputs: prepared.inputs.clone(),
        tasks: vec![CallTask {
            id: "generate".into(),
            rows: n,
            hooks: None,
        }],
    };
    let started = std::time::Instant::now();
    let outputs = backend.run(&call)?;
    let elapsed = started.elapsed();
    let images = prepared.render.render(&outputs, 0..n)?;
    for (i, image) in images.iter().enumerate() {
        let path = image_path(&args.out, i, n);
        std::fs::write(&path, &image.bytes).with_context(|| format!("writing {}", path.display()))?;
        println!("{}", path.display());
    }
    if let Some(path) = &args.latents_out {
        let final_latents = outputs.iter().find(|t| t.name == "latents").context("no latents output")?;
        let data = final_latents.f32_rows(0, n).context("latents are float32")?.to_vec();
        npy::write(
            path,
            &Array {
                shape: final_latents.shape.clone(),
                data,
            },
        )
        .map_err(anyhow::Error::msg)?;
    }
    eprintln!(
        "seed {seed}, {} on {}: {} image(s) of {}x{} in {:.2} s ({})",
        sampler.name(),
        backend.placement(),
        n,
        request.width,
        request.height,
        elapsed.as_secs_f64(),
        bucket
    );
    Ok(())
}
