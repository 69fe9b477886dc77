//! Caller authentication: bearer API keys, each bound to a tenant. Closed by default: without
//! keys the producer refuses to start unless anonymous access is asked for by name. Beside the
//! keys, the priority lanes each tenant may ask for ([`TenantLanes`]).

use std::collections::HashMap;

use sluice_schemas::Priority;

use sha2::{Digest, Sha256};
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("missing Authorization: Bearer <api key>")]
    Missing,
    #[error("unknown API key")]
    Unknown,
    /// The entry's position only: an entry without `:` may be a bare key.
    #[error("API key entry {0} is malformed: expected tenant:key (its text is not shown)")]
    BadEntry(usize),
    #[error("no API keys: set SLUICE_API_KEYS (tenant:key,…), or SLUICE_ALLOW_ANONYMOUS=true for an open API")]
    NoKeys,
    #[error("SLUICE_TENANT_LANES entry {0:?} is malformed: expected tenant=lane+lane with lanes among interactive, standard, batch")]
    BadLanes(String),
}

/// The configured keys, by their SHA-256: a lookup compares digests, never the key's bytes,
/// so its timing says nothing about a key.
#[derive(Clone)]
pub struct ApiKeys {
    tenants: HashMap<[u8; 32], String>,
    anonymous: bool,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut tenants: Vec<&String> = self.tenants.values().collect();
        tenants.sort();
        f.debug_struct("ApiKeys")
            .field("tenants", &tenants)
            .field("anonymous", &self.anonymous)
            .finish()
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl ApiKeys {
    /// `tenant:key` entries (blank ones skipped); at least one is required.
    pub fn parse(entries: &[String]) -> Result<ApiKeys, AuthError> {
        let mut tenants = HashMap::new();
        for (i, entry) in entries.iter().enumerate().filter(|(_, e)| !e.trim().is_empty()) {
            let (tenant, key) = entry.split_once(':').ok_or(AuthError::BadEntry(i + 1))?;
            let (tenant, key) = (tenant.trim(), key.trim());
            if tenant.is_empty() || key.is_empty() {
                return Err(AuthError::BadEntry(i + 1));
            }
            tenants.insert(digest(key), tenant.to_owned());
        }
        if tenants.is_empty() {
            return Err(AuthError::NoKeys);
        }
        Ok(ApiKeys { tenants, anonymous: false })
    }

    /// No keys: every caller is tenant `default` (`SLUICE_ALLOW_ANONYMOUS=true`, local use).
    pub fn anonymous() -> ApiKeys {
        ApiKeys {
            tenants: HashMap::new(),
            anonymous: true,
        }
    }

    pub fn is_anonymous(&self) -> bool {
        self.anonymous
    }

    /// The tenant of an `Authorization` header value.
    pub fn tenant(&self, authorization: Option<&str>) -> Result<String, AuthError> {
        if self.anonymous {
            return Ok("default".to_owned());
        }
        let key = authorization
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(AuthError::Missing)?;
        self.tenants.get(&digest(key)).cloned().ok_or(AuthError::Unknown)
    }
}

/// The lanes each tenant may ask for (`SLUICE_TENANT_LANES`: `tenant=lane+lane,…`). A tenant
/// not listed may use `standard` and `batch`: `interactive` goes before everyone's work, so it is
/// granted by name.
#[derive(Debug, Clone, Default)]
pub struct TenantLanes {
    lanes: HashMap<String, Vec<Priority>>,
}

impl TenantLanes {
    /// The lanes of a tenant the configuration does not name.
    pub const UNLISTED: [Priority; 2] = [Priority::Standard, Priority::Batch];

    /// `tenant=lane+lane` entries (blank ones skipped).
    pub fn parse(entries: &[String]) -> Result<TenantLanes, AuthError> {
        let mut lanes = HashMap::new();
        for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            let bad = || AuthError::BadLanes(entry.to_owned());
            let (tenant, names) = entry.split_once('=').ok_or_else(bad)?;
            let tenant = tenant.trim();
            let of: Option<Vec<Priority>> = names.split('+').map(|n| Priority::parse(n.trim())).collect();
            match of {
                Some(of) if !tenant.is_empty() && !of.is_empty() => lanes.insert(tenant.to_owned(), of),
                _ => return Err(bad()),
            };
        }
        Ok(TenantLanes { lanes })
    }

    /// The lanes `tenant` may ask for.
    pub fn of(&self, tenant: &str) -> &[Priority] {
        self.lanes.get(tenant).map_or(&Self::UNLISTED, Vec::as_slice)
    }

    pub fn allows(&self, tenant: &str, lane: Priority) -> bool {
        self.of(tenant).contains(&lane)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_are_granted_by_name_and_interactive_is_not_granted_by_default() {
        let lanes = TenantLanes::parse(&["acme=interactive+standard".into(), " ".into(), "globex = batch".into()]).unwrap();
        assert!(lanes.allows("acme", Priority::Interactive));
        assert!(!lanes.allows("acme", Priority::Batch), "only what is listed");
        assert_eq!(lanes.of("globex"), &[Priority::Batch]);
        assert_eq!(lanes.of("initech"), &TenantLanes::UNLISTED);
        assert!(!lanes.allows("initech", Priority::Interactive));
        for bad in ["acme", "acme=", "=batch", "acme=urgent", "acme=batch+"] {
            assert!(TenantLanes::parse(&[bad.into()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn maps_keys_to_tenants() {
        let keys = ApiKeys::parse(&["acme:k1".into(), " globex : k2 ".into()]).unwrap();
        assert_eq!(keys.tenant(Some("Bearer k1")), Ok("acme".into()));
        assert_eq!(keys.tenant(Some("Bearer k2")), Ok("globex".into()));
        assert_eq!(keys.tenant(Some("Bearer nope")), Err(AuthError::Unknown));
        assert_eq!(keys.tenant(None), Err(AuthError::Missing));
        assert_eq!(keys.tenant(Some("k1")), Err(AuthError::Missing));
    }

    #[test]
    fn no_keys_is_refused_and_anonymous_is_asked_for() {
        assert_eq!(ApiKeys::parse(&[]).unwrap_err(), AuthError::NoKeys);
        assert_eq!(ApiKeys::parse(&[" ".into(), "".into()]).unwrap_err(), AuthError::NoKeys);
        let open = ApiKeys::anonymous();
        assert!(open.is_anonymous());
        assert_eq!(open.tenant(None), Ok("default".into()));
    }

    /// A malformed entry is named by position; neither its text nor any key is printed.
    #[test]
    fn rejects_malformed_entries_without_printing_them() {
        let e = ApiKeys::parse(&["acme:ok".into(), "s3cr3t-key".into()]).unwrap_err();
        assert_eq!(e, AuthError::BadEntry(2));
        assert!(!e.to_string().contains("s3cr3t"), "{e}");
        assert!(ApiKeys::parse(&[":k".into()]).is_err());
        let keys = ApiKeys::parse(&["acme:s3cr3t".into()]).unwrap();
        assert!(!format!("{keys:?}").contains("s3cr3t"), "{keys:?}");
    }
}
