//! DPM-Solver++ 2M (`DPMSolverMultistepScheduler`, `algorithm_type="dpmsolver++"`, order 2),
//! optionally on Karras sigmas: a second-order multistep solver in the data (x0) prediction.

use super::euler::arange_down;
use super::{
    DEFAULT_BETAS, ImageState, Prediction, Sampler, ScheduleError, SchedulerConfig, Spacing, Training, at, first_index, interp, karras,
    linspace, round_even, sigma_to_t,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SolverType {
    Midpoint,
    Heun,
}

#[derive(Debug, Clone)]
pub(super) struct Dpm {
    sampler: Sampler,
    prediction: Prediction,
    solver: SolverType,
    timesteps: Vec<i64>,
    sigmas: Vec<f32>,
    first: usize,
    lower_order_final: bool,
    euler_at_final: bool,
    final_zero: bool,
    steps: usize,
}

impl Dpm {
    pub(super) fn new(sampler: Sampler, c: &SchedulerConfig, steps: usize) -> Result<Dpm, ScheduleError> {
        let unsupported = |what: &str| ScheduleError::Unsupported {
            sampler: sampler.name(),
            what: what.to_owned(),
        };
        if c.thresholding == Some(true) {
            return Err(unsupported("dynamic thresholding (pixel-space models)"));
        }
        if c.use_lu_lambdas == Some(true) || c.use_exponential_sigmas == Some(true) || c.use_beta_sigmas == Some(true) {
            return Err(unsupported("Lu lambdas, exponential or beta sigmas"));
        }
        if c.variance_type.is_some() {
            return Err(unsupported("a learned variance"));
        }
        let solver = match c.solver_type.as_deref().unwrap_or("midpoint") {
            // diffusers maps the UniPC/DEIS solver types to midpoint.
            "midpoint" | "logrho" | "bh1" | "bh2" => SolverType::Midpoint,
            "heun" => SolverType::Heun,
            other => return Err(unsupported(&format!("solver_type {other:?}"))),
        };
        let training = Training::new(c, DEFAULT_BETAS, true, sampler)?;
        let n = training.len();
        let full = training.sigmas();
        let log_sigmas: Vec<f32> = full.iter().map(|s| s.ln()).collect();
        // Timesteps whose log-SNR is below lambda_min_clipped are cut off the schedule's top.
        let clipped = match c.lambda_min_clipped {
            Some(min) if min.is_finite() => {
                let lambdas: Vec<f32> = training
                    .alphas_cumprod
                    .iter()
                    .rev()
                    .map(|&a| a.sqrt().ln() - (1.0 - a).sqrt().ln())
                    .collect();
                lambdas.partition_point(|&l| (l as f64) < min)
            }
            _ => 0,
        };
        let last = n - clipped;
        let offset = c.steps_offset.unwrap_or(0);
        let mut timesteps: Vec<i64> = match Spacing::of(c, Spacing::Linspace, sampler)? {
            Spacing::Linspace => linspace(0.0, (last - 1) as f64, steps + 1)
                .into_iter()
                .rev()
                .take(steps)
                .map(|t| round_even(t) as i64)
                .collect(),
            Spacing::Leading => {
                let ratio = last / (steps + 1);
                (1..=steps).rev().map(|i| (i * ratio) as i64 + offset).collect()
            }
            Spacing::Trailing => arange_down(last as f64, n as f64 / steps as f64)
                .into_iter()
                .map(|t| round_even(t) as i64 - 1)
                .collect(),
        };
        let karras_sigmas = sampler == Sampler::DpmPp2mKarras || c.use_karras_sigmas == Some(true);
        let sigmas: Vec<f64> = if karras_sigmas {
            // On the flipped training sigmas: from the largest to the smallest.
            let sigmas = karras(full[0] as f64, full[n - 1] as f64, steps);
            timesteps = sigmas
                .iter()
                .map(|&s| {
                    let t = sigma_to_t(s, &log_sigmas);
                    (if c.beta_schedule.as_deref() == Some("squaredcos_cap_v2") {
                        t
                    } else {
                        round_even(t)
                    }) as i64
                })
                .collect();
            sigmas
        } else {
            timesteps.iter().map(|&t| interp(t as f64, &full)).collect()
        };
        let final_zero = match c.final_sigmas_type.as_deref().unwrap_or("zero") {
            "zero" => true,
            "sigma_min" => false,
            other => return Err(unsupported(&format!("final_sigmas_type {other:?}"))),
        };
        let last_sigma = if final_zero {
            0.0
        } else {
            let a = training.alphas_cumprod[0];
            ((1.0 - a) / a).sqrt()
        };
        let mut sigmas: Vec<f32> = sigmas.into_iter().map(|s| s as f32).collect();
        sigmas.push(last_sigma);
        Ok(Dpm {
            sampler,
            prediction: Prediction::of(c, sampler)?,
            solver,
            first: first_index(&timesteps),
            timesteps,
            sigmas,
            lower_order_final: c.lower_order_final.unwrap_or(true),
            euler_at_final: c.euler_at_final.unwrap_or(false),
            final_zero,
            steps,
        })
    }

    pub(super) fn timesteps(&self) -> Vec<f32> {
        self.timesteps.iter().map(|&t| t as f32).collect()
    }

    fn sigma(&self, index: usize) -> Result<f32, ScheduleError> {
        at(&self.sigmas, index, self.sampler, self.steps)
    }

    /// Steps index the schedule directly (a begin index is set: img2img, inpainting).
    pub(super) fn index_directly(&mut self) {
        self.first = 0;
    }

    /// `add_noise` at step `i`: `alpha_t * x0 + sigma_t * noise` of the step's sigma.
    pub(super) fn add_noise(&self, i: usize, x0: &[f32], noise: &[f32]) -> Result<Vec<f32>, ScheduleError> {
        let (alpha, sigma) = alpha_sigma(self.sigma(self.first + i)?);
        Ok(x0.iter().zip(noise).map(|(&x, &z)| alpha * x + sigma * z).collect())
    }

    pub(super) fn step(&self, i: usize, model_output: &[f32], sample: &mut [f32], state: &mut ImageState) -> Result<(), ScheduleError> {
        let idx = self.first + i;
        let len = self.timesteps.len();
        // The last step is first order for short schedules and whenever the final sigma is 0.
        let lower_order_final = idx == len - 1 && (self.euler_at_final || (self.lower_order_final && len < 15) || self.final_zero);
        // The data prediction x0 of this step.
        let (alpha, sigma) = alpha_sigma(self.sigma(idx)?);
        let x0: Vec<f32> = sample
            .iter()
            .zip(model_output)
            .map(|(&x, &m)| match self.prediction {
                Prediction::Epsilon => (x - sigma * m) / alpha,
                Prediction::Velocity => alpha * x - sigma * m,
                Prediction::Sample => m,
            })
            .collect();
        let (alpha_t, sigma_t) = alpha_sigma(self.sigma(idx + 1)?);
        let sigma_s0 = sigma;
        let lambda = |a: f32, s: f32| a.ln() - s.ln();
        let lambda_t = lambda(alpha_t, sigma_t);
        let lambda_s0 = lambda(alpha, sigma);
        let h = lambda_t - lambda_s0;
        let ratio = sigma_t / sigma_s0;
        let d0_scale = alpha_t * ((-h).exp() - 1.0);
        match (&state.previous, state.lower_order_nums < 1 || lower_order_final) {
            (Some(previous), false) => {
                let (alpha_s1, sigma_s1) = alpha_sigma(self.sigma(idx - 1)?);
                let h_0 = lambda_s0 - lambda(alpha_s1, sigma_s1);
                let r0 = h_0 / h;
                let inv_r0 = 1.0 / r0;
                for ((x, &m0), &m1) in sample.iter_mut().zip(&x0).zip(previous) {
                    let d1 = inv_r0 * (m0 - m1);
                    *x = match self.solver {
                        SolverType::Midpoint => ratio * *x - d0_scale * m0 - 0.5 * d0_scale * d1,
                        SolverType::Heun => ratio * *x - d0_scale * m0 + alpha_t * (((-h).exp() - 1.0) / h + 1.0) * d1,
                    };
                }
            }
            _ => {
                for (x, &m0) in sample.iter_mut().zip(&x0) {
                    *x = ratio * *x - d0_scale * m0;
                }
            }
        }
        state.previous = Some(x0);
        state.lower_order_nums = (state.lower_order_nums + 1).min(2);
        Ok(())
    }
}

/// `(alpha_t, sigma_t)` of a k-diffusion sigma: `1 / (sigma^2 + 1)^0.5` and `sigma * alpha_t`.
fn alpha_sigma(sigma: f32) -> (f32, f32) {
    let alpha = 1.0 / (sigma * sigma + 1.0).sqrt();
    (alpha, sigma * alpha)
}
