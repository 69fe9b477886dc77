//! Forming batches: the batcher groups decoded tasks by bucket into model calls, and the adaptive
//! batcher sizes each call to what the device's memory holds, learning per bucket (halving on an
//! out-of-memory error, probing upwards after a run of successes). Nothing in here talks to Kafka
//! or to ONNX Runtime directly: the engine is reached through [`crate::engine::Engine`], and the
//! learned ceilings are kept through the [`adaptive::CeilingStore`] a caller hands in.

pub mod adaptive;
pub(crate) mod batcher;
pub mod fair;
mod joiners;
pub mod steps;
