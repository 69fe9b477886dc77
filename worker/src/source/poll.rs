//! The poll thread: reads the task topics, pauses and resumes each under backpressure, hands each
//! record to the pipeline, and leaves the group when told to.
//!
//! Each task topic (the tasks topic, and a lane's own topic where it has one:
//! `SLUICE_INTERACTIVE_TOPIC`, `SLUICE_BATCH_TOPIC`) is a work source of its own with its own
//! window of `max_in_flight` records: a backlog read from one never pauses the reading of
//! another, so an interactive task is read while a batch backlog fills its lane's window.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::TopicPartitionList;
use rdkafka::consumer::Consumer;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use sluice_service::backpressure::Backpressure;
use sluice_service::kafka_failure;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::TaskConsumer;
use super::offsets::{Offsets, TopicPartition};
use super::record::{Origin, Record};
use crate::events::{Emit, Paused, PollGap, RecordReceived};
use crate::metrics::Metrics;

/// Signals to the poll thread.
#[derive(Clone)]
pub(crate) struct SourceControl {
    /// Stop reading: pause everything and close the channel into the pipeline.
    pub stop_reading: CancellationToken,
    /// Leave: commit what is finished and leave the group.
    pub close: CancellationToken,
    /// Set by the poll loop when the consumer failed for good: the worker exits (crash-only)
    /// and its supervisor starts it again.
    pub fatal: CancellationToken,
}

/// The poll loop. Runs until `control.close`; then commits and leaves the group.
pub(crate) fn poll_loop(
    consumer: Arc<TaskConsumer>,
    offsets: Arc<Offsets>,
    tx: mpsc::Sender<Record>,
    control: SourceControl,
    max_in_flight: usize,
    metrics: Metrics,
) {
    let mut tx = Some(tx);
    let mut last_error_log: Option<Instant> = None;
    let mut windows: Vec<(String, Backpressure)> = consumer
        .context()
        .topics
        .iter()
        .map(|t| (t.clone(), Backpressure::new(max_in_flight)))
        .collect();
    let mut last_poll = Instant::now();
    while !control.close.is_cancelled() {
        PollGap { gap: last_poll.elapsed() }.emit(&metrics);
        last_poll = Instant::now();
        if tx.is_some() && control.stop_reading.is_cancelled() {
            tx = None; // closes the pipeline's input: the stages drain and end
            tracing::info!("stopped reading new tasks");
        }
        let one_topic = windows.len() == 1;
        for (topic, window) in &mut windows {
            let in_flight = if one_topic {
                offsets.in_flight()
            } else {
                offsets.in_flight_of(topic)
            };
            // Stopping: paused for good (nothing read now would be tracked).
            let counted = if tx.is_none() { usize::MAX } else { in_flight };
            if let Some(pause) = window.update(counted) {
                set_paused(&consumer, &metrics, topic, pause, in_flight);
            }
        }
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            // librdkafka's consumer is unusable after a fatal error; one seen here: a KIP-848
            // static member restarted before its previous instance's session expired
            // (UNRELEASED_INSTANCE_ID).
            Some(Err(e)) => {
                let failure = kafka_failure::classify(&e);
                if failure.ends_client() {
                    tracing::error!(error = %e, %failure, "the Kafka consumer failed for good; the worker exits");
                    control.fatal.cancel();
                    break;
                }
                if last_error_log.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!(error = %e, %failure, "consumer error");
                    last_error_log = Some(Instant::now());
                }
            }
            Some(Ok(message)) => {
                let Some(sender) = &tx else { continue }; // stopping: not tracked, read again later
                let tp = TopicPartition {
                    topic: message.topic().into(),
                    partition: message.partition(),
                };
                let Some(origin) = offsets.track(&tp, message.offset()) else {
                    continue;
                };
                RecordReceived.emit(&metrics);
                if sender.blocking_send(record_of(origin, &message)).is_err() {
                    tracing::warn!("pipeline input closed");
                    tx = None;
                }
            }
        }
    }
    leave(&consumer);
}

/// Pauses or resumes fetching from every assigned partition of `topic`.
fn set_paused(consumer: &TaskConsumer, metrics: &Metrics, topic: &str, pause: bool, in_flight: usize) {
    let paused_topics = {
        let mut paused = consumer.context().paused();
        if pause {
            paused.insert(topic.to_owned());
        } else {
            paused.remove(topic);
        }
        paused.len()
    };
    Paused {
        topic,
        paused: pause,
        in_flight,
        paused_topics,
    }
    .emit(metrics);
    if let Ok(assignment) = consumer.assignment() {
        let mut partitions = TopicPartitionList::new();
        for e in assignment.elements().iter().filter(|e| e.topic() == topic) {
            partitions.add_partition(topic, e.partition());
        }
        let r = if pause {
            consumer.pause(&partitions)
        } else {
            consumer.resume(&partitions)
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, pause, "pause/resume failed");
        }
    }
}

/// A message read, as the pipeline's record of it.
fn record_of(origin: Origin, message: &BorrowedMessage<'_>) -> Record {
    let headers = message
        .headers()
        .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec))).collect())
        .unwrap_or_default();
    Record {
        origin,
        key: message.key().map(<[u8]>::to_vec),
        value: message.payload().map(<[u8]>::to_vec).unwrap_or_default(),
        headers,
        timestamp_ms: message.timestamp().to_millis(),
        received_at: Instant::now(),
    }
}

/// Leaves the group; the revoke callback runs during the following polls and commits what is
/// finished (the caller bounds how long it waits for this thread).
fn leave(consumer: &TaskConsumer) {
    consumer.unsubscribe();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && consumer.assignment().map(|a| a.count() > 0).unwrap_or(false) {
        let _ = consumer.poll(Duration::from_millis(100));
    }
}
