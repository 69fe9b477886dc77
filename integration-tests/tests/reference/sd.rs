//! Stable Diffusion against the reference implementation: every case recorded by
//! `scripts/sd-reference/generate.sh` (Optimum's `ORTStableDiffusionPipeline` /
//! `ORTLatentConsistencyModelPipeline`, diffusers 0.39, on the tiny random-weight models in
//! `fixtures/sd-tiny.tar.xz`) and by `generate.sh --sdxl` (`ORTStableDiffusionXLPipeline` on
//! `fixtures/sdxl-tiny.tar.xz`), run by Sluice from the same initial latents and per-step noise.
//! Final latents within 1e-3, PNGs within ±1 level, prompt tokens identical.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use sluice_integration_tests::inprocess::{assert_as_alone, rows_at_different_steps, run_alone, runtime};
use sluice_integration_tests::{assets, png_pixels, stack::repo_root};
use sluice_worker::engine::{Call, CallTask, OrtBackend, SessionOptions};
use sluice_worker::models::ModelAdapter;
use sluice_worker::models::diffusion::StableDiffusion;
use sluice_worker::models::diffusion::input;
use sluice_worker::models::diffusion::npy;
use sluice_worker::models::diffusion::request::{Draws, ImageInput, SdRequest};
use sluice_worker::models::diffusion::schedulers::Sampler;
use sluice_worker::models::diffusion::tokenizer::ClipTokenizer;

/// A set of recorded cases: its fixtures and the tiny models it ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Set {
    /// SD 1.x-shaped models (sd-tiny, sd-tiny-lcm, sd-tiny-external).
    Sd,
    /// An SDXL-shaped model (sdxl-tiny).
    Sdxl,
    /// img2img and inpainting on sd-tiny, sdxl-tiny and a 9-channel inpainting UNet.
    Image,
}

impl Set {
    fn fixtures(self) -> PathBuf {
        repo_root().join(match self {
            Set::Sd => "integration-tests/fixtures/sd-reference",
            Set::Sdxl => "integration-tests/fixtures/sdxl-reference",
            Set::Image => "integration-tests/fixtures/image-reference",
        })
    }

    fn cases(self) -> Vec<Value> {
        serde_json::from_str(&std::fs::read_to_string(self.fixtures().join("cases.json")).unwrap()).unwrap()
    }
}

fn fixtures() -> PathBuf {
    Set::Sd.fixtures()
}

/// Where the tiny models are (both fixtures are unpacked side by side).
fn models() -> PathBuf {
    assets().unwrap()["SLUICE_SD_TINY"].clone().into()
}

/// The model directory of a case: the named model, or a copy (by symlinks) with the case's
/// scheduler config in place of its own.
fn model_dir(case: &Value) -> PathBuf {
    let base = models().join(case["model"].as_str().unwrap());
    let Some(config) = case["scheduler_config_override"].as_object() else {
        return base;
    };
    let dir = copy_but(&base, &format!("sluice-sd-{}", case["name"].as_str().unwrap()), "scheduler");
    std::fs::write(dir.join("scheduler/scheduler_config.json"), serde_json::to_string(config).unwrap()).unwrap();
    dir
}

/// A fresh directory `name` (of this process, in the temporary directory) holding symlinks to
/// every entry of `base` but the folder `own`, which it creates empty.
fn copy_but(base: &Path, name: &str, own: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(dir.join(own)).unwrap();
    for entry in std::fs::read_dir(base).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != own {
            std::os::unix::fs::symlink(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    dir
}

/// [`model_dir`] with its UNet given a timestep per row by `scripts/unet_timestep_rows.py` (a copy
/// of the edited `unet/` of [`per_row_unet`]: ONNX Runtime reads external data only beside the
/// graph; the rest by symlinks).
fn per_row_dir(case: &Value) -> PathBuf {
    let dir = copy_but(
        &model_dir(case),
        &format!("sluice-sd-rows-{}", case["name"].as_str().unwrap()),
        "unet",
    );
    for entry in std::fs::read_dir(per_row_unet(case["model"].as_str().unwrap())).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join("unet").join(entry.file_name())).unwrap();
    }
    dir
}

/// The `unet/` of model `name` edited by `scripts/unet_timestep_rows.py`, once per model and
/// process, and checked to load with a timestep per row.
fn per_row_unet(name: &str) -> PathBuf {
    static EDITED: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut edited = EDITED.lock().unwrap();
    if let Some((_, unet)) = edited.iter().find(|(n, _)| n == name) {
        return unet.clone();
    }
    let dir = copy_but(&models().join(name), &format!("sluice-sd-rows-model-{name}"), "unet");
    for entry in std::fs::read_dir(models().join(name).join("unet")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join("unet").join(entry.file_name())).unwrap();
    }
    let python = assets().unwrap()["SLUICE_ONNX_PYTHON"].clone();
    let status = std::process::Command::new(python)
        .arg(repo_root().join("scripts/unet_timestep_rows.py"))
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "unet_timestep_rows.py edits {}", dir.display());
    // What the backend reads to run rows at different steps in one UNet call.
    let unet = OrtBackend::load(&runtime(), &dir.join("unet/model.onnx"), &SessionOptions::default()).unwrap();
    let timestep = unet.inputs().into_iter().find(|i| i.name == "timestep").unwrap();
    assert_eq!(timestep.shape, vec![-1], "{}: a timestep per row", dir.display());
    edited.push((name.to_owned(), dir.join("unet")));
    dir.join("unet")
}

fn cases() -> Vec<Value> {
    Set::Sd.cases()
}

/// The init image and mask of an img2img or inpainting case.
fn image_input(set: Set, case: &Value) -> Option<ImageInput> {
    let read = |key: &str| case[key].as_str().map(|p| std::fs::read(set.fixtures().join(p)).unwrap());
    let (w, h) = (case["width"].as_u64().unwrap() as usize, case["height"].as_u64().unwrap() as usize);
    let init = read("init_image")?;
    let strength = case["strength"].as_f64().unwrap();
    Some(input::image_input(&init, read("mask_image").as_deref(), strength, w, h).unwrap())
}

/// A case's request and its recorded draws.
fn case_request(set: Set, case: &Value) -> (SdRequest, Draws) {
    let n = case["num_images"].as_u64().unwrap() as usize;
    let request = SdRequest {
        prompt: case["prompt"].as_str().unwrap().to_owned(),
        negative_prompt: case["negative_prompt"].as_str().map(str::to_owned),
        steps: case["steps"].as_u64().unwrap() as usize,
        guidance_scale: case["guidance_scale"].as_f64().unwrap() as f32,
        sampler: Sampler::parse(case["sampler"].as_str().unwrap()).unwrap(),
        width: case["width"].as_u64().unwrap() as usize,
        height: case["height"].as_u64().unwrap() as usize,
        num_images: n,
        seed: 0,
        image: image_input(set, case),
    };
    let latents = npy::read(&set.fixtures().join(case["latents_in"].as_str().unwrap())).unwrap();
    let draws = case["noise_draws"].as_u64().unwrap() as usize;
    let per = latents.data.len() / n;
    let mut noise = vec![0f32; n * draws * per];
    if let Some(path) = case["noise_in"].as_str() {
        let a = npy::read(&set.fixtures().join(path)).unwrap();
        assert_eq!(a.shape[..2], [draws, n]);
        for d in 0..draws {
            for i in 0..n {
                noise[(i * draws + d) * per..][..per].copy_from_slice(&a.data[(d * n + i) * per..][..per]);
            }
        }
    }
    let image_noise = case["image_noise_in"]
        .as_str()
        .map(|path| npy::read(&set.fixtures().join(path)).unwrap().data);
    let draws = Draws {
        latents: latents.data,
        noise,
        image_noise,
    };
    (request, draws)
}

/// Runs a case; returns (final latents, PNG bytes per image).
fn run_case(set: Set, case: &Value, dir: &Path) -> (Vec<f32>, Vec<Vec<u8>>) {
    let model = StableDiffusion::open(runtime(), "sd", dir).unwrap();
    let (request, draws) = case_request(set, case);
    run_alone(&model, dir, &request, draws, Vec::new())
}

/// Image `k` of a request alone: one image, its draws.
fn one_image(request: &SdRequest, draws: &Draws, k: usize) -> (SdRequest, Draws) {
    let n = request.num_images;
    let row = |values: &[f32]| {
        let per = values.len() / n;
        values[k * per..(k + 1) * per].to_vec()
    };
    let one = SdRequest {
        num_images: 1,
        ..request.clone()
    };
    let draws = Draws {
        latents: row(&draws.latents),
        noise: row(&draws.noise),
        // The VAE draw is the task's, one for all its images.
        image_noise: draws.image_noise.clone(),
    };
    (one, draws)
}

#[test]
fn every_reference_case_matches_diffusers() {
    every_case_matches(Set::Sd, 20, model_dir);
}

#[test]
fn every_sdxl_reference_case_matches_diffusers() {
    every_case_matches(Set::Sdxl, SDXL_CASES, model_dir);
}

#[test]
fn every_img2img_and_inpainting_reference_case_matches_diffusers() {
    every_case_matches(Set::Image, IMAGE_CASES, model_dir);
}

/// How many cases `generate.sh --images` records.
const IMAGE_CASES: usize = 19;

/// How many cases `generate.sh --sdxl` records.
const SDXL_CASES: usize = 11;

/// Runs every case of `set` (there must be `count`) on the model in `dir_of(case)`, each within
/// the tolerances.
fn every_case_matches(set: Set, count: usize, dir_of: fn(&Value) -> PathBuf) {
    let fixtures = set.fixtures();
    let mut report = Vec::new();
    for case in set.cases() {
        let name = case["name"].as_str().unwrap().to_owned();
        let dir = dir_of(&case);
        let (latents, images) = run_case(set, &case, &dir);
        let expected = npy::read(&fixtures.join(case["expected_latents"].as_str().unwrap())).unwrap();
        assert_eq!(latents.len(), expected.data.len(), "{name}: latents");
        let latent_err = latents.iter().zip(&expected.data).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(latent_err <= 1e-3, "{name}: final latents differ by {latent_err} (tolerance 1e-3)");
        let mut level_err = 0;
        for (i, (png, want)) in images.iter().zip(case["expected_images"].as_array().unwrap()).enumerate() {
            let (w, h, got) = png_pixels(png).unwrap();
            let (ew, eh, want) = png_pixels(&std::fs::read(fixtures.join(want.as_str().unwrap())).unwrap()).unwrap();
            assert_eq!((w, h), (ew, eh), "{name}: image {i} size");
            let e = got.iter().zip(&want).map(|(a, b)| (*a as i32 - *b as i32).abs()).max().unwrap();
            assert!(e <= 1, "{name}: image {i} differs by {e} levels (tolerance 1)");
            level_err = level_err.max(e);
        }
        assert_eq!(images.len(), case["num_images"].as_u64().unwrap() as usize, "{name}");
        report.push(format!("{name}: max |Δ latents| {latent_err:.2e}, max |Δ PNG| {level_err}"));
    }
    assert_eq!(report.len(), count, "every recorded case");
    eprintln!("{}", report.join("\n"));
}

/// Step-level batching on the UNet families. Every recorded case whose bucket runs two steps
/// or more: its first image runs half its steps in one call and stops, then carries on (its
/// latents and solver state from that call's outputs) in a call shared with another request of
/// the bucket (another prompt, guidance and draws) at its first step. Both land where they land
/// alone: final latents within 1e-5 and the same PNG bytes. Rows at different steps take UNet
/// calls of their own (the export's timestep is a scalar), rows at one step share one.
#[test]
fn every_reference_case_gives_its_image_in_a_call_beside_rows_at_other_steps() {
    every_case_runs_as_alone_beside_rows_at_other_steps(model_dir);
}

/// The UNet given a timestep per row (`scripts/unet_timestep_rows.py`): rows at different steps
/// now share one UNet call. Every recorded case still matches diffusers within the reference
/// tolerances, and lands where it lands alone beside a row at another step (1e-5, same PNG).
#[test]
fn with_a_timestep_per_row_every_reference_case_matches_diffusers_and_runs_as_alone_beside_other_steps() {
    every_case_matches(Set::Sd, 20, per_row_dir);
    every_case_matches(Set::Sdxl, SDXL_CASES, per_row_dir);
    every_case_matches(Set::Image, IMAGE_CASES, per_row_dir);
    every_case_runs_as_alone_beside_rows_at_other_steps(per_row_dir);
}

/// [`every_reference_case_gives_its_image_in_a_call_beside_rows_at_other_steps`] on the models in
/// `dir_of(case)`.
fn every_case_runs_as_alone_beside_rows_at_other_steps(dir_of: fn(&Value) -> PathBuf) {
    let mut report = Vec::new();
    for set in [Set::Sd, Set::Sdxl, Set::Image] {
        for case in set.cases() {
            let name = format!("{set:?}/{}", case["name"].as_str().unwrap());
            let dir = dir_of(&case);
            let model = StableDiffusion::open(runtime(), "sd", &dir).unwrap();
            let (request, draws) = case_request(set, &case);
            let (a, a_draws) = one_image(&request, &draws, 0);
            let (mut b, b_draws) = one_image(&request, &draws, request.num_images - 1);
            b.prompt = "a watercolor of a lighthouse at dusk".into();
            if b.guidance_scale > 1.0 {
                b.guidance_scale += 2.0;
            }
            let Some((ra, rb)) = rows_at_different_steps(&model, &dir, (&a, a_draws), (&b, b_draws)) else {
                continue;
            };
            assert_as_alone(&name, (ra, rb));
            report.push(format!("{name}: A {:.2e}, B {:.2e}", ra.latents, rb.latents));
        }
    }
    // Every case but the three of one step (two one-step turbo cases, img2img at strength 0.3).
    assert_eq!(
        report.len(),
        20 + SDXL_CASES + IMAGE_CASES - 3,
        "cases mixed:\n{}",
        report.join("\n")
    );
    eprintln!("{}", report.join("\n"));
}

#[test]
fn prompt_tokens_match_the_reference_tokenizer() {
    let tokens: Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("tokens.json")).unwrap()).unwrap();
    let tokenizer = ClipTokenizer::load(&models().join("sd-tiny/tokenizer")).unwrap();
    let mut checked = 0;
    for p in tokens["prompts"].as_array().unwrap() {
        let text = p["text"].as_str().unwrap();
        // Python's ftfy rewrites HTML entities, curly quotes and ligatures; the rest is the same.
        if !text.is_ascii() || text.contains('&') {
            continue;
        }
        let want: Vec<u32> = p["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(tokenizer.encode(text).unwrap(), want, "{text:?}");
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} ASCII prompts checked");
}

#[test]
fn sdxl_prompts_tokenize_as_both_reference_tokenizers() {
    let dir = models().join("sdxl-tiny");
    let first = ClipTokenizer::load(&dir.join("tokenizer")).unwrap();
    let second = ClipTokenizer::load(&dir.join("tokenizer_2")).unwrap();
    let ids = |v: &Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect() };
    let mut checked = 0;
    for case in Set::Sdxl.cases() {
        let prompts = [
            ("prompt", "prompt_ids", "prompt_ids_2"),
            ("negative_prompt", "negative_prompt_ids", "negative_prompt_ids_2"),
        ];
        for (text, ids_1, ids_2) in prompts {
            let Some(text) = case[text].as_str() else { continue };
            if case[ids_1].is_array() {
                assert_eq!(first.encode(text).unwrap(), ids(&case[ids_1]), "{text:?}, tokenizer");
                checked += 1;
            }
            if case[ids_2].is_array() {
                assert_eq!(second.encode(text).unwrap(), ids(&case[ids_2]), "{text:?}, tokenizer_2");
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "only {checked} prompts checked");
    // tokenizer_2 pads with `!`, a special token there: written in a prompt it is the pad id.
    let wow = second.encode("wow!").unwrap();
    assert_eq!(wow[2], wow[wow.len() - 1], "`!` in a prompt is tokenizer_2's pad token {wow:?}");
}

/// Mean |Δ| between the float images of two runs that differ in one input.
fn moved(a: &[Vec<u8>], b: &[Vec<u8>]) -> f64 {
    let (_, _, a) = png_pixels(&a[0]).unwrap();
    let (_, _, b) = png_pixels(&b[0]).unwrap();
    a.iter().zip(&b).map(|(x, y)| (*x as f64 - *y as f64).abs() / 255.0).sum::<f64>() / a.len() as f64
}

#[test]
fn prompt_negative_prompt_guidance_and_seed_each_change_the_image() {
    let base = cases().into_iter().find(|c| c["name"] == "euler").unwrap();
    let dir = model_dir(&base);
    let (_, reference) = run_case(Set::Sd, &base, &dir);
    let vary = |key: &str, value: Value| {
        let mut c = base.clone();
        c[key] = value;
        run_case(Set::Sd, &c, &dir).1
    };
    // The reference generator measured these moves on the same model (fixtures README): prompt
    // 0.017, negative prompt 0.012, guidance 7.5 → 1 0.022, seed 0.157 mean |Δ|.
    let changes = [
        ("prompt", moved(&reference, &vary("prompt", "a watercolor of a lighthouse".into()))),
        ("negative_prompt", moved(&reference, &vary("negative_prompt", "".into()))),
        ("guidance_scale", moved(&reference, &vary("guidance_scale", 1.0.into()))),
        (
            "latents (seed)",
            moved(&reference, &vary("latents_in", "ddim/latents_in.npy".into())),
        ),
    ];
    for (what, d) in changes {
        assert!(d > 0.005, "changing {what} moved the image by only {d}");
    }
    assert_eq!(
        moved(&reference, &run_case(Set::Sd, &base, &dir).1),
        0.0,
        "the same inputs give the same image"
    );
}

/// Runs `sluice-worker generate` on a recorded case with its flags (`--negative-prompt` only when
/// the case had one) into `out`, and checks the latents and the PNG against the reference.
fn generate_matches(set: Set, case: &Value, out: &Path) {
    let fixtures = set.fixtures();
    let f = |p: &str| fixtures.join(case[p].as_str().unwrap()).display().to_string();
    let number = |p: &str| case[p].to_string();
    let mut command = std::process::Command::new(sluice_integration_tests::bin("sluice-worker"));
    let model = models().join(case["model"].as_str().unwrap());
    command
        .args(["generate", "--model-path", &model.display().to_string()])
        .args(["--prompt", case["prompt"].as_str().unwrap()])
        .args(["--steps", &number("steps"), "--guidance-scale", &number("guidance_scale")])
        .args(["--sampler", case["sampler"].as_str().unwrap()])
        .args(["--width", &number("width"), "--height", &number("height")])
        .args(["--num-images", "1", "--latents-in", &f("latents_in")])
        .args(["--out", &out.join("x.png").display().to_string()])
        .args(["--latents-out", &out.join("x.npy").display().to_string()])
        .env("ORT_DYLIB_PATH", &assets().unwrap()["ORT_DYLIB_PATH"]);
    if let Some(negative) = case["negative_prompt"].as_str() {
        command.args(["--negative-prompt", negative]);
    }
    if case["noise_in"].is_string() {
        command.args(["--noise-in", &f("noise_in")]);
    }
    assert!(command.status().unwrap().success());
    let got = npy::read(&out.join("x.npy")).unwrap();
    let want = npy::read(&fixtures.join(case["expected_latents"].as_str().unwrap())).unwrap();
    assert_eq!(got.shape, want.shape);
    let err = got.data.iter().zip(&want.data).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err <= 1e-3, "latents differ by {err}");
    let (_, _, a) = png_pixels(&std::fs::read(out.join("x.png")).unwrap()).unwrap();
    let png = fixtures.join(case["expected_images"][0].as_str().unwrap());
    let (_, _, b) = png_pixels(&std::fs::read(png).unwrap()).unwrap();
    assert_eq!(a.len(), b.len());
    let levels = a.iter().zip(&b).map(|(x, y)| (*x as i32 - *y as i32).abs()).max().unwrap();
    assert!(levels <= 1, "PNG differs by {levels} levels");
}

#[test]
fn generate_cli_runs_sdxl_and_an_absent_negative_prompt_is_not_an_empty_one() {
    let out = std::env::temp_dir().join(format!("sluice-generate-xl-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    for name in ["euler_absent_negative", "euler_empty_negative", "euler_a"] {
        let case = Set::Sdxl.cases().into_iter().find(|c| c["name"] == name).unwrap();
        generate_matches(Set::Sdxl, &case, &out);
    }
    std::fs::remove_dir_all(out).ok();
}

#[test]
fn generate_cli_reproduces_a_reference_case_with_its_flags() {
    let case = cases().into_iter().find(|c| c["name"] == "euler_a").unwrap();
    let out = std::env::temp_dir().join(format!("sluice-generate-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    generate_matches(Set::Sd, &case, &out);
    // Two images: x_0.png, x_1.png.
    let status = std::process::Command::new(sluice_integration_tests::bin("sluice-worker"))
        .args([
            "generate",
            "--model-path",
            &models().join("sd-tiny").display().to_string(),
            "--prompt",
            "a red car",
        ])
        .args([
            "--num-images",
            "2",
            "--seed",
            "7",
            "--out",
            &out.join("y.png").display().to_string(),
        ])
        .env("ORT_DYLIB_PATH", &assets().unwrap()["ORT_DYLIB_PATH"])
        .status()
        .unwrap();
    assert!(status.success());
    let (y0, y1) = (
        std::fs::read(out.join("y_0.png")).unwrap(),
        std::fs::read(out.join("y_1.png")).unwrap(),
    );
    assert_ne!(y0, y1, "each image has its own noise");
    std::fs::remove_dir_all(out).ok();
}

/// Hooks of a test: cancels the task once `cancel_after` steps are done; records progress.
struct CancelAfter {
    cancel_after: usize,
    seen: std::sync::Mutex<Vec<usize>>,
}

impl sluice_worker::engine::TaskHooks for CancelAfter {
    fn cancelled(&self) -> bool {
        self.seen.lock().unwrap().last().is_some_and(|&s| s >= self.cancel_after)
    }
    fn progress(&self, step: usize, _steps: usize) {
        self.seen.lock().unwrap().push(step);
    }
}

#[test]
fn the_unet_loop_reports_each_step_and_stops_a_cancelled_task_between_steps() {
    let dir = models().join("sd-tiny");
    let model = StableDiffusion::open(runtime(), "sd", &dir).unwrap();
    let request = |seed| SdRequest {
        prompt: "a lighthouse".into(),
        negative_prompt: Some(String::new()),
        steps: 8,
        guidance_scale: 7.5,
        sampler: Sampler::Euler,
        width: 64,
        height: 64,
        num_images: 1,
        seed,
        image: None,
    };
    let (bucket, a) = model.prepare_request(&request(1), None).unwrap();
    let (_, b) = model.prepare_request(&request(2), None).unwrap();
    let cancelled = Arc::new(CancelAfter {
        cancel_after: 3,
        seen: Default::default(),
    });
    let kept = Arc::new(CancelAfter {
        cancel_after: usize::MAX,
        seen: Default::default(),
    });
    let inputs = (0..a.inputs.len())
        .map(|i| sluice_worker::engine::Tensor::concat(&[&a.inputs[i], &b.inputs[i]]))
        .collect();
    let call = Call {
        key: bucket.key,
        inputs,
        tasks: vec![
            CallTask {
                id: "cancelled".into(),
                attempt: 1,
                rows: 1,
                hooks: Some(cancelled.clone()),
            },
            CallTask {
                id: "kept".into(),
                attempt: 1,
                rows: 1,
                hooks: Some(kept.clone()),
            },
        ],
    };
    let mut backend = model.load(&dir, &SessionOptions::default()).unwrap();
    let outputs = backend.run(&call).unwrap();
    assert_eq!(*cancelled.seen.lock().unwrap(), vec![1, 2, 3], "no step after the cancellation");
    assert_eq!(*kept.seen.lock().unwrap(), (1..=8).collect::<Vec<_>>(), "the other task runs on");
    assert_eq!(
        a.render.render(&outputs, 0..1).unwrap_err(),
        sluice_worker::models::ModelError::Cancelled
    );
    assert_eq!(b.render.render(&outputs, 1..2).unwrap().len(), 1);
    // The batch mate's image is what it would have been alone.
    let alone = Call {
        key: call.key.clone(),
        inputs: b.inputs.clone(),
        tasks: vec![CallTask {
            id: "b".into(),
            attempt: 1,
            rows: 1,
            hooks: None,
        }],
    };
    let alone = backend.run(&alone).unwrap();
    assert_eq!(b.render.render(&outputs, 1..2).unwrap(), b.render.render(&alone, 0..1).unwrap());
}
