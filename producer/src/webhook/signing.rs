//! Standard Webhooks signatures (<https://www.standardwebhooks.com/>): each delivery carries
//! `webhook-id` (the same on every attempt of one event), `webhook-timestamp` (Unix seconds of
//! the attempt) and `webhook-signature`: `v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, one
//! per secret of the tenant, space-separated, so that a receiver can rotate secrets.

use std::collections::HashMap;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use thiserror::Error;
use uuid::Uuid;

#[derive(Debug, Error)]
pub enum SecretsError {
    #[error("webhook secret {0}: expected tenant:whsec_<base64>")]
    Format(String),
    #[error("webhook secret of tenant {0:?}: {1}")]
    Key(String, String),
    #[error("reading {0}: {1}")]
    File(String, std::io::Error),
}

/// Every tenant's signing keys (several during a rotation).
#[derive(Clone, Default)]
pub struct Secrets {
    keys: HashMap<String, Vec<Vec<u8>>>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secrets")
            .field("tenants", &self.keys.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Secrets {
    /// From `tenant:whsec_…` entries (`SLUICE_WEBHOOK_SECRETS`) and the lines of a file
    /// (`SLUICE_WEBHOOK_SECRETS_FILE`: one entry per line or comma-separated, `#` comments).
    pub fn load(entries: &[String], file: Option<&std::path::Path>) -> Result<Secrets, SecretsError> {
        let mut all: Vec<String> = entries.to_vec();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| SecretsError::File(path.display().to_string(), e))?;
            for line in text.lines() {
                let line = line.split('#').next().unwrap_or_default();
                all.extend(line.split(',').map(str::to_owned));
            }
        }
        let mut secrets = Secrets::default();
        for entry in all.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            let (tenant, secret) = entry.split_once(':').ok_or_else(|| SecretsError::Format(redact(entry)))?;
            let encoded = secret.strip_prefix("whsec_").ok_or_else(|| SecretsError::Format(redact(entry)))?;
            let key = STANDARD
                .decode(encoded)
                .map_err(|e| SecretsError::Key(tenant.to_owned(), format!("not base64: {e}")))?;
            if key.len() < 24 {
                return Err(SecretsError::Key(tenant.to_owned(), "shorter than 24 bytes".into()));
            }
            secrets.keys.entry(tenant.to_owned()).or_default().push(key);
        }
        Ok(secrets)
    }

    pub fn has(&self, tenant: &str) -> bool {
        self.keys.contains_key(tenant)
    }

    /// The `webhook-signature` header for `body` sent as message `id` at `timestamp`, or `None`
    /// when the tenant has no secret.
    pub fn signature(&self, tenant: &str, id: &str, timestamp: i64, body: &[u8]) -> Option<String> {
        let keys = self.keys.get(tenant)?;
        Some(
            keys.iter()
                .map(|k| format!("v1,{}", sign(k, id, timestamp, body)))
                .collect::<Vec<_>>()
                .join(" "),
        )
    }
}

fn redact(entry: &str) -> String {
    entry
        .split_once(':')
        .map_or_else(|| "(unnamed)".to_owned(), |(t, _)| format!("of tenant {t:?}"))
}

/// base64 of HMAC-SHA256(`key`, `id.timestamp.body`).
pub fn sign(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    STANDARD.encode(mac.finalize().into_bytes())
}

/// The `webhook-id` of an event: derived from the task, its attempt, the event and the step (for
/// `completed`, its status: 0 succeeded, 1 failed, 2 cancelled, 3 expired), so that every
/// delivery attempt and every replica gives the same one, and a redriven task's events (attempt 2
/// on), or another outcome of one attempt, are new events to a receiver that deduplicates by id.
/// (Attempt 1 keeps the ids of releases before attempts counted.)
pub fn event_id(task_id: Uuid, attempt: u32, event: sluice_schemas::WebhookEvent, step: u32) -> String {
    let mut text = format!("sluice-webhook\0{task_id}\0{}\0{step}", event.as_str());
    if attempt > 1 {
        text.push_str(&format!("\0attempt {attempt}"));
    }
    let digest = Sha256::digest(text.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("msg_{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_standard_webhooks_reference_vector() {
        // The example of the Standard Webhooks specification and its reference libraries.
        let key = STANDARD.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            sign(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn signs_with_every_secret_of_the_tenant() {
        let secrets = Secrets::load(
            &[
                "acme:whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(),
                "acme:whsec_c2Vjb25kLXNlY3JldC1mb3Itcm90YXRpb24=".into(),
            ],
            None,
        )
        .unwrap();
        let header = secrets.signature("acme", "msg_1", 10, b"{}").unwrap();
        assert_eq!(header.split(' ').count(), 2);
        assert!(header.split(' ').all(|s| s.starts_with("v1,")));
        assert!(secrets.signature("rival", "msg_1", 10, b"{}").is_none());
        assert!(Secrets::load(&["acme:secret".into()], None).is_err());
        assert!(
            Secrets::load(&["acme:whsec_c2hvcnQ=".into()], None).is_err(),
            "a short key is refused"
        );
    }

    #[test]
    fn event_ids_are_stable_and_distinct() {
        use sluice_schemas::WebhookEvent::*;
        let t = Uuid::from_u128(7);
        assert_eq!(event_id(t, 1, Completed, 0), event_id(t, 1, Completed, 0));
        assert_ne!(event_id(t, 1, Completed, 0), event_id(t, 1, Progress, 0));
        assert_ne!(event_id(t, 1, Progress, 1), event_id(t, 1, Progress, 2));
        assert!(event_id(t, 1, Started, 0).len() == 36);
        // A redriven task's completion is another event.
        assert_ne!(event_id(t, 1, Completed, 0), event_id(t, 2, Completed, 0));
        assert_ne!(event_id(t, 2, Completed, 0), event_id(t, 3, Completed, 0));
    }
}
