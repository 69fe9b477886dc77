//! The gauges that are read rather than counted, refreshed on a tick.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::events::{Emit, MemorySampled};

use crate::metrics::Metrics;
use crate::models::serving::Serving;
use crate::source::offsets::Offsets;

/// Refreshes the gauges that are read rather than counted.
pub(crate) async fn gauges(offsets: Arc<Offsets>, serving: Arc<Serving>, metrics: Metrics, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !stop.is_cancelled() {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        offsets.observed().emit(&metrics);
        MemorySampled {
            rss_bytes: crate::metrics::rss_bytes(),
            arena: serving.arena_stats(),
        }
        .emit(&metrics);
    }
}
