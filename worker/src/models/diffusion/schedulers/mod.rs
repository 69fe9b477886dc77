//! Samplers, each matching the diffusers class built with `Class.from_config(the model's
//! scheduler_config.json)` (diffusers 0.39; checked against its traces in `testdata/`):
//!
//! | sampler | diffusers class | from_config overrides |
//! |---|---|---|
//! | `euler` | EulerDiscreteScheduler | |
//! | `euler_a` | EulerAncestralDiscreteScheduler | |
//! | `ddim` | DDIMScheduler | `step(eta=0)` |
//! | `dpmpp_2m` | DPMSolverMultistepScheduler | `algorithm_type="dpmsolver++", solver_order=2` |
//! | `dpmpp_2m_karras` | DPMSolverMultistepScheduler | the same, `use_karras_sigmas=True` |
//! | `lcm` | LCMScheduler | |
//! | `flow_euler` | FlowMatchEulerDiscreteScheduler (FLUX.1, SD3; [`flow_euler`]) | |
//!
//! Keys the file lacks take each class's own default (so `timestep_spacing` is `linspace` for
//! Euler and DPM, `leading` for DDIM); keys a class does not know are ignored, as `from_config`
//! does. The arithmetic follows diffusers' order and precision: schedules are computed as torch
//! and numpy compute them (float32 tensors, float64 numpy), each step in float32 per element.
//!
//! A [`Schedule`] is one sampler's plan for one number of steps; it is shared by every image of a
//! batch, and each image carries its own [`ImageState`] (the multistep solver's history), so that
//! any image can stop (a cancelled task) without touching the others.

mod ddim;
mod dpm;
mod euler;
pub mod flow_euler;
mod lcm;

use serde::Deserialize;
use thiserror::Error;

use super::python_json;

/// The samplers a task can ask for, with their names and rules, are the records' (`sluice-schemas`).
pub use sluice_schemas::Sampler;

/// Why a schedule can't be made.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ScheduleError {
    #[error("scheduler_config.json: {0}")]
    Config(String),
    #[error("{sampler}: {what} is not supported")]
    Unsupported { sampler: &'static str, what: String },
    #[error("{sampler}: {steps} steps: {reason}")]
    Steps {
        sampler: &'static str,
        steps: usize,
        reason: String,
    },
}

/// `scheduler/scheduler_config.json` as a model ships it: every key optional, unknown keys
/// ignored. Which of them a sampler reads, and its default, is the sampler's class's business.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct SchedulerConfig {
    pub num_train_timesteps: Option<usize>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub beta_start: Option<f64>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub beta_end: Option<f64>,
    pub beta_schedule: Option<String>,
    pub trained_betas: Option<Vec<f64>>,
    pub prediction_type: Option<String>,
    pub timestep_spacing: Option<String>,
    pub steps_offset: Option<i64>,
    pub rescale_betas_zero_snr: Option<bool>,
    pub clip_sample: Option<bool>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub clip_sample_range: Option<f64>,
    pub set_alpha_to_one: Option<bool>,
    pub thresholding: Option<bool>,
    pub interpolation_type: Option<String>,
    pub use_karras_sigmas: Option<bool>,
    pub use_exponential_sigmas: Option<bool>,
    pub use_beta_sigmas: Option<bool>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub sigma_min: Option<f64>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub sigma_max: Option<f64>,
    pub final_sigmas_type: Option<String>,
    pub timestep_type: Option<String>,
    pub solver_type: Option<String>,
    pub lower_order_final: Option<bool>,
    pub euler_at_final: Option<bool>,
    pub use_lu_lambdas: Option<bool>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub lambda_min_clipped: Option<f64>,
    pub variance_type: Option<String>,
    pub original_inference_steps: Option<usize>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub timestep_scaling: Option<f64>,
    // FlowMatchEulerDiscreteScheduler's.
    #[serde(default, deserialize_with = "python_json::float")]
    pub shift: Option<f64>,
    pub use_dynamic_shifting: Option<bool>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub base_shift: Option<f64>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub max_shift: Option<f64>,
    pub base_image_seq_len: Option<usize>,
    pub max_image_seq_len: Option<usize>,
    pub time_shift_type: Option<String>,
    #[serde(default, deserialize_with = "python_json::float")]
    pub shift_terminal: Option<f64>,
    pub invert_sigmas: Option<bool>,
    pub stochastic_sampling: Option<bool>,
}

impl SchedulerConfig {
    /// Parses the file as diffusers writes it (Python's `json`: `-Infinity` bare). Keys listed in `_use_default_values` were filled by the class that saved
    /// the file with its own defaults; `from_config` does not pass them on, so neither does this.
    pub fn from_json(text: &str) -> Result<SchedulerConfig, ScheduleError> {
        let bad = |e: serde_json::Error| ScheduleError::Config(e.to_string());
        let mut value = python_json::parse(text).map_err(bad)?;
        if let Some(map) = value.as_object_mut() {
            let defaults: Vec<String> = map
                .remove("_use_default_values")
                .and_then(|v| serde_json::from_value(v).ok())
                .unwrap_or_default();
            for key in defaults {
                map.remove(&key);
            }
        }
        serde_json::from_value(value).map_err(bad)
    }
}

/// What the model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prediction {
    Epsilon,
    Velocity,
    Sample,
}

impl Prediction {
    fn of(config: &SchedulerConfig, sampler: Sampler) -> Result<Prediction, ScheduleError> {
        match config.prediction_type.as_deref().unwrap_or("epsilon") {
            "epsilon" => Ok(Prediction::Epsilon),
            "v_prediction" => Ok(Prediction::Velocity),
            "sample" | "original_sample" if sampler != Sampler::EulerAncestral => Ok(Prediction::Sample),
            other => Err(ScheduleError::Unsupported {
                sampler: sampler.name(),
                what: format!("prediction_type {other:?}"),
            }),
        }
    }
}

/// How inference timesteps are spread over the training ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spacing {
    Linspace,
    Leading,
    Trailing,
}

impl Spacing {
    fn of(config: &SchedulerConfig, default: Spacing, sampler: Sampler) -> Result<Spacing, ScheduleError> {
        match config.timestep_spacing.as_deref() {
            None => Ok(default),
            Some("linspace") => Ok(Spacing::Linspace),
            Some("leading") => Ok(Spacing::Leading),
            Some("trailing") => Ok(Spacing::Trailing),
            Some(other) => Err(ScheduleError::Unsupported {
                sampler: sampler.name(),
                what: format!("timestep_spacing {other:?}"),
            }),
        }
    }
}

/// The training noise schedule: cumulative products of `1 - beta`, float32 as torch makes them.
#[derive(Debug, Clone)]
struct Training {
    alphas_cumprod: Vec<f32>,
}

/// Class defaults of the beta schedule (LCM's differ from the others').
struct BetaDefaults {
    start: f64,
    end: f64,
    schedule: &'static str,
}

const DEFAULT_BETAS: BetaDefaults = BetaDefaults {
    start: 0.0001,
    end: 0.02,
    schedule: "linear",
};

impl Training {
    /// `clamp_zero_snr`: Euler, Euler a and DPM set the last cumulative alpha to 2^-24 after a
    /// zero-SNR rescale (so sigmas stay finite); DDIM and LCM keep the 0.
    fn new(c: &SchedulerConfig, defaults: BetaDefaults, clamp_zero_snr: bool, sampler: Sampler) -> Result<Training, ScheduleError> {
        let n = c.num_train_timesteps.unwrap_or(1000);
        if n < 2 {
            return Err(ScheduleError::Config(format!("num_train_timesteps {n}")));
        }
        let start = c.beta_start.unwrap_or(defaults.start);
        let end = c.beta_end.unwrap_or(defaults.end);
        let mut betas: Vec<f32> = match (&c.trained_betas, c.beta_schedule.as_deref().unwrap_or(defaults.schedule)) {
            (Some(betas), _) => betas.iter().map(|&b| b as f32).collect(),
            (None, "linear") => torch_linspace(start as f32, end as f32, n),
            (None, "scaled_linear") => torch_linspace(start.sqrt() as f32, end.sqrt() as f32, n)
                .into_iter()
                .map(|b| b * b)
                .collect(),
            (None, "squaredcos_cap_v2") => betas_for_alpha_bar(n),
            (None, other) => {
                return Err(ScheduleError::Unsupported {
                    sampler: sampler.name(),
                    what: format!("beta_schedule {other:?}"),
                });
            }
        };
        let rescale = c.rescale_betas_zero_snr.unwrap_or(false);
        if rescale {
            betas = rescale_zero_terminal_snr(&betas);
        }
        let mut alphas_cumprod = cumprod(betas.iter().map(|b| 1.0 - b));
        if rescale && clamp_zero_snr {
            *alphas_cumprod.last_mut().expect("non-empty") = 2f32.powi(-24);
        }
        Ok(Training { alphas_cumprod })
    }

    fn len(&self) -> usize {
        self.alphas_cumprod.len()
    }

    /// `((1 - alphas_cumprod) / alphas_cumprod) ** 0.5`, float32.
    fn sigmas(&self) -> Vec<f32> {
        self.alphas_cumprod.iter().map(|&a| ((1.0 - a) / a).sqrt()).collect()
    }
}

/// `torch.linspace(start, end, steps)` for float32 on the CPU: computed in float32, from the
/// start up to half way and from the end back for the rest.
fn torch_linspace(start: f32, end: f32, steps: usize) -> Vec<f32> {
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|i| {
            if i < halfway {
                start + step * i as f32
            } else {
                end - step * (steps - i - 1) as f32
            }
        })
        .collect()
}

/// `torch.cumprod` of float32 values on the CPU: accumulated in float64, stored as float32.
fn cumprod(values: impl Iterator<Item = f32>) -> Vec<f32> {
    let mut acc = 1f64;
    values
        .map(|v| {
            acc *= v as f64;
            acc as f32
        })
        .collect()
}

/// diffusers' `betas_for_alpha_bar` (cosine schedule), float64 then float32.
fn betas_for_alpha_bar(n: usize) -> Vec<f32> {
    let alpha_bar = |t: f64| ((t + 0.008) / 1.008 * std::f64::consts::PI / 2.0).cos().powi(2);
    (0..n)
        .map(|i| {
            let (t1, t2) = (i as f64 / n as f64, (i + 1) as f64 / n as f64);
            (1.0 - alpha_bar(t2) / alpha_bar(t1)).min(0.999) as f32
        })
        .collect()
}

/// diffusers' `rescale_zero_terminal_snr`, in float32 as torch computes it.
fn rescale_zero_terminal_snr(betas: &[f32]) -> Vec<f32> {
    let alphas_cumprod = cumprod(betas.iter().map(|b| 1.0 - b));
    let mut sqrt: Vec<f32> = alphas_cumprod.iter().map(|a| a.sqrt()).collect();
    let (first, last) = (sqrt[0], *sqrt.last().expect("non-empty"));
    let scale = first / (first - last);
    for s in &mut sqrt {
        *s -= last;
        *s *= scale;
    }
    let bar: Vec<f32> = sqrt.iter().map(|s| s * s).collect();
    let mut alphas = vec![bar[0]];
    alphas.extend(bar.windows(2).map(|w| w[1] / w[0]));
    alphas.iter().map(|a| 1.0 - a).collect()
}

/// `np.interp(x, arange(len(ys)), ys)` for x within range, float64.
fn interp(x: f64, ys: &[f32]) -> f64 {
    if x <= 0.0 {
        return ys[0] as f64;
    }
    let last = ys.len() - 1;
    if x >= last as f64 {
        return ys[last] as f64;
    }
    let i = x.floor() as usize;
    let f = x - i as f64;
    let (a, b) = (ys[i] as f64, ys[i + 1] as f64);
    // numpy: slope * (x - xp[i]) + fp[i]
    (b - a) * f + a
}

/// diffusers' `_sigma_to_t`: the (fractional) training timestep of `sigma`, by interpolating
/// in log sigma. `log_sigmas` are float32, as `np.log` of the float32 sigmas gives them.
fn sigma_to_t(sigma: f64, log_sigmas: &[f32]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    // Index of the last log sigma at or below it (the cumsum/argmax of the original), clipped.
    let count = log_sigmas.iter().filter(|&&l| log_sigma - l as f64 >= 0.0).count();
    let low_idx = count.saturating_sub(1).min(log_sigmas.len() - 2);
    let high_idx = low_idx + 1;
    let (low, high) = (log_sigmas[low_idx] as f64, log_sigmas[high_idx] as f64);
    let w = ((low - log_sigma) / (low - high)).clamp(0.0, 1.0);
    (1.0 - w) * low_idx as f64 + w * high_idx as f64
}

/// The Karras et al. (2022) schedule between two sigmas, float64 (rho 7).
fn karras(sigma_min: f64, sigma_max: f64, steps: usize) -> Vec<f64> {
    let rho = 7.0;
    let (min_inv, max_inv) = (sigma_min.powf(1.0 / rho), sigma_max.powf(1.0 / rho));
    linspace(0.0, 1.0, steps)
        .into_iter()
        .map(|r| (max_inv + r * (min_inv - max_inv)).powf(rho))
        .collect()
}

/// `np.linspace(start, stop, n)` (float64, endpoint included).
fn linspace(start: f64, stop: f64, n: usize) -> Vec<f64> {
    if n == 1 {
        return vec![start];
    }
    let step = (stop - start) / (n - 1) as f64;
    (0..n).map(|i| if i == n - 1 { stop } else { start + i as f64 * step }).collect()
}

/// numpy's round half to even.
fn round_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 { 2.0 * (x / 2.0).round() } else { r }
}

/// The step diffusers starts at: the index of the first timestep, or of its second occurrence
/// when it repeats (its `index_for_timestep`, meant for img2img; a schedule whose first timestep
/// repeats skips a sigma, and diffusers runs off its end at the last step).
fn first_index<T: PartialEq>(timesteps: &[T]) -> usize {
    let first = &timesteps[0];
    timesteps
        .iter()
        .enumerate()
        .filter(|(_, t)| *t == first)
        .nth(1)
        .map_or(0, |(i, _)| i)
}

/// One sampler's plan for one number of steps.
#[derive(Debug, Clone)]
pub struct Schedule {
    sampler: Sampler,
    /// The timestep of each step, as the UNet gets it (diffusers' value, as float32).
    timesteps: Vec<f32>,
    init_noise_sigma: f32,
    plan: Plan,
    /// The first step run: 0, or later for img2img and inpainting (see [`Schedule::beginning_at`]).
    begin: usize,
}

#[derive(Debug, Clone)]
enum Plan {
    Euler(euler::Euler),
    Ddim(ddim::Ddim),
    Dpm(dpm::Dpm),
    Lcm(lcm::Lcm),
}

/// Per-image solver state (the multistep solver's previous prediction).
#[derive(Debug, Clone, Default)]
pub struct ImageState {
    previous: Option<Vec<f32>>,
    lower_order_nums: usize,
}

impl Schedule {
    pub fn new(sampler: Sampler, config: &SchedulerConfig, steps: usize) -> Result<Schedule, ScheduleError> {
        if steps == 0 {
            return Err(ScheduleError::Steps {
                sampler: sampler.name(),
                steps,
                reason: "at least one step".into(),
            });
        }
        let (timesteps, init_noise_sigma, plan) = match sampler {
            Sampler::Euler | Sampler::EulerAncestral => {
                let e = euler::Euler::new(sampler, config, steps)?;
                (e.timesteps(), e.init_noise_sigma(), Plan::Euler(e))
            }
            Sampler::Ddim => {
                let d = ddim::Ddim::new(config, steps)?;
                (d.timesteps(), 1.0, Plan::Ddim(d))
            }
            Sampler::DpmPp2m | Sampler::DpmPp2mKarras => {
                let d = dpm::Dpm::new(sampler, config, steps)?;
                (d.timesteps(), 1.0, Plan::Dpm(d))
            }
            Sampler::Lcm => {
                let l = lcm::Lcm::new(config, steps)?;
                (l.timesteps(), 1.0, Plan::Lcm(l))
            }
            Sampler::FlowEuler => {
                return Err(ScheduleError::Unsupported {
                    sampler: sampler.name(),
                    what: "a UNet model (flow_euler runs the flow-matching transformers: FLUX.1, SD3)".into(),
                });
            }
        };
        Ok(Schedule {
            sampler,
            timesteps,
            init_noise_sigma,
            plan,
            begin: 0,
        })
    }

    /// The schedule as diffusers' img2img and inpainting pipelines run it: they set the begin
    /// index (`set_begin_index(t_start)`), so the steps run are `begin..` and each indexes the
    /// sigmas directly (text-to-image's rule for a repeated first timestep does not apply).
    pub fn beginning_at(mut self, begin: usize) -> Result<Schedule, ScheduleError> {
        if begin >= self.timesteps.len() {
            return Err(ScheduleError::Steps {
                sampler: self.sampler.name(),
                steps: self.timesteps.len(),
                reason: format!("no step left to run from step {begin}"),
            });
        }
        match &mut self.plan {
            Plan::Euler(e) => e.index_directly(),
            Plan::Dpm(d) => d.index_directly(),
            Plan::Lcm(l) => l.index_directly(),
            Plan::Ddim(_) => {}
        }
        self.begin = begin;
        Ok(self)
    }

    /// The first step run.
    pub fn begin(&self) -> usize {
        self.begin
    }

    /// Clean latents `x0` noised with `noise` to the level of step `i` (diffusers' `add_noise`
    /// with the step index it uses there: the begin index before the first step, the current
    /// one after).
    pub fn add_noise(&self, i: usize, x0: &[f32], noise: &[f32]) -> Result<Vec<f32>, ScheduleError> {
        match &self.plan {
            Plan::Euler(e) => e.add_noise(i, x0, noise),
            Plan::Ddim(d) => d.add_noise(i, x0, noise),
            Plan::Dpm(d) => d.add_noise(i, x0, noise),
            Plan::Lcm(l) => l.add_noise(i, x0, noise),
        }
    }

    pub fn sampler(&self) -> Sampler {
        self.sampler
    }

    /// The timestep of every step, as the UNet gets it.
    pub fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    /// What initial standard-normal latents are multiplied by.
    pub fn init_noise_sigma(&self) -> f32 {
        self.init_noise_sigma
    }

    /// How many noise draws the sampler makes (each the size of one image's latents), in order:
    /// one per step for Euler a, one per step but the last for LCM, none for the others.
    pub fn noise_draws(&self) -> usize {
        let run = self.timesteps.len() - self.begin;
        match &self.plan {
            Plan::Euler(e) if e.ancestral() => run,
            Plan::Lcm(_) => run - 1,
            _ => 0,
        }
    }

    /// Whether step `i` draws noise (in order: the k-th draw is for the k-th step that does).
    pub fn draws_noise(&self, i: usize) -> bool {
        match &self.plan {
            Plan::Euler(e) => e.ancestral(),
            Plan::Lcm(_) => i + 1 < self.timesteps.len(),
            _ => false,
        }
    }

    /// Scales the UNet's input for step `i` in place (Euler divides by (sigma^2+1)^0.5).
    pub fn scale_model_input(&self, i: usize, sample: &mut [f32]) -> Result<(), ScheduleError> {
        match &self.plan {
            Plan::Euler(e) => e.scale_model_input(i, sample),
            _ => Ok(()),
        }
    }

    /// Step `i` of one image: `sample` becomes the previous sample (after the last step, the
    /// result). `noise` is this step's draw when [`Schedule::draws_noise`].
    pub fn step(
        &self,
        i: usize,
        model_output: &[f32],
        sample: &mut [f32],
        noise: Option<&[f32]>,
        state: &mut ImageState,
    ) -> Result<(), ScheduleError> {
        match &self.plan {
            Plan::Euler(e) => e.step(i, model_output, sample, noise),
            Plan::Ddim(d) => d.step(i, model_output, sample),
            Plan::Dpm(d) => d.step(i, model_output, sample, state),
            Plan::Lcm(l) => l.step(i, model_output, sample, noise),
        }
    }
}

/// `sqrt(ᾱ) x0 + sqrt(1 - ᾱ) noise`, in float32 as DDPM-style schedulers' `add_noise`.
fn add_noise_vp(alpha_cumprod: f32, x0: &[f32], noise: &[f32]) -> Vec<f32> {
    let (a, b) = (alpha_cumprod.sqrt(), (1.0 - alpha_cumprod).sqrt());
    x0.iter().zip(noise).map(|(&x, &z)| a * x + b * z).collect()
}

/// `index` or an error naming the step: diffusers' index arithmetic can run past its arrays.
fn at<T: Copy>(values: &[T], index: usize, sampler: Sampler, steps: usize) -> Result<T, ScheduleError> {
    values.get(index).copied().ok_or_else(|| ScheduleError::Steps {
        sampler: sampler.name(),
        steps,
        reason: format!(
            "the schedule's first timestep repeats, so the sampler runs past its end at step {index} (diffusers fails the same way)"
        ),
    })
}

#[cfg(test)]
mod tests;
