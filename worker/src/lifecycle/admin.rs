//! Starting role three: the worker's HTTP endpoint — health probes, `/metrics`, and the admin
//! routes (reload, drain) behind the admin token.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::load::Loaded;
use super::{Setup, StartError};
use crate::http::{self, AppState};
use crate::source::offsets::Offsets;

/// The HTTP server, serving until [`Admin::stop`].
pub(super) struct Admin {
    stop: CancellationToken,
    server: JoinHandle<std::io::Result<()>>,
}

/// Binds `SLUICE_LISTEN` (failing the start if it cannot) and serves on a task of its own.
pub(super) async fn serve(setup: &Setup<'_>, loaded: &Loaded, offsets: Arc<Offsets>) -> Result<Admin, StartError> {
    let Setup {
        config, metrics, fatal, ..
    } = *setup;
    let app = Arc::new(AppState {
        metrics: metrics.clone(),
        health: loaded.health.subscribe(),
        serving: loaded.serving.clone(),
        admin_token: config
            .admin_token
            .as_deref()
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(http::token_digest),
        fatal: fatal.clone(),
        offsets,
    });
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| StartError::Listen {
            addr: config.listen,
            source,
        })?;
    let stop = CancellationToken::new();
    let server = {
        let stop = stop.clone();
        tokio::spawn(async move {
            axum::serve(listener, http::router(app))
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        })
    };
    Ok(Admin { stop, server })
}

impl Admin {
    /// Stops serving, waiting at most two seconds for open requests.
    pub(super) async fn stop(self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), self.server).await;
    }
}
