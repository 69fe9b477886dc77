//! What the worker keeps outside its process: images and result manifests in object storage
//! ([`images`]), long diffusion tasks' step checkpoints there too ([`checkpoints`]), model
//! repositories copied from object storage before the worker starts ([`sync_models`]), and
//! learned batch ceilings in a compacted Kafka topic ([`ceilings`]).

pub(crate) mod ceilings;
pub mod checkpoints;
pub mod images;
pub mod sync_models;
