//! Storing images. Keys are derived from the task id and image index, images are written
//! create-only (a redelivered task can never turn one image into two different objects), and a
//! small result manifest is written last: its presence means the task's results are complete.

use std::sync::Arc;

use bytes::Bytes;
use chrono::Utc;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use sha2::{Digest, Sha256};
use sluice_schemas::{ImageRef, OutputRef, RecordKind, ResultManifest, SCHEMA_VERSION};
use thiserror::Error;
use uuid::Uuid;

use crate::models::encode::Image;
use crate::retry::Retriable;

#[derive(Debug, Error)]
pub enum StorageError {
    /// The output URL can't be used.
    #[error("invalid output URL {url}: {reason}")]
    Config { url: String, reason: String },
    /// The store failed: transient (network, server down, throttling) or not (see
    /// [`Retriable`]).
    #[error("object store: {0}")]
    Store(#[from] object_store::Error),
    /// An object in the store (a manifest) is not one a worker wrote.
    #[error("{key} is unreadable: {reason}")]
    Unreadable { key: String, reason: String },
}

impl Retriable for StorageError {
    fn is_retriable(&self) -> bool {
        match self {
            StorageError::Config { .. } | StorageError::Unreadable { .. } => false,
            StorageError::Store(e) => store_error_is_retriable(e),
        }
    }
}

/// Whether an object store error may go away on its own. Authentication, permission, path and
/// configuration errors never do, nor a 4xx answer other than 408 (timeout) and 429 (throttled);
/// connection failures, timeouts and 5xx answers may. `NotFound`, `AlreadyExists` and
/// `Precondition` are answers the callers expect and handle where they mean something; anywhere
/// else they are not transient either.
fn store_error_is_retriable(e: &object_store::Error) -> bool {
    use object_store::Error as E;
    match e {
        E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::InvalidPath { .. }
        | E::NotSupported { .. }
        | E::NotImplemented { .. }
        | E::UnknownConfigurationKey { .. }
        | E::NotFound { .. }
        | E::AlreadyExists { .. }
        | E::Precondition { .. }
        | E::NotModified { .. } => false,
        // The HTTP status of a generic failure is only in its text ("... non-2xx status code:
        // 400 Bad Request ..."): the client's error type is private.
        _ => http_status(&e.to_string()).is_none_or(|s| !(400..500).contains(&s) || s == 408 || s == 429),
    }
}

/// The HTTP status an object store error message reports, if any.
fn http_status(message: &str) -> Option<u16> {
    let (_, rest) = message.split_once("status code: ")?;
    rest.get(..3)?.parse().ok()
}

/// Storage requests in flight at once, by default. Unbounded, a backlog of tasks opens a
/// connection per request and overflows the server's accept queue (connects then stall for
/// seconds in SYN retransmission); bounded, a small pool of kept-alive connections is reused.
pub const DEFAULT_CONCURRENCY: usize = 32;

/// The largest input image a worker reads: a 4096 × 4096 RGB PNG stored uncompressed, and some.
pub const MAX_INPUT_BYTES: u64 = 64 << 20;

/// The output location.
#[derive(Clone)]
pub struct ImageStore {
    store: Arc<dyn ObjectStore>,
    requests: Arc<tokio::sync::Semaphore>,
    prefix: Path,
    /// `s3://bucket` or `file:///root`, to which keys are appended for output URLs.
    url_base: String,
}

impl std::fmt::Debug for ImageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageStore")
            .field("url_base", &self.url_base)
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl ImageStore {
    /// Opens `s3://bucket/prefix` (endpoint and credentials from the `AWS_*` variables) or
    /// `file:///path`.
    pub fn from_url(url: &str) -> Result<ImageStore, StorageError> {
        ImageStore::from_url_with(url, std::iter::empty::<(String, String)>())
    }

    /// Like [`ImageStore::from_url`], with `AWS_*` settings given here taking precedence over the
    /// environment (tools that talk to several stacks).
    pub fn from_url_with(url: &str, settings: impl IntoIterator<Item = (String, String)>) -> Result<ImageStore, StorageError> {
        let at = sluice_service::object_url::open(url, settings).map_err(|e| StorageError::Config {
            url: url.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(ImageStore::new(at.store, at.prefix, at.url_base))
    }

    fn new(store: Arc<dyn ObjectStore>, prefix: Path, url_base: String) -> ImageStore {
        ImageStore {
            store,
            requests: Arc::new(tokio::sync::Semaphore::new(DEFAULT_CONCURRENCY)),
            prefix,
            url_base,
        }
    }

    /// Sets how many storage requests may be in flight at once.
    pub fn with_concurrency(mut self, requests: usize) -> ImageStore {
        self.requests = Arc::new(tokio::sync::Semaphore::new(requests.max(1)));
        self
    }

    async fn permit(&self) -> tokio::sync::SemaphorePermit<'_> {
        self.requests.acquire().await.expect("never closed")
    }

    fn key(&self, task_id: Uuid, name: &str) -> Path {
        self.prefix.clone().join(task_id.to_string()).join(name)
    }

    /// The URL of a key in this store.
    pub(crate) fn url(&self, key: &Path) -> String {
        format!("{}/{}", self.url_base, key)
    }

    /// An input image (img2img, inpainting) the producer stored under its content address, its
    /// bytes checked against the hash the record carries. A key that is not the hash's address,
    /// an object over [`MAX_INPUT_BYTES`] or bytes of another hash are [`StorageError::Unreadable`]
    /// (permanent); a missing object is `NotFound` (permanent too).
    pub(crate) async fn input(&self, image: &ImageRef) -> Result<Bytes, StorageError> {
        let bad = |reason: String| StorageError::Unreadable {
            key: image.key.clone(),
            reason,
        };
        if !image.is_content_addressed() {
            return Err(bad(format!("not the content address of sha256 {}", image.sha256)));
        }
        let key = self.prefix.clone().join(image.key.as_str());
        let _permit = self.permit().await;
        let result = self.store.get(&key).await?;
        if result.meta.size > MAX_INPUT_BYTES {
            return Err(bad(format!(
                "{} bytes; an input image may have {MAX_INPUT_BYTES}",
                result.meta.size
            )));
        }
        let bytes = result.bytes().await?;
        let sha256 = hex::encode(Sha256::digest(&bytes));
        if sha256 != image.sha256 {
            return Err(bad(format!("its sha256 is {sha256}, the task record says {}", image.sha256)));
        }
        Ok(bytes)
    }

    /// The task's manifest, if its results are complete.
    pub(crate) async fn manifest(&self, task_id: Uuid) -> Result<Option<ResultManifest>, StorageError> {
        let key = self.key(task_id, "manifest.json");
        let _permit = self.permit().await;
        let bytes = match self.store.get(&key).await {
            Ok(result) => result.bytes().await?,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let bad = |reason: String| StorageError::Unreadable {
            key: key.to_string(),
            reason,
        };
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        sluice_schemas::validate(RecordKind::Manifest, &value).map_err(|v| bad(format!("{v:?}")))?;
        serde_json::from_value(value).map(Some).map_err(|e| bad(e.to_string()))
    }

    /// Stores image `index` of a task. If an earlier attempt already stored it, the stored object
    /// is kept and described instead.
    pub(crate) async fn put_image(&self, task_id: Uuid, index: u32, image: &Image) -> Result<OutputRef, StorageError> {
        let key = self.key(task_id, &format!("{index}.png"));
        let options = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let bytes = Bytes::from(image.bytes.clone());
        let _permit = self.permit().await;
        let (stored_len, sha) = match self.store.put_opts(&key, PutPayload::from_bytes(bytes), options).await {
            Ok(_) => (image.bytes.len() as u64, hex::encode(Sha256::digest(&image.bytes))),
            Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => {
                let existing = self.store.get(&key).await?.bytes().await?;
                (existing.len() as u64, hex::encode(Sha256::digest(&existing)))
            }
            Err(e) => return Err(e.into()),
        };
        Ok(OutputRef {
            index,
            url: self.url(&key),
            key: key.to_string(),
            content_type: image.content_type.to_owned(),
            bytes: stored_len,
            sha256: sha,
            width: image.width,
            height: image.height,
        })
    }

    /// Writes the manifest, after every image; `request_sha256` is an idempotent task's
    /// request hash.
    pub(crate) async fn put_manifest(
        &self,
        task_id: Uuid,
        outputs: &[OutputRef],
        inference_ms: u64,
        worker_id: &str,
        request_sha256: Option<&str>,
    ) -> Result<ResultManifest, StorageError> {
        let manifest = ResultManifest {
            version: SCHEMA_VERSION,
            task_id,
            outputs: outputs.to_vec(),
            inference_ms: Some(inference_ms),
            created_at: Utc::now(),
            worker_id: worker_id.to_owned(),
            request_sha256: request_sha256.map(str::to_owned),
        };
        let body = serde_json::to_vec(&manifest).expect("manifest serializes");
        let _permit = self.permit().await;
        self.store.put(&self.key(task_id, "manifest.json"), PutPayload::from(body)).await?;
        Ok(manifest)
    }

    /// The store and the prefix under it (for tools that walk it, such as `sync-models`).
    pub(crate) fn objects(&self) -> (&Arc<dyn ObjectStore>, &Path) {
        (&self.store, &self.prefix)
    }

    /// The keys of the objects under `dir` of the store's prefix (for tools and tests).
    pub async fn keys_under(&self, dir: &str) -> Result<Vec<String>, StorageError> {
        use futures::TryStreamExt;
        let _permit = self.permit().await;
        let under = dir
            .split('/')
            .filter(|p| !p.is_empty())
            .fold(self.prefix.clone(), |path, part| path.join(part));
        let keys: Vec<String> = self
            .store
            .list(Some(&under))
            .map_ok(|m| m.location.to_string())
            .try_collect()
            .await?;
        Ok(keys)
    }

    /// Writes an object by its key (for tools and tests).
    pub async fn write(&self, key: &str, bytes: Bytes) -> Result<(), StorageError> {
        let _permit = self.permit().await;
        self.store.put(&Path::from(key), PutPayload::from(bytes)).await?;
        Ok(())
    }

    /// Reads an object by its key (for tools and tests).
    pub async fn read(&self, key: &str) -> Result<Bytes, StorageError> {
        let _permit = self.permit().await;
        Ok(self.store.get(&Path::from(key)).await?.bytes().await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(bytes: &[u8]) -> Image {
        Image {
            bytes: bytes.to_vec(),
            width: 1,
            height: 1,
            content_type: "image/png",
        }
    }

    #[tokio::test]
    async fn an_input_image_is_read_only_with_the_bytes_of_its_hash() {
        let dir = std::env::temp_dir().join(format!("sluice-inputs-{}", Uuid::new_v4()));
        let inputs = ImageStore::from_url(&format!("file://{}", dir.display())).unwrap();
        let good = ImageRef::of_sha256(hex::encode(Sha256::digest(b"pixels")));
        std::fs::write(dir.join(&good.key), b"pixels").unwrap();
        assert_eq!(inputs.input(&good).await.unwrap().as_ref(), b"pixels");
        // Bytes under the key that are not the hash's: refused, permanently.
        let altered = ImageRef::of_sha256(hex::encode(Sha256::digest(b"other")));
        std::fs::write(dir.join(&altered.key), b"pixels").unwrap();
        let e = inputs.input(&altered).await.unwrap_err();
        assert!(matches!(e, StorageError::Unreadable { .. }) && !e.is_retriable(), "{e}");
        // A key that is not the hash's address is never read.
        let elsewhere = ImageRef {
            key: "../outside.png".into(),
            sha256: good.sha256.clone(),
        };
        assert!(matches!(inputs.input(&elsewhere).await, Err(StorageError::Unreadable { .. })));
        // Missing: permanent too.
        let missing = ImageRef::of_sha256("0".repeat(64));
        assert!(!inputs.input(&missing).await.unwrap_err().is_retriable());
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn an_image_is_written_once_and_described_as_stored() {
        let dir = std::env::temp_dir().join(format!("sluice-sink-{}", Uuid::new_v4()));
        let sink = ImageStore::from_url(&format!("file://{}", dir.display())).unwrap();
        let task = Uuid::new_v4();
        let first = sink.put_image(task, 0, &image(b"first")).await.unwrap();
        // A second attempt made different bytes (say, another batch size): the first object stays.
        let second = sink.put_image(task, 0, &image(b"second attempt")).await.unwrap();
        assert_eq!(first, second);
        assert_eq!(sink.read(&first.key).await.unwrap().as_ref(), b"first");
        assert_eq!(first.sha256, hex::encode(Sha256::digest(b"first")));
        assert!(first.url.starts_with("file://") && first.url.ends_with(&format!("{task}/0.png")));

        assert!(sink.manifest(task).await.unwrap().is_none());
        sink.put_manifest(task, std::slice::from_ref(&first), 5, "w", None).await.unwrap();
        let manifest = sink.manifest(task).await.unwrap().unwrap();
        assert_eq!(manifest.outputs, vec![first]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn only_errors_that_can_pass_are_retriable() {
        let generic = |text: &str| {
            StorageError::Store(object_store::Error::Generic {
                store: "S3",
                source: text.to_owned().into(),
            })
        };
        let cases = [
            (
                generic("Error performing PUT http://s3/x in 2ms - Server returned non-2xx status code: 400 Bad Request: <Error/>"),
                false,
            ),
            (
                generic("Error performing GET http://s3/x in 2ms - Server returned non-2xx status code: 404 Not Found: "),
                false,
            ),
            (
                generic("Error performing PUT http://s3/x in 1s - Server returned non-2xx status code: 429 Too Many Requests: "),
                true,
            ),
            (
                generic("Error performing PUT http://s3/x in 1s - Server returned non-2xx status code: 408 Request Timeout: "),
                true,
            ),
            (
                generic("Error performing PUT http://s3/x in 1s - Server returned non-2xx status code: 503 Service Unavailable: "),
                true,
            ),
            (
                generic("Error performing PUT http://s3/x in 5s, after 2 retries - HTTP error: error sending request"),
                true,
            ),
            (
                StorageError::Store(object_store::Error::PermissionDenied {
                    path: "x".into(),
                    source: "403".into(),
                }),
                false,
            ),
            (
                StorageError::Store(object_store::Error::Unauthenticated {
                    path: "x".into(),
                    source: "401".into(),
                }),
                false,
            ),
            (
                StorageError::Unreadable {
                    key: "k".into(),
                    reason: "not JSON".into(),
                },
                false,
            ),
        ];
        for (error, retriable) in cases {
            assert_eq!(error.is_retriable(), retriable, "{error}");
        }
    }

    #[test]
    fn rejects_other_urls() {
        assert!(matches!(ImageStore::from_url("http://x/y"), Err(StorageError::Config { .. })));
        assert!(matches!(ImageStore::from_url("s3:///prefix"), Err(StorageError::Config { .. })));
    }
}
