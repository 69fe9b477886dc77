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
use sluice_service::http_error::{ApiError, FieldError, json_errors};

use crate::auth::ApiKeys;
use crate::metrics::Metrics;
use crate::publish::{SubmitError, Submitter, TaskPublisher};

pub struct AppState {
    pub catalog: sluice_schemas::Catalog,
    pub publisher: TaskPublisher,
    pub keys: ApiKeys,
    pub metrics: Metrics,
    pub publish_timeout: Duration,
}

pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    json_errors(
        Router::new()
            .route("/v1/tasks", post(submit))
            .route("/v1/models", get(models))
            .route(
                "/metrics",
                get(|State(s): State<Arc<AppState>>| async move { sluice_service::metrics::render(&s.metrics.registry) }),
            )
            .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
            .layer(DefaultBodyLimit::max(max_body_bytes)),
    )
    .with_state(state)
}

/// `GET /v1/models`: every served model with its kind, bounds and defaults (the catalog minus
/// file paths).
async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    let models: Vec<Value> = s
        .catalog
        .models
        .iter()
        .map(|m| {
            json!({
                "name": m.name,
                "kind": m.kind.as_str(),
                "width": m.width,
                "height": m.height,
                "size_multiple": m.size_multiple,
                "steps": m.steps,
                "guidance_scale": m.guidance_scale,
                "samplers": m.samplers,
                "default_sampler": m.default_sampler,
                "max_num_images": m.max_num_images,
                "max_prompt_chars": m.max_prompt_chars,
            })
        })
        .collect();
    Json(json!({ "models": models }))
}

fn field(field: &str, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.to_owned(),
        message: message.into(),
    }
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
    let response = submit_inner(&s, &headers, &body).await.unwrap_or_else(IntoResponse::into_response);
    s.metrics.requests.with_label_values(&[response.status().as_str()]).inc();
    response
}

async fn submit_inner(s: &AppState, headers: &HeaderMap, body: &[u8]) -> Result<Response, ApiError> {
    let authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let tenant = s.keys.tenant(authorization).map_err(|e| {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string()).with_header(header::WWW_AUTHENTICATE, "Bearer")
    })?;
    let user = user_of(headers).map_err(|message| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message).with_fields([field("X-Sluice-User", message)])
    })?;
    let request: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", format!("the body is not JSON: {e}")).with_fields([field("", e.to_string())])
    })?;
    let record = TaskPublisher::record(&s.catalog, &request, &Submitter { tenant, user }).map_err(|e| match e {
        SubmitError::Invalid(violations) => {
            let mut names: Vec<&str> = violations
                .iter()
                .map(|v| if v.field.is_empty() { "(body)" } else { v.field.as_str() })
                .collect();
            names.dedup();
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("invalid field(s): {}", names.join(", ")),
            )
            .with_fields(violations.into_iter().map(|v| field(&v.field, v.message)))
        }
        e => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()),
    })?;
    if let Err(e) = s.publisher.publish(&record, s.publish_timeout).await {
        tracing::warn!(error = %e, "broker unavailable; task refused");
        let retry = s.publish_timeout.as_secs().max(1).to_string();
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", e.to_string()).with_header(header::RETRY_AFTER, &retry));
    }
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, format!("/v1/tasks/{}", record.task_id))],
        Json(json!({"task_id": record.task_id, "status": "queued"})),
    )
        .into_response())
}
