//! A record as the poll loop read it from the tasks topic: where it came from (its origin, which
//! the offsets are acknowledged by) and its bytes, kept whole for the DLQ.

use std::sync::Arc;
use std::time::Instant;

use sluice_schemas::SourceRef;

/// Where a record was read from, and under which assignment. Whatever stage finishes a task
/// acknowledges its origin to [`crate::source::offsets::Offsets`]; nothing else commits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Origin {
    pub topic: Arc<str>,
    pub partition: i32,
    pub offset: i64,
    /// The assignment the record was read under; an acknowledgement from an older assignment of
    /// the partition is ignored (the partition was revoked in between).
    pub generation: u64,
}

impl Origin {
    pub fn source_ref(&self) -> SourceRef {
        SourceRef {
            topic: self.topic.to_string(),
            partition: self.partition,
            offset: self.offset,
        }
    }
}

/// A record as read from the tasks topic, kept byte for byte for the DLQ.
#[derive(Debug, Clone)]
pub struct Record {
    pub origin: Origin,
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
    pub headers: sluice_schemas::RawHeaders,
    pub timestamp_ms: Option<i64>,
    pub received_at: Instant,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(k, _)| k == name).and_then(|(_, v)| v.as_deref())
    }

    /// The attempt this delivery is: 1, or what a redrive recorded in `sluice-attempt`.
    pub fn attempt(&self) -> u32 {
        sluice_schemas::attempt_of(self.header(sluice_schemas::HEADER_ATTEMPT))
    }
}
