//! Every Prometheus metric of the producer, registered in one place; written only by `events`.

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, exponential_buckets,
};
use sluice_service::metrics::register;

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub published: IntCounterVec,
    pub publish_seconds: Histogram,
    /// How far behind its topics the status view applies a record.
    pub view_lag_seconds: Histogram,
    /// Webhook attempts by event and outcome: delivered, retrying, dropped (a started or
    /// progress event not delivered), throttled, superseded (a started or progress event after the
    /// task's completed one, or a step behind), deferred (past its tenant's or host's share of
    /// the attempts in flight), refused, gone, rejected, exhausted.
    pub webhook_deliveries: IntCounterVec,
    /// Attempts after the first.
    pub webhook_retries: IntCounter,
    /// How long one attempt took, by event.
    pub webhook_attempt_seconds: HistogramVec,
    /// Time from an event (the completion or progress record's time) to its first attempt.
    pub webhook_event_age_seconds: Histogram,
    /// Records the notifier consumed and has not finished (waiting retries included).
    pub webhook_pending: IntGauge,
    /// Tasks the workers' group has not committed, by partition ([`crate::backlog`]).
    pub backlog_tasks: IntGaugeVec,
    /// How long the oldest of them has waited, by partition.
    pub backlog_oldest_seconds: GaugeVec,
}

impl Metrics {
    pub fn new() -> Metrics {
        let r = Registry::new();
        Metrics {
            requests: register(
                &r,
                IntCounterVec::new(
                    Opts::new("sluice_producer_requests_total", "Task requests, by HTTP status"),
                    &["status"],
                )
                .unwrap(),
            ),
            published: register(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "sluice_producer_tasks_published_total",
                        "Task records acknowledged by the broker, by model",
                    ),
                    &["model"],
                )
                .unwrap(),
            ),
            publish_seconds: register(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "sluice_producer_publish_seconds",
                        "Time until the broker acknowledged a task record",
                    )
                    .buckets(exponential_buckets(0.0005, 2.0, 16).unwrap()),
                )
                .unwrap(),
            ),
            view_lag_seconds: register(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "sluice_producer_status_view_lag_seconds",
                        "Time from a record's own timestamp (submitted, progress, completed) to the status view applying it",
                    )
                    .buckets(exponential_buckets(0.001, 2.0, 20).unwrap()),
                )
                .unwrap(),
            ),
            webhook_deliveries: register(
                &r,
                IntCounterVec::new(
                    Opts::new("sluice_producer_webhook_deliveries_total", "Webhook attempts, by event and outcome"),
                    &["event", "outcome"],
                )
                .unwrap(),
            ),
            webhook_retries: register(
                &r,
                IntCounter::new("sluice_producer_webhook_retries_total", "Webhook attempts after the first").unwrap(),
            ),
            webhook_attempt_seconds: register(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "sluice_producer_webhook_attempt_seconds",
                        "Duration of one webhook attempt, by event",
                    )
                    .buckets(exponential_buckets(0.001, 2.0, 16).unwrap()),
                    &["event"],
                )
                .unwrap(),
            ),
            webhook_event_age_seconds: register(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "sluice_producer_webhook_event_age_seconds",
                        "Time from an event to its first webhook attempt",
                    )
                    .buckets(exponential_buckets(0.001, 2.0, 20).unwrap()),
                )
                .unwrap(),
            ),
            webhook_pending: register(
                &r,
                IntGauge::new(
                    "sluice_producer_webhook_pending",
                    "Records the webhook notifier consumed and has not finished, waiting retries included",
                )
                .unwrap(),
            ),
            backlog_tasks: register(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "sluice_producer_backlog_tasks",
                        "Tasks on the tasks topic the workers' group has not committed, by partition (measured by the producer, workers up or not)",
                    ),
                    &["topic", "partition"],
                )
                .unwrap(),
            ),
            backlog_oldest_seconds: register(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "sluice_producer_backlog_oldest_seconds",
                        "Age of the oldest task the workers' group has not committed, by partition (0: none waiting)",
                    ),
                    &["topic", "partition"],
                )
                .unwrap(),
            ),
            registry: r,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
