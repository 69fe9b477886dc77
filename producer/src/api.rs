//! The HTTP API: `POST /v1/tasks`, `GET /v1/tasks/{id}`, `GET /v1/tasks`, `GET /v1/models`,
//! `GET /healthz` (alive), `GET /readyz` (ready: the status view caught up), `GET /openapi.json`; and, on a listener of its own, `GET /metrics`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use sluice_schemas::TaskRecord;
use sluice_service::http_error::{ApiError, json_errors};

use crate::admission::{self, Repeat, field};
use crate::auth::ApiKeys;
use crate::events::{Emit, RequestAnswered};
use crate::metrics::Metrics;
use crate::publish::{SubmitError, TaskPublisher};

/// The OpenAPI document, built once.
static OPENAPI: std::sync::LazyLock<Value> = std::sync::LazyLock::new(crate::openapi::document);

pub struct AppState {
    pub catalog: sluice_schemas::Catalog,
    /// The status view (`None`: the API answers no status, e.g. in unit tests).
    pub status: Option<Arc<crate::status::StatusStore>>,
    /// Signs the URLs of stored images.
    pub presigner: Arc<crate::presign::Presigner>,
    /// The topic cancels are published to.
    pub control_topic: String,
    /// Whether the status view has read what its topics held at start.
    pub view_caught_up: Option<crate::status::CaughtUp>,
    pub publisher: TaskPublisher,
    pub keys: ApiKeys,
    /// The priority lanes each tenant may ask for.
    pub lanes: crate::auth::TenantLanes,
    pub metrics: Metrics,
    pub publish_timeout: Duration,
    /// The longest an event stream stays open; the client reconnects with `Last-Event-ID`.
    pub events_max: Duration,
    /// Bounds on open event streams, per tenant and in all.
    pub streams: Arc<crate::streams::Streams>,
    /// What a submitted webhook must satisfy (`None`: no secrets configured, no webhooks).
    pub webhooks: Option<crate::webhook::Policy>,
    /// Where input images are stored (`None`: requests with images are refused).
    pub inputs: Option<crate::input_images::InputImages>,
    /// The body limit, input images left out (`SLUICE_MAX_BODY_BYTES`).
    pub max_body_bytes: usize,
    /// The most a submission's body may be, input images included: read only once the caller
    /// is authenticated.
    pub body_limit: usize,
    /// Room for submission bodies being read and admitted at once, in KiB
    /// (`SLUICE_BODY_BYTES_IN_FLIGHT`): see [`body_room`].
    pub body_room: tokio::sync::Semaphore,
    /// Idempotent submissions between their check and their publication.
    pub keys_in_flight: admission::KeysInFlight,
}

/// The room, in KiB permits, that a submission holds while its body is read and admitted: its
/// `Content-Length`, or the whole limit for a body without one.
fn body_room<'a>(s: &'a AppState, headers: &HeaderMap) -> Result<tokio::sync::SemaphorePermit<'a>, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if let Some(length) = declared.filter(|l| *l > s.body_limit) {
        let message = format!("the body is {length} bytes; this endpoint reads at most {}", s.body_limit);
        return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message));
    }
    let kib = u32::try_from(declared.unwrap_or(s.body_limit).div_ceil(1024).max(1)).unwrap_or(u32::MAX);
    s.body_room.try_acquire_many(kib).map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            "too many request bodies are being read at once; retry shortly",
        )
        .with_header(header::RETRY_AFTER, "1")
    })
}

/// KiB permits for `SLUICE_BODY_BYTES_IN_FLIGHT` bytes of bodies, never less than one body of
/// the largest size.
pub fn body_room_permits(bytes_in_flight: usize, body_limit: usize) -> usize {
    bytes_in_flight
        .max(body_limit)
        .div_ceil(1024)
        .min(tokio::sync::Semaphore::MAX_PERMITS)
}

pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    json_errors(
        Router::new()
            .route("/v1/tasks", post(submit))
            .route("/v1/models", get(models))
            .route("/v1/tasks", get(list_tasks))
            .route("/v1/tasks/{id}", get(task_status))
            .route("/v1/tasks/{id}/events", get(task_events))
            .route("/v1/tasks/{id}/cancel", post(cancel_task))
            .route("/openapi.json", get(|| async { Json(OPENAPI.clone()) }))
            .route(
                "/healthz",
                get(|State(s): State<Arc<AppState>>| async move {
                    let view = match &s.view_caught_up {
                        Some(c) if c.get() => "caught_up",
                        Some(_) => "catching_up",
                        None => "none",
                    };
                    Json(json!({"status": "ok", "status_view": view}))
                }),
            )
            .route(
                "/readyz",
                get(|State(s): State<Arc<AppState>>| async move {
                    match catching_up(&s) {
                        Some(e) => e.into_response(),
                        None => {
                            let view = if s.view_caught_up.is_some() { "caught_up" } else { "none" };
                            Json(json!({"status": "ready", "status_view": view})).into_response()
                        }
                    }
                }),
            )
            .layer(DefaultBodyLimit::max(max_body_bytes)),
    )
    .with_state(state)
}

/// The metrics listener's routes: `GET /metrics` only.
pub fn metrics_router(metrics: Metrics) -> Router {
    json_errors(Router::new().route(
        "/metrics",
        get(move || async move { sluice_service::metrics::render(&metrics.registry) }),
    ))
}

/// `GET /v1/models`: every served model with its kind, bounds and defaults (the catalog minus
/// file paths), and the priority lanes; with the caller's API key (or on an open producer), the
/// lanes its tenant may use. A key that is not valid is refused, as everywhere.
async fn models(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let granted = match tenant_of(&s, &headers) {
        Ok(tenant) => Some(s.lanes.of(&tenant)),
        Err(e) if headers.contains_key(header::AUTHORIZATION) => return e.into_response(),
        Err(_) => None,
    };
    // The body depends on the key: no cache may hand one caller's to another.
    ([(header::VARY, "Authorization")], Json(model_list(&s.catalog, granted))).into_response()
}

/// The body of `GET /v1/models` (`model-list.schema.json`): `granted`, the lanes of the caller's
/// tenant where it is known.
pub fn model_list(catalog: &sluice_schemas::Catalog, granted: Option<&[sluice_schemas::Priority]>) -> Value {
    let models: Vec<Value> = catalog
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
                "max_ttl_seconds": m.max_ttl_seconds,
                "max_task_pixels": m.max_task_pixels(),
                "max_task_rows": m.max_task_rows(),
                "modes": m.modes,
                "negative_prompt": m.negative_prompt,
            })
        })
        .collect();
    // A lane serializes as its name.
    let mut lanes = json!({
        "names": sluice_schemas::Priority::ALL,
        "default": sluice_schemas::Priority::default(),
    });
    if let Some(granted) = granted {
        lanes["granted"] = json!(granted);
    }
    json!({ "models": models, "lanes": lanes })
}

async fn submit(State(s): State<Arc<AppState>>, headers: HeaderMap, body: axum::body::Body) -> Response {
    let response = submit_inner(&s, &headers, body).await.unwrap_or_else(IntoResponse::into_response);
    RequestAnswered {
        status: response.status().as_u16(),
    }
    .emit(&s.metrics);
    response
}

/// Admits the request ([`crate::admission`]), answers a retry of a task the view knows as the
/// first time, and publishes anything else.
async fn submit_inner(s: &AppState, headers: &HeaderMap, body: axum::body::Body) -> Result<Response, ApiError> {
    let tenant = tenant_of(s, headers)?;
    // Read only for a caller with a key, at most the limit with room for input images, and only
    // while the bodies read at once stay within their room: held until the task is published.
    let _room = body_room(s, headers)?;
    let body = axum::body::to_bytes(body, s.body_limit).await.map_err(|_| {
        let message = format!("the body is over the {} bytes this endpoint reads", s.body_limit);
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    })?;
    let body = &body[..];
    let limits = admission::Limits {
        webhooks: s.webhooks.as_ref(),
        lanes: &s.lanes,
        images_accepted: s.inputs.is_some(),
        max_body_bytes: s.max_body_bytes,
    };
    let admission::Admitted { mut record, images } = admission::record(&s.catalog, &limits, &tenant, headers, body)?;
    // Two requests with one key and different bodies at once: the second is refused (422)
    // until the first is published and in the view.
    let _key = match &record.idempotency {
        Some(idem) => Some(s.keys_in_flight.claim(record.task_id, idem)?),
        None => None,
    };
    if let (Some(_), Some(idem)) = (&s.status, &record.idempotency) {
        let (who, task_id) = (tenant.clone(), record.task_id);
        let known = on_store(s, move |store| store.request_hash(&who, task_id)).await?;
        match admission::repeat(idem, known)? {
            Repeat::Retry => return Ok(accepted(record.task_id)),
            // Unknown to a view that has not read everything yet: it may be a retry.
            Repeat::Unknown => {
                if let Some(e) = catching_up(s) {
                    return Err(e);
                }
            }
        }
    }
    if let Some(inputs) = &s.inputs {
        inputs.attach(&mut record, images).await.map_err(input_refused)?;
    }
    publish(s, headers, record).await
}

/// An input image that can't be the task's (a 400 naming its field), or an input store that did
/// not take it (a 503: nothing was published, the client may retry).
fn input_refused(e: crate::input_images::InputImageError) -> ApiError {
    use crate::input_images::InputImageError;
    match e {
        InputImageError::Invalid { field, message } => {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", format!("invalid field(s): {field}"))
                .with_fields([admission::field(field, message)])
        }
        InputImageError::Store(e) => {
            tracing::warn!(error = %e, "input store unavailable; task refused");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the input image store is unavailable; retry later",
            )
            .with_header(header::RETRY_AFTER, "1")
        }
    }
}

/// Publishes an admitted record, the request's trace continued in it, and writes it through to
/// the status view: a 202, or a 503 when the broker did not acknowledge it in time.
async fn publish(s: &AppState, headers: &HeaderMap, record: TaskRecord) -> Result<Response, ApiError> {
    // The request's trace continues in the task (a new trace when it came without one).
    let incoming = headers
        .get(sluice_service::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(sluice_service::trace::TraceContext::parse);
    let trace = incoming.map_or_else(sluice_service::trace::TraceContext::root, |t| t.child());
    // Within W3C's limits, or not at all: a client's header is not copied unbounded into the record.
    let tracestate = headers
        .get(sluice_service::trace::TRACESTATE)
        .and_then(|v| v.to_str().ok())
        .and_then(sluice_service::trace::bounded_tracestate);
    tracing::info!(task_id = %record.task_id, trace_id = %trace.trace_id_hex(), model = %record.model, "task accepted");
    if let Err(e) = s
        .publisher
        .publish_traced(
            &record,
            Some((&trace, incoming.map(|t| t.span_id))),
            tracestate.as_deref(),
            s.publish_timeout,
        )
        .await
    {
        tracing::warn!(error = %e, "broker unavailable; task refused");
        return Err(unavailable(s, e));
    }
    if s.status.is_some() {
        // Written through: the task is `queued` here at once, before the view reads it back.
        let task_id = record.task_id;
        if let Err(e) = on_store(s, move |store| store.apply(&[crate::status::Change::Queued(record)])).await {
            tracing::warn!(error = %e.message, %task_id, "status view write-through failed; the view will read the task from its topic");
        }
        return Ok(accepted(task_id));
    }
    Ok(accepted(record.task_id))
}

fn accepted(task_id: uuid::Uuid) -> Response {
    (
        StatusCode::ACCEPTED,
        [(header::LOCATION, format!("/v1/tasks/{task_id}"))],
        Json(json!({"task_id": task_id, "status": "queued"})),
    )
        .into_response()
}

/// The caller's tenant, or a 401.
fn tenant_of(s: &AppState, headers: &HeaderMap) -> Result<String, ApiError> {
    let authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    s.keys
        .tenant(authorization)
        .map_err(|e| ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string()).with_header(header::WWW_AUTHENTICATE, "Bearer"))
}

fn status_store(s: &AppState) -> Result<Arc<crate::status::StatusStore>, ApiError> {
    s.status
        .clone()
        .ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "this producer keeps no status view"))
}

/// Runs `f` on the status view on the blocking pool: redb reads and writes are disk I/O, kept
/// off the async threads that serve requests.
async fn on_store<T: Send + 'static>(
    s: &AppState,
    f: impl FnOnce(&crate::status::StatusStore) -> Result<T, crate::status::StatusError> + Send + 'static,
) -> Result<T, ApiError> {
    let store = status_store(s)?;
    tokio::task::spawn_blocking(move || f(&store))
        .await
        .map_err(internal)?
        .map_err(internal)
}

/// A 503 when the broker did not acknowledge in time; retry after the publish timeout.
fn unavailable(s: &AppState, e: SubmitError) -> ApiError {
    let retry = s.publish_timeout.as_secs().max(1).to_string();
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", e.to_string()).with_header(header::RETRY_AFTER, &retry)
}

/// A 503 while the status view has not yet read what its topics held when the producer
/// started: what it does not know yet may exist, so it answers neither "no such task" nor
/// "new idempotency key".
fn catching_up(s: &AppState) -> Option<ApiError> {
    s.view_caught_up.as_ref().filter(|c| !c.get()).map(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "catching_up",
            "the status view is still reading its topics after a start; retry after `Retry-After` seconds",
        )
        .with_header(header::RETRY_AFTER, "2")
    })
}

/// The caller's tenant and the status of task `id` in the view: 401 without a valid key, 404
/// for an id that is no task of that tenant's (503 while the view catches up).
async fn callers_task(s: &AppState, headers: &HeaderMap, id: &str) -> Result<(String, uuid::Uuid, crate::status::TaskStatus), ApiError> {
    let tenant = tenant_of(s, headers)?;
    let task_id = uuid::Uuid::parse_str(id).map_err(|_| not_found(id))?;
    let who = tenant.clone();
    let status = on_store(s, move |store| store.get(&who, task_id))
        .await?
        .ok_or_else(|| catching_up(s).unwrap_or_else(|| not_found(id)))?;
    Ok((tenant, task_id, status))
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no task {id}"))
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
}

/// `GET /v1/tasks/{id}`: the task's status. Another tenant's task is a 404, as an unknown one.
async fn task_status(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    let (_, _, mut status) = callers_task(&s, &headers, &id).await?;
    s.presigner.sign(&mut status).await;
    Ok(Json(status).into_response())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    status: Option<String>,
    since: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

/// `GET /v1/tasks?status=&since=&limit=&cursor=`: the caller's tasks, newest first.
async fn list_tasks(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    query: Result<axum::extract::Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let tenant = tenant_of(&s, &headers)?;
    status_store(&s)?;
    // A partial list would leave out tasks that exist.
    if let Some(e) = catching_up(&s) {
        return Err(e);
    }
    let bad = |name: &str, message: String| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("invalid query parameter {name}"),
        )
        .with_fields([field(name, message)])
    };
    let axum::extract::Query(q) = query.map_err(|e| bad("(query)", e.body_text()))?;
    let status = match q.status.as_deref() {
        None => None,
        Some(v) => Some(crate::status::Status::parse(v).ok_or_else(|| {
            bad(
                "status",
                format!("one of queued, running, succeeded, failed, cancelled, expired; got {v:?}"),
            )
        })?),
    };
    let since = match q.since.as_deref() {
        None => None,
        Some(v) => Some(
            chrono::DateTime::parse_from_rfc3339(v)
                .map_err(|e| bad("since", format!("an RFC 3339 time: {e}")))?
                .with_timezone(&chrono::Utc),
        ),
    };
    let limit = match q.limit.as_deref() {
        None => 50,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=500).contains(n))
            .ok_or_else(|| bad("limit", format!("1 to 500, got {v:?}")))?,
    };
    if let Some(c) = q.cursor.as_deref()
        && crate::status::cursor_key(c).is_none()
    {
        return Err(bad("cursor", "not a cursor this API returned".into()));
    }
    let cursor = q.cursor.clone();
    let mut page = on_store(&s, move |store| store.list(&tenant, status, since, limit, cursor.as_deref())).await?;
    for task in &mut page.tasks {
        s.presigner.sign(task).await;
    }
    Ok(Json(page).into_response())
}

/// How often an event stream looks at the status view.
const EVENTS_POLL: Duration = Duration::from_millis(200);

/// The id of a state, for `Last-Event-ID`: the same state always has the same id.
fn event_id(status: &crate::status::TaskStatus) -> String {
    let step = status.progress.map_or(0, |p| p.step);
    format!("{}-{}-{step}", status.updated_at.timestamp_millis(), status.status.as_str())
}

/// `GET /v1/tasks/{id}/events`: Server-Sent Events. The current state at once (unless the
/// client's `Last-Event-ID` is that state), then each change — `status` when the state changes,
/// `progress` when only the step does — and a terminal `completed` event with the same body as
/// `GET /v1/tasks/{id}`, after which the stream ends. A comment every 15 s keeps idle connections
/// open. Each connection reads the view itself and holds one state: nothing queues up behind a
/// slow client (the stream is produced only as fast as it is read). A stream ends after
/// `SLUICE_EVENTS_MAX_SECONDS`; the client reconnects with `Last-Event-ID`.
async fn task_events(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    use axum::response::sse::{Event, KeepAlive, Sse};
    let (tenant, task_id, first) = callers_task(&s, &headers, &id).await?;
    let slot = s.streams.open(&tenant).map_err(|refused| {
        ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_streams", refused.to_string()).with_header(header::RETRY_AFTER, "5")
    })?;
    let last_seen = headers.get("last-event-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let state = (s.clone(), tenant, task_id, Some(first), last_seen, false);
    let stream = futures::stream::unfold(state, |(s, tenant, task_id, mut pending, mut last_seen, done)| async move {
        if done {
            return None;
        }
        loop {
            let current = match pending.take() {
                Some(c) => c,
                None => {
                    tokio::time::sleep(EVENTS_POLL).await;
                    // A view read is disk I/O: on the blocking pool, not the async threads.
                    let (store, who) = (s.status.clone()?, tenant.clone());
                    match tokio::task::spawn_blocking(move || store.get(&who, task_id)).await {
                        Ok(Ok(Some(c))) => c,
                        _ => return None,
                    }
                }
            };
            let id = event_id(&current);
            if last_seen.as_deref() == Some(id.as_str()) {
                if current.status.is_terminal() {
                    return None; // resumed after the end: nothing more will come
                }
                continue;
            }
            let previous_status = last_seen.as_deref().and_then(|l| l.split('-').nth(1)).map(str::to_owned);
            last_seen = Some(id.clone());
            let terminal = current.status.is_terminal();
            let mut current = current;
            if terminal {
                s.presigner.sign(&mut current).await;
            }
            let name = if terminal {
                "completed"
            } else if previous_status.as_deref() == Some(current.status.as_str()) {
                "progress"
            } else {
                "status"
            };
            let event = Event::default()
                .event(name)
                .id(id)
                .json_data(&current)
                .unwrap_or_else(|_| Event::default().comment("unserializable"));
            return Some((
                Ok::<_, std::convert::Infallible>(event),
                (s, tenant, task_id, None, last_seen, terminal),
            ));
        }
    });
    let stream = futures::StreamExt::take_until(stream, tokio::time::sleep(s.events_max));
    // The slot lives as long as the stream: dropped when it ends or the client goes away.
    let stream = futures::StreamExt::map(stream, move |event| {
        let _open = &slot;
        event
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// `POST /v1/tasks/{id}/cancel`: 202 while the task is not finished (a queued task is never
/// run; a running diffusion task stops between steps; either way its completion says
/// `cancelled`), 409 with its status once it is, 404 for an unknown or another tenant's task.
async fn cancel_task(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    let (tenant, task_id, status) = callers_task(&s, &headers, &id).await?;
    if status.status.is_terminal() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "already_finished",
            format!("task {id} already finished: {}", status.status.as_str()),
        ));
    }
    let record = sluice_schemas::ControlRecord {
        version: sluice_schemas::SCHEMA_VERSION,
        task_id,
        tenant,
        action: sluice_schemas::ControlAction::Cancel,
        at: chrono::Utc::now(),
    };
    if let Err(e) = s.publisher.publish_control(&s.control_topic, &record, s.publish_timeout).await {
        return Err(unavailable(&s, e));
    }
    Ok((StatusCode::ACCEPTED, Json(json!({"task_id": task_id, "status": "cancelling"}))).into_response())
}
