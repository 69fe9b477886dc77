//! Object stores named by URL: `s3://bucket/prefix` (endpoint and credentials from the `AWS_*`
//! variables) or `file:///path`. The worker's image store and its input reader, and the
//! producer's input store, open theirs here, with the same client timeouts and retries.

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ClientConfigKey, ObjectStore, RetryConfig};
use thiserror::Error;

/// Why a URL names no store this can open.
#[derive(Debug, Error)]
pub enum ObjectUrlError {
    #[error("expected s3://bucket/prefix or file:///path")]
    Scheme,
    #[error("no bucket")]
    NoBucket,
    #[error("{0}")]
    Store(#[from] object_store::Error),
    #[error("{0}")]
    Directory(#[from] std::io::Error),
}

/// An opened store and where under it the URL points.
pub struct StoreAt {
    pub store: Arc<dyn ObjectStore>,
    /// The URL's path inside the store (empty for `file://`, whose root is the path).
    pub prefix: Path,
    /// `s3://bucket` or `file:///root`, to which keys are appended to name objects.
    pub url_base: String,
}

/// Opens `url`; `settings` (`AWS_*` names) take precedence over the environment, for tools that
/// talk to several stacks.
pub fn open(url: &str, settings: impl IntoIterator<Item = (String, String)>) -> Result<StoreAt, ObjectUrlError> {
    if let Some(rest) = url.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(ObjectUrlError::NoBucket);
        }
        // The callers' own retry loops count attempts (and feed the DLQ); the client retries
        // only briefly underneath them.
        let retry = RetryConfig {
            max_retries: 2,
            retry_timeout: Duration::from_secs(10),
            ..Default::default()
        };
        // Timeouts go through config keys: replacing the client options would drop what
        // `from_env` read (AWS_ALLOW_HTTP, proxies).
        crate::http_client::install_crypto_provider();
        let mut builder = AmazonS3Builder::from_env();
        for (key, value) in settings {
            if let Ok(key) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                builder = builder.with_config(key, value);
            }
        }
        #[allow(clippy::disallowed_methods)] // the crypto provider is installed above
        let store = builder
            .with_bucket_name(bucket)
            .with_retry(retry)
            .with_config(AmazonS3ConfigKey::Client(ClientConfigKey::Timeout), "30s")
            .with_config(AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout), "5s")
            .build()?;
        Ok(StoreAt {
            store: Arc::new(store),
            prefix: Path::from(prefix),
            url_base: format!("s3://{bucket}"),
        })
    } else if let Some(path) = url.strip_prefix("file://") {
        std::fs::create_dir_all(path)?;
        let store = LocalFileSystem::new_with_prefix(path)?;
        Ok(StoreAt {
            store: Arc::new(store),
            prefix: Path::default(),
            url_base: format!("file://{}", path.trim_end_matches('/')),
        })
    } else {
        Err(ObjectUrlError::Scheme)
    }
}
