//! Sluice's worker: consumes tasks from Kafka, runs them in batches on ONNX Runtime, stores the
//! images and announces each result. See `pipeline` for how the stages fit together.

pub mod adaptive;
pub mod batcher;
pub mod config;
pub mod encode;
pub mod engine;
pub mod events;
pub mod gpu;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod models;
pub mod offsets;
pub mod pipeline;
pub mod publish;
pub mod retry;
pub mod serving;
pub mod sink;
pub mod source;
pub mod task;
