//! Caller authentication: bearer API keys, each bound to a tenant.

use std::collections::HashMap;

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("missing Authorization: Bearer <api key>")]
    Missing,
    #[error("unknown API key")]
    Unknown,
    #[error("invalid API key entry {0:?}: expected tenant:key")]
    BadEntry(String),
}

/// The configured keys. Empty means authentication is off.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    tenants: HashMap<String, String>,
}

impl ApiKeys {
    pub fn parse(entries: &[String]) -> Result<ApiKeys, AuthError> {
        let mut tenants = HashMap::new();
        for entry in entries.iter().filter(|e| !e.trim().is_empty()) {
            let (tenant, key) = entry.split_once(':').ok_or_else(|| AuthError::BadEntry(entry.clone()))?;
            let (tenant, key) = (tenant.trim(), key.trim());
            if tenant.is_empty() || key.is_empty() {
                return Err(AuthError::BadEntry(entry.clone()));
            }
            tenants.insert(key.to_owned(), tenant.to_owned());
        }
        Ok(ApiKeys { tenants })
    }

    pub fn enabled(&self) -> bool {
        !self.tenants.is_empty()
    }

    /// The tenant of an `Authorization` header value.
    pub fn tenant(&self, authorization: Option<&str>) -> Result<String, AuthError> {
        if !self.enabled() {
            return Ok("default".to_owned());
        }
        let key = authorization
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(AuthError::Missing)?;
        self.tenants.get(key).cloned().ok_or(AuthError::Unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn no_keys_means_open_and_default_tenant() {
        let keys = ApiKeys::parse(&[]).unwrap();
        assert!(!keys.enabled());
        assert_eq!(keys.tenant(None), Ok("default".into()));
    }

    #[test]
    fn rejects_malformed_entries() {
        assert!(ApiKeys::parse(&["nokey".into()]).is_err());
        assert!(ApiKeys::parse(&[":k".into()]).is_err());
    }
}
