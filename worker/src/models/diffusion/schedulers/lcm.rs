//! LCM (`LCMScheduler`): latent consistency sampling in 1–8 steps, on a subset of the original
//! schedule's timesteps, with fresh noise between steps.

use super::{BetaDefaults, Prediction, Sampler, ScheduleError, SchedulerConfig, Training, at, first_index, linspace};

const LCM_BETAS: BetaDefaults = BetaDefaults {
    start: 0.00085,
    end: 0.012,
    schedule: "scaled_linear",
};

/// The consistency model's data standard deviation.
const SIGMA_DATA: f32 = 0.5;

#[derive(Debug, Clone)]
pub(super) struct Lcm {
    prediction: Prediction,
    alphas_cumprod: Vec<f32>,
    final_alpha_cumprod: f32,
    clip: Option<f32>,
    timestep_scaling: f32,
    timesteps: Vec<i64>,
    first: usize,
    steps: usize,
}

impl Lcm {
    pub(super) fn new(c: &SchedulerConfig, steps: usize) -> Result<Lcm, ScheduleError> {
        let sampler = Sampler::Lcm;
        if c.thresholding == Some(true) {
            return Err(ScheduleError::Unsupported {
                sampler: sampler.name(),
                what: "dynamic thresholding (pixel-space models)".into(),
            });
        }
        let training = Training::new(c, LCM_BETAS, false, sampler)?;
        let n = training.len();
        let original = c.original_inference_steps.unwrap_or(50);
        let bad = |reason: String| ScheduleError::Steps {
            sampler: sampler.name(),
            steps,
            reason,
        };
        if original > n || original == 0 {
            return Err(bad(format!("original_inference_steps {original} against {n} training steps")));
        }
        if steps > original {
            return Err(bad(format!("at most original_inference_steps ({original})")));
        }
        // The original schedule's timesteps, largest first, and `steps` of them evenly spaced.
        let k = n / original;
        let origin: Vec<i64> = (1..=original).rev().map(|i| (i * k) as i64 - 1).collect();
        let timesteps: Vec<i64> = linspace(0.0, origin.len() as f64, steps + 1)
            .into_iter()
            .take(steps)
            .map(|x| origin[x.floor() as usize])
            .collect();
        let final_alpha_cumprod = if c.set_alpha_to_one.unwrap_or(true) {
            1.0
        } else {
            training.alphas_cumprod[0]
        };
        Ok(Lcm {
            prediction: Prediction::of(c, sampler)?,
            final_alpha_cumprod,
            clip: c.clip_sample.unwrap_or(false).then(|| c.clip_sample_range.unwrap_or(1.0) as f32),
            timestep_scaling: c.timestep_scaling.unwrap_or(10.0) as f32,
            alphas_cumprod: training.alphas_cumprod,
            first: first_index(&timesteps),
            timesteps,
            steps,
        })
    }

    pub(super) fn timesteps(&self) -> Vec<f32> {
        self.timesteps.iter().map(|&t| t as f32).collect()
    }

    fn alpha(&self, t: i64) -> Result<f32, ScheduleError> {
        if t < 0 {
            return Ok(self.final_alpha_cumprod);
        }
        at(&self.alphas_cumprod, t as usize, Sampler::Lcm, self.steps)
    }

    /// Steps index the schedule directly (a begin index is set: img2img, inpainting).
    pub(super) fn index_directly(&mut self) {
        self.first = 0;
    }

    /// `add_noise` at step `i`: `sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) noise` of the step's timestep.
    pub(super) fn add_noise(&self, i: usize, x0: &[f32], noise: &[f32]) -> Result<Vec<f32>, ScheduleError> {
        let alpha = self.alpha(at(&self.timesteps, self.first + i, Sampler::Lcm, self.steps)?)?;
        Ok(super::add_noise_vp(alpha, x0, noise))
    }

    pub(super) fn step(&self, i: usize, model_output: &[f32], sample: &mut [f32], noise: Option<&[f32]>) -> Result<(), ScheduleError> {
        let idx = self.first + i;
        let t = at(&self.timesteps, i, Sampler::Lcm, self.steps)?;
        let last = idx + 1 >= self.timesteps.len();
        let prev_t = if last { t } else { self.timesteps[idx + 1] };
        let (alpha_t, alpha_prev) = (self.alpha(t)?, self.alpha(prev_t)?);
        let (beta_t, beta_prev) = (1.0 - alpha_t, 1.0 - alpha_prev);
        // The boundary condition's scalings, of the timestep scaled to continuous time.
        let scaled = t as f32 * self.timestep_scaling;
        let c_skip = SIGMA_DATA * SIGMA_DATA / (scaled * scaled + SIGMA_DATA * SIGMA_DATA);
        let c_out = scaled / (scaled * scaled + SIGMA_DATA * SIGMA_DATA).sqrt();
        let (sa, sb) = (alpha_t.sqrt(), beta_t.sqrt());
        let noise = if last {
            None
        } else {
            Some(noise.ok_or_else(|| ScheduleError::Steps {
                sampler: Sampler::Lcm.name(),
                steps: self.steps,
                reason: format!("step {i} needs its noise draw"),
            })?)
        };
        let (sa_prev, sb_prev) = (alpha_prev.sqrt(), beta_prev.sqrt());
        for (j, (x, &m)) in sample.iter_mut().zip(model_output).enumerate() {
            let mut x0 = match self.prediction {
                Prediction::Epsilon => (*x - sb * m) / sa,
                Prediction::Velocity => sa * *x - sb * m,
                Prediction::Sample => m,
            };
            if let Some(r) = self.clip {
                x0 = x0.clamp(-r, r);
            }
            let denoised = c_out * x0 + c_skip * *x;
            *x = match noise {
                Some(z) => sa_prev * denoised + sb_prev * z[j],
                None => denoised,
            };
        }
        Ok(())
    }
}
