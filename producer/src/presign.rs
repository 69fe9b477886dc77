//! Presigned GET URLs for a task's stored images, so that an HTTP client downloads its PNGs
//! without S3 credentials. Outputs stored on S3 (`s3://bucket/key`) get an `https` URL signed
//! with the producer's `AWS_*` credentials, valid for the configured time; other stores' URLs are
//! passed through.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::signer::Signer;

use crate::status::TaskStatus;

pub struct Presigner {
    ttl: Duration,
    stores: Mutex<HashMap<String, Arc<AmazonS3>>>,
}

impl Presigner {
    pub fn new(ttl: Duration) -> Presigner {
        Presigner {
            ttl,
            stores: Mutex::default(),
        }
    }

    fn store(&self, bucket: &str) -> Option<Arc<AmazonS3>> {
        let mut stores = self.stores.lock().expect("not poisoned");
        if let Some(s) = stores.get(bucket) {
            return Some(s.clone());
        }
        sluice_service::http_client::install_crypto_provider();
        #[allow(clippy::disallowed_methods)] // the crypto provider is installed above
        let built = AmazonS3Builder::from_env().with_bucket_name(bucket).build();
        match built {
            Ok(s) => {
                let s = Arc::new(s);
                stores.insert(bucket.to_owned(), s.clone());
                Some(s)
            }
            Err(e) => {
                tracing::warn!(bucket, error = %e, "cannot presign: no S3 client for the bucket");
                None
            }
        }
    }

    /// Replaces each `s3://` output URL of `status` by a presigned one (left as it is when
    /// signing fails: the client still has the key).
    pub async fn sign(&self, status: &mut TaskStatus) {
        for output in &mut status.outputs {
            let Some((bucket, key)) = output.url.strip_prefix("s3://").and_then(|r| r.split_once('/')) else {
                continue;
            };
            let Some(store) = self.store(bucket) else { continue };
            match store.signed_url(axum::http::Method::GET, &Path::from(key), self.ttl).await {
                Ok(url) => output.url = url.to_string(),
                Err(e) => tracing::warn!(key, error = %e, "presigning failed"),
            }
        }
    }
}
