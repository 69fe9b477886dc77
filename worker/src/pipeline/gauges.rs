//! The gauges that are read rather than counted, refreshed on a tick.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::events::{Emit, MemorySampled};

use super::Shared;

/// Refreshes the gauges that are read rather than counted.
pub(crate) async fn gauges(shared: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !stop.is_cancelled() {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        shared.offsets.observed().emit(&shared.metrics);
        MemorySampled {
            rss_bytes: crate::metrics::rss_bytes(),
            arena: shared.serving.arena_stats(),
        }
        .emit(&shared.metrics);
    }
}
