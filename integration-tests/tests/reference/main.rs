//! Sluice against the reference implementation (diffusers / Optimum), in process, from the
//! recorded fixtures: the same inputs give the same latents and PNGs, alone and as a row of a
//! call beside rows at other steps.
//!
//! - [`sd`]: Stable Diffusion 1.x, SDXL, img2img and inpainting, and their tokenizers;
//! - [`flow`]: FLUX.1 and SD3, their tokenizers, schedules and text-encoder placements.

mod flow;
mod sd;
