//! `flow_euler`: diffusers' `FlowMatchEulerDiscreteScheduler` as FLUX.1 and Stable Diffusion 3
//! run it. The model predicts a velocity `v`; a step is `x + (σ_next − σ) v`, in float32.
//!
//! The sigmas come from the scheduler config and the pipeline:
//! - SD3's pipeline calls `set_timesteps(steps)`: timesteps `linspace(σ_max·N, σ_min·N, steps)`
//!   (float64) between the *training* sigmas' ends, which the constructor already shifted, then
//!   shifted again: `shift·σ / (1 + (shift − 1)·σ)` (so SD3's `shift` applies twice at σ_min).
//! - FLUX's pipeline passes `sigmas = linspace(1, 1/steps, steps)` (float64, then float32 in the
//!   scheduler) and `mu`, the image-sequence-length shift: `mu = len·m + b` on the line through
//!   (`base_image_seq_len`, `base_shift`) and (`max_image_seq_len`, `max_shift`); with
//!   `use_dynamic_shifting` the sigmas become `e^mu / (e^mu + (1/σ − 1))` (schnell's config has
//!   no dynamic shifting and `shift` 1, so its sigmas stay linear).
//!
//! Then `timesteps = σ·N` (float32) and a final σ of 0. Config options neither model ships
//! (`shift_terminal`, Karras/exponential/beta sigmas, `invert_sigmas`, `stochastic_sampling`,
//! linear time shift) are refused rather than run differently.

use super::{Sampler, ScheduleError, SchedulerConfig, linspace};

/// Which sigmas the pipeline hands the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlowSigmas {
    /// `set_timesteps(steps)` (StableDiffusion3Pipeline).
    Scheduler,
    /// `set_timesteps(sigmas=linspace(1, 1/steps, steps), mu=…)` (FluxPipeline).
    Linear,
}

/// The flow-matching schedule for one number of steps and image sequence length.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowSchedule {
    /// `steps + 1` sigmas, the last 0.
    sigmas: Vec<f32>,
    /// `σ·N` per step, float32, as the pipeline's loop gets them.
    timesteps: Vec<f32>,
    /// The dynamic shift used, if the config asks for one.
    mu: Option<f64>,
}

fn unsupported(what: impl Into<String>) -> ScheduleError {
    ScheduleError::Unsupported {
        sampler: Sampler::FlowEuler.name(),
        what: what.into(),
    }
}

impl FlowSchedule {
    /// The schedule of `steps` steps for an image of `image_seq_len` transformer tokens.
    pub fn new(config: &SchedulerConfig, steps: usize, sigmas: FlowSigmas, image_seq_len: usize) -> Result<FlowSchedule, ScheduleError> {
        if steps == 0 {
            return Err(ScheduleError::Steps {
                sampler: Sampler::FlowEuler.name(),
                steps,
                reason: "at least one step".into(),
            });
        }
        for (set, what) in [
            (config.use_karras_sigmas, "use_karras_sigmas"),
            (config.use_exponential_sigmas, "use_exponential_sigmas"),
            (config.use_beta_sigmas, "use_beta_sigmas"),
            (config.invert_sigmas, "invert_sigmas"),
            (config.stochastic_sampling, "stochastic_sampling"),
        ] {
            if set == Some(true) {
                return Err(unsupported(what));
            }
        }
        if config.shift_terminal.is_some_and(|s| s != 0.0) {
            return Err(unsupported("shift_terminal"));
        }
        if config.time_shift_type.as_deref().is_some_and(|t| t != "exponential") {
            return Err(unsupported(format!("time_shift_type {:?}", config.time_shift_type)));
        }
        let n = config.num_train_timesteps.unwrap_or(1000);
        if n < 2 {
            return Err(ScheduleError::Config(format!("num_train_timesteps {n}")));
        }
        let shift = config.shift.unwrap_or(1.0);
        if !(shift > 0.0 && shift.is_finite()) {
            return Err(ScheduleError::Config(format!("shift {shift}")));
        }
        let dynamic = config.use_dynamic_shifting.unwrap_or(false);
        if dynamic && config.max_image_seq_len.unwrap_or(4096) <= config.base_image_seq_len.unwrap_or(256) {
            return Err(ScheduleError::Config("max_image_seq_len must exceed base_image_seq_len".into()));
        }
        let mu = dynamic.then(|| Self::calculate_shift(config, image_seq_len));
        let shifted: Vec<f32> = match sigmas {
            FlowSigmas::Scheduler => {
                let (max, min) = Self::training_ends(n, shift, dynamic);
                linspace(max * n as f64, min * n as f64, steps)
                    .into_iter()
                    .map(|t| {
                        let s = t / n as f64;
                        let s = match mu {
                            Some(mu) => mu.exp() / (mu.exp() + (1.0 / s - 1.0)),
                            None => shift * s / (1.0 + (shift - 1.0) * s),
                        };
                        s as f32
                    })
                    .collect()
            }
            FlowSigmas::Linear => {
                let start = 1.0 / steps as f64;
                linspace(1.0, start, steps)
                    .into_iter()
                    .map(|s| {
                        // numpy float32 arithmetic with Python floats as weak scalars.
                        let s = s as f32;
                        match mu {
                            Some(mu) => {
                                let e = mu.exp() as f32;
                                e / (e + (1.0 / s - 1.0))
                            }
                            None => shift as f32 * s / (1.0 + (shift - 1.0) as f32 * s),
                        }
                    })
                    .collect()
            }
        };
        if let Some(bad) = shifted.iter().find(|s| !(0.0..=1.0).contains(*s)) {
            return Err(ScheduleError::Config(format!(
                "the shift settings give a sigma of {bad} (mu {mu:?}): check shift, base_shift, max_shift, base_image_seq_len, max_image_seq_len"
            )));
        }
        let timesteps = shifted.iter().map(|s| s * n as f32).collect();
        let mut all = shifted;
        all.push(0.0);
        Ok(FlowSchedule {
            sigmas: all,
            timesteps,
            mu,
        })
    }

    /// The pipelines' `calculate_shift` from the config (the same defaults in both).
    pub fn calculate_shift(config: &SchedulerConfig, image_seq_len: usize) -> f64 {
        let base_len = config.base_image_seq_len.unwrap_or(256) as f64;
        let max_len = config.max_image_seq_len.unwrap_or(4096) as f64;
        let base = config.base_shift.unwrap_or(0.5);
        let max = config.max_shift.unwrap_or(1.15);
        let m = (max - base) / (max_len - base_len);
        let b = base - m * base_len;
        image_seq_len as f64 * m + b
    }

    /// `(sigma_max, sigma_min)` of the constructor's training sigmas, float32 as torch makes them
    /// (statically shifted unless the shift is dynamic).
    fn training_ends(n: usize, shift: f64, dynamic: bool) -> (f64, f64) {
        let sigma = |t: f32| {
            let s = t / n as f32;
            if dynamic {
                s
            } else {
                let shift = shift as f32;
                shift * s / (1.0 + (shift - 1.0) * s)
            }
        };
        (sigma(n as f32) as f64, sigma(1.0) as f64)
    }

    pub fn steps(&self) -> usize {
        self.timesteps.len()
    }

    /// `σ·N` of step `i`.
    pub fn timestep(&self, i: usize) -> f32 {
        self.timesteps[i]
    }

    pub fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    /// Every sigma, the final 0 included.
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    pub fn mu(&self) -> Option<f64> {
        self.mu
    }

    /// Step `i` of one image: `sample += (σ_{i+1} − σ_i) · velocity`, float32.
    pub fn step(&self, i: usize, velocity: &[f32], sample: &mut [f32]) -> Result<(), ScheduleError> {
        if i >= self.steps() {
            return Err(ScheduleError::Steps {
                sampler: Sampler::FlowEuler.name(),
                steps: self.steps(),
                reason: format!("no step {i}"),
            });
        }
        let dt = self.sigmas[i + 1] - self.sigmas[i];
        for (x, v) in sample.iter_mut().zip(velocity) {
            *x += dt * v;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> SchedulerConfig {
        SchedulerConfig::from_json(text).unwrap()
    }

    const FLUX_DEV: &str = r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
        "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": true}"#;

    #[test]
    fn schnell_sigmas_are_linear_and_end_at_zero() {
        let c = config(r#"{"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": false}"#);
        let s = FlowSchedule::new(&c, 4, FlowSigmas::Linear, 16).unwrap();
        assert_eq!(s.sigmas(), &[1.0, 0.75, 0.5, 0.25, 0.0]);
        assert_eq!(s.timesteps(), &[1000.0, 750.0, 500.0, 250.0]);
        assert_eq!(s.mu(), None);
    }

    #[test]
    fn dev_shifts_by_the_image_sequence_length() {
        let c = config(FLUX_DEV);
        // 1024x1024: 4096 tokens, mu = max_shift.
        assert!((FlowSchedule::calculate_shift(&c, 4096) - 1.15).abs() < 1e-12);
        assert!((FlowSchedule::calculate_shift(&c, 256) - 0.5).abs() < 1e-12);
        let s = FlowSchedule::new(&c, 2, FlowSigmas::Linear, 4096).unwrap();
        let e = 1.15f64.exp();
        assert_eq!(s.sigmas()[0], 1.0);
        assert!((s.sigmas()[1] as f64 - e / (e + 1.0)).abs() < 1e-6);
        // Longer sequences shift more noise into the late steps.
        let short = FlowSchedule::new(&c, 2, FlowSigmas::Linear, 16).unwrap();
        assert!(short.sigmas()[1] < s.sigmas()[1]);
    }

    #[test]
    fn sd3_shifts_twice_at_the_low_end() {
        let c = config(r#"{"num_train_timesteps": 1000, "shift": 3.0}"#);
        let s = FlowSchedule::new(&c, 2, FlowSigmas::Scheduler, 16).unwrap();
        assert_eq!(s.sigmas()[0], 1.0);
        let once = 3.0 * 0.001 / (1.0 + 2.0 * 0.001);
        let twice = 3.0 * once / (1.0 + 2.0 * once);
        assert!((s.sigmas()[1] as f64 - twice).abs() < 1e-7, "{:?}", s.sigmas());
        assert_eq!(s.sigmas()[2], 0.0);
    }

    #[test]
    fn a_step_moves_along_the_velocity() {
        let c = config(r#"{"shift": 1.0}"#);
        let s = FlowSchedule::new(&c, 2, FlowSigmas::Linear, 16).unwrap();
        let mut x = vec![1.0, -2.0];
        s.step(0, &[2.0, 4.0], &mut x).unwrap();
        assert_eq!(x, vec![0.0, -4.0]);
        assert!(s.step(2, &[0.0, 0.0], &mut x).is_err());
    }

    #[test]
    fn options_no_flow_model_ships_are_refused() {
        for text in [
            r#"{"use_karras_sigmas": true}"#,
            r#"{"stochastic_sampling": true}"#,
            r#"{"shift_terminal": 0.1}"#,
            r#"{"time_shift_type": "linear"}"#,
            r#"{"use_dynamic_shifting": true, "base_image_seq_len": 4096}"#,
            r#"{"use_dynamic_shifting": true, "max_shift": NaN}"#,
        ] {
            assert!(FlowSchedule::new(&config(text), 4, FlowSigmas::Linear, 16).is_err(), "{text}");
        }
        assert!(FlowSchedule::new(&config("{}"), 0, FlowSigmas::Linear, 16).is_err());
    }
}
