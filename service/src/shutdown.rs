//! Shutdown and reload signals.

use tokio::signal::unix::{SignalKind, signal};

/// Resolves on the first SIGTERM or SIGINT.
pub async fn terminated() {
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!(signal = "SIGTERM", "shutting down"),
        _ = int.recv() => tracing::info!(signal = "SIGINT", "shutting down"),
    }
}

/// A stream of SIGHUPs (each asks for a reload).
pub fn hangups() -> tokio::signal::unix::Signal {
    signal(SignalKind::hangup()).expect("SIGHUP handler")
}
