//! Sluice's worker: consumes tasks from Kafka, runs them in batches on ONNX Runtime, stores the
//! images and announces each result. [`run`] is the whole worker; see `pipeline` for how the
//! stages fit together.

pub mod adaptive;
mod batcher;
mod cancellations;
mod ceilings;
mod commit;
pub mod config;
mod crash_guard;
mod encode;
pub mod engine;
mod events;
#[cfg(test)]
mod fake;
mod faults;
mod gpu;
mod http;
pub mod metrics;
pub mod model_sync;
pub mod models;
mod offsets;
mod outcome;
mod panics;
mod pipeline;
mod progress;
mod publish;
mod redelivery;
mod retry;
mod running;
mod service;
mod serving;
pub mod sink;
mod source;
mod task;

pub use service::{Exit, Models, StartError, run};
