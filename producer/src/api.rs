//! The HTTP API: `POST /v1/tasks`, `GET /metrics`, `GET /healthz`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::auth::ApiKeys;
use crate::metrics::Metrics;
use crate::publish::{SubmitError, Submitter, TaskPublisher};

pub struct AppState {
    pub publisher: TaskPublisher,
    pub keys: ApiKeys,
    pub metrics: Metrics,
    pub publish_timeout: Duration,
}

pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/tasks", post(submit))
        .route(
            "/metrics",
            get(|State(s): State<Arc<AppState>>| async move { sluice_service::metrics::render(&s.metrics.registry) }),
        )
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

fn error(status: StatusCode, code: &str, message: String, fields: Value) -> Response {
    (status, Json(json!({"error": code, "message": message, "fields": fields}))).into_response()
}

/// The user the task is submitted for, from `X-Sluice-User`.
fn user_of(headers: &HeaderMap) -> Result<Option<String>, &'static str> {
    match headers.get("x-sluice-user").map(|v| v.to_str()) {
        None => Ok(None),
        Some(Ok(u)) if !u.is_empty() && u.len() <= 256 => Ok(Some(u.to_owned())),
        Some(_) => Err("X-Sluice-User must be 1 to 256 visible characters"),
    }
}

async fn submit(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let response = submit_inner(&s, &headers, &body).await;
    s.metrics.requests.with_label_values(&[response.status().as_str()]).inc();
    response
}

async fn submit_inner(s: &AppState, headers: &HeaderMap, body: &[u8]) -> Response {
    let authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let tenant = match s.keys.tenant(authorization) {
        Ok(t) => t,
        Err(e) => {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                Json(json!({"error": "unauthorized", "message": e.to_string()})),
            )
                .into_response();
        }
    };
    let user = match user_of(headers) {
        Ok(u) => u,
        Err(message) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                message.into(),
                json!([{"field": "X-Sluice-User", "message": message}]),
            );
        }
    };
    let request: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("the body is not JSON: {e}"),
                json!([{"field": "", "message": e.to_string()}]),
            );
        }
    };
    let record = match TaskPublisher::record(&request, &Submitter { tenant, user }) {
        Ok(r) => r,
        Err(SubmitError::Invalid(violations)) => {
            let mut names: Vec<&str> = violations
                .iter()
                .map(|v| if v.field.is_empty() { "(body)" } else { v.field.as_str() })
                .collect();
            names.dedup();
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("invalid field(s): {}", names.join(", ")),
                json!(violations),
            );
        }
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string(), json!([])),
    };
    match s.publisher.publish(&record, s.publish_timeout).await {
        Ok(()) => (
            StatusCode::ACCEPTED,
            [(header::LOCATION, format!("/v1/tasks/{}", record.task_id))],
            Json(json!({"task_id": record.task_id, "status": "queued"})),
        )
            .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "broker unavailable; task refused");
            let retry = (s.publish_timeout.as_secs().max(1)).to_string();
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, retry)],
                Json(json!({"error": "unavailable", "message": e.to_string()})),
            )
                .into_response()
        }
    }
}
