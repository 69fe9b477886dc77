//! The listeners of `serve`: `GET /metrics` on one of its own, served at once, and the API's.

use tokio::net::TcpListener;

use super::ServeError;
use crate::config::ServeArgs;
use crate::metrics::Metrics;

/// Binds the metrics listener and serves it until the process exits, then binds the API's
/// listener, which the caller serves.
pub(super) async fn listen(args: &ServeArgs, metrics: &Metrics) -> Result<TcpListener, ServeError> {
    let metrics_listener = TcpListener::bind(args.metrics_listen)
        .await
        .map_err(|source| ServeError::MetricsListener {
            addr: args.metrics_listen,
            source,
        })?;
    let metrics_router = crate::api::metrics_router(metrics.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(metrics_listener, metrics_router).await {
            tracing::error!(error = %e, "metrics listener stopped");
        }
    });
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|source| ServeError::Listener { addr: args.listen, source })?;
    tracing::info!(listen = %args.listen, metrics = %args.metrics_listen, topics = ?args.publish.task_topics().all(), "producer listening");
    Ok(listener)
}
