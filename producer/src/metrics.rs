//! Every Prometheus metric of the producer, registered in one place.

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry, exponential_buckets};
use sluice_service::metrics::register;

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub published: IntCounterVec,
    pub publish_seconds: Histogram,
    /// How far behind its topics the status view applies a record.
    pub view_lag_seconds: Histogram,
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
            registry: r,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
