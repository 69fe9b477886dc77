//! The producer of exactly-once transactions, served by the thread that runs them rather than
//! by a polling thread of its own.
//!
//! rdkafka's `FutureProducer` (a `ThreadedProducer` underneath) serves the producer's event
//! queue from a thread of its own, woken for every delivery report. A transactional producer
//! needs no such thread: its records are sent only inside a transaction, by one thread (the
//! worker's committer), which waits for their delivery before it commits anyway. So that thread
//! serves the queue while it waits ([`TransactionProducer::delivered`]); only an abort, whose
//! flush in librdkafka relies on another thread to serve the reports of the records it purges,
//! has a thread serve the queue meanwhile. Measured with `perf` under the pretrained terrain
//! model, exactly-once: the two producers' polling threads took ~100 of the ~12,500 samples of
//! a 15 s row on two cores, and are gone (docs/benchmarks.md).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::TopicPartitionList;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};

use crate::kafka_failure::{self, Failure};

/// How long [`TransactionProducer::delivered`] first waits between looks at the queue while
/// records are on their way (a delivery takes a few milliseconds on a local broker), doubling
/// up to [`DELIVERY_POLL_MAX`]: a record late by at most that, and a broker away for the 15 s a
/// record may take costs ~500 wake-ups a second, not thousands.
const DELIVERY_POLL: Duration = Duration::from_micros(100);
const DELIVERY_POLL_MAX: Duration = Duration::from_millis(2);

/// The first delivery failure since the transaction began.
#[derive(Default)]
struct Reports {
    failed: Mutex<Option<KafkaError>>,
}

impl ClientContext for Reports {}

impl ProducerContext for Reports {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((e, _)) = result {
            self.failed.lock().expect("delivery reports lock").get_or_insert_with(|| e.clone());
        }
    }
}

/// A producer of transactions, one at a time, from one thread (the committer's).
pub struct TransactionProducer {
    inner: BaseProducer<Reports>,
}

impl TransactionProducer {
    pub fn create(config: &ClientConfig) -> KafkaResult<TransactionProducer> {
        Ok(TransactionProducer {
            inner: config.create_with_context(Reports::default())?,
        })
    }

    pub fn init_transactions(&self, timeout: Duration) -> KafkaResult<()> {
        self.inner.init_transactions(timeout)
    }

    /// Begins a transaction, first serving what the queue still holds (the reports of an aborted
    /// transaction's records, errors logged while idle): a failure reported now is not this
    /// transaction's.
    pub fn begin_transaction(&self) -> KafkaResult<()> {
        if !self.serve_queue(Instant::now() + Duration::from_secs(1)) {
            tracing::warn!(
                outstanding = self.inner.in_flight_count(),
                "the transactional producer still counts records of an earlier transaction; beginning anyway"
            );
        }
        self.inner.context().failed.lock().expect("delivery reports lock").take();
        self.inner.begin_transaction()
    }

    /// Queues one record of the open transaction; [`Self::delivered`] waits for it.
    pub fn send(&self, topic: &str, key: Option<&[u8]>, payload: &[u8], headers: &OwnedHeaders) -> KafkaResult<()> {
        loop {
            let mut record = BaseRecord::<[u8], [u8]>::to(topic).payload(payload).headers(headers.clone());
            if let Some(key) = key {
                record = record.key(key);
            }
            match self.inner.send(record) {
                Ok(()) => return Ok(()),
                Err((e, _)) if kafka_failure::classify(&e) == Failure::QueueFull => {
                    self.inner.poll(Duration::from_millis(10));
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    /// Waits until every record sent is delivered and its report served (so the commit's own
    /// flush returns at once), at most `timeout`; the first delivery failure, if any.
    pub fn delivered(&self, timeout: Duration) -> KafkaResult<()> {
        if !self.serve_queue(Instant::now() + timeout) {
            return Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut));
        }
        match self.inner.context().failed.lock().expect("delivery reports lock").take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Serves the event queue until librdkafka counts nothing outstanding (messages on their
    /// way, reports and errors not served); false at `deadline` with some left. Each poll takes
    /// one event without waiting: rdkafka's `poll` with a timeout would wait out all of it.
    fn serve_queue(&self, deadline: Instant) -> bool {
        let mut wait = DELIVERY_POLL;
        loop {
            while self.inner.in_flight_count() > 0 {
                let before = self.inner.in_flight_count();
                self.inner.poll(Duration::ZERO);
                if self.inner.in_flight_count() >= before {
                    break; // nothing served: wait a little
                }
            }
            if self.inner.in_flight_count() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(wait);
            wait = (wait * 2).min(DELIVERY_POLL_MAX);
        }
    }

    pub fn send_offsets_to_transaction(
        &self,
        offsets: &TopicPartitionList,
        group: &ConsumerGroupMetadata,
        timeout: Duration,
    ) -> KafkaResult<()> {
        self.inner.send_offsets_to_transaction(offsets, group, timeout)
    }

    pub fn commit_transaction(&self, timeout: Duration) -> KafkaResult<()> {
        self.inner.commit_transaction(timeout)
    }

    /// Aborts the open transaction. librdkafka's abort purges the records still queued and then
    /// waits for their reports to be served (its flush, in the event mode rdkafka uses, relies on
    /// another thread to serve them), so a thread serves the queue until it returns.
    pub fn abort_transaction(&self, timeout: Duration) -> KafkaResult<()> {
        let aborted = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !aborted.load(Ordering::Acquire) {
                    self.inner.poll(Duration::from_millis(10));
                }
            });
            let result = self.inner.abort_transaction(timeout);
            aborted.store(true, Ordering::Release);
            result
        })
    }
}
