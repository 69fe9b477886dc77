//! Every sampler against diffusers 0.39's own traces (`testdata/schedulers.json`, made by
//! `scripts/sd-reference/generate.sh`): the same configs, step counts, model outputs and noise,
//! each step's result within 1e-4 relative + 1e-5 absolute.

use serde_json::Value;

use super::*;

const TRACES: &str = include_str!("../testdata/schedulers.json");

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| match x {
            Value::String(s) if s == "NaN" => f32::NAN,
            Value::String(s) if s == "Infinity" => f32::INFINITY,
            Value::String(s) if s == "-Infinity" => f32::NEG_INFINITY,
            x => x.as_f64().expect("a number") as f32,
        })
        .collect()
}

fn close(got: &[f32], want: &[f32], what: &str) {
    close_from(got, want, 0.0, what)
}

/// Within 1e-4 relative + 1e-5 absolute of diffusers, plus 2 float32 epsilons of `input` (the
/// largest magnitude the step started from): torch's vectorized `sqrt` is not correctly rounded
/// (it differs from IEEE `sqrtf` in the last bit for ~18% of SD's training sigmas), and a step
/// that cancels large terms (zero-SNR Euler: a sample of ~2,750 at sigma 4,096 steps to ~0.5)
/// turns that last bit of its operands into an absolute error of one ulp of the operands.
fn close_from(got: &[f32], want: &[f32], input: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let rms = (want.iter().filter(|w| w.is_finite()).map(|w| w * w).sum::<f32>() / want.len().max(1) as f32).sqrt();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = 1e-5 + 1e-4 * w.abs().max(rms) + 2.0 * f32::EPSILON * input;
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= bound;
        assert!(ok, "{what}[{i}]: {g} vs diffusers {w} (bound {bound})");
    }
}

/// The sampler's config as `from_config` sees it: the named config, plus the sampler's own
/// overrides that this crate models (the Karras flag).
fn config_of(traces: &Value, entry: &Value) -> SchedulerConfig {
    let mut config = traces["configs"][entry["config_name"].as_str().unwrap()].clone();
    if let Some(kwargs) = entry["from_config_kwargs"].as_object() {
        for (k, v) in kwargs {
            config[k] = v.clone();
        }
    }
    SchedulerConfig::from_json(&config.to_string()).unwrap()
}

#[test]
fn every_sampler_matches_diffusers_step_by_step() {
    let traces: Value = serde_json::from_str(TRACES).unwrap();
    let inputs = &traces["inputs"];
    let image_len: usize = inputs["shape"].as_array().unwrap()[1..]
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .product();
    let start = floats(&inputs["sample"]);
    let mut checked = 0;
    let mut failures = Vec::new();
    for entry in traces["entries"].as_array().unwrap() {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let sampler = Sampler::parse(entry["sampler"].as_str().unwrap()).unwrap();
            let steps = entry["steps"].as_u64().unwrap() as usize;
            let name = format!("{} / {} / {steps} steps", sampler.name(), entry["config_name"]);
            let config = config_of(&traces, entry);
            let schedule = Schedule::new(sampler, &config, steps).unwrap_or_else(|e| panic!("{name}: {e}"));
            close(schedule.timesteps(), &floats(&entry["timesteps"]), &format!("{name}: timesteps"));
            let init = entry["init_noise_sigma"].as_f64().unwrap() as f32;
            close(&[schedule.init_noise_sigma()], &[init], &format!("{name}: init_noise_sigma"));
            let mut sample: Vec<f32> = start.iter().map(|x| x * schedule.init_noise_sigma()).collect();
            close(&sample, &floats(&entry["initial_sample"]), &format!("{name}: initial sample"));
            let mut states = [ImageState::default(), ImageState::default()];
            let mut draws = 0;
            // The largest magnitude any earlier step started from: its rounding carries on.
            let mut carried = 0f32;
            let trace = entry["trace"].as_array().unwrap();
            for (i, expected) in trace.iter().enumerate() {
                let what = format!("{name}: step {i}");
                if let Some(scaled) = expected.get("scaled_model_input") {
                    let mut input = sample.clone();
                    schedule.scale_model_input(i, &mut input).unwrap();
                    close_from(&input, &floats(scaled), carried, &format!("{what}: scaled input"));
                }
                let output = floats(&inputs["model_outputs"][i]);
                let noise = schedule.draws_noise(i).then(|| {
                    draws += 1;
                    floats(&inputs["noises"][draws - 1])
                });
                let input = sample.iter().fold(0f32, |m, x| m.max(x.abs()));
                carried = carried.max(input);
                for (image, state) in states.iter_mut().enumerate() {
                    let range = image * image_len..(image + 1) * image_len;
                    let noise = noise.as_ref().map(|n| &n[range.clone()]);
                    schedule
                        .step(i, &output[range.clone()], &mut sample[range], noise, state)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                close_from(&sample, &floats(&expected["prev_sample"]), carried, &format!("{what}: sample"));
            }
            if entry.get("error").is_some() {
                // diffusers failed at the next step; so must this.
                let i = trace.len();
                let output = floats(&inputs["model_outputs"][i]);
                let result = schedule.step(i, &output[..image_len], &mut sample[..image_len], None, &mut states[0]);
                assert!(result.is_err(), "{name}: diffusers fails at step {i}: {}", entry["error"]);
            } else {
                assert_eq!(trace.len(), steps, "{name}");
                assert_eq!(draws, entry["noise_draws"].as_u64().unwrap() as usize, "{name}: noise draws");
                assert_eq!(schedule.noise_draws(), draws, "{name}: noise_draws()");
            }
        }));
        if let Err(e) = r {
            failures.push(e.downcast_ref::<String>().cloned().unwrap_or_default());
        }
        checked += 1;
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(checked, 240, "every recorded entry");
}

/// Every entry's scheduler config as diffusers saves it (`scheduler.config` written by Python's
/// `json`: `lambda_min_clipped` and any other non-finite float bare, `-Infinity`) loads and gives
/// the recorded timesteps.
#[test]
fn configs_load_as_diffusers_writes_them() {
    let traces: Value = serde_json::from_str(TRACES).unwrap();
    let mut bare = 0;
    for entry in traces["entries"].as_array().unwrap() {
        if entry.get("error").is_some() {
            continue;
        }
        let sampler = Sampler::parse(entry["sampler"].as_str().unwrap()).unwrap();
        let steps = entry["steps"].as_u64().unwrap() as usize;
        let name = format!("{} / {} / {steps} steps", sampler.name(), entry["config_name"]);
        let written = ["NaN", "Infinity", "-Infinity"]
            .iter()
            .fold(entry["config"].to_string(), |text, t| text.replace(&format!("\"{t}\""), t));
        bare += usize::from(written.contains("-Infinity"));
        let config = SchedulerConfig::from_json(&written).unwrap_or_else(|e| panic!("{name}: {e}\n{written}"));
        let schedule = Schedule::new(sampler, &config, steps).unwrap_or_else(|e| panic!("{name}: {e}"));
        close(schedule.timesteps(), &floats(&entry["timesteps"]), &format!("{name}: timesteps"));
    }
    assert!(bare >= 10, "the DPM entries' configs carry a bare -Infinity: {bare}");
}

#[test]
fn the_training_schedule_matches_torch() {
    let traces: Value = serde_json::from_str(TRACES).unwrap();
    for (name, config) in traces["configs"].as_object().unwrap() {
        let config = SchedulerConfig::from_json(&config.to_string()).unwrap();
        // DDIM's: no zero-SNR clamp.
        let training = Training::new(&config, DEFAULT_BETAS, false, Sampler::Ddim).unwrap();
        close(
            &training.alphas_cumprod,
            &floats(&traces["alphas_cumprod"][name]),
            &format!("{name}: alphas_cumprod"),
        );
    }
}

#[test]
fn config_keys_saved_as_defaults_take_the_reading_class_defaults() {
    let c =
        SchedulerConfig::from_json(r#"{"timestep_spacing": "leading", "steps_offset": 1, "_use_default_values": ["timestep_spacing"]}"#)
            .unwrap();
    assert_eq!(c.timestep_spacing, None);
    assert_eq!(c.steps_offset, Some(1));
    let euler = Schedule::new(Sampler::Euler, &c, 4).unwrap();
    assert_eq!(euler.timesteps(), &[999.0, 666.0, 333.0, 0.0], "Euler's own default: linspace");
}

#[test]
fn unsupported_options_are_refused_by_name() {
    let c = SchedulerConfig::from_json(r#"{"thresholding": true}"#).unwrap();
    let e = Schedule::new(Sampler::Ddim, &c, 4).unwrap_err();
    assert!(e.to_string().contains("thresholding"), "{e}");
    let c = SchedulerConfig::from_json(r#"{"beta_schedule": "sigmoid"}"#).unwrap();
    assert!(Schedule::new(Sampler::Euler, &c, 4).unwrap_err().to_string().contains("sigmoid"));
    assert!(Schedule::new(Sampler::Lcm, &SchedulerConfig::default(), 51).is_err());
    assert!(Schedule::new(Sampler::Euler, &SchedulerConfig::default(), 0).is_err());
}
