//! Durable step checkpoints: where a diffusion task's rows stood after a step ([`Resume`]: the
//! step and the latents and sampler state that carry them on), written to object storage every
//! `checkpoint_every` steps of a model that asks for it, so that the next owner of a task whose
//! worker was killed, preempted or drained carries on from there instead of from the first step.
//!
//! Keys are `checkpoints/<task id>/<attempt>/<step, six digits>.ckpt` under the output prefix,
//! written create-only (a step's state is the same whoever writes it: seeded noise, the same
//! model). An attempt carries on from its own checkpoints only: a task redriven from the DLQ
//! (attempt 2, …) starts from its first step, not from where the attempt that failed stopped. A
//! checkpoint is a versioned file: a magic line, a JSON header (format version, task, attempt,
//! model, bucket, step, each tensor's name and shape, the payload's sha256) and the tensors'
//! float32 values, little-endian. One that does not read back as written for this task, attempt
//! and bucket is passed over with a WARN, and the task starts from an earlier checkpoint or its
//! first step. A task's checkpoints, of every attempt, are deleted once its results are stored
//! (their manifest supersedes them); what a crash or a failed task leaves behind is swept by age ([`sweep`]:
//! `sluice-worker sweep-checkpoints`, the chart's CronJob) or by the bucket's lifecycle rule.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::images::{ImageStore, StorageError};
use crate::batching::steps::{Checkpoints, Resume};
use crate::engine::{CallTask, Tensor, TensorData};
use crate::events::{self, Emit};
use crate::metrics::Metrics;
use crate::models::Bucket;

/// The format this worker writes and reads (1 had no attempt).
pub const FORMAT_VERSION: u32 = 2;
const MAGIC: &[u8] = b"SLUICE-CHECKPOINT\n";
/// The largest header read.
const MAX_HEADER_BYTES: usize = 64 << 10;
/// The largest checkpoint read: far above any task's latents (FLUX.1 at 1024², four images, with
/// two tensors a row, is 8 MiB).
pub const MAX_CHECKPOINT_BYTES: u64 = 256 << 20;
/// Checkpoint writes in flight at once; past it a checkpoint is skipped (the next one is taken),
/// so a slow store never holds the engine's memory.
const MAX_WRITES_IN_FLIGHT: usize = 16;

/// What a checkpoint says about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Header {
    version: u32,
    task_id: Uuid,
    attempt: u32,
    model: String,
    bucket: String,
    step: usize,
    tensors: Vec<TensorHeader>,
    sha256: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct TensorHeader {
    name: String,
    shape: Vec<usize>,
}

/// Whose checkpoint a file must be to be read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owner {
    pub task_id: Uuid,
    /// The task's delivery attempt (1, or what a redrive recorded).
    pub attempt: u32,
    pub model: String,
    /// The bucket key's name: size, sampler, steps, guidance.
    pub bucket: String,
}

/// A checkpoint as bytes: the magic line, the header and the payload.
pub(crate) fn encode(owner: &Owner, resume: &Resume) -> Result<Vec<u8>, String> {
    let mut payload = Vec::new();
    let mut tensors = Vec::new();
    for t in &resume.carried {
        let TensorData::F32(values) = &t.data else {
            return Err(format!("`{}` is not float32", t.name));
        };
        payload.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        tensors.push(TensorHeader {
            name: t.name.clone(),
            shape: t.shape.clone(),
        });
    }
    let header = Header {
        version: FORMAT_VERSION,
        task_id: owner.task_id,
        attempt: owner.attempt,
        model: owner.model.clone(),
        bucket: owner.bucket.clone(),
        step: resume.step,
        tensors,
        sha256: hex::encode(Sha256::digest(&payload)),
    };
    let mut out = MAGIC.to_vec();
    out.extend(serde_json::to_vec(&header).expect("a header serializes"));
    out.push(b'\n');
    out.extend(payload);
    Ok(out)
}

/// A checkpoint read back, checked: the format, its owner, the shapes against the payload, and
/// the payload's hash.
pub(crate) fn decode(bytes: &[u8], owner: &Owner) -> Result<Resume, String> {
    let rest = bytes.strip_prefix(MAGIC).ok_or("not a checkpoint (no magic line)")?;
    let end = rest
        .iter()
        .take(MAX_HEADER_BYTES)
        .position(|&b| b == b'\n')
        .ok_or("no header within 64 KiB")?;
    let header: Header = serde_json::from_slice(&rest[..end]).map_err(|e| format!("header: {e}"))?;
    if header.version != FORMAT_VERSION {
        return Err(format!("format version {}, this worker reads {FORMAT_VERSION}", header.version));
    }
    let theirs = Owner {
        task_id: header.task_id,
        attempt: header.attempt,
        model: header.model.clone(),
        bucket: header.bucket.clone(),
    };
    if theirs != *owner {
        return Err(format!("written for {theirs:?}, read for {owner:?}"));
    }
    let payload = &rest[end + 1..];
    if hex::encode(Sha256::digest(payload)) != header.sha256 {
        return Err("the payload's sha256 is not the header's".into());
    }
    let mut at = 0;
    let mut carried = Vec::new();
    for t in &header.tensors {
        let values = t
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| n.checked_mul(4).is_some_and(|b| at + b <= payload.len()))
            .ok_or_else(|| format!("`{}` of shape {:?} is larger than the payload", t.name, t.shape))?;
        let data = payload[at..at + 4 * values]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        at += 4 * values;
        carried.push(Tensor::f32(t.name.clone(), t.shape.clone(), data));
    }
    if at != payload.len() {
        return Err(format!("{} payload bytes past the tensors", payload.len() - at));
    }
    Ok(Resume {
        step: header.step,
        carried,
    })
}

/// Checkpoints in the output store.
#[derive(Clone)]
pub(crate) struct CheckpointStore {
    images: ImageStore,
    metrics: Metrics,
    in_flight: Arc<AtomicUsize>,
}

impl CheckpointStore {
    pub(crate) fn new(images: ImageStore, metrics: Metrics) -> CheckpointStore {
        CheckpointStore {
            images,
            metrics,
            in_flight: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Where all of a task's checkpoints are, of every attempt.
    fn dir(&self, task_id: Uuid) -> Path {
        let (_, prefix) = self.images.objects();
        prefix.clone().join("checkpoints").join(task_id.to_string())
    }

    /// Where one attempt's checkpoints are.
    fn attempt_dir(&self, owner: &Owner) -> Path {
        self.dir(owner.task_id).join(owner.attempt.to_string())
    }

    /// Writes a checkpoint create-only; one already there (the same step of the same task) is
    /// kept. Returns its size.
    pub(crate) async fn put(&self, owner: &Owner, resume: &Resume) -> Result<u64, StorageError> {
        let bytes = encode(owner, resume).map_err(|reason| StorageError::Unreadable {
            key: owner.task_id.to_string(),
            reason,
        })?;
        let size = bytes.len() as u64;
        let key = self.attempt_dir(owner).join(format!("{:06}.ckpt", resume.step));
        let (store, _) = self.images.objects();
        let options = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match store.put_opts(&key, PutPayload::from(Bytes::from(bytes)), options).await {
            Ok(_) | Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => Ok(size),
            Err(e) => Err(e.into()),
        }
    }

    /// The checkpoints under `dir`, the latest step first.
    async fn keys(&self, dir: &Path) -> Result<Vec<Path>, StorageError> {
        let (store, _) = self.images.objects();
        let mut keys: Vec<Path> = store.list(Some(dir)).map_ok(|meta| meta.location).try_collect().await?;
        keys.sort_unstable_by(|a, b| b.as_ref().cmp(a.as_ref()));
        Ok(keys)
    }

    /// The latest checkpoint of the task's attempt that reads back as `owner`'s, if any (each
    /// that does not is passed over with a WARN), and how many of the attempt's checkpoints are
    /// stored.
    pub(crate) async fn latest(&self, owner: &Owner) -> Result<(Option<Resume>, u32), StorageError> {
        let (store, _) = self.images.objects();
        let keys = self.keys(&self.attempt_dir(owner)).await?;
        let stored = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        for key in keys {
            let result = store.get(&key).await?;
            if result.meta.size > MAX_CHECKPOINT_BYTES {
                tracing::warn!(%key, bytes = result.meta.size, "a checkpoint larger than any this worker writes; passed over");
                continue;
            }
            let bytes = result.bytes().await?;
            match decode(&bytes, owner) {
                Ok(resume) => return Ok((Some(resume), stored)),
                Err(reason) => tracing::warn!(%key, reason, "an unreadable checkpoint; passed over"),
            }
        }
        Ok((None, stored))
    }

    /// Deletes the task's checkpoints, of every attempt.
    pub(crate) async fn delete(&self, task_id: Uuid) -> Result<(), StorageError> {
        let (store, _) = self.images.objects();
        for key in self.keys(&self.dir(task_id)).await? {
            match store.delete(&key).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// What a sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct Swept {
    /// Checkpoints deleted, and their bytes.
    pub deleted: usize,
    pub deleted_bytes: u64,
    /// Checkpoints younger than the bound, kept.
    pub kept: usize,
}

/// Deletes the step checkpoints under `images`' prefix last written more than `older_than` ago:
/// what tasks left behind when they failed or were cancelled mid-run, or when their records went
/// to another deployment (a task's are deleted with its results when it succeeds). A task that
/// may still carry on wrote its latest checkpoint within its deadline, so a bound above the
/// catalog's longest `max_ttl_seconds` never deletes one that could still be read. Nothing
/// outside `checkpoints/` is touched.
pub async fn sweep(images: &ImageStore, older_than: std::time::Duration) -> Result<Swept, StorageError> {
    let (store, prefix) = images.objects();
    let age = chrono::Duration::from_std(older_than).unwrap_or(chrono::Duration::MAX);
    let cutoff = chrono::Utc::now()
        .checked_sub_signed(age)
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
    let listed: Vec<object_store::ObjectMeta> = store.list(Some(&prefix.clone().join("checkpoints"))).try_collect().await?;
    let mut swept = Swept::default();
    for meta in listed {
        if meta.last_modified >= cutoff {
            swept.kept += 1;
            continue;
        }
        match store.delete(&meta.location).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                swept.deleted += 1;
                swept.deleted_bytes += meta.size;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(swept)
}

impl Checkpoints for CheckpointStore {
    fn save(&self, task: &CallTask, bucket: &Bucket, resume: Resume) {
        let Ok(task_id) = task.id.parse::<Uuid>() else {
            return;
        };
        if self.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_WRITES_IN_FLIGHT {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            tracing::debug!(%task_id, step = resume.step, "checkpoint writes are behind; this one is skipped");
            return;
        }
        let owner = Owner {
            task_id,
            attempt: task.attempt,
            model: bucket.model.clone(),
            bucket: bucket.key.name().to_owned(),
        };
        let this = self.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            match this.put(&owner, &resume).await {
                Ok(bytes) => events::CheckpointWritten {
                    task_id: &task_id.to_string(),
                    step: resume.step,
                    bytes,
                    elapsed: started.elapsed(),
                }
                .emit(&this.metrics),
                Err(e) => tracing::warn!(%task_id, step = resume.step, error = %e, "a checkpoint could not be written"),
            }
            this.in_flight.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner() -> Owner {
        Owner {
            task_id: Uuid::nil(),
            attempt: 1,
            model: "sd".into(),
            bucket: "64x64:euler:20:cfg".into(),
        }
    }

    fn resume() -> Resume {
        Resume {
            step: 7,
            carried: vec![
                Tensor::f32("step_latents", vec![2, 1, 2, 2], (0..8).map(|v| v as f32 - 3.5).collect()),
                Tensor::f32("solver_previous", vec![2, 1, 2, 2], vec![f32::MIN_POSITIVE; 8]),
            ],
        }
    }

    /// A sweep deletes the checkpoints older than its bound and nothing else: not a younger
    /// checkpoint, not an image beside them.
    #[tokio::test]
    async fn a_sweep_deletes_checkpoints_older_than_its_bound_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("sluice-sweep-{}", Uuid::new_v4()));
        let images = ImageStore::from_url(&format!("file://{}", dir.display())).unwrap();
        let store = CheckpointStore::new(images.clone(), Metrics::new());
        let (old, young) = (Uuid::now_v7(), Uuid::now_v7());
        for task_id in [old, young] {
            store.put(&Owner { task_id, ..owner() }, &resume()).await.unwrap();
        }
        images.write(&format!("{old}/0.png"), Bytes::from_static(b"png")).await.unwrap();
        let two_days_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(2 * 86_400);
        let file = dir.join(format!("checkpoints/{old}/1/000007.ckpt"));
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(two_days_ago)
            .unwrap();
        let day = std::time::Duration::from_secs(86_400);
        let swept = sweep(&images, day).await.unwrap();
        assert_eq!((swept.deleted, swept.kept), (1, 1));
        assert!(swept.deleted_bytes > 0);
        assert!(!file.exists() && dir.join(format!("checkpoints/{young}/1/000007.ckpt")).exists());
        assert!(dir.join(format!("{old}/0.png")).exists(), "an image is not a checkpoint");
        assert_eq!(
            sweep(&images, day).await.unwrap(),
            Swept {
                kept: 1,
                ..Swept::default()
            }
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    /// An attempt carries on from its own checkpoints only: a redriven task (attempt 2) finds
    /// none of attempt 1's and starts from its first step; its own are found; a succeeded task's
    /// checkpoints of every attempt are deleted.
    #[tokio::test]
    async fn an_attempt_carries_on_from_its_own_checkpoints_only_and_all_go_with_the_task() {
        let dir = std::env::temp_dir().join(format!("sluice-attempts-{}", Uuid::new_v4()));
        let images = ImageStore::from_url(&format!("file://{}", dir.display())).unwrap();
        let store = CheckpointStore::new(images, Metrics::new());
        let task_id = Uuid::now_v7();
        let first = Owner { task_id, ..owner() };
        let second = Owner {
            attempt: 2,
            ..first.clone()
        };
        store.put(&first, &resume()).await.unwrap();
        store.put(&first, &Resume { step: 9, ..resume() }).await.unwrap();
        assert!(dir.join(format!("checkpoints/{task_id}/1/000009.ckpt")).exists());
        let (found, stored) = store.latest(&second).await.unwrap();
        assert_eq!((found, stored), (None, 0), "attempt 1's are not attempt 2's");
        store.put(&second, &Resume { step: 3, ..resume() }).await.unwrap();
        let (found, stored) = store.latest(&second).await.unwrap();
        assert_eq!((found.map(|r| r.step), stored), (Some(3), 1));
        let (found, stored) = store.latest(&first).await.unwrap();
        assert_eq!((found.map(|r| r.step), stored), (Some(9), 2), "the latest of attempt 1");
        store.delete(task_id).await.unwrap();
        for owner in [&first, &second] {
            assert_eq!(store.latest(owner).await.unwrap(), (None, 0));
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_checkpoint_reads_back_as_written() {
        let bytes = encode(&owner(), &resume()).unwrap();
        let back = decode(&bytes, &owner()).unwrap();
        assert_eq!(back.step, 7);
        assert_eq!(back.carried, resume().carried);
    }

    #[test]
    fn a_checkpoint_of_another_task_bucket_or_version_or_with_a_changed_byte_is_refused() {
        let bytes = encode(&owner(), &resume()).unwrap();
        let other = |change: &dyn Fn(&mut Owner)| {
            let mut o = owner();
            change(&mut o);
            decode(&bytes, &o).unwrap_err()
        };
        assert!(other(&|o| o.task_id = Uuid::max()).contains("written for"));
        assert!(other(&|o| o.bucket = "64x64:euler:25:cfg".into()).contains("written for"));
        assert!(other(&|o| o.model = "sdxl".into()).contains("written for"));
        assert!(other(&|o| o.attempt = 2).contains("written for"));
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(decode(&flipped, &owner()).unwrap_err().contains("sha256"));
        let newer = String::from_utf8_lossy(&bytes).replacen("\"version\":2", "\"version\":3", 1);
        assert!(decode(newer.as_bytes(), &owner()).is_err());
        assert!(decode(b"PNG...", &owner()).unwrap_err().contains("magic"));
        assert!(decode(&bytes[..bytes.len() - 4], &owner()).is_err(), "a truncated payload");
    }
}
