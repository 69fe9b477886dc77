//! `sluice-worker generate`: one diffusion run (SD, SDXL, FLUX.1, SD3) from the command line —
//! no Kafka, no S3.
//! What an operator uses to check a model before serving it, and what reproduces a reference
//! run from its initial latents and noise.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Parser;
use sluice_worker::config::DeviceArgs;
use sluice_worker::engine::{Call, CallTask, Runtime};
use sluice_worker::models::ModelAdapter;
use sluice_worker::models::diffusion::flow::backend::EncoderPlacement;
use sluice_worker::models::diffusion::flow::layout::FlowFamily;
use sluice_worker::models::diffusion::input;
use sluice_worker::models::diffusion::npy::{self, Array};
use sluice_worker::models::diffusion::request::{Draws, ImageInput, SdRequest};
use sluice_worker::models::diffusion::schedulers::Sampler;
use sluice_worker::models::diffusion::{FlowSettings, Pipeline, StableDiffusion};

/// Generates images with a diffusion model in the Optimum ONNX layout (Stable Diffusion
/// 1.x/2.x, SDXL, FLUX.1, SD3; the family is read from model_index.json).
#[derive(Debug, Parser)]
#[command(name = "sluice-worker generate")]
pub struct GenerateArgs {
    /// The model directory (model_index.json, tokenizer/, text_encoder/, unet/, vae_decoder/,
    /// scheduler/; SDXL also tokenizer_2/, text_encoder_2/; FLUX.1 and SD3 a transformer/ and
    /// their T5). The family is read from it.
    #[arg(long, env = "SLUICE_GENERATE_MODEL_PATH")]
    model_path: PathBuf,
    #[arg(long, env = "SLUICE_GENERATE_PROMPT")]
    prompt: String,
    /// Absent is not empty: for SDXL (force_zeros_for_empty_prompt) an absent negative prompt
    /// gives all-zero unconditional embeddings and `""` encodes the empty string, as diffusers.
    /// FLUX.1 takes none.
    #[arg(long, env = "SLUICE_GENERATE_NEGATIVE_PROMPT")]
    negative_prompt: Option<String>,
    #[arg(long, env = "SLUICE_GENERATE_STEPS", default_value_t = 4)]
    steps: usize,
    /// Classifier-free guidance scale; for FLUX.1-dev the guidance embedding's value (schnell
    /// has none and ignores it). Default: the pipeline's (7.5 for SD and SDXL, 3.5 for FLUX.1,
    /// 7.0 for SD3).
    #[arg(long, env = "SLUICE_GENERATE_GUIDANCE_SCALE")]
    guidance_scale: Option<f32>,
    /// euler, euler_a, ddim, dpmpp_2m, dpmpp_2m_karras, lcm (UNet models) or flow_euler (FLUX.1,
    /// SD3); default: flow_euler for a flow model, euler otherwise.
    #[arg(long, env = "SLUICE_GENERATE_SAMPLER")]
    sampler: Option<String>,
    #[arg(long, env = "SLUICE_GENERATE_WIDTH", default_value_t = 64)]
    width: usize,
    #[arg(long, env = "SLUICE_GENERATE_HEIGHT", default_value_t = 64)]
    height: usize,
    #[arg(long, env = "SLUICE_GENERATE_NUM_IMAGES", default_value_t = 1)]
    num_images: usize,
    /// Seed of the worker's own noise (drawn and printed when absent).
    #[arg(long, env = "SLUICE_GENERATE_SEED")]
    seed: Option<u64>,
    /// Standard-normal initial latents [num_images, c, h/8, w/8] (.npy, float32; c = 4, 16 for
    /// FLUX.1 and SD3), scaled by the scheduler's initial sigma as diffusers' `latents=`; for
    /// FLUX.1 the draw *before* packing (as `prepare_latents` draws it). With --init-image: the
    /// noise diffusers' `prepare_latents` draws (added to the encoded image at the first step run).
    #[arg(long, env = "SLUICE_GENERATE_LATENTS_IN")]
    latents_in: Option<PathBuf>,
    /// Per-step noise of ancestral and LCM samplers, draws stacked on axis 0:
    /// [draws, num_images, 4, h/8, w/8] (.npy, float32).
    #[arg(long, env = "SLUICE_GENERATE_NOISE_IN")]
    noise_in: Option<PathBuf>,
    /// The PNG to write; with --num-images N, `x.png` becomes `x_0.png` … `x_{N-1}.png`.
    #[arg(long, env = "SLUICE_GENERATE_OUT")]
    out: PathBuf,
    /// Writes the final latents (unscaled, before the VAE; FLUX.1's unpacked) as .npy.
    #[arg(long, env = "SLUICE_GENERATE_LATENTS_OUT")]
    latents_out: Option<PathBuf>,
    /// img2img: the image to start from (PNG of exactly --width × --height); with --mask-image,
    /// inpainting. The text-to-image export serves both.
    #[arg(long, env = "SLUICE_GENERATE_INIT_IMAGE")]
    init_image: Option<PathBuf>,
    /// With --init-image: the share of the steps that runs, (0, 1]; `int(steps × strength)`
    /// steps run (computed in f64).
    #[arg(long, env = "SLUICE_GENERATE_STRENGTH", default_value_t = 0.8)]
    strength: f64,
    /// Inpainting (with --init-image): white repaints, black keeps (binarized at 0.5).
    #[arg(long, env = "SLUICE_GENERATE_MASK_IMAGE", requires = "init_image")]
    mask_image: Option<PathBuf>,
    /// The VAE encoder's latent sampling draw, [1, 4, h/8, w/8] (.npy, float32), used for every
    /// VAE-encoder sample of the run (seed stream 0 when absent).
    #[arg(long, env = "SLUICE_GENERATE_IMAGE_NOISE_IN", requires = "init_image")]
    image_noise_in: Option<PathBuf>,
    /// FLUX.1 / SD3: T5's sequence length (default: the pipeline's, 512 for FLUX, 256 for SD3).
    #[arg(long, env = "SLUICE_GENERATE_T5_MAX_LENGTH")]
    t5_max_length: Option<usize>,
    /// FLUX.1 / SD3: where the text encoders run: device (default), cpu or on_demand.
    #[arg(long, env = "SLUICE_GENERATE_TEXT_ENCODERS", value_enum, default_value_t = EncoderPlacement::Device)]
    text_encoders: EncoderPlacement,
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
    let runtime = Arc::new(Runtime::init(&args.device.runtime_options())?);
    let settings = FlowSettings {
        text_encoders: args.text_encoders,
        t5_max_length: args.t5_max_length,
    };
    let model = StableDiffusion::open_with(runtime, "generate", &args.model_path, settings)?;
    let (default_sampler, default_guidance) = match model.pipeline() {
        Pipeline::Flow(l, _) if l.family == FlowFamily::Flux => ("flow_euler", 3.5),
        Pipeline::Flow(..) => ("flow_euler", 7.0),
        Pipeline::Unet(_) => ("euler", 7.5),
    };
    let name = args.sampler.as_deref().unwrap_or(default_sampler);
    let sampler = Sampler::parse(name).with_context(|| format!("--sampler {name:?}: one of {}", Sampler::names()))?;
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(0..(1 << 53)));
    let request = SdRequest {
        prompt: args.prompt.clone(),
        negative_prompt: args.negative_prompt.clone(),
        steps: args.steps,
        guidance_scale: args.guidance_scale.unwrap_or(default_guidance),
        sampler,
        width: args.width,
        height: args.height,
        num_images: args.num_images,
        seed,
        image: image_input(&args)?,
    };
    let noise_draws = model.check(&request).map_err(anyhow::Error::msg)?;
    let n = request.num_images;
    let given = draws(&args, &request, model.latent_dims(&request), noise_draws)?;
    let (bucket, prepared) = model.prepare_request(&request, Some(given)).map_err(anyhow::Error::msg)?;
    let mut backend = model.load(&args.model_path, &args.device.session_options())?;
    let call = Call {
        key: bucket.key.clone(),
        inputs: prepared.inputs.clone(),
        tasks: vec![CallTask {
            id: "generate".into(),
            attempt: 1,
            rows: n,
            hooks: None,
        }],
    };
    let started = std::time::Instant::now();
    let outputs = backend.run(&call)?;
    let elapsed = started.elapsed();
    write_outputs(&args, &outputs, prepared.render.render(&outputs, 0..n)?, n)?;
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

/// The init image and mask of --init-image and --mask-image, if given.
fn image_input(args: &GenerateArgs) -> anyhow::Result<Option<ImageInput>> {
    let Some(init) = &args.init_image else { return Ok(None) };
    let read = |path: &PathBuf| std::fs::read(path).with_context(|| format!("reading {}", path.display()));
    let mask = args.mask_image.as_ref().map(read).transpose()?;
    let input = input::image_input(&read(init)?, mask.as_deref(), args.strength, args.width, args.height).map_err(anyhow::Error::msg)?;
    Ok(Some(input))
}

/// The run's draws: seeded, with --latents-in, --noise-in and --image-noise-in in their place.
fn draws(args: &GenerateArgs, request: &SdRequest, dims: [usize; 3], draws: usize) -> anyhow::Result<Draws> {
    let mut given = request.seeded_draws(dims, draws);
    let n = request.num_images;
    if let Some(path) = &args.latents_in {
        given.latents = read_npy(path, &[n, dims[0], dims[1], dims[2]], "--latents-in")?;
    }
    if let Some(path) = &args.image_noise_in {
        given.image_noise = Some(read_npy(path, &[1, dims[0], dims[1], dims[2]], "--image-noise-in")?);
    }
    match (&args.noise_in, draws) {
        (Some(path), 0) => bail!("--noise-in {}: sampler {} draws no noise", path.display(), request.sampler.name()),
        (Some(path), _) => {
            let a = read_npy(path, &[draws, n, dims[0], dims[1], dims[2]], "--noise-in (draws, images, latent)")?;
            // Draw-major on disk, image-major in the model inputs.
            let per: usize = dims.iter().product();
            for d in 0..draws {
                for i in 0..n {
                    given.noise[(i * draws + d) * per..][..per].copy_from_slice(&a[(d * n + i) * per..][..per]);
                }
            }
        }
        (None, _) => {}
    }
    Ok(given)
}

/// A float32 .npy of the given shape.
fn read_npy(path: &Path, want: &[usize], flag: &str) -> anyhow::Result<Vec<f32>> {
    let a = npy::read(path).map_err(anyhow::Error::msg)?;
    if a.shape != want {
        bail!("{flag} {}: shape {:?}, expected {want:?}", path.display(), a.shape);
    }
    Ok(a.data)
}

/// Writes the PNGs (and --latents-out).
fn write_outputs(
    args: &GenerateArgs,
    outputs: &[sluice_worker::engine::Tensor],
    images: Vec<sluice_worker::models::encode::Image>,
    n: usize,
) -> anyhow::Result<()> {
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
    Ok(())
}
