//! Fair shares of the notifier's deliveries: one tenant, or one receiver host, may hold only so
//! many attempts in flight (sending, or queued for the host's connections). An attempt past its
//! share is not made now: a `completed` event is deferred to the retry topic without counting
//! as an attempt, a `started` or `progress` event is dropped (those are tried once anyway). So a
//! tenant flooding a slow receiver gets its share of the notifier and everyone else the rest.
//!
//! The counts are kept only while non-zero: a host or tenant with nothing in flight has no entry.

use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Tenant(String),
    Host(String),
}

/// The shares of one notifier.
pub(crate) struct Shares {
    per_tenant: usize,
    per_host: usize,
    in_flight: Mutex<HashMap<Key, usize>>,
}

/// One attempt's place in its tenant's and host's shares, given back when dropped.
pub(crate) struct Share<'a> {
    shares: &'a Shares,
    keys: [Key; 2],
}

impl Shares {
    pub(crate) fn new(per_tenant: usize, per_host: usize) -> Shares {
        Shares {
            per_tenant: per_tenant.max(1),
            per_host: per_host.max(1),
            in_flight: Mutex::default(),
        }
    }

    /// A place for an attempt of `tenant` to `host`, or why there is none.
    pub(crate) fn take(&self, tenant: &str, host: &str) -> Result<Share<'_>, String> {
        let mut in_flight = self.in_flight.lock().expect("not poisoned");
        let (t, h) = (Key::Tenant(tenant.to_owned()), Key::Host(host.to_owned()));
        let tenant_now = in_flight.get(&t).copied().unwrap_or(0);
        if tenant_now >= self.per_tenant {
            return Err(format!("tenant {tenant:?} has {tenant_now} webhook attempts in flight, its share"));
        }
        let host_now = in_flight.get(&h).copied().unwrap_or(0);
        if host_now >= self.per_host {
            return Err(format!("{host} has {host_now} webhook attempts in flight, its share"));
        }
        *in_flight.entry(t.clone()).or_default() += 1;
        *in_flight.entry(h.clone()).or_default() += 1;
        Ok(Share {
            shares: self,
            keys: [t, h],
        })
    }

    #[cfg(test)]
    fn entries(&self) -> usize {
        self.in_flight.lock().expect("not poisoned").len()
    }
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        let mut in_flight = self.shares.in_flight.lock().expect("not poisoned");
        for key in &self.keys {
            if let Some(n) = in_flight.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    in_flight.remove(key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_or_host_past_its_share_waits_and_others_do_not() {
        let shares = Shares::new(2, 3);
        let a1 = shares.take("a", "slow:443").unwrap();
        let a2 = shares.take("a", "slow:443").unwrap();
        let refused = shares.take("a", "other:443").err().unwrap();
        assert!(refused.contains("tenant \"a\""), "{refused}");
        let b1 = shares.take("b", "slow:443").unwrap();
        let refused = shares.take("c", "slow:443").err().unwrap();
        assert!(refused.starts_with("slow:443"), "{refused}");
        let c = shares.take("c", "fast:443").unwrap();
        drop(a1);
        let a3 = shares.take("a", "other:443").unwrap();
        drop((a2, a3, b1, c));
        assert_eq!(shares.entries(), 0, "nothing in flight, nothing kept");
    }
}
