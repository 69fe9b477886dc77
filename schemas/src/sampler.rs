//! The samplers a diffusion task can ask for: their names on the wire, which models run them, and
//! the rules a request with one must meet. The sampler enums of the JSON Schemas
//! (`generation.schema.json`, `stable-diffusion-request.schema.json`) list the same names, held to
//! [`Sampler::ALL`] by the contract test; the worker's schedulers implement each one.

use std::fmt;

/// A sampler a diffusion task can ask for (terrain's one step is not one of them: `onestep`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sampler {
    Euler,
    EulerAncestral,
    Ddim,
    DpmPp2m,
    DpmPp2mKarras,
    /// Latent consistency: for LCM-distilled UNets, 1 to [`LCM_MAX_STEPS`] steps, text to image.
    Lcm,
    /// Flow matching (FLUX.1, SD3): runs on the flow transformers only, as they run it alone.
    FlowEuler,
}

/// The most steps the `lcm` sampler takes (LCM's distilled schedules).
pub const LCM_MAX_STEPS: u32 = 8;

impl Sampler {
    pub const ALL: [Sampler; 7] = [
        Sampler::Euler,
        Sampler::EulerAncestral,
        Sampler::Ddim,
        Sampler::DpmPp2m,
        Sampler::DpmPp2mKarras,
        Sampler::Lcm,
        Sampler::FlowEuler,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Sampler::Euler => "euler",
            Sampler::EulerAncestral => "euler_a",
            Sampler::Ddim => "ddim",
            Sampler::DpmPp2m => "dpmpp_2m",
            Sampler::DpmPp2mKarras => "dpmpp_2m_karras",
            Sampler::Lcm => "lcm",
            Sampler::FlowEuler => "flow_euler",
        }
    }

    pub fn parse(name: &str) -> Option<Sampler> {
        Sampler::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Every sampler's name, comma-separated, for messages.
    pub fn names() -> String {
        Sampler::ALL.map(Sampler::name).join(", ")
    }

    /// Whether the flow-matching transformers (FLUX.1, SD3) run it. They run `flow_euler` alone,
    /// and the UNet families (SD 1.x/2.x, SDXL) every other one.
    pub fn for_flow_models(self) -> bool {
        self == Sampler::FlowEuler
    }

    /// The most steps a request with this sampler may ask for, where the sampler bounds them.
    pub fn max_steps(self) -> Option<u32> {
        (self == Sampler::Lcm).then_some(LCM_MAX_STEPS)
    }

    /// Whether img2img and inpainting run with it (LCM's schedule is text to image only).
    pub fn takes_init_image(self) -> bool {
        self != Sampler::Lcm
    }
}

impl fmt::Display for Sampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_to_its_sampler() {
        for s in Sampler::ALL {
            assert_eq!(Sampler::parse(s.name()), Some(s));
        }
        assert_eq!(Sampler::parse("onestep"), None);
        assert_eq!(Sampler::parse("Euler"), None);
    }

    #[test]
    fn the_rules_each_sampler_carries() {
        let flow: Vec<_> = Sampler::ALL.into_iter().filter(|s| s.for_flow_models()).collect();
        assert_eq!(flow, [Sampler::FlowEuler]);
        assert_eq!(Sampler::Lcm.max_steps(), Some(8));
        assert!(
            Sampler::ALL
                .iter()
                .filter(|s| **s != Sampler::Lcm)
                .all(|s| s.max_steps().is_none() && s.takes_init_image())
        );
        assert!(!Sampler::Lcm.takes_init_image());
    }
}
