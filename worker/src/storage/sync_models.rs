//! `sluice-worker sync-models`: copies a model repository from object storage (`s3://bucket/prefix`)
//! to a local directory before the worker starts — what a Kubernetes initContainer runs so that
//! models are neither baked into the image nor read over the network while serving.
//!
//! Every object under the prefix lands at the same relative path. Files are streamed to a
//! temporary name and renamed into place, so an interrupted copy never leaves a truncated model
//! behind. What was copied is recorded (size and entity tag per file) in `.sluice-sync.json` in the
//! directory: a second run over a kept volume copies only what changed in the store.

use std::collections::BTreeMap;
use std::path::{Path as FsPath, PathBuf};
use std::time::Instant;

use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectMeta, ObjectStoreExt};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::io::AsyncWriteExt;

use crate::storage::images::ImageStore;

/// The record of earlier copies, in the target directory.
pub const RECORD: &str = ".sluice-sync.json";

/// Objects copied at once.
const CONCURRENCY: usize = 4;

#[derive(Debug, Error)]
pub enum SyncError {
    #[error("object store: {0}")]
    Store(#[from] object_store::Error),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("nothing under {0}: is the prefix right?")]
    Empty(String),
    #[error("{path}: the store said {expected} bytes, {got} arrived")]
    Short { path: PathBuf, expected: u64, got: u64 },
}

/// What one run did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SyncSummary {
    /// Files written.
    pub copied: u64,
    /// Files already there, unchanged in the store.
    pub unchanged: u64,
    /// Bytes written.
    pub bytes: u64,
    pub seconds: f64,
}

/// What the record keeps of each file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Copied {
    size: u64,
    e_tag: Option<String>,
}

fn io(path: &FsPath) -> impl FnOnce(std::io::Error) -> SyncError + '_ {
    move |source| SyncError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Copies every object under `source`'s prefix into `to`.
pub async fn sync(source: &ImageStore, to: &FsPath) -> Result<SyncSummary, SyncError> {
    let started = Instant::now();
    let (store, prefix) = source.objects();
    tokio::fs::create_dir_all(to).await.map_err(io(to))?;
    let record_path = to.join(RECORD);
    let mut record: BTreeMap<String, Copied> = match tokio::fs::read(&record_path).await {
        // An unreadable record only means copying everything again.
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_default(),
        Err(_) => BTreeMap::new(),
    };
    let listed: Vec<ObjectMeta> = store.list(Some(prefix)).try_collect().await?;
    if listed.is_empty() {
        return Err(SyncError::Empty(source.url(prefix)));
    }
    let mut summary = SyncSummary::default();
    let mut wanted = Vec::new();
    for meta in listed {
        let Some(parts) = meta.location.prefix_match(prefix) else {
            continue;
        };
        let relative: Vec<String> = parts.map(|p| p.as_ref().to_owned()).collect();
        if relative.is_empty() {
            continue;
        }
        let name = relative.join("/");
        let target = relative.iter().fold(to.to_owned(), |path, part| path.join(part));
        let copied = Copied {
            size: meta.size,
            e_tag: meta.e_tag.clone(),
        };
        let present = tokio::fs::metadata(&target).await.is_ok_and(|m| m.len() == meta.size);
        if present && record.get(&name) == Some(&copied) {
            summary.unchanged += 1;
        } else {
            wanted.push((name, target, meta, copied));
        }
    }
    let results: Vec<Result<(String, Copied), SyncError>> = futures::stream::iter(wanted)
        .map(|(name, target, meta, copied)| async move {
            copy(store, &meta, &target).await?;
            tracing::info!(file = %name, bytes = meta.size, "copied");
            Ok((name, copied))
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    // Record what did arrive before reporting what didn't: the next run resumes from there.
    let mut failure = None;
    for result in results {
        match result {
            Ok((name, copied)) => {
                summary.copied += 1;
                summary.bytes += copied.size;
                record.insert(name, copied);
            }
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    let json = serde_json::to_vec_pretty(&record).expect("the record serializes");
    write_atomically(&record_path, &json).await?;
    if let Some(e) = failure {
        return Err(e);
    }
    summary.seconds = started.elapsed().as_secs_f64();
    Ok(summary)
}

/// Streams one object to `target` through a temporary file.
async fn copy(store: &std::sync::Arc<dyn object_store::ObjectStore>, meta: &ObjectMeta, target: &FsPath) -> Result<(), SyncError> {
    if let Some(dir) = target.parent() {
        tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
    }
    let partial = partial_name(target);
    let mut file = tokio::fs::File::create(&partial).await.map_err(io(&partial))?;
    let mut stream = store.get(&meta.location).await?.into_stream();
    let mut got = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        got += chunk.len() as u64;
        file.write_all(&chunk).await.map_err(io(&partial))?;
    }
    if got != meta.size {
        let _ = tokio::fs::remove_file(&partial).await;
        return Err(SyncError::Short {
            path: target.to_owned(),
            expected: meta.size,
            got,
        });
    }
    file.sync_all().await.map_err(io(&partial))?;
    drop(file);
    tokio::fs::rename(&partial, target).await.map_err(io(target))
}

async fn write_atomically(path: &FsPath, bytes: &[u8]) -> Result<(), SyncError> {
    let partial = partial_name(path);
    tokio::fs::write(&partial, bytes).await.map_err(io(&partial))?;
    tokio::fs::rename(&partial, path).await.map_err(io(path))
}

fn partial_name(path: &FsPath) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".partial");
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(what: &str) -> PathBuf {
        std::env::temp_dir().join(format!("sluice-sync-{what}-{}", uuid::Uuid::new_v4()))
    }

    fn tree(root: &FsPath) -> BTreeMap<String, Vec<u8>> {
        let mut out = BTreeMap::new();
        let mut stack = vec![root.to_owned()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else {
                    let name = path.strip_prefix(root).unwrap().display().to_string();
                    out.insert(name, std::fs::read(&path).unwrap());
                }
            }
        }
        out
    }

    #[tokio::test]
    async fn copies_a_tree_then_only_what_changed() {
        let (store_dir, to) = (temp_dir("store"), temp_dir("to"));
        let files = [("m/unet/model.onnx", vec![7u8; 300_000]), ("m/model_index.json", b"{}".to_vec())];
        for (name, bytes) in &files {
            let path = store_dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes).unwrap();
        }
        std::fs::write(store_dir.join("other.txt"), b"not under the prefix").unwrap();
        let source = ImageStore::from_url(&format!("file://{}/m", store_dir.display())).unwrap();

        let first = sync(&source, &to).await.unwrap();
        assert_eq!((first.copied, first.unchanged, first.bytes), (2, 0, 300_002));
        let mut got = tree(&to);
        assert!(got.remove(RECORD).is_some());
        let expected: BTreeMap<String, Vec<u8>> = files
            .iter()
            .map(|(n, b)| (n.trim_start_matches("m/").to_owned(), b.clone()))
            .collect();
        assert_eq!(got, expected);

        let again = sync(&source, &to).await.unwrap();
        assert_eq!((again.copied, again.unchanged), (0, 2));

        // A changed object (another size) and a damaged local file are copied again.
        std::fs::write(store_dir.join("m/model_index.json"), b"{\"a\": 1}").unwrap();
        std::fs::write(to.join("unet/model.onnx"), b"truncated").unwrap();
        let third = sync(&source, &to).await.unwrap();
        assert_eq!((third.copied, third.unchanged), (2, 0));
        assert_eq!(std::fs::read(to.join("model_index.json")).unwrap(), b"{\"a\": 1}");
        assert_eq!(std::fs::read(to.join("unet/model.onnx")).unwrap(), vec![7u8; 300_000]);
        let _ = (std::fs::remove_dir_all(&store_dir), std::fs::remove_dir_all(&to));
    }

    #[tokio::test]
    async fn an_empty_prefix_is_an_error() {
        let (store_dir, to) = (temp_dir("store"), temp_dir("to"));
        let source = ImageStore::from_url(&format!("file://{}/nothing", store_dir.display())).unwrap();
        assert!(matches!(sync(&source, &to).await, Err(SyncError::Empty(_))));
    }
}
