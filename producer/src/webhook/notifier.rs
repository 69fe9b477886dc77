//! The notifier: a consumer group over the progress, completion and retry topics that delivers
//! each record's webhook event, commits in order, schedules retries and keeps tenants fair
//! (see the module above for the whole design).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Map, Value};
use sluice_schemas::{
    CompletionEvent, CompletionStatus, HEADER_SCHEMA_VERSION, ProgressEvent, ProgressRecord, SCHEMA_VERSION, WebhookDelivery,
    WebhookDlqRecord, WebhookEvent, WebhookFailure,
};
use sluice_service::backpressure::Backpressure;
use sluice_service::ordered_acks::OrderedAcks;
use thiserror::Error;
use tokio::sync::Semaphore;
use uuid::Uuid;

use super::delivery::{Attempt, Deliverer, Request, host_of};
use super::schedule::RetrySchedule;
use super::{fair, order, signing};
use crate::events::{
    Emit, WebhookAttempted, WebhookDeferred, WebhookDelivered, WebhookDropped, WebhookFirstAttempt, WebhookGivenUp, WebhookNotSent,
    WebhookPending, WebhookRetryDue, WebhookRetrying,
};
use crate::metrics::Metrics;
use crate::presign::Presigner;
use crate::status::{CaughtUp, Change, StatusStore, TaskStatus};

/// At most one `progress` delivery per task this often.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);
/// How long an event waits for the status view to read its task's record.
const VIEW_WAIT: Duration = Duration::from_secs(10);
/// Events older than this whose task the view does not know are skipped at once (the task is
/// past the view's retention, or had no record).
const RECENT: chrono::TimeDelta = chrono::TimeDelta::seconds(60);

/// What can keep the notifier from starting.
#[derive(Debug, Error)]
pub enum NotifierError {
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    #[error("the webhook retry topic {0} has no partitions (create it first)")]
    NoRetryPartitions(String),
}

/// The notifier's settings.
pub struct Settings {
    pub group: String,
    pub instance_id: Option<String>,
    pub progress_topic: String,
    pub completions_topic: String,
    pub retry_topic: String,
    pub dlq_topic: String,
    pub schedule: RetrySchedule,
    pub concurrency: usize,
    pub max_pending: usize,
}

/// What the notifier does with one consumed record.
enum Job {
    /// An event of a task, first attempt.
    Event {
        event: WebhookEvent,
        change: Box<Change>,
        task_id: Uuid,
        step: u32,
        at: chrono::DateTime<Utc>,
    },
    /// A pending retry.
    Retry(Box<WebhookDelivery>),
    Nothing,
}

/// Offsets consumed but not yet finished, per partition, kept in the shared [`OrderedAcks`]: a
/// partition's offset to commit is its committable one, the lowest still pending or one past the
/// highest read. `epoch` changes when a partition is read again from an earlier offset (it was
/// revoked and assigned back): finishes of the older reading are ignored.
#[derive(Default)]
struct Tracker {
    partitions: HashMap<(String, i32), Reading>,
    /// The last epoch handed out.
    epoch: u64,
}

/// One partition's current reading: its epoch, and its offsets read and not finished.
struct Reading {
    epoch: u64,
    acks: OrderedAcks<()>,
}

impl Reading {
    /// A reading from scratch, under the next epoch.
    fn new(epoch: &mut u64) -> Reading {
        *epoch += 1;
        Reading {
            epoch: *epoch,
            acks: OrderedAcks::new(),
        }
    }
}

impl Tracker {
    /// Records that `offset` was read; returns the epoch of the reading it belongs to. An offset
    /// below the partition's next one starts a fresh reading.
    fn begin(&mut self, topic: &str, partition: i32, offset: i64) -> u64 {
        let reading = self
            .partitions
            .entry((topic.to_owned(), partition))
            .or_insert_with(|| Reading::new(&mut self.epoch));
        if reading.acks.next().is_some_and(|next| offset < next) {
            *reading = Reading::new(&mut self.epoch);
        }
        // Never already pending: within a reading, offsets are read in increasing order.
        reading.acks.read(offset, ());
        reading.epoch
    }

    /// Marks `offset` finished; returns the offset to store for commit when this finish moved it
    /// (never for a finish of an older reading, or of an offset not pending).
    fn finish(&mut self, topic: &str, partition: i32, offset: i64, epoch: u64) -> Option<i64> {
        let reading = self.partitions.get_mut(&(topic.to_owned(), partition))?;
        if reading.epoch != epoch {
            return None;
        }
        let before = reading.acks.committable();
        reading.acks.finish(offset)?;
        let after = reading.acks.committable();
        after.filter(|_| after != before)
    }

    /// How many offsets are read and not finished, over all partitions.
    fn pending(&self) -> usize {
        self.partitions.values().map(|p| p.acks.len()).sum()
    }
}

pub struct Notifier {
    settings: Settings,
    consumer: StreamConsumer,
    producer: FutureProducer,
    deliverer: Deliverer,
    store: Arc<StatusStore>,
    presigner: Arc<Presigner>,
    metrics: Metrics,
    permits: Semaphore,
    tracker: Mutex<Tracker>,
    order: order::EventOrder,
    retry_partitions: usize,
    shares: fair::Shares,
}

/// A retry partition paused at a record that is not due yet.
struct Waiting {
    offset: i64,
    due: Instant,
}

/// Retry records due sooner than this are waited for in memory rather than by pausing.
const WAIT_IN_MEMORY: Duration = Duration::from_millis(200);

/// What `Notifier::run` keeps from one record to the next.
struct Consuming {
    backpressure: Backpressure,
    /// Retry partitions paused at a record not due yet.
    waiting: HashMap<i32, Waiting>,
    /// Every partition paused now.
    paused_now: HashSet<(String, i32)>,
    /// Whether `waiting` changed since the pauses were last applied.
    pauses_changed: bool,
    /// When a consume error was last logged.
    last_warning: Option<Instant>,
    /// The assignment last logged, and when the assignment was last looked at.
    last_assignment: Vec<String>,
    last_assignment_check: Instant,
}

impl Consuming {
    /// Nothing paused or logged yet; fetching stops past `max_pending` records in flight.
    fn new(max_pending: usize) -> Consuming {
        Consuming {
            backpressure: Backpressure::new(max_pending),
            waiting: HashMap::new(),
            paused_now: HashSet::new(),
            pauses_changed: false,
            last_warning: None,
            last_assignment: Vec::new(),
            last_assignment_check: Instant::now() - Duration::from_secs(60),
        }
    }

    /// Logs a consume error, unless one was logged in the last 30 s.
    fn consume_error(&mut self, e: &KafkaError) {
        if self.last_warning.is_none_or(|t: Instant| t.elapsed() >= Duration::from_secs(30)) {
            self.last_warning = Some(Instant::now());
            let failure = sluice_service::kafka_failure::classify(e);
            tracing::warn!(error = %e, %failure, "webhook notifier: consume error (repeats are not logged for 30 s)");
        }
    }
}

impl Notifier {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: Settings,
        kafka: &sluice_service::kafka::KafkaClientArgs,
        deliverer: Deliverer,
        store: Arc<StatusStore>,
        presigner: Arc<Presigner>,
        metrics: Metrics,
    ) -> Result<Notifier, NotifierError> {
        let mut consumer_settings = vec![
            ("group.id", settings.group.as_str()),
            // Offsets are committed explicitly, each as soon as the records before it finished.
            ("enable.auto.commit", "false"),
            ("auto.offset.reset", "earliest"),
            // Only completions of committed worker transactions are announced (exactly-once
            // delivery); an aborted one's records are skipped.
            ("isolation.level", "read_committed"),
            ("partition.assignment.strategy", "cooperative-sticky"),
            ("session.timeout.ms", "10000"),
            ("heartbeat.interval.ms", "1000"),
            ("max.poll.interval.ms", "30000"),
            ("fetch.wait.max.ms", "100"),
        ];
        if let Some(id) = &settings.instance_id {
            consumer_settings.push(("group.instance.id", id.as_str()));
        }
        let consumer: StreamConsumer = kafka.config(&consumer_settings).create()?;
        let producer: FutureProducer = kafka.producer_config("sluice-webhooks", 30_000, 5).create()?;
        let retry_partitions = consumer
            .fetch_metadata(Some(&settings.retry_topic), Duration::from_secs(10))
            .ok()
            .and_then(|m| m.topics().first().map(|t| t.partitions().len()))
            .unwrap_or(0);
        if retry_partitions == 0 {
            return Err(NotifierError::NoRetryPartitions(settings.retry_topic.clone()));
        }
        if retry_partitions < settings.schedule.tiers() {
            tracing::warn!(
                topic = %settings.retry_topic,
                partitions = retry_partitions,
                delays = settings.schedule.tiers(),
                "the webhook retry topic has fewer partitions than the schedule has delays: long retries may hold up short ones"
            );
        }
        Ok(Notifier {
            // A tenant may hold half the attempts in flight; a host four times its connections.
            shares: fair::Shares::new(settings.concurrency / 2, deliverer.host_concurrency() * 4),
            permits: Semaphore::new(settings.concurrency.max(1)),
            settings,
            consumer,
            producer,
            deliverer,
            store,
            presigner,
            metrics,
            tracker: Mutex::default(),
            order: order::EventOrder::new(PROGRESS_INTERVAL),
            retry_partitions,
        })
    }

    /// Consumes and delivers until `shutdown` resolves. Starts once the status view has caught
    /// up with its topics (before that, a task's webhook may not be known yet).
    pub async fn run(self: Arc<Self>, caught_up: CaughtUp, shutdown: impl std::future::Future<Output = ()>) -> Result<(), KafkaError> {
        tokio::pin!(shutdown);
        while !caught_up.get() {
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
        self.subscribe()?;
        let mut state = Consuming::new(self.settings.max_pending);
        loop {
            self.update_pauses(&mut state);
            self.log_assignment(&mut state);
            let message = tokio::select! {
                _ = &mut shutdown => break,
                m = tokio::time::timeout(Duration::from_millis(200), self.consumer.recv()) => m,
            };
            match message {
                Err(_) => {}
                Ok(Err(e)) => {
                    state.consume_error(&e);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ok(Ok(m)) => self.take(m, &mut state),
            }
        }
        Ok(())
    }

    /// Subscribes to the completion, progress and retry topics.
    fn subscribe(&self) -> Result<(), KafkaError> {
        let s = &self.settings;
        self.consumer
            .subscribe(&[s.completions_topic.as_str(), s.progress_topic.as_str(), s.retry_topic.as_str()])?;
        tracing::info!(group = %s.group, "webhook notifier consuming");
        Ok(())
    }

    /// Reports the records in flight, and pauses or resumes partitions when backpressure or a
    /// retry partition's wait changed, or a wait is over.
    fn update_pauses(&self, state: &mut Consuming) {
        let pending = self.tracker.lock().expect("not poisoned").pending();
        WebhookPending { records: pending }.emit(&self.metrics);
        // Bounded memory: past max_pending, stop fetching (still polling, to stay in the
        // group) until half of it has finished.
        let changed = state.backpressure.update(pending).is_some();
        let now = Instant::now();
        if changed || state.pauses_changed || state.waiting.values().any(|w| w.due <= now) {
            state.waiting.retain(|_, w| w.due > now);
            state.pauses_changed = false;
            self.apply_pauses(state.backpressure.is_paused(), &state.waiting, &mut state.paused_now);
        }
    }

    /// Logs the partitions assigned when they changed, looking every 5 s.
    fn log_assignment(&self, state: &mut Consuming) {
        if state.last_assignment_check.elapsed() >= Duration::from_secs(5) {
            state.last_assignment_check = Instant::now();
            if let Ok(assignment) = self.consumer.assignment() {
                let mut owned: Vec<String> = assignment
                    .elements()
                    .iter()
                    .map(|e| format!("{}/{}", e.topic(), e.partition()))
                    .collect();
                owned.sort();
                if owned != state.last_assignment {
                    tracing::info!(partitions = %owned.join(","), "webhook notifier assignment");
                    state.last_assignment = owned;
                }
            }
        }
    }

    /// Takes one consumed record: skipped while its retry partition waits, its partition paused
    /// at it when it is a retry not due yet, else its job started.
    fn take(self: &Arc<Self>, message: BorrowedMessage<'_>, state: &mut Consuming) {
        let (topic, partition, offset) = (message.topic().to_owned(), message.partition(), message.offset());
        tracing::debug!(topic, partition, offset, "webhook notifier: record");
        if topic == self.settings.retry_topic && state.waiting.get(&partition).is_some_and(|w| offset >= w.offset) {
            return; // fetched before the pause; read again once the partition is due
        }
        let job = self.job_of(&message);
        if let Job::Retry(d) = &job
            && let Ok(wait) = (d.due_at - Utc::now()).to_std()
            && wait > WAIT_IN_MEMORY
            && self.wait_for_head(&topic, partition, offset, wait, state)
        {
            return;
        }
        let traceparent = child_traceparent(&message);
        drop(message);
        self.start(job, topic, partition, offset, traceparent);
    }

    /// Pauses a retry partition at its record at `offset`, not due for `wait`, rather than hold
    /// the record in memory; false when the partition could not be sought back (it waits in
    /// memory then).
    fn wait_for_head(&self, topic: &str, partition: i32, offset: i64, wait: Duration, state: &mut Consuming) -> bool {
        match self
            .consumer
            .seek(topic, partition, rdkafka::Offset::Offset(offset), Duration::from_secs(1))
        {
            Ok(()) => {
                tracing::debug!(partition, offset, ?wait, "webhook notifier: retry partition waits for its head");
                state.waiting.insert(
                    partition,
                    Waiting {
                        offset,
                        due: Instant::now() + wait,
                    },
                );
                state.pauses_changed = true;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, partition, "webhook notifier: could not seek a retry partition back; waiting in memory");
                false
            }
        }
    }

    /// Starts a record's job: finished at once when there is nothing to do, else handled on a
    /// task of its own and finished after.
    fn start(self: &Arc<Self>, job: Job, topic: String, partition: i32, offset: i64, traceparent: Option<String>) {
        if matches!(job, Job::Nothing) {
            self.finish(&topic, partition, offset, None);
            return;
        }
        let epoch = self.tracker.lock().expect("not poisoned").begin(&topic, partition, offset);
        let this = self.clone();
        tokio::spawn(async move {
            this.handle(job, traceparent.as_deref()).await;
            this.finish(&topic, partition, offset, Some(epoch));
        });
    }

    /// Pauses every assigned partition (`all`: too much in flight) or only the retry partitions
    /// waiting for their heads, and resumes the rest of those paused before.
    fn apply_pauses(&self, all: bool, waiting: &HashMap<i32, Waiting>, paused_now: &mut HashSet<(String, i32)>) {
        let Ok(assignment) = self.consumer.assignment() else { return };
        let assigned: HashSet<(String, i32)> = assignment
            .elements()
            .iter()
            .map(|e| (e.topic().to_owned(), e.partition()))
            .collect();
        let want: HashSet<(String, i32)> = assigned
            .iter()
            .filter(|(t, p)| all || (*t == self.settings.retry_topic && waiting.contains_key(p)))
            .cloned()
            .collect();
        let list = |set: &mut dyn Iterator<Item = &(String, i32)>| {
            let mut tpl = rdkafka::TopicPartitionList::new();
            for (t, p) in set {
                tpl.add_partition(t, *p);
            }
            tpl
        };
        let pause = list(&mut want.difference(paused_now));
        let resume = list(&mut paused_now.difference(&want).filter(|tp| assigned.contains(*tp)));
        let paused_ok = pause.count() == 0 || self.consumer.pause(&pause).is_ok();
        let resumed_ok = resume.count() == 0 || self.consumer.resume(&resume).is_ok();
        if paused_ok && resumed_ok {
            *paused_now = want;
        } else {
            tracing::warn!("webhook notifier: pausing or resuming partitions failed; trying again");
        }
    }

    fn finish(&self, topic: &str, partition: i32, offset: i64, epoch: Option<u64>) {
        let next = match epoch {
            Some(epoch) => self.tracker.lock().expect("not poisoned").finish(topic, partition, offset, epoch),
            None => {
                // Nothing to do for this record: it is finished unless an earlier one is pending.
                let mut tracker = self.tracker.lock().expect("not poisoned");
                let epoch = tracker.begin(topic, partition, offset);
                tracker.finish(topic, partition, offset, epoch)
            }
        };
        if let Some(next) = next {
            let mut list = rdkafka::TopicPartitionList::new();
            let committed = list
                .add_partition_offset(topic, partition, rdkafka::Offset::Offset(next))
                .and_then(|_| self.consumer.commit(&list, rdkafka::consumer::CommitMode::Async));
            if let Err(e) = committed {
                tracing::debug!(error = %e, topic, partition, "webhook notifier: committing an offset (partition revoked?)");
            }
        }
    }

    fn job_of(&self, message: &BorrowedMessage<'_>) -> Job {
        let Some(payload) = message.payload() else {
            return Job::Nothing;
        };
        let s = &self.settings;
        if message.topic() == s.completions_topic {
            match serde_json::from_slice::<CompletionEvent>(payload) {
                Ok(c) => Job::Event {
                    event: WebhookEvent::Completed,
                    task_id: c.task_id,
                    // Each outcome of an attempt is its own event (succeeded keeps the ids of
                    // earlier releases): a receiver deduplicating by id never drops the one that
                    // stands because another outcome of the attempt came first.
                    step: match c.status {
                        CompletionStatus::Succeeded => 0,
                        CompletionStatus::Failed => 1,
                        CompletionStatus::Cancelled => 2,
                        CompletionStatus::Expired => 3,
                    },
                    at: c.completed_at,
                    change: Box::new(Change::Completed(c)),
                },
                Err(_) => Job::Nothing,
            }
        } else if message.topic() == s.progress_topic {
            match serde_json::from_slice::<ProgressRecord>(payload) {
                Ok(p) => Job::Event {
                    event: match p.event {
                        ProgressEvent::Started => WebhookEvent::Started,
                        ProgressEvent::Step => WebhookEvent::Progress,
                    },
                    task_id: p.task_id,
                    step: p.step,
                    at: p.at,
                    change: Box::new(Change::Progress(p)),
                },
                Err(_) => Job::Nothing,
            }
        } else if message.topic() == s.retry_topic {
            match serde_json::from_slice::<WebhookDelivery>(payload) {
                Ok(d) => Job::Retry(Box::new(d)),
                Err(e) => {
                    tracing::warn!(error = %e, "webhook notifier: unreadable retry record skipped");
                    Job::Nothing
                }
            }
        } else {
            Job::Nothing
        }
    }

    async fn handle(&self, job: Job, traceparent: Option<&str>) {
        match job {
            Job::Nothing => {}
            Job::Event {
                event,
                change,
                task_id,
                step,
                at,
            } => {
                let Some((tenant, url, status)) = self.target(task_id, event, &change, at).await else {
                    return;
                };
                if let Change::Completed(c) = &*change
                    && status.status != c.status.into()
                {
                    // An outcome that does not stand (the attempt succeeded already): the view
                    // and the receiver agree on the one that does.
                    WebhookNotSent {
                        event,
                        outcome: "superseded",
                    }
                    .emit(&self.metrics);
                    return;
                }
                // The task's events take turns; `completed` is the last one a receiver gets.
                let turn = self.order.turn(task_id);
                let _turn = turn.lock().await;
                let refused = match self.order.admit(task_id, event, step) {
                    order::Verdict::Send => None,
                    order::Verdict::Throttled => Some("throttled"),
                    order::Verdict::Superseded => Some("superseded"),
                };
                if let Some(outcome) = refused {
                    WebhookNotSent { event, outcome }.emit(&self.metrics);
                    return;
                }
                // The attempt the event belongs to: a completion names its own; the others are
                // of the attempt the view shows.
                let attempt = match &*change {
                    Change::Completed(c) => c.attempt,
                    _ => status.attempt,
                };
                let payload = match serde_json::to_value(&status) {
                    Ok(Value::Object(m)) => m,
                    _ => Map::new(),
                };
                let delivery = WebhookDelivery {
                    version: SCHEMA_VERSION,
                    event_id: signing::event_id(task_id, attempt, event, step),
                    event,
                    task_id,
                    tenant,
                    url,
                    attempt: 1,
                    due_at: Utc::now(),
                    first_attempt_at: Utc::now(),
                    last_error: String::new(),
                    payload,
                };
                WebhookFirstAttempt { at }.emit(&self.metrics);
                self.deliver(delivery, traceparent).await;
            }
            Job::Retry(delivery) => {
                let wait = (delivery.due_at - Utc::now()).to_std().unwrap_or_default();
                tokio::time::sleep(wait).await;
                WebhookRetryDue.emit(&self.metrics);
                self.deliver(*delivery, traceparent).await;
            }
        }
    }

    /// The tenant, URL and body of task `task_id`'s `event`, when its webhook wants it. Waits a
    /// little for the view to read the task's record when the event is recent.
    async fn target(
        &self,
        task_id: Uuid,
        event: WebhookEvent,
        change: &Change,
        at: chrono::DateTime<Utc>,
    ) -> Option<(String, String, TaskStatus)> {
        let started = Instant::now();
        loop {
            // A view read is disk I/O: on the blocking pool.
            let (store, c) = (self.store.clone(), change.clone());
            let read = tokio::task::spawn_blocking(move || store.with_webhook(task_id, &c))
                .await
                .unwrap_or_else(|e| Err(crate::status::StatusError::Store(e.to_string())));
            let may_wait = Utc::now() - at < RECENT && started.elapsed() < VIEW_WAIT;
            match read {
                // Known from its completion only (the completions topic read ahead of the
                // tasks topic): whether it has a webhook comes with its record.
                Ok(Some(t)) if t.awaiting_record && may_wait => {}
                Ok(Some(t)) => {
                    let webhook = t.webhook?;
                    return webhook.events.contains(&event).then_some((t.tenant, webhook.url, t.status));
                }
                Ok(None) if may_wait => {}
                Ok(None) => return None,
                Err(e) => tracing::warn!(error = %e, "webhook notifier: reading the status view"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One attempt at `delivery`, then whatever follows: done, a retry record, or the DLQ.
    async fn deliver(&self, delivery: WebhookDelivery, traceparent: Option<&str>) {
        let _share = match self.shares.take(&delivery.tenant, &host_of(&delivery.url)) {
            Ok(share) => share,
            Err(why) => return self.defer(delivery, why).await,
        };
        match self.attempt(&delivery, traceparent).await {
            Attempt::Delivered { status } => {
                WebhookDelivered {
                    event: delivery.event,
                    event_id: &delivery.event_id,
                    task_id: delivery.task_id,
                    status,
                    attempt: delivery.attempt,
                }
                .emit(&self.metrics);
            }
            Attempt::Retry {
                error,
                status,
                retry_after,
            } => self.retry(delivery, error, status, retry_after).await,
            Attempt::GiveUp { reason, error, status } => self.give_up(delivery, reason, error, status).await,
        }
    }

    /// Sends `delivery` once, its body presigned now, within the notifier's concurrency.
    async fn attempt(&self, delivery: &WebhookDelivery, traceparent: Option<&str>) -> Attempt {
        let event = delivery.event;
        let body = self.body(&delivery.payload).await;
        let started = Instant::now();
        let outcome = {
            let _permit = self.permits.acquire().await.expect("never closed");
            self.deliverer
                .attempt(&Request {
                    url: &delivery.url,
                    tenant: &delivery.tenant,
                    event_id: &delivery.event_id,
                    event,
                    body: &body,
                    traceparent,
                })
                .await
        };
        WebhookAttempted {
            event,
            elapsed: started.elapsed(),
        }
        .emit(&self.metrics);
        outcome
    }

    /// A failed attempt worth another: a `completed` event is scheduled again, or goes to the DLQ
    /// once its schedule is spent; other events are dropped.
    async fn retry(&self, delivery: WebhookDelivery, error: String, status: Option<u16>, retry_after: Option<Duration>) {
        let event = delivery.event;
        let next = if event == WebhookEvent::Completed {
            self.settings.schedule.next(delivery.attempt, retry_after)
        } else {
            None
        };
        match next {
            Some((delay, tier)) => self.schedule_retry(delivery, error, delay, tier).await,
            None if event == WebhookEvent::Completed => {
                self.dead_letter(delivery, WebhookFailure::Exhausted, error, status).await;
            }
            None => {
                WebhookDropped {
                    event,
                    event_id: &delivery.event_id,
                    error: &error,
                }
                .emit(&self.metrics);
            }
        }
    }

    /// Publishes the next attempt at `delivery` to the retry topic's partition for `tier`, due
    /// after `delay` and a little jitter.
    async fn schedule_retry(&self, delivery: WebhookDelivery, error: String, delay: Duration, tier: usize) {
        WebhookRetrying {
            event: delivery.event,
            event_id: &delivery.event_id,
            task_id: delivery.task_id,
            attempt: delivery.attempt,
            error: &error,
            delay,
        }
        .emit(&self.metrics);
        let jitter = delay.mul_f64(fastrand::f64() * 0.1);
        let retry = WebhookDelivery {
            attempt: delivery.attempt + 1,
            due_at: Utc::now() + chrono::Duration::from_std(delay + jitter).unwrap_or_default(),
            last_error: error,
            ..delivery
        };
        let partition = (tier % self.retry_partitions) as i32;
        self.publish(&self.settings.retry_topic, Some(partition), retry.task_id, &retry)
            .await;
    }

    /// An attempt not worth repeating: a `completed` event goes to the DLQ; others are counted
    /// as not sent.
    async fn give_up(&self, delivery: WebhookDelivery, reason: WebhookFailure, error: String, status: Option<u16>) {
        if delivery.event == WebhookEvent::Completed {
            self.dead_letter(delivery, reason, error, status).await;
        } else {
            WebhookNotSent {
                event: delivery.event,
                outcome: reason.as_str(),
            }
            .emit(&self.metrics);
        }
    }

    /// An attempt past its tenant's or host's share: a `completed` event goes to the retry
    /// topic's shortest tier without counting as an attempt; others are dropped.
    async fn defer(&self, delivery: WebhookDelivery, why: String) {
        WebhookDeferred {
            event: delivery.event,
            event_id: &delivery.event_id,
            task_id: delivery.task_id,
            why: &why,
        }
        .emit(&self.metrics);
        if delivery.event != WebhookEvent::Completed {
            return;
        }
        let delay = self.settings.schedule.shortest();
        let jitter = delay.mul_f64(fastrand::f64() * 0.5);
        let retry = WebhookDelivery {
            due_at: Utc::now() + chrono::Duration::from_std(delay + jitter).unwrap_or_default(),
            last_error: why,
            ..delivery
        };
        self.publish(&self.settings.retry_topic, Some(0), retry.task_id, &retry).await;
    }

    /// The payload as sent: its stored image URLs presigned for this attempt.
    async fn body(&self, payload: &Map<String, Value>) -> Vec<u8> {
        match serde_json::from_value::<TaskStatus>(Value::Object(payload.clone())) {
            Ok(mut status) => {
                self.presigner.sign(&mut status).await;
                serde_json::to_vec(&status).expect("status serializes")
            }
            Err(_) => serde_json::to_vec(payload).expect("JSON serializes"),
        }
    }

    async fn dead_letter(&self, delivery: WebhookDelivery, reason: WebhookFailure, error: String, status: Option<u16>) {
        WebhookGivenUp {
            event: delivery.event,
            event_id: &delivery.event_id,
            task_id: delivery.task_id,
            host: &host_of(&delivery.url),
            reason,
            error: &error,
        }
        .emit(&self.metrics);
        let record = WebhookDlqRecord {
            version: SCHEMA_VERSION,
            event_id: delivery.event_id,
            event: delivery.event,
            task_id: delivery.task_id,
            tenant: delivery.tenant,
            url: delivery.url,
            attempts: if reason == WebhookFailure::Refused && status.is_none() && delivery.attempt == 1 {
                0
            } else {
                delivery.attempt
            },
            first_attempt_at: delivery.first_attempt_at,
            failed_at: Utc::now(),
            reason,
            message: error,
            last_status: status,
            payload: delivery.payload,
        };
        self.publish(&self.settings.dlq_topic, None, record.task_id, &record).await;
    }

    /// Publishes `record` and waits for the broker's acknowledgement, retrying until it comes:
    /// the consumed record is finished (and its offset committed) only after.
    async fn publish(&self, topic: &str, partition: Option<i32>, task_id: Uuid, record: &impl serde::Serialize) {
        let payload = serde_json::to_vec(record).expect("record serializes");
        let key = task_id.to_string();
        let version = SCHEMA_VERSION.to_string();
        let mut backoff = Duration::from_millis(200);
        loop {
            let mut r = FutureRecord::to(topic)
                .key(&key)
                .payload(&payload)
                .headers(sluice_service::kafka::headers([(HEADER_SCHEMA_VERSION, Some(version.as_bytes()))]));
            if let Some(p) = partition {
                r = r.partition(p);
            }
            match self.producer.send(r, Duration::from_secs(30)).await {
                Ok(_) => return,
                Err((e, _)) => {
                    tracing::warn!(error = %e, topic, "webhook notifier: publishing failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
    }
}

/// The trace context a record's handling runs in: a child of the one its header carries.
fn child_traceparent(message: &BorrowedMessage<'_>) -> Option<String> {
    message
        .headers()
        .and_then(|h| h.iter().find(|h| h.key == sluice_service::trace::TRACEPARENT).and_then(|h| h.value))
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(sluice_service::trace::TraceContext::parse)
        .map(|t| t.child().header())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_stored_only_past_a_finished_prefix() {
        let mut t = Tracker::default();
        let e0 = t.begin("t", 0, 10);
        let e1 = t.begin("t", 0, 11);
        let e2 = t.begin("t", 0, 12);
        assert_eq!(e0, e1);
        assert_eq!(t.finish("t", 0, 11, e1), None, "10 is still pending");
        assert_eq!(t.finish("t", 0, 12, e2), None);
        assert_eq!(t.finish("t", 0, 10, e0), Some(13));
        assert_eq!(t.pending(), 0);
        // Read again from 12 (revoked and assigned back): the older reading's finishes are void.
        let stale = t.begin("t", 0, 14);
        let fresh = t.begin("t", 0, 12);
        assert_ne!(stale, fresh);
        assert_eq!(t.finish("t", 0, 14, stale), None);
        assert_eq!(t.finish("t", 0, 12, fresh), Some(13));
    }
}
