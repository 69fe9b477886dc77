//! The engine: model sessions on dedicated threads, behind a small [`Backend`] trait.
//!
//! Inference runs on `slots` OS threads (never on the async runtime), each owning its own session
//! of every loaded model. A run takes one permit of the device gate; an *exclusive* run takes all
//! of them, so nothing else runs on the device beside it. The adaptive batcher
//! ([`crate::adaptive`]) uses exclusive runs once a bucket is down to batch 1, so that concurrent
//! singles do not fight for memory.

mod error;
mod pool;
mod runtime;
mod session;
mod tensor;

pub use error::{EngineError, is_out_of_memory};
pub use pool::{Engine, Loader};
pub use runtime::{ArenaStats, Runtime, RuntimeOptions};
pub use session::{ArenaExtend, ConvSearch, Device, OrtBackend, Placement, SessionOptions};
pub use tensor::{Tensor, TensorData};

/// A loaded model that can run a batch. Implementations own their sessions and live on one
/// engine thread; `run` may block for as long as the model takes.
pub trait Backend: Send {
    /// Runs one batch. Inputs and outputs are whole-batch tensors (batch on axis 0).
    fn run(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>, EngineError>;
    /// Gives back what the allocator holds but does not use, after an out-of-memory error: the
    /// next run asks ONNX Runtime to shrink its arena (the counterpart of `torch.cuda.empty_cache`).
    fn release_memory(&mut self);
    /// Where the model runs.
    fn placement(&self) -> Placement;
}
