//! Sluice's worker: consumes tasks from Kafka, runs them in batches on ONNX Runtime, stores the
//! images and announces each result. [`run`] is the whole worker; see `pipeline` for how the
//! stages fit together.

pub mod batching;
pub mod config;
pub mod engine;
mod events;
mod http;
mod lifecycle;
pub mod metrics;
pub mod models;
mod outcome;
mod panics;
mod pipeline;
mod retry;
mod source;
pub mod storage;
mod testing;

pub use lifecycle::{Exit, Models, StartError, run, serve};
