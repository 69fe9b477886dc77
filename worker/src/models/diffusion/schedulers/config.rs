//! `scheduler/scheduler_config.json` as a model ships it, and what its keys mean to every sampler:
//! what the model predicts, how inference timesteps are spread over the training ones.

use serde::Deserialize;

use super::super::python_json;
use super::{Sampler, ScheduleError};

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
pub(super) enum Prediction {
    Epsilon,
    Velocity,
    Sample,
}

impl Prediction {
    pub(super) fn of(config: &SchedulerConfig, sampler: Sampler) -> Result<Prediction, ScheduleError> {
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
pub(super) enum Spacing {
    Linspace,
    Leading,
    Trailing,
}

impl Spacing {
    pub(super) fn of(config: &SchedulerConfig, default: Spacing, sampler: Sampler) -> Result<Spacing, ScheduleError> {
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
