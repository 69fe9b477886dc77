//! The Prometheus endpoint, and a helper to register collectors in one place.

use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use prometheus::{Encoder, Registry, TextEncoder};

/// Renders `registry` in the Prometheus text format.
pub fn render(registry: &Registry) -> impl IntoResponse + use<> {
    let mut buffer = Vec::new();
    match TextEncoder::new().encode(&registry.gather(), &mut buffer) {
        Ok(()) => (StatusCode::OK, [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], buffer).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Registers `collector` and returns it. Registration fails only on a duplicate name, which is a
/// programming error caught by every test that builds the metrics.
pub fn register<C: prometheus::core::Collector + Clone + 'static>(registry: &Registry, collector: C) -> C {
    registry.register(Box::new(collector.clone())).expect("metric registered twice");
    collector
}
