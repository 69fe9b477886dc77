//! What the worker keeps outside its process: images and result manifests in object storage
//! ([`images`]), model repositories copied from object storage before the worker starts
//! ([`sync_models`]), and learned batch ceilings in a compacted Kafka topic ([`ceilings`]).

pub(crate) mod ceilings;
pub mod images;
pub mod sync_models;
