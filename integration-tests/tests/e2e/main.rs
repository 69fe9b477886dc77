//! Sluice end to end on real parts, one file per behaviour: tasks submitted over HTTP go
//! through the broker to workers running ONNX Runtime, images land in the S3 server and each
//! result is announced on the completion topic. The stacks are shared across files
//! ([`stacks`]); one test binary, so they start once.
//!
//! - [`api`]: 4xx naming the field, JSON errors, the OpenAPI contract, hostile bodies;
//! - [`security`]: closed by default, clear startup errors;
//! - [`terrain`], [`diffusion`]: tasks become images (terrain maps; SD, SDXL, FLUX.1, SD3,
//!   img2img and inpainting);
//! - [`models`]: the catalog, models synced from S3, a model injected in process;
//! - [`status`]: the status view, lists, its store across restarts and clusters;
//! - [`idempotency`]: retries with a key, racing bodies, a reused key;
//! - [`cancel_and_deadlines`]: cancelled and expired tasks;
//! - [`webhooks`]: signed deliveries, retries, per-tenant isolation, order;
//! - [`events`]: progress records and Server-Sent Events;
//! - [`observability`]: trace context, bounded metric series;
//! - [`dlq`]: malformed records, panics, redrive;
//! - [`replay`]: replay by time;
//! - [`scheduling`]: turns between buckets, joining a running batch, priority lanes.
//! - [`transactions`]: exactly-once transactions carry what finished in their interval.

mod api;
mod cancel_and_deadlines;
mod diffusion;
mod dlq;
mod events;
mod idempotency;
mod models;
mod observability;
mod replay;
mod scheduling;
mod security;
mod stacks;
mod status;
mod terrain;
mod transactions;
mod webhooks;
