//! Flow-matching transformers: FLUX.1 (schnell, dev) and Stable Diffusion 3 / 3.5 from an
//! Optimum ONNX export. They take the same requests as the UNet families ([`SdRequest`]) and
//! differ in everything between: three text encoders (CLIP, CLIP-G, T5), a transformer over
//! patch tokens with a per-row timestep, the `flow_euler` sampler, a 16-channel VAE with a shift.
//!
//! [`layout`] reads a directory, [`request`] turns a request into inputs, [`backend`] runs the
//! sessions in a step-level loop.
//!
//! [`SdRequest`]: super::request::SdRequest

pub mod backend;
pub mod layout;
pub mod request;
