//! The drain on shutdown: once `shutdown` resolves, the API stops accepting connections and
//! finishes the requests in flight, and the parts that run on their own (the webhook notifier)
//! are told to stop.

use std::future::{Future, IntoFuture};

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::ServeError;

/// Tells the parts that run on their own that the producer is stopping.
pub(super) struct Stop(watch::Sender<bool>);

impl Stop {
    pub(super) fn new() -> Stop {
        Stop(watch::channel(false).0)
    }

    /// Resolves once the producer is stopping (or `serve` has returned).
    pub(super) fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut stopping = self.0.subscribe();
        async move {
            let _ = stopping.wait_for(|stopping| *stopping).await;
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains: `stop` tells the others,
/// and this returns once the requests in flight have been answered.
pub(super) async fn serve(listener: TcpListener, app: Router, shutdown: impl Future<Output = ()>, stop: Stop) -> Result<(), ServeError> {
    let server = axum::serve(listener, app).with_graceful_shutdown(stop.stopped()).into_future();
    tokio::pin!(server);
    tokio::select! {
        served = &mut server => served,
        () = shutdown => {
            stop.0.send_replace(true);
            server.await
        }
    }
    .map_err(ServeError::Http)
}
