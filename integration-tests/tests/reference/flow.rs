//! FLUX.1 and SD3 against the reference implementation: every case recorded by
//! `scripts/sd-reference/generate.sh --flow` (Optimum's `ORTFluxPipeline` /
//! `ORTStableDiffusion3Pipeline`, diffusers 0.39, on the tiny random-weight models in
//! `fixtures/flow-tiny.tar.xz`), run by Sluice from the same initial latents. Final latents
//! within 1e-3, PNGs within ±1 level, token ids and sigmas identical; and the step-level loop:
//! rows at different steps in one transformer call give what each gives alone.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sluice_integration_tests::inprocess::{assert_as_alone, max_diff, rows_at_different_steps, run_alone, runtime};
use sluice_integration_tests::{assets, png_pixels, stack::repo_root};
use sluice_worker::models::diffusion::flow::backend::EncoderPlacement;
use sluice_worker::models::diffusion::npy;
use sluice_worker::models::diffusion::request::{Draws, SdRequest};
use sluice_worker::models::diffusion::schedulers::flow_euler::FlowSchedule;
use sluice_worker::models::diffusion::schedulers::{Sampler, SchedulerConfig};
use sluice_worker::models::diffusion::{FlowSettings, Pipeline, StableDiffusion};

/// How many cases `generate.sh --flow` records.
const FLOW_CASES: usize = 13;

fn fixtures() -> PathBuf {
    repo_root().join("integration-tests/fixtures/flow-reference")
}

fn cases() -> Vec<Value> {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json")).unwrap()).unwrap()
}

fn case(name: &str) -> Value {
    cases().into_iter().find(|c| c["name"] == name).unwrap()
}

fn model_dir(case: &Value) -> PathBuf {
    PathBuf::from(&assets().unwrap()["SLUICE_SD_TINY"]).join(case["model"].as_str().unwrap())
}

fn settings(case: &Value, text_encoders: EncoderPlacement) -> FlowSettings {
    FlowSettings {
        text_encoders,
        t5_max_length: case["max_sequence_length"].as_u64().map(|l| l as usize),
    }
}

fn request(case: &Value) -> SdRequest {
    SdRequest {
        prompt: case["prompt"].as_str().unwrap().to_owned(),
        negative_prompt: case["negative_prompt"].as_str().map(str::to_owned),
        steps: case["steps"].as_u64().unwrap() as usize,
        guidance_scale: case["guidance_scale"].as_f64().unwrap() as f32,
        sampler: Sampler::FlowEuler,
        width: case["width"].as_u64().unwrap() as usize,
        height: case["height"].as_u64().unwrap() as usize,
        num_images: case["num_images"].as_u64().unwrap() as usize,
        seed: 0,
        image: None,
    }
}

fn latents_in(case: &Value) -> Vec<f32> {
    npy::read(&fixtures().join(case["latents_in"].as_str().unwrap())).unwrap().data
}

/// Runs `request` from `latents` alone (see [`run_alone`]).
fn run(model: &StableDiffusion, dir: &Path, request: &SdRequest, latents: Vec<f32>) -> (Vec<f32>, Vec<Vec<u8>>) {
    let draws = Draws {
        latents,
        noise: Vec::new(),
        image_noise: None,
    };
    run_alone(model, dir, request, draws, Vec::new())
}

fn run_case(case: &Value, text_encoders: EncoderPlacement) -> (Vec<f32>, Vec<Vec<u8>>) {
    let dir = model_dir(case);
    let model = StableDiffusion::open_with(runtime(), "flow", &dir, settings(case, text_encoders)).unwrap();
    run(&model, &dir, &request(case), latents_in(case))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect()
}

/// Max level difference between two PNGs of the same size.
fn png_levels(a: &[u8], b: &[u8]) -> i32 {
    let (w, h, a) = png_pixels(a).unwrap();
    let (ew, eh, b) = png_pixels(b).unwrap();
    assert_eq!((w, h), (ew, eh));
    a.iter().zip(&b).map(|(x, y)| (*x as i32 - *y as i32).abs()).max().unwrap()
}

#[test]
fn every_flow_reference_case_matches_diffusers() {
    let mut report = Vec::new();
    for case in cases() {
        let name = case["name"].as_str().unwrap().to_owned();
        let (latents, images) = run_case(&case, EncoderPlacement::Device);
        let expected = npy::read(&fixtures().join(case["expected_latents"].as_str().unwrap())).unwrap();
        let latent_err = max_diff(&latents, &expected.data);
        assert!(latent_err <= 1e-3, "{name}: final latents differ by {latent_err} (tolerance 1e-3)");
        let want = case["expected_images"].as_array().unwrap();
        assert_eq!(images.len(), want.len(), "{name}");
        let mut level_err = 0;
        for (i, (png, want)) in images.iter().zip(want).enumerate() {
            let e = png_levels(png, &std::fs::read(fixtures().join(want.as_str().unwrap())).unwrap());
            assert!(e <= 1, "{name}: image {i} differs by {e} levels (tolerance 1)");
            level_err = level_err.max(e);
        }
        report.push(format!("{name}: max |Δ latents| {latent_err:.2e}, max |Δ PNG| {level_err}"));
    }
    assert_eq!(report.len(), FLOW_CASES, "every recorded case");
    eprintln!("{}", report.join("\n"));
}

#[test]
fn every_case_tokenizes_and_schedules_as_the_pipeline() {
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let dir = model_dir(&case);
        let model = StableDiffusion::open_with(runtime(), "flow", &dir, settings(&case, EncoderPlacement::Device)).unwrap();
        let Pipeline::Flow(layout, _) = model.pipeline() else {
            panic!("{name}: not a flow model")
        };
        let texts = [("prompt", ""), ("negative_prompt", "negative_")];
        for (text, prefix) in texts {
            let Some(text) = case[text]
                .as_str()
                .or((prefix == "negative_" && case["negative_t5_ids"].is_array()).then_some(""))
            else {
                continue;
            };
            if !case[format!("{prefix}t5_ids")].is_array() {
                continue;
            }
            assert_eq!(
                layout.clip.encode(text).unwrap(),
                ids(&case[format!("{prefix}clip_ids")]),
                "{name}: {prefix}clip_ids"
            );
            if let Some(clip_2) = &layout.clip_2 {
                assert_eq!(
                    clip_2.encode(text).unwrap(),
                    ids(&case[format!("{prefix}clip_g_ids")]),
                    "{name}: {prefix}clip_g_ids"
                );
            }
            let t5 = layout.t5.encode(text, layout.t5_length).unwrap();
            assert_eq!(t5, ids(&case[format!("{prefix}t5_ids")]), "{name}: {prefix}t5_ids");
        }
        let config = SchedulerConfig::from_json(&case["scheduler_config"].to_string()).unwrap();
        let r = request(&case);
        let schedule = FlowSchedule::new(&config, r.steps, layout.family.sigmas(), layout.image_seq_len(r.width, r.height)).unwrap();
        let recorded = |key: &str| -> Vec<f32> { case[key].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect() };
        assert_eq!(schedule.sigmas(), recorded("sigmas").as_slice(), "{name}: sigmas");
        assert_eq!(schedule.timesteps(), recorded("timesteps").as_slice(), "{name}: timesteps");
        // mu shifts the sigmas only where the config has dynamic shifting (dev).
        assert_eq!(schedule.mu().is_some(), config.use_dynamic_shifting == Some(true), "{name}: mu");
        if let Some(mu) = schedule.mu() {
            let want = case["mu"].as_f64().unwrap();
            assert!((mu - want).abs() < 1e-12, "{name}: mu {mu} vs {want}");
        }
    }
}

#[test]
fn t5_prompts_tokenize_as_the_reference_tokenizer() {
    let tokens: Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("tokens.json")).unwrap()).unwrap();
    let dir = model_dir(&case("sd3_1step"));
    let model = StableDiffusion::open(runtime(), "flow", &dir).unwrap();
    let Pipeline::Flow(layout, _) = model.pipeline() else {
        panic!("not a flow model")
    };
    let mut checked = 0;
    for p in tokens["prompts"].as_array().unwrap() {
        let text = p["text"].as_str().unwrap();
        assert_eq!(layout.t5.encode(text, 512).unwrap(), ids(&p["t5_ids"]), "{text:?} (512)");
        assert_eq!(layout.t5.encode(text, 256).unwrap(), ids(&p["t5_ids_256"]), "{text:?} (256)");
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} prompts checked");
}

/// Step-level batching: task A runs the first half of its steps alone; then A (from those
/// latents, the rest of its steps) and B (from noise, every step) share transformer calls, A at
/// step `half` while B is at step 0. Each ends where it ends alone: latents within 1e-5, the same
/// PNG bytes.
fn rows_at_different_steps_match(case_name: &str) {
    let case = case(case_name);
    let dir = model_dir(&case);
    let model = StableDiffusion::open_with(runtime(), "flow", &dir, settings(&case, EncoderPlacement::Device)).unwrap();
    let mut a = request(&case);
    a.num_images = 1;
    let mut b = a.clone();
    b.prompt = "a watercolor of a lighthouse at dusk".into();
    // Its own guidance too (dev's embedding, SD3's scale; schnell ignores it), so per-row
    // guidance is mixed in the shared calls as well.
    b.guidance_scale += 2.0;
    let noise = latents_in(&case);
    let per = noise.len() / case["num_images"].as_u64().unwrap() as usize;
    let (a_noise, b_noise) = (noise[..per].to_vec(), noise[per..].to_vec());
    assert!(!b_noise.is_empty(), "{case_name}: two images' draws");
    let draws = |latents| Draws {
        latents,
        noise: Vec::new(),
        image_noise: None,
    };
    let (ra, rb) = rows_at_different_steps(&model, &dir, (&a, draws(a_noise)), (&b, draws(b_noise)))
        .unwrap_or_else(|| panic!("{case_name}: at least two steps"));
    assert_as_alone(case_name, (ra, rb));
    eprintln!("{case_name}: mixed-step call vs alone: A {:.2e}, B {:.2e}", ra.latents, rb.latents);
}

#[test]
fn flux_rows_at_different_steps_in_one_call_give_the_images_of_each_alone() {
    rows_at_different_steps_match("schnell_96x64_4step_batch2");
    rows_at_different_steps_match("dev_96x64_2step_g5_batch2");
}

#[test]
fn sd3_rows_at_different_steps_in_one_call_give_the_images_of_each_alone() {
    rows_at_different_steps_match("sd3_96x64_batch2");
}

#[test]
fn every_text_encoder_placement_gives_the_same_images() {
    for name in ["dev_64_4step_g35", "sd3_64_4step_cfg5_neg"] {
        let case = case(name);
        let (device, _) = run_case(&case, EncoderPlacement::Device);
        for placement in [EncoderPlacement::Cpu, EncoderPlacement::OnDemand] {
            let (latents, _) = run_case(&case, placement);
            assert_eq!(latents, device, "{name}: {placement:?}");
        }
    }
}

#[test]
fn flow_models_refuse_what_their_pipelines_do_not_run() {
    let flux = case("schnell_64_1step");
    let dir = model_dir(&flux);
    let model = StableDiffusion::open(runtime(), "flow", &dir).unwrap();
    let base = request(&flux);
    let refused = |change: &dyn Fn(&mut SdRequest), field: &str| {
        let mut r = base.clone();
        change(&mut r);
        let e = model.check(&r).unwrap_err();
        assert!(e.contains(field), "{e:?} should name {field}");
    };
    refused(&|r| r.width = 72, "multiples of 16");
    refused(&|r| r.sampler = Sampler::Euler, "flow_euler");
    refused(&|r| r.negative_prompt = Some("blurry".into()), "negative_prompt");
    assert_eq!(model.check(&base), Ok(0));
    // SD3's positional embedding covers 16x16 patches of the tiny model: 256 pixels a side.
    let sd3 = StableDiffusion::open(runtime(), "sd3", &model_dir(&case("sd3_1step"))).unwrap();
    let mut r = request(&case("sd3_1step"));
    r.width = 256;
    assert_eq!(sd3.check(&r), Ok(0));
    r.width = 272;
    assert!(sd3.check(&r).unwrap_err().contains("at most 256"));
    // And a UNet model refuses the flow sampler.
    let sd = StableDiffusion::open(runtime(), "sd", &model_dir(&flux).with_file_name("sd-tiny")).unwrap();
    let mut r = base.clone();
    r.sampler = Sampler::FlowEuler;
    assert!(sd.check(&r).unwrap_err().contains("flow"));
    // A catalog entry must offer only what the model runs.
    let entry = |extra: &str| {
        let text = format!("[[model]]\nname = \"m\"\nkind = \"stable-diffusion\"\nsize_multiple = 16\n{extra}");
        sluice_schemas::Catalog::parse(&text).unwrap().get("m").unwrap().clone()
    };
    let flux_entry = entry("samplers = [\"flow_euler\"]\ndefault_sampler = \"flow_euler\"\nnegative_prompt = false\n");
    assert_eq!(model.fits_catalog(&flux_entry), Ok(()));
    assert!(model.fits_catalog(&entry("")).unwrap_err().contains("euler"), "the UNet samplers");
    let with_negative = entry("samplers = [\"flow_euler\"]\ndefault_sampler = \"flow_euler\"\n");
    assert!(model.fits_catalog(&with_negative).unwrap_err().contains("negative_prompt"));
    assert_eq!(sd3.fits_catalog(&with_negative), Ok(()), "SD3 takes one");
    assert!(sd.fits_catalog(&flux_entry).unwrap_err().contains("flow_euler"));
}

/// `sluice-worker generate` on a recorded case: the family from `model_index.json`,
/// `--latents-in` unpacked [n, 16, h/8, w/8], `--latents-out` the same layout.
fn generate_matches(case: &Value, out: &Path) {
    let f = |p: &str| fixtures().join(case[p].as_str().unwrap()).display().to_string();
    let number = |p: &str| case[p].to_string();
    let mut command = std::process::Command::new(sluice_integration_tests::bin("sluice-worker"));
    command
        .args(["generate", "--model-path", &model_dir(case).display().to_string()])
        .args(["--prompt", case["prompt"].as_str().unwrap()])
        .args(["--steps", &number("steps"), "--guidance-scale", &number("guidance_scale")])
        .args(["--sampler", "flow_euler"])
        .args(["--width", &number("width"), "--height", &number("height")])
        .args(["--num-images", &number("num_images"), "--latents-in", &f("latents_in")])
        .args(["--t5-max-length", &number("max_sequence_length")])
        .args(["--out", &out.join("x.png").display().to_string()])
        .args(["--latents-out", &out.join("x.npy").display().to_string()])
        .env("ORT_DYLIB_PATH", &assets().unwrap()["ORT_DYLIB_PATH"]);
    if let Some(negative) = case["negative_prompt"].as_str() {
        command.args(["--negative-prompt", negative]);
    }
    assert!(command.status().unwrap().success());
    let got = npy::read(&out.join("x.npy")).unwrap();
    let want = npy::read(&fixtures().join(case["expected_latents"].as_str().unwrap())).unwrap();
    assert_eq!(got.shape, want.shape);
    let err = max_diff(&got.data, &want.data);
    assert!(err <= 1e-3, "latents differ by {err}");
    let n = case["num_images"].as_u64().unwrap() as usize;
    for (i, png) in case["expected_images"].as_array().unwrap().iter().enumerate() {
        let file = if n == 1 { "x.png".to_owned() } else { format!("x_{i}.png") };
        let levels = png_levels(
            &std::fs::read(out.join(file)).unwrap(),
            &std::fs::read(fixtures().join(png.as_str().unwrap())).unwrap(),
        );
        assert!(levels <= 1, "PNG {i} differs by {levels} levels");
    }
}

#[test]
fn generate_cli_runs_flux_and_sd3_cases() {
    let out = std::env::temp_dir().join(format!("sluice-generate-flow-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    for name in [
        "dev_96x64_2step_g5_batch2",
        "schnell_long_prompt_t5_truncated",
        "sd3_64_4step_cfg5_neg",
    ] {
        generate_matches(&case(name), &out);
    }
    std::fs::remove_dir_all(out).ok();
}
