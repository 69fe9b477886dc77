//! Progress of multi-step tasks on `sluice.progress.v1`: `started` when a worker begins a task,
//! then `step n/N` at most once per [`THROTTLE`] per task (and always the last step). The engine
//! thread calls [`TaskProgress`] between sampler steps; it only puts a record on a channel, and
//! one publisher task sends them without waiting for acknowledgements (progress is advisory; the
//! completion or DLQ record is the outcome). The same object carries the task's cancellation
//! flag, which the UNet loop reads between steps.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use rdkafka::producer::{FutureProducer, FutureRecord};
use sluice_schemas::{ProgressEvent, ProgressRecord, SCHEMA_VERSION};
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::engine::TaskHooks;
use crate::outcome::publish::TraceHeaders;
use crate::source::cancellations::Cancellations;

/// At most one step record per task this often.
pub(crate) const THROTTLE: Duration = Duration::from_millis(500);

/// Where progress records go.
#[derive(Clone)]
pub(crate) struct ProgressSink {
    tx: mpsc::UnboundedSender<(ProgressRecord, Option<Arc<TraceHeaders>>)>,
    worker_id: String,
    cancellations: Cancellations,
}

impl ProgressSink {
    pub(crate) fn new(
        worker_id: String,
        cancellations: Cancellations,
    ) -> (ProgressSink, mpsc::UnboundedReceiver<(ProgressRecord, Option<Arc<TraceHeaders>>)>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            ProgressSink {
                tx,
                worker_id,
                cancellations,
            },
            rx,
        )
    }

    /// A task's hooks; publishes its `started` record, at step `from` of `steps` (0, or the step
    /// a task carries on from, its step checkpoint's). Its records carry the task's trace.
    pub(crate) fn start(&self, task_id: Uuid, model: &str, (from, steps): (u32, u32), trace: Option<TraceHeaders>) -> TaskProgress {
        let p = TaskProgress {
            sink: self.clone(),
            task_id,
            trace: trace.map(Arc::new),
            model: model.to_owned(),
            // The throttle counts from the start: a task shorter than it reports its start and
            // its last step only (two records, not three, for a quick SD-Turbo image).
            last: Mutex::new(Some(Instant::now())),
            cancelled: AtomicBool::new(false),
            handoff: None,
        };
        p.send(ProgressEvent::Started, from, steps);
        p
    }
}

/// One task's progress and cancellation flag.
pub(crate) struct TaskProgress {
    sink: ProgressSink,
    task_id: Uuid,
    trace: Option<Arc<TraceHeaders>>,
    model: String,
    last: Mutex<Option<Instant>>,
    cancelled: AtomicBool,
    /// Where to ask whether the task's record is being handed off, and the record.
    handoff: Option<(Arc<crate::source::offsets::Offsets>, crate::source::record::Origin)>,
}

impl TaskProgress {
    /// Asks `offsets` whether `origin` is being handed off ([`TaskHooks::handed_off`]).
    pub(crate) fn with_handoff(
        mut self,
        offsets: Arc<crate::source::offsets::Offsets>,
        origin: crate::source::record::Origin,
    ) -> TaskProgress {
        self.handoff = Some((offsets, origin));
        self
    }

    fn send(&self, event: ProgressEvent, step: u32, steps: u32) {
        let record = ProgressRecord {
            version: SCHEMA_VERSION,
            task_id: self.task_id,
            model: self.model.clone(),
            worker_id: self.sink.worker_id.clone(),
            event,
            step,
            steps,
            at: Utc::now(),
        };
        let _ = self.sink.tx.send((record, self.trace.clone()));
    }

    /// Asks the model to stop working on the task at its next step.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

impl TaskHooks for TaskProgress {
    fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed) || self.sink.cancellations.contains(&self.task_id)
    }

    fn progress(&self, step: usize, steps: usize) {
        let now = Instant::now();
        let mut last = self.last.lock().expect("not poisoned");
        if step < steps && last.is_some_and(|t| now.duration_since(t) < THROTTLE) {
            return;
        }
        *last = Some(now);
        self.send(ProgressEvent::Step, step as u32, steps as u32);
    }

    fn handed_off(&self) -> bool {
        self.handoff.as_ref().is_some_and(|(offsets, origin)| offsets.is_handed_off(origin))
    }
}

/// Sends progress records until every sink is dropped.
pub(crate) async fn publish(
    mut rx: mpsc::UnboundedReceiver<(ProgressRecord, Option<Arc<TraceHeaders>>)>,
    producer: FutureProducer,
    topic: String,
) {
    while let Some((record, trace)) = rx.recv().await {
        let payload = serde_json::to_vec(&record).expect("record serializes");
        let key = record.task_id.to_string();
        let mut message = FutureRecord::to(&topic).key(&key).payload(&payload);
        if let Some(t) = &trace {
            message = message.headers(sluice_service::kafka::headers(t.pairs()));
        }
        // Enqueue only: a full queue or an unreachable broker drops progress, never tasks.
        if let Err((e, _)) = producer.send_result(message) {
            tracing::debug!(error = %e, "progress record dropped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_throttled_but_the_last_one_always_goes_out() {
        let cancellations = Cancellations::default();
        let (sink, mut rx) = ProgressSink::new("w".into(), cancellations.clone());
        let p = sink.start(Uuid::nil(), "sd", (0, 30), None);
        for step in 1..=10 {
            p.progress(step, 30);
        }
        std::thread::sleep(THROTTLE + Duration::from_millis(20));
        for step in 11..=30 {
            p.progress(step, 30);
        }
        let records: Vec<ProgressRecord> = std::iter::from_fn(|| rx.try_recv().ok()).map(|(r, _)| r).collect();
        let events: Vec<(ProgressEvent, u32)> = records.iter().map(|r| (r.event, r.step)).collect();
        // Nothing within the first 500 ms but the start; then the first step after it; the last.
        assert_eq!(
            events,
            vec![(ProgressEvent::Started, 0), (ProgressEvent::Step, 11), (ProgressEvent::Step, 30)]
        );
        assert!(!p.cancelled());
        p.cancel();
        assert!(p.cancelled());
        // A cancel from the control topic reaches the task's hooks too.
        let other = sink.start(Uuid::now_v7(), "sd", (0, 4), None);
        assert!(!other.cancelled());
        cancellations.insert(other.task_id, "acme", chrono::Utc::now());
        assert!(other.cancelled());
    }
}
