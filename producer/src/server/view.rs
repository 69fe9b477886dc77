//! The status view in `serve`: its store, opened as a previous run left it, and the feed that
//! keeps it up to date from the topics.

use std::sync::Arc;
use std::time::Duration;

use sluice_schemas::Catalog;

use super::ServeError;
use crate::config::ServeArgs;
use crate::metrics::Metrics;
use crate::status::CaughtUp;
use crate::status::StatusStore;
use crate::status::feed::{self, Retention, ViewTopics};
use crate::status::identity;

/// The status view, fed.
pub(super) struct View {
    pub store: Arc<StatusStore>,
    /// Whether the feed has read what the topics held at start.
    pub caught_up: CaughtUp,
}

/// Opens the store at `SLUICE_STATUS_PATH` and starts its feed.
pub(super) fn start(args: &ServeArgs, catalog: &Catalog, metrics: &Metrics) -> Result<View, ServeError> {
    let topics = ViewTopics {
        tasks: args.publish.task_topics().names(),
        progress: args.progress_topic.clone(),
        completions: args.completions_topic.clone(),
    };
    let names: Vec<&str> = topics
        .tasks
        .iter()
        .chain([&topics.progress, &topics.completions])
        .map(String::as_str)
        .collect();
    let identity = identity::fetch(&args.publish.kafka, &names, Duration::from_secs(10))
        .inspect_err(|e| tracing::warn!(error = %e, "status view: the cluster's and topics' ids are unknown"))
        .ok();
    let (store, kept) = StatusStore::open(&args.status_path, identity.as_ref()).map_err(|source| ServeError::StatusStore {
        path: args.status_path.clone(),
        source,
    })?;
    tracing::info!(path = %args.status_path.display(), kept, cluster = ?identity.as_ref().map(|i| &i.cluster), "status view store");
    let store = Arc::new(store);
    let caught_up = feed::start(
        &args.publish.kafka,
        topics,
        store.clone(),
        metrics.clone(),
        retention(args, catalog),
    )?;
    Ok(View { store, caught_up })
}

/// How long the view keeps tasks. A task that has not finished stays in the view until its
/// longest possible deadline has passed, whatever the retention of finished ones.
fn retention(args: &ServeArgs, catalog: &Catalog) -> Retention {
    let longest_ttl = catalog
        .names()
        .iter()
        .filter_map(|n| catalog.get(n))
        .map(|m| m.max_ttl_seconds)
        .max()
        .unwrap_or(0);
    let retention = Retention::new(
        Duration::from_secs(args.status_retention_hours.saturating_mul(3600)),
        Duration::from_secs(longest_ttl),
    );
    tracing::info!(
        finished_hours = retention.finished.as_secs() / 3600,
        unfinished_hours = retention.unfinished.as_secs() / 3600,
        "status view retention"
    );
    retention
}
