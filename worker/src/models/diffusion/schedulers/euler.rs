//! Euler (`EulerDiscreteScheduler`) and Euler ancestral (`EulerAncestralDiscreteScheduler`):
//! k-diffusion style samplers on the model's sigmas.

use super::{
    DEFAULT_BETAS, Prediction, Sampler, ScheduleError, SchedulerConfig, Spacing, Training, at, first_index, interp, karras, linspace,
    round_even, sigma_to_t,
};

#[derive(Debug, Clone)]
pub(super) struct Euler {
    sampler: Sampler,
    prediction: Prediction,
    timesteps: Vec<f32>,
    /// One per step, then the final sigma.
    sigmas: Vec<f32>,
    init_noise_sigma: f32,
    first: usize,
    steps: usize,
}

impl Euler {
    pub(super) fn new(sampler: Sampler, c: &SchedulerConfig, steps: usize) -> Result<Euler, ScheduleError> {
        let ancestral = sampler == Sampler::EulerAncestral;
        let unsupported = |what: String| ScheduleError::Unsupported {
            sampler: sampler.name(),
            what,
        };
        let training = Training::new(c, DEFAULT_BETAS, true, sampler)?;
        let prediction = Prediction::of(c, sampler)?;
        let spacing = Spacing::of(c, Spacing::Linspace, sampler)?;
        let n = training.len();
        let mut timesteps: Vec<f64> = spaced(spacing, n, steps, c.steps_offset.unwrap_or(0));
        let full = training.sigmas();
        let log_sigmas: Vec<f32> = full.iter().map(|s| s.ln()).collect();
        let mut sigmas: Vec<f64> = timesteps.iter().map(|&t| interp(t, &full)).collect();
        let mut last = 0f32;
        let mut continuous = false;
        if !ancestral {
            // Options of the non-ancestral class only.
            if c.interpolation_type.as_deref().is_some_and(|t| t != "linear") {
                return Err(unsupported(format!("interpolation_type {:?}", c.interpolation_type)));
            }
            if c.use_exponential_sigmas == Some(true) || c.use_beta_sigmas == Some(true) {
                return Err(unsupported("exponential or beta sigmas".into()));
            }
            if c.use_karras_sigmas == Some(true) {
                let min = c.sigma_min.unwrap_or(*sigmas.last().expect("steps > 0"));
                let max = c.sigma_max.unwrap_or(sigmas[0]);
                sigmas = karras(min, max, steps);
                timesteps = sigmas.iter().map(|&s| sigma_to_t(s, &log_sigmas)).collect();
            }
            last = match c.final_sigmas_type.as_deref().unwrap_or("zero") {
                "zero" => 0.0,
                "sigma_min" => {
                    let a = training.alphas_cumprod[0];
                    ((1.0 - a) / a).sqrt()
                }
                other => return Err(unsupported(format!("final_sigmas_type {other:?}"))),
            };
            continuous = c.timestep_type.as_deref() == Some("continuous") && prediction == Prediction::Velocity;
        }
        let mut sigmas: Vec<f32> = sigmas.into_iter().map(|s| s as f32).collect();
        sigmas.push(last);
        let timesteps: Vec<f32> = if continuous {
            sigmas[..steps].iter().map(|s| 0.25 * s.ln()).collect()
        } else {
            timesteps.into_iter().map(|t| t as f32).collect()
        };
        let max = sigmas.iter().copied().fold(f32::MIN, f32::max);
        let init_noise_sigma = match spacing {
            Spacing::Linspace | Spacing::Trailing => max,
            Spacing::Leading => (max * max + 1.0).sqrt(),
        };
        Ok(Euler {
            sampler,
            prediction,
            first: first_index(&timesteps),
            timesteps,
            sigmas,
            init_noise_sigma,
            steps,
        })
    }

    pub(super) fn ancestral(&self) -> bool {
        self.sampler == Sampler::EulerAncestral
    }

    pub(super) fn timesteps(&self) -> Vec<f32> {
        self.timesteps.clone()
    }

    pub(super) fn init_noise_sigma(&self) -> f32 {
        self.init_noise_sigma
    }

    fn sigma(&self, i: usize) -> Result<f32, ScheduleError> {
        at(&self.sigmas, self.first + i, self.sampler, self.steps)
    }

    /// Steps index the schedule directly (a begin index is set: img2img, inpainting).
    pub(super) fn index_directly(&mut self) {
        self.first = 0;
    }

    /// `add_noise` at step `i`: `x0 + noise * sigma`.
    pub(super) fn add_noise(&self, i: usize, x0: &[f32], noise: &[f32]) -> Result<Vec<f32>, ScheduleError> {
        let sigma = self.sigma(i)?;
        Ok(x0.iter().zip(noise).map(|(&x, &z)| x + z * sigma).collect())
    }

    pub(super) fn scale_model_input(&self, i: usize, sample: &mut [f32]) -> Result<(), ScheduleError> {
        let sigma = self.sigma(i)?;
        let scale = (sigma * sigma + 1.0).sqrt();
        sample.iter_mut().for_each(|x| *x /= scale);
        Ok(())
    }

    pub(super) fn step(&self, i: usize, model_output: &[f32], sample: &mut [f32], noise: Option<&[f32]>) -> Result<(), ScheduleError> {
        let sigma = self.sigma(i)?;
        let next = self.sigma(i + 1)?;
        // Euler with s_churn = 0: sigma_hat = sigma.
        let c_out = -sigma / (sigma * sigma + 1.0).sqrt();
        let c_in = sigma * sigma + 1.0;
        let pred = |x: f32, m: f32| match self.prediction {
            Prediction::Epsilon => x - sigma * m,
            Prediction::Velocity => m * c_out + x / c_in,
            Prediction::Sample => m,
        };
        if self.ancestral() {
            let up = (next * next * (sigma * sigma - next * next) / (sigma * sigma)).sqrt();
            let down = (next * next - up * up).sqrt();
            let dt = down - sigma;
            let noise = noise.ok_or_else(|| ScheduleError::Steps {
                sampler: self.sampler.name(),
                steps: self.steps,
                reason: format!("step {i} needs its noise draw"),
            })?;
            for ((x, &m), &z) in sample.iter_mut().zip(model_output).zip(noise) {
                let derivative = (*x - pred(*x, m)) / sigma;
                *x = (*x + derivative * dt) + z * up;
            }
        } else {
            let dt = next - sigma;
            for (x, &m) in sample.iter_mut().zip(model_output) {
                let derivative = (*x - pred(*x, m)) / sigma;
                *x += derivative * dt;
            }
        }
        Ok(())
    }
}

/// Inference timesteps over `n` training steps, as Euler's classes space them (float32 values
/// before the cast, so the caller can interpolate at them).
fn spaced(spacing: Spacing, n: usize, steps: usize, offset: i64) -> Vec<f64> {
    match spacing {
        Spacing::Linspace => linspace(0.0, (n - 1) as f64, steps)
            .into_iter()
            .rev()
            .map(|t| t as f32 as f64)
            .collect(),
        Spacing::Leading => {
            let ratio = n / steps;
            (0..steps).rev().map(|i| ((i * ratio) as f32 + offset as f32) as f64).collect()
        }
        Spacing::Trailing => arange_down(n as f64, n as f64 / steps as f64)
            .into_iter()
            .map(|t| (round_even(t) as f32 - 1.0) as f64)
            .collect(),
    }
}

/// `np.arange(start, 0, -step)`: as many values as numpy makes (`ceil(start / step)`).
pub(super) fn arange_down(start: f64, step: f64) -> Vec<f64> {
    let len = (start / step).ceil() as usize;
    (0..len).map(|i| start - i as f64 * step).collect()
}
