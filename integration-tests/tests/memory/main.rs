//! Memory discipline on real out-of-memory errors and reloads, one file per model family:
//! ONNX Runtime's arena is capped (`SLUICE_ORT_CPU_ARENA_MAX_BYTES` on the CPU, `gpu_mem_limit`
//! on a GPU node), so a batch that needs more fails inside ORT as a CUDA allocation does.
//!
//! - [`terrain`]: batches halve, a map's tiles run in parts, singles on two slots, fifty reloads
//!   under load, a leaking reload trips the bound;
//! - [`diffusion`]: the same for SD, SDXL, FLUX.1 and SD3, `resource_exhausted` for an image that
//!   never fits, twenty reloads of each family, a restarted worker's learned ceilings.

mod diffusion;
mod terrain;
