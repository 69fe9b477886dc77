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

mod config;
mod ddim;
mod dpm;
mod euler;
pub mod flow_euler;
mod lcm;
mod state;
mod training;

use thiserror::Error;

pub use config::SchedulerConfig;
use config::{Prediction, Spacing};
pub use state::ImageState;
use training::{BetaDefaults, DEFAULT_BETAS, Training, first_index, interp, karras, linspace, round_even, sigma_to_t};

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

    /// Whether images carry state from one step to the next beyond their latents (the multistep
    /// solver's previous prediction, [`ImageState`]).
    pub fn multistep(&self) -> bool {
        matches!(self.plan, Plan::Dpm(_))
    }

    /// Which of an image's noise draws step `i` takes, when it draws ([`Schedule::draws_noise`]):
    /// the samplers that draw do so at every step run but LCM's last, so it is the step's place
    /// among the steps run, whichever call runs it.
    pub fn draw_index(&self, i: usize) -> usize {
        i - self.begin
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
