//! The training noise schedule the samplers share, and the torch and numpy arithmetic they
//! reproduce (float32 where torch computes, float64 where numpy does).

use super::{Sampler, ScheduleError, SchedulerConfig};

/// The training noise schedule: cumulative products of `1 - beta`, float32 as torch makes them.
#[derive(Debug, Clone)]
pub(super) struct Training {
    pub(super) alphas_cumprod: Vec<f32>,
}

/// Class defaults of the beta schedule (LCM's differ from the others').
pub(super) struct BetaDefaults {
    pub(super) start: f64,
    pub(super) end: f64,
    pub(super) schedule: &'static str,
}

pub(super) const DEFAULT_BETAS: BetaDefaults = BetaDefaults {
    start: 0.0001,
    end: 0.02,
    schedule: "linear",
};

impl Training {
    /// `clamp_zero_snr`: Euler, Euler a and DPM set the last cumulative alpha to 2^-24 after a
    /// zero-SNR rescale (so sigmas stay finite); DDIM and LCM keep the 0.
    pub(super) fn new(
        c: &SchedulerConfig,
        defaults: BetaDefaults,
        clamp_zero_snr: bool,
        sampler: Sampler,
    ) -> Result<Training, ScheduleError> {
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

    pub(super) fn len(&self) -> usize {
        self.alphas_cumprod.len()
    }

    /// `((1 - alphas_cumprod) / alphas_cumprod) ** 0.5`, float32.
    pub(super) fn sigmas(&self) -> Vec<f32> {
        self.alphas_cumprod.iter().map(|&a| ((1.0 - a) / a).sqrt()).collect()
    }
}

/// `torch.linspace(start, end, steps)` for float32 on the CPU: computed in float32, from the
/// start up to half way and from the end back for the rest.
pub(super) fn torch_linspace(start: f32, end: f32, steps: usize) -> Vec<f32> {
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
pub(super) fn cumprod(values: impl Iterator<Item = f32>) -> Vec<f32> {
    let mut acc = 1f64;
    values
        .map(|v| {
            acc *= v as f64;
            acc as f32
        })
        .collect()
}

/// diffusers' `betas_for_alpha_bar` (cosine schedule), float64 then float32.
pub(super) fn betas_for_alpha_bar(n: usize) -> Vec<f32> {
    let alpha_bar = |t: f64| ((t + 0.008) / 1.008 * std::f64::consts::PI / 2.0).cos().powi(2);
    (0..n)
        .map(|i| {
            let (t1, t2) = (i as f64 / n as f64, (i + 1) as f64 / n as f64);
            (1.0 - alpha_bar(t2) / alpha_bar(t1)).min(0.999) as f32
        })
        .collect()
}

/// diffusers' `rescale_zero_terminal_snr`, in float32 as torch computes it.
pub(super) fn rescale_zero_terminal_snr(betas: &[f32]) -> Vec<f32> {
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
pub(super) fn interp(x: f64, ys: &[f32]) -> f64 {
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
pub(super) fn sigma_to_t(sigma: f64, log_sigmas: &[f32]) -> f64 {
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
pub(super) fn karras(sigma_min: f64, sigma_max: f64, steps: usize) -> Vec<f64> {
    let rho = 7.0;
    let (min_inv, max_inv) = (sigma_min.powf(1.0 / rho), sigma_max.powf(1.0 / rho));
    linspace(0.0, 1.0, steps)
        .into_iter()
        .map(|r| (max_inv + r * (min_inv - max_inv)).powf(rho))
        .collect()
}

/// `np.linspace(start, stop, n)` (float64, endpoint included).
pub(super) fn linspace(start: f64, stop: f64, n: usize) -> Vec<f64> {
    if n == 1 {
        return vec![start];
    }
    let step = (stop - start) / (n - 1) as f64;
    (0..n).map(|i| if i == n - 1 { stop } else { start + i as f64 * step }).collect()
}

/// numpy's round half to even.
pub(super) fn round_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 { 2.0 * (x / 2.0).round() } else { r }
}

/// The step diffusers starts at: the index of the first timestep, or of its second occurrence
/// when it repeats (its `index_for_timestep`, meant for img2img; a schedule whose first timestep
/// repeats skips a sigma, and diffusers runs off its end at the last step).
pub(super) fn first_index<T: PartialEq>(timesteps: &[T]) -> usize {
    let first = &timesteps[0];
    timesteps
        .iter()
        .enumerate()
        .filter(|(_, t)| *t == first)
        .nth(1)
        .map_or(0, |(i, _)| i)
}
