//! The records that cross Sluice's topics and its HTTP API, in one place.
//!
//! The JSON Schema files under `schemas/v1/` are the contract: producers, workers and outside
//! consumers validate against them. The Rust types here mirror them, and the tests in this crate
//! check the two against each other (every example validates and round-trips through the types;
//! a fully populated value of every type validates), so neither can drift alone.

pub mod catalog;
pub mod decode;
pub mod normalize;
pub mod priority;
pub mod records;
pub mod sampler;
pub mod topics;
pub mod validate;

pub use catalog::{Catalog, CatalogError, CatalogModel, ModelKind, TaskMode, TextEncoders};
pub use decode::{DecodeError, decode_task};
pub use priority::Priority;
pub use records::*;
pub use sampler::Sampler;
pub use validate::{RecordKind, Violation, validate};

/// Version of the record layouts in this crate, carried in every record's `version` field and in
/// the [`HEADER_SCHEMA_VERSION`] header.
pub const SCHEMA_VERSION: u32 = 1;

/// Kafka header carrying the record's schema version.
pub const HEADER_SCHEMA_VERSION: &str = "sluice-schema-version";
/// Kafka header carrying how many times a task has been attempted (set by redrive).
pub const HEADER_ATTEMPT: &str = "sluice-attempt";

/// The attempt a [`HEADER_ATTEMPT`] value names: 1 where there is none, or it is not a number
/// of at least 1 (a record as first published carries none).
pub fn attempt_of(header: Option<&[u8]>) -> u32 {
    header
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.trim().parse().ok())
        .filter(|a| *a >= 1)
        .unwrap_or(1)
}
/// Kafka header that replay and redrive put on the records they write: where the record came
/// from (`replay:<topic>:<partition>:<offset>` or `redrive:<topic>:<partition>:<offset>`).
/// Workers check such records for existing results before running them.
pub const HEADER_ORIGIN: &str = "sluice-origin";

/// Headers on every DLQ record; the same facts are fields of [`DlqRecord`].
pub mod dlq_headers {
    pub const REASON: &str = "sluice-dlq-reason";
    pub const MESSAGE: &str = "sluice-dlq-message";
    pub const ATTEMPTS: &str = "sluice-dlq-attempts";
    pub const SOURCE_TOPIC: &str = "sluice-dlq-source-topic";
    pub const SOURCE_PARTITION: &str = "sluice-dlq-source-partition";
    pub const SOURCE_OFFSET: &str = "sluice-dlq-source-offset";
    pub const FIRST_FAILED_AT: &str = "sluice-dlq-first-failed-at";
    pub const LAST_FAILED_AT: &str = "sluice-dlq-last-failed-at";
}

#[cfg(test)]
mod tests {
    use super::attempt_of;

    #[test]
    fn an_attempt_header_reads_as_its_number_and_anything_else_as_the_first() {
        assert_eq!(attempt_of(Some(b"3")), 3);
        assert_eq!(attempt_of(Some(b" 2 ")), 2);
        for other in [None, Some(&b""[..]), Some(b"0"), Some(b"-1"), Some(b"two"), Some(b"\xff")] {
            assert_eq!(attempt_of(other), 1, "{other:?}");
        }
    }
}
