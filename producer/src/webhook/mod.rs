//! Webhooks: a task's `started`, `progress` and `completed` events pushed to the URL its request
//! named, signed per Standard Webhooks ([`signing`]), through the SSRF guard ([`guard`]).
//!
//! The notifier is a consumer group (`sluice-webhooks`, part of `sluice-producer serve`) over the
//! progress, completion and retry topics, so each event is delivered by one replica. The body is
//! the task's `GET /v1/tasks/{id}` answer right after the event, from the status view (which
//! also holds each task's webhook, from its record). Delivery is at least once: a record's
//! offset is committed only once its event was delivered, scheduled for a retry (a record
//! on the retry topic, so retries survive restarts: [`schedule`]) or given up (a record on the
//! webhook DLQ). `completed` events are retried over the schedule; `started` and `progress`
//! events are tried once (progress at most every 500 ms per task); one task's events reach the
//! receiver in order, `completed` last ([`order`]).
//!
//! Nothing waits in memory for long: a retry record not due yet pauses its retry partition at
//! that record until it is (records of a partition are due in order), and each tenant and each
//! receiver host gets a bounded share of the attempts in flight ([`fair`]). So one tenant's
//! failing receiver neither fills the notifier's memory nor holds up other tenants' events.

pub mod delivery;
mod fair;
pub mod guard;
mod notifier;
mod order;
pub mod schedule;
pub mod signing;

pub use notifier::{Notifier, NotifierError, Settings};

/// What the API checks of a submitted webhook.
#[derive(Debug, Clone)]
pub struct Policy {
    pub guard: guard::Guard,
    pub secrets: signing::Secrets,
}

impl Policy {
    /// Why a submitted webhook is refused at once (a 400), when that can be judged without
    /// resolving its host: `(field, message)` for its URL, or for a tenant without a signing
    /// secret.
    pub fn check(&self, tenant: &str, url: &str) -> Result<(), (&'static str, String)> {
        self.guard.check_url(url).map_err(|r| ("webhook.url", r.0))?;
        if !self.secrets.has(tenant) {
            return Err((
                "webhook",
                format!("no webhook secret is configured for tenant {tenant:?} (SLUICE_WEBHOOK_SECRETS)"),
            ));
        }
        Ok(())
    }
}
