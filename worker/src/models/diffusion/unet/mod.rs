//! The UNet families: Stable Diffusion 1.x/2.x, SD-Turbo, LCM and SDXL (their directory is read by
//! `diffusion::layout`). [`backend`] runs their text encoders, the UNet loop under one of the
//! samplers and the VAE decoder; `image` adds img2img and inpainting to the loop.

pub mod backend;
mod image;
