//! The engine: model sessions on dedicated threads, behind a small [`Backend`] trait.
//!
//! Inference runs on `slots` OS threads (never on the async runtime), each owning its own session
//! of every loaded model. A run takes one permit of the device gate; an *exclusive* run takes all
//! of them, so nothing else runs on the device beside it. Waiting runs take turns by priority
//! lane, then in order of asking ([`turns`]). The adaptive batcher
//! ([`crate::batching::adaptive`]) uses exclusive runs once a bucket is down to batch 1, so that concurrent
//! singles do not fight for memory.

pub mod gpu;

mod error;
mod gate;
mod key;
mod pool;
mod runtime;
mod session;
mod tensor;
pub(crate) mod turns;

use std::sync::Arc;

pub use error::EngineError;
pub(crate) use error::is_out_of_memory;
pub use key::{CallKey, Stepped};
pub use pool::{Engine, Loader};
pub use runtime::{ArenaStats, Runtime, RuntimeOptions};
pub use session::{ArenaExtend, ConvSearch, Device, ElementKind, InputInfo, OrtBackend, Placement, SessionOptions};
pub use tensor::{Tensor, TensorData};
pub use turns::Turn;

/// One model call: the inputs of a batch and which task owns which rows.
#[derive(Debug, Clone)]
pub struct Call {
    /// The batch's bucket key ([`crate::models::Bucket::key`]): what its tasks share, in the
    /// model adapter's own type.
    pub key: CallKey,
    /// Whole-batch tensors, batch on axis 0: the tasks' rows concatenated in task order.
    pub inputs: Vec<Tensor>,
    pub tasks: Vec<CallTask>,
}

impl Call {
    /// Each task with the rows of the call's tensors that are its, in order.
    pub fn task_rows(&self) -> impl Iterator<Item = (&CallTask, std::ops::Range<usize>)> {
        self.tasks.iter().scan(0, |row, task| {
            let rows = *row..*row + task.rows;
            *row = rows.end;
            Some((task, rows))
        })
    }
}

/// A task's share of a [`Call`].
#[derive(Clone)]
pub struct CallTask {
    /// The task id, for logs.
    pub id: String,
    /// Which delivery of the task this is: 1, or what a redrive recorded. Step checkpoints are
    /// an attempt's own.
    pub attempt: u32,
    /// Rows of the outputs that belong to this task.
    pub rows: usize,
    /// What a model with many steps reports of the task, and asks of it, between steps.
    pub hooks: Option<Arc<dyn TaskHooks>>,
}

impl std::fmt::Debug for CallTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallTask")
            .field("id", &self.id)
            .field("attempt", &self.attempt)
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

/// A task's side of a long model call, called on the engine thread between steps: cheap and
/// non-blocking.
pub trait TaskHooks: Send + Sync {
    /// Whether the task was cancelled: the model stops working on it at the next step.
    fn cancelled(&self) -> bool;
    /// The task finished step `step` of `steps` (1-based).
    fn progress(&self, step: usize, steps: usize);
    /// Whether the task is being handed to another worker (its partition drains for a
    /// rebalance): a model that keeps step checkpoints keeps its state after every step from
    /// then on, so that the next owner loses none.
    fn handed_off(&self) -> bool {
        false
    }
}

/// A loaded model that can run a batch. Implementations own their sessions and live on one
/// engine thread; `run` may block for as long as the model takes.
pub trait Backend: Send {
    /// Runs one batch. Outputs are whole-batch tensors (batch on axis 0), each task's rows in
    /// the order of `call.tasks`.
    fn run(&mut self, call: &Call) -> Result<Vec<Tensor>, EngineError>;
    /// Gives back what the allocator holds but does not use, after an out-of-memory error: the
    /// next run asks ONNX Runtime to shrink its arena (the counterpart of `torch.cuda.empty_cache`).
    fn release_memory(&mut self);
    /// Where the model runs.
    fn placement(&self) -> Placement;
}
