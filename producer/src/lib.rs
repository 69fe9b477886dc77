//! Sluice's producer: validates task requests, authenticates callers, publishes versioned task
//! records to Kafka and answers at once with a task id. Also the operator's tool for batch
//! submission, topic replay and DLQ redrive. [`serve`] is the whole HTTP service.

mod admission;
pub mod api;
pub mod auth;
pub mod backlog;
pub mod config;
mod events;
mod input_images;
pub mod metrics;
pub mod openapi;
pub mod presign;
pub mod publish;
pub mod replay;
mod server;
pub mod status;
pub mod streams;
pub mod webhook;

pub use server::{ServeError, serve};
