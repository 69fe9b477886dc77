//! DDIM (`DDIMScheduler`) with eta 0: deterministic, on the training schedule's alphas.

use super::euler::arange_down;
use super::{DEFAULT_BETAS, Prediction, Sampler, ScheduleError, SchedulerConfig, Spacing, Training, at, linspace, round_even};

#[derive(Debug, Clone)]
pub(super) struct Ddim {
    prediction: Prediction,
    alphas_cumprod: Vec<f32>,
    final_alpha_cumprod: f32,
    clip: Option<f32>,
    timesteps: Vec<i64>,
    /// Training steps between two inference steps.
    stride: i64,
    steps: usize,
}

impl Ddim {
    pub(super) fn new(c: &SchedulerConfig, steps: usize) -> Result<Ddim, ScheduleError> {
        let sampler = Sampler::Ddim;
        if c.thresholding == Some(true) {
            return Err(ScheduleError::Unsupported {
                sampler: sampler.name(),
                what: "dynamic thresholding (pixel-space models)".into(),
            });
        }
        let training = Training::new(c, DEFAULT_BETAS, false, sampler)?;
        let n = training.len();
        if steps > n {
            return Err(ScheduleError::Steps {
                sampler: sampler.name(),
                steps,
                reason: format!("more than the {n} training steps"),
            });
        }
        let timesteps = spaced(Spacing::of(c, Spacing::Leading, sampler)?, n, steps, c.steps_offset.unwrap_or(0));
        let final_alpha_cumprod = if c.set_alpha_to_one.unwrap_or(true) {
            1.0
        } else {
            training.alphas_cumprod[0]
        };
        Ok(Ddim {
            prediction: Prediction::of(c, sampler)?,
            final_alpha_cumprod,
            clip: c.clip_sample.unwrap_or(true).then(|| c.clip_sample_range.unwrap_or(1.0) as f32),
            alphas_cumprod: training.alphas_cumprod,
            timesteps,
            stride: (n / steps) as i64,
            steps,
        })
    }

    pub(super) fn timesteps(&self) -> Vec<f32> {
        self.timesteps.iter().map(|&t| t as f32).collect()
    }

    fn alpha(&self, t: i64) -> Result<f32, ScheduleError> {
        usize::try_from(t)
            .ok()
            .and_then(|t| self.alphas_cumprod.get(t).copied())
            .ok_or_else(|| ScheduleError::Steps {
                sampler: Sampler::Ddim.name(),
                steps: self.steps,
                reason: format!("timestep {t} is outside the training schedule"),
            })
    }

    /// `add_noise` at step `i`: `sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) noise` of the step's timestep.
    pub(super) fn add_noise(&self, i: usize, x0: &[f32], noise: &[f32]) -> Result<Vec<f32>, ScheduleError> {
        let alpha = self.alpha(at(&self.timesteps, i, Sampler::Ddim, self.steps)?)?;
        Ok(super::add_noise_vp(alpha, x0, noise))
    }

    pub(super) fn step(&self, i: usize, model_output: &[f32], sample: &mut [f32]) -> Result<(), ScheduleError> {
        let t = at(&self.timesteps, i, Sampler::Ddim, self.steps)?;
        let prev = t - self.stride;
        let alpha_t = self.alpha(t)?;
        let alpha_prev = if prev >= 0 { self.alpha(prev)? } else { self.final_alpha_cumprod };
        let beta_t = 1.0 - alpha_t;
        let (sa, sb) = (alpha_t.sqrt(), beta_t.sqrt());
        let direction_scale = (1.0 - alpha_prev - 0.0).sqrt();
        let sa_prev = alpha_prev.sqrt();
        for (x, &m) in sample.iter_mut().zip(model_output) {
            let (mut x0, eps) = match self.prediction {
                Prediction::Epsilon => ((*x - sb * m) / sa, m),
                Prediction::Velocity => (sa * *x - sb * m, sa * m + sb * *x),
                Prediction::Sample => (m, (*x - sa * m) / sb),
            };
            if let Some(r) = self.clip {
                x0 = x0.clamp(-r, r);
            }
            *x = sa_prev * x0 + direction_scale * eps;
        }
        Ok(())
    }
}

/// DDIM's and LCM's integer timesteps (DDIM's `set_timesteps`).
fn spaced(spacing: Spacing, n: usize, steps: usize, offset: i64) -> Vec<i64> {
    match spacing {
        Spacing::Linspace => linspace(0.0, (n - 1) as f64, steps)
            .into_iter()
            .rev()
            .map(|t| round_even(t) as i64)
            .collect(),
        Spacing::Leading => {
            let ratio = n / steps;
            (0..steps).rev().map(|i| (i * ratio) as i64 + offset).collect()
        }
        Spacing::Trailing => arange_down(n as f64, n as f64 / steps as f64)
            .into_iter()
            .map(|t| round_even(t) as i64 - 1)
            .collect(),
    }
}
