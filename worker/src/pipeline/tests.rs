//! Unit tests of `pipeline`.

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures::future::BoxFuture;
use sluice_schemas::CompletionEvent;
use uuid::Uuid;

use std::time::Duration;

use chrono::Utc;
use tokio::sync::mpsc;

use super::*;
use crate::batching::adaptive::BatchSize;
use crate::batching::batcher::{Admission, Batcher};
use crate::engine::{Engine, SessionOptions};
use crate::models::Registry;
use crate::models::serving::Health;
use crate::outcome::OutcomeSettings;
use crate::outcome::failure::Failure;
use crate::outcome::publish::{Publish, PublishError};
use crate::source::offsets::TopicPartition;
use crate::source::record::Record;
use crate::source::redelivery::RedeliveryCheck;
use crate::testing::fake::{Device, ERROR_SEED, FakeModel, PANIC_SEED};

/// What the recording publisher saw: per offset, the kind of record, whether the record was
/// still unacknowledged then, and the partition's commit candidate at that moment.
#[derive(Debug, Clone, PartialEq)]
struct Published {
    offset: i64,
    kind: &'static str,
    pending: bool,
    commit_at_publish: Option<i64>,
}

struct Recorder {
    offsets: Arc<Offsets>,
    seen: Mutex<Vec<Published>>,
}

impl Recorder {
    fn note(&self, tp: TopicPartition, offset: i64, kind: &'static str) {
        let commit_at_publish = self.offsets.commit_candidates().first().map(|c| c.offset);
        self.seen.lock().unwrap().push(Published {
            offset,
            kind,
            pending: self.offsets.is_pending(&tp, offset),
            commit_at_publish,
        });
    }
}

impl Publish for Recorder {
    fn completion<'a>(
        &'a self,
        _origin: &'a crate::source::record::Origin,
        event: &'a CompletionEvent,
        _trace: Option<&'a crate::outcome::publish::TraceHeaders>,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        let kind = event.status.as_str();
        let tp = TopicPartition {
            topic: event.source.topic.as_str().into(),
            partition: event.source.partition,
        };
        self.note(tp, event.source.offset, kind);
        Box::pin(async { Ok(()) })
    }

    fn dead_letter<'a>(&'a self, record: &'a Record, _: &'a Failure, _: Option<Uuid>) -> BoxFuture<'a, Result<(), PublishError>> {
        self.note(TopicPartition::of(&record.origin), record.origin.offset, "dlq");
        Box::pin(async { Ok(()) })
    }
}

/// Every record is a first delivery (this test is about ordering, not redelivery).
struct NeverStarted;

impl RedeliveryCheck for NeverStarted {
    fn admit<'a>(&'a self, _: &'a crate::source::record::Origin, _: bool) -> BoxFuture<'a, bool> {
        Box::pin(async { false })
    }
}

fn record(offsets: &Offsets, tp: &TopicPartition, offset: i64, value: Vec<u8>) -> Record {
    Record {
        origin: offsets.track(tp, offset).expect("assigned"),
        key: None,
        value,
        headers: vec![("sluice-schema-version".into(), Some(b"1".to_vec()))],
        timestamp_ms: None,
        received_at: std::time::Instant::now(),
    }
}

fn task(seed: u64, images: u32) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "version": 1, "task_id": Uuid::now_v7(), "submitted_at": Utc::now(), "tenant": "t", "user": null, "model": "terrain",
        "request": {"prompt": "", "negative_prompt": "", "steps": 1, "guidance_scale": 1.0, "seed": seed, "sampler": "onestep",
                    "width": 128, "height": 128, "num_images": images, "params": {}}
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_finish_out_of_order_and_offsets_are_acknowledged_only_after_their_outcome() {
    let dir = std::env::temp_dir().join(format!("sluice-pipeline-{}", Uuid::new_v4()));
    std::fs::create_dir_all(dir.join("models/terrain")).unwrap();
    std::fs::write(dir.join("models/terrain/model.onnx"), b"fake").unwrap();
    let metrics = Metrics::new();
    let offsets = Arc::new(Offsets::new());
    let tp = TopicPartition {
        topic: "tasks".into(),
        partition: 0,
    };
    offsets.assign(std::slice::from_ref(&tp));
    offsets.lease_known(std::slice::from_ref(&tp));
    let recorder = Arc::new(Recorder {
        offsets: offsets.clone(),
        seen: Mutex::new(Vec::new()),
    });
    // A device of 6 rows, two engine threads: batches of three buckets (1, 2, 3 images per
    // task) finish at different times, and some halve.
    let engine = Engine::start(2);
    let registry = Registry::default().with(
        "terrain",
        Arc::new(FakeModel {
            device: Device::new(6, Duration::from_millis(5)),
        }),
    );
    let (health, _) = tokio::sync::watch::channel(Health::default());
    let serving = Serving::start(
        engine.clone(),
        None,
        &registry,
        &[("terrain".to_owned(), dir.join("models/terrain"))],
        SessionOptions::default(),
        metrics.clone(),
        health,
        crate::models::serving::ReloadLimits {
            min_free_bytes: 0,
            leak_bound_bytes: u64::MAX / 2,
        },
    )
    .await
    .unwrap();
    let sink = ImageStore::from_url(&format!("file://{}", dir.join("out").display())).unwrap();
    let adaptive = Arc::new(Adaptive::new(
        engine.clone(),
        BatchSize {
            max_tasks: 4,
            max_rows: 64,
        },
        4,
        true,
        metrics.clone(),
    ));
    let tasks = TaskTracker::new();
    let abandon = CancellationToken::new();
    let outcomes = Outcomes::new(OutcomeSettings {
        offsets: offsets.clone(),
        publisher: recorder.clone(),
        metrics: metrics.clone(),
        worker_id: "w".into(),
        group: "g".into(),
        retry: RetryPolicy::forever(Duration::from_millis(1)),
        abandon: abandon.clone(),
        tasks: tasks.clone(),
    });
    let serving = Arc::new(serving);
    let crash_guard = Arc::new(CrashGuard::new(offsets.clone(), 0));
    let store = Arc::new(RetriedStore {
        images: sink,
        inputs: None,
        retry: RetryPolicy {
            max_attempts: 3,
            max_elapsed: Duration::from_secs(5),
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(2),
        },
        metrics: metrics.clone(),
        abandon,
    });
    let decode_stage = Arc::new(DecodeStage {
        offsets: offsets.clone(),
        redelivery: Arc::new(NeverStarted),
        running: Arc::default(),
        crash_guard: crash_guard.clone(),
        serving: serving.clone(),
        catalog: Arc::new(sluice_schemas::Catalog::default()),
        max_task_bytes: 1 << 20,
        store: store.clone(),
        outcomes: outcomes.clone(),
        tasks: tasks.clone(),
    });
    let engine_stage = Arc::new(EngineStage {
        offsets: offsets.clone(),
        cancellations: Default::default(),
        serving,
        adaptive: adaptive.clone(),
        crash_guard,
        progress: None,
        outcomes: outcomes.clone(),
        tasks: tasks.clone(),
        finish: Arc::new(FinishStage {
            permits: Semaphore::new(8),
            store,
            outcomes,
            worker_id: "w".into(),
        }),
    });
    let (record_tx, record_rx) = mpsc::channel(256);
    let (job_tx, job_rx) = mpsc::channel(256);
    let (batcher, requests) = Batcher::new(job_rx, adaptive, Duration::from_millis(5), Admission::for_slots(2));
    let stages = [
        tokio::spawn(decode(record_rx, job_tx, decode_stage)),
        tokio::spawn(batcher.run()),
        tokio::spawn(super::engine(requests, engine_stage)),
    ];

    // 60 records: tasks of 1-3 images, a task whose model code panics, one it fails on, a
    // record that is not JSON and one over the size limit.
    let mut expected = BTreeMap::new();
    for offset in 0..60i64 {
        let (value, kind) = match offset {
            13 => (task(PANIC_SEED, 1), "dlq"),
            29 => (task(ERROR_SEED, 2), "dlq"),
            41 => (b"{not json".to_vec(), "dlq"),
            50 => (vec![b' '; (1 << 20) + 1], "dlq"),
            _ => (task(offset as u64, 1 + (offset % 3) as u32), "succeeded"),
        };
        expected.insert(offset, kind);
        record_tx.send(record(&offsets, &tp, offset, value)).await.unwrap();
    }
    drop(record_tx);
    for stage in stages {
        stage.await.unwrap();
    }
    tasks.close();
    tokio::time::timeout(Duration::from_secs(30), tasks.wait()).await.unwrap();

    let seen = recorder.seen.lock().unwrap().clone();
    // Every record has exactly one outcome of the expected kind (a failed task's DLQ record
    // comes with a failed completion; an undecodable record has no task to complete).
    for (offset, kind) in &expected {
        let outcomes: Vec<&str> = seen.iter().filter(|p| p.offset == *offset).map(|p| p.kind).collect();
        let want: &[&str] = match (*kind, *offset) {
            ("dlq", 41 | 50) => &["dlq"],
            ("dlq", _) => &["dlq", "failed"],
            _ => &["succeeded"],
        };
        assert_eq!(outcomes, want, "offset {offset}");
    }
    // They finished out of order...
    let order: Vec<i64> = seen.iter().map(|p| p.offset).collect();
    assert!(
        order.windows(2).any(|w| w[1] < w[0]),
        "outcomes in offset order: the test proves nothing"
    );
    // ...yet no record was acknowledged before its outcome was published, and no offset was
    // committable past an unfinished record.
    for p in &seen {
        assert!(p.pending, "acknowledged before its outcome was published: {p:?}");
        assert!(p.commit_at_publish.is_none_or(|c| c <= p.offset), "{p:?}");
    }
    assert_eq!(offsets.in_flight(), 0);
    let at_end: Vec<_> = offsets.commit_candidates().into_iter().map(|c| (c.tp, c.offset)).collect();
    assert_eq!(at_end, vec![(tp, 60)], "everything committable at the end");
    std::fs::remove_dir_all(dir).unwrap();
}
