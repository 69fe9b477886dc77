//! The worker's HTTP server: `/metrics`, `/healthz` (alive), `/readyz` (serving), and
//! `POST /admin/reload` — which answers 404 unless an admin token is configured, and 401
//! without it (compared in constant time).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use sluice_service::http_error::{ApiError, json_errors};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::events::Emit;
use crate::metrics::Metrics;
use crate::models::serving::{Health, ReloadOverrides, Serving, ServingError};
use crate::source::offsets::Offsets;

pub(crate) struct AppState {
    pub metrics: Metrics,
    pub health: watch::Receiver<Health>,
    pub serving: Arc<Serving>,
    /// SHA-256 of the bearer token for `/admin/*`; without one they answer 404.
    pub admin_token: Option<[u8; 32]>,
    /// Fired when a reload leaves the worker unable to serve.
    pub fatal: CancellationToken,
    /// Read at every scrape, so the in-flight gauges are exact when scraped.
    pub offsets: Arc<Offsets>,
}

pub(crate) fn router(state: Arc<AppState>) -> Router {
    json_errors(
        Router::new()
            .route(
                "/metrics",
                get(|State(s): State<Arc<AppState>>| async move {
                    s.offsets.observed().emit(&s.metrics);
                    sluice_service::metrics::render(&s.metrics.registry)
                }),
            )
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .route("/admin/reload", post(reload)),
    )
    .with_state(state)
}

async fn healthz(State(s): State<Arc<AppState>>) -> Response {
    let health = s.health.borrow().clone();
    let status = if health.fatal.is_none() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(health)).into_response()
}

async fn readyz(State(s): State<Arc<AppState>>) -> Response {
    let health = s.health.borrow().clone();
    let status = if health.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(health)).into_response()
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReloadRequest {
    model: Option<String>,
    intra_threads: Option<usize>,
    gpu_mem_limit: Option<usize>,
}

/// The digest admin tokens are compared by: equal lengths, so the comparison's time is fixed.
pub(crate) fn token_digest(token: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(token.as_bytes()).into()
}

/// `None` when the request may use `/admin/*`, else the answer: 404 while no token is
/// configured (admin is off, as if absent), 401 for a missing or wrong token.
fn admin_refusal(s: &AppState, headers: &HeaderMap) -> Option<Response> {
    use subtle::ConstantTimeEq;
    let Some(expected) = &s.admin_token else {
        return Some(
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                "no such route (admin is off without SLUICE_ADMIN_TOKEN)",
            )
            .into_response(),
        );
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| token_digest(t.trim()));
    match given {
        Some(given) if bool::from(given.ct_eq(expected)) => None,
        _ => Some(
            ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong bearer token")
                .with_header(header::WWW_AUTHENTICATE, "Bearer")
                .into_response(),
        ),
    }
}

async fn reload(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Option<Json<ReloadRequest>>) -> Response {
    if let Some(refusal) = admin_refusal(&s, &headers) {
        return refusal;
    }
    let request = body.map(|Json(b)| b).unwrap_or_default();
    let overrides = ReloadOverrides {
        intra_threads: request.intra_threads,
        gpu_mem_limit: request.gpu_mem_limit,
    };
    match s.serving.reload(request.model.as_deref(), overrides).await {
        Ok(reports) => (StatusCode::OK, Json(serde_json::json!({ "reloads": reports }))).into_response(),
        Err(e @ ServingError::UnknownModel(_)) => ApiError::new(StatusCode::NOT_FOUND, "unknown_model", e.to_string()).into_response(),
        Err(ServingError::InvalidOption { field, message }) => ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message.clone())
            .with_fields([sluice_service::http_error::FieldError {
                field: field.to_owned(),
                message,
            }])
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "reload failed; the worker cannot serve and exits");
            s.fatal.cancel();
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "reload_failed", e.to_string()).into_response()
        }
    }
}
