//! Bounds on open `GET /v1/tasks/{id}/events` streams: each holds a connection and polls the
//! status view, so one tenant opening thousands must not take the replica. A stream past the
//! global or its tenant's bound is refused (429 with `Retry-After`); an open one gives its place
//! back when it ends, the client disconnecting included.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The open streams of one replica.
#[derive(Debug)]
pub struct Streams {
    max: usize,
    per_tenant: usize,
    open: Mutex<(usize, HashMap<String, usize>)>,
}

/// Why a stream is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("{0} event streams are open on this replica, its limit (SLUICE_EVENTS_MAX_STREAMS)")]
    Replica(usize),
    #[error("tenant {0:?} has {1} event streams open, its limit (SLUICE_EVENTS_MAX_STREAMS_PER_TENANT)")]
    Tenant(String, usize),
}

/// One open stream's place, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    streams: Arc<Streams>,
    tenant: String,
}

impl Streams {
    pub fn new(max: usize, per_tenant: usize) -> Arc<Streams> {
        Arc::new(Streams {
            max,
            per_tenant,
            open: Mutex::default(),
        })
    }

    /// A place for a stream of `tenant`.
    pub fn open(self: &Arc<Self>, tenant: &str) -> Result<Slot, Refused> {
        let mut open = self.open.lock().expect("not poisoned");
        if open.0 >= self.max {
            return Err(Refused::Replica(open.0));
        }
        let of_tenant = open.1.get(tenant).copied().unwrap_or(0);
        if of_tenant >= self.per_tenant {
            return Err(Refused::Tenant(tenant.to_owned(), of_tenant));
        }
        open.0 += 1;
        *open.1.entry(tenant.to_owned()).or_default() += 1;
        Ok(Slot {
            streams: self.clone(),
            tenant: tenant.to_owned(),
        })
    }

    /// Streams open now.
    pub fn len(&self) -> usize {
        self.open.lock().expect("not poisoned").0
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.streams.open.lock().expect("not poisoned");
        open.0 -= 1;
        if let Some(n) = open.1.get_mut(&self.tenant) {
            *n -= 1;
            if *n == 0 {
                open.1.remove(&self.tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_bounded_per_tenant_and_per_replica() {
        let streams = Streams::new(3, 2);
        let a1 = streams.open("a").unwrap();
        let _a2 = streams.open("a").unwrap();
        assert_eq!(streams.open("a").unwrap_err(), Refused::Tenant("a".into(), 2));
        let _b1 = streams.open("b").unwrap();
        assert_eq!(streams.open("c").unwrap_err(), Refused::Replica(3));
        drop(a1);
        let _c1 = streams.open("c").unwrap();
        assert_eq!(streams.len(), 3);
    }
}
