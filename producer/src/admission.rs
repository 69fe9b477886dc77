//! Admission: what a `POST /v1/tasks` request must be to become a task record, judged before
//! anything is published. The caller's tenant (already authenticated), `X-Sluice-User`, the body
//! validated against the schemas and the model's catalog entry, its deadline, its
//! `Idempotency-Key`, and its webhook against the deployment's policy give the record, or the
//! 400 or 422 that says why not. Nothing here touches Kafka; the status view is asked only
//! whether an idempotent request repeats a task it knows, and the caller does the asking.

use axum::http::{HeaderMap, StatusCode};
use serde_json::Value;
use sluice_schemas::{Catalog, Idempotency, TaskRecord};
use sluice_service::http_error::{ApiError, FieldError};

use crate::input_images::InlineImages;
use crate::publish::{SubmitError, Submitter, TaskPublisher};
use crate::webhook::Policy;

/// A field's error, for the `fields` of an error body.
pub(crate) fn field(field: &str, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.to_owned(),
        message: message.into(),
    }
}

/// An admitted request: its record, and the input images it sent inline, which the record
/// references once they are stored ([`crate::input_images::InputImages::attach`]).
pub(crate) struct Admitted {
    pub record: TaskRecord,
    pub images: InlineImages,
}

/// The text of a body's `init_image` and `mask_image` strings, read without building anything
/// else of the body: every other value is skipped as it is scanned (serde's `IgnoredAny`), so a
/// body of 11 MB costs no more than its bytes, whatever it nests. A body whose images are not
/// both strings (or not an object, or not JSON) reads as having none.
#[derive(serde::Deserialize, Default)]
struct ImageText<'a> {
    #[serde(borrow, default)]
    init_image: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    mask_image: Option<std::borrow::Cow<'a, str>>,
}

impl ImageText<'_> {
    /// Bytes of the body that are input images (their decoded text: never longer than the JSON).
    fn len(body: &[u8]) -> usize {
        let text = serde_json::from_slice::<ImageText>(body).unwrap_or_default();
        [&text.init_image, &text.mask_image]
            .iter()
            .map(|i| i.as_ref().map_or(0, |t| t.len()))
            .sum()
    }
}

/// What a deployment admits beyond the catalog and the schemas.
pub(crate) struct Limits<'a> {
    /// What a submitted webhook must satisfy (`None`: no webhooks on this deployment).
    pub webhooks: Option<&'a Policy>,
    /// The priority lanes each tenant may ask for.
    pub lanes: &'a crate::auth::TenantLanes,
    /// Whether an input store is configured for input images.
    pub images_accepted: bool,
    /// The body limit without its data URLs (`SLUICE_MAX_BODY_BYTES`): the HTTP layer lets a
    /// body through with room for two images when input images are accepted.
    pub max_body_bytes: usize,
}

/// The record of `tenant`'s request (`headers` and `body`), or a 400 naming what is wrong (a 413
/// for a body over the limit once its input images are left out).
pub(crate) fn record(catalog: &Catalog, limits: &Limits<'_>, tenant: &str, headers: &HeaderMap, body: &[u8]) -> Result<Admitted, ApiError> {
    let user = user_of(headers).map_err(|message| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message).with_fields([field("X-Sluice-User", message)])
    })?;
    // The size rule first, on the body's bytes: only a body within it is parsed into a tree
    // (an 11 MB `[0,0,…]` would take ~400 MB as one).
    let rest = body.len().saturating_sub(ImageText::len(body));
    if rest > limits.max_body_bytes {
        let message = format!(
            "the body is {rest} bytes without its images; the limit is {}",
            limits.max_body_bytes
        );
        return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message));
    }
    let parsed = serde_json::from_slice::<Value>(body);
    let text = |name: &str| parsed.as_ref().ok()?.get(name)?.as_str().map(str::to_owned);
    let images = InlineImages {
        init: text("init_image"),
        mask: text("mask_image"),
    };
    let request = parsed.map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", format!("the body is not JSON: {e}")).with_fields([field("", e.to_string())])
    })?;
    let key = idempotency_key(headers)?;
    let submitter = Submitter {
        tenant: tenant.to_owned(),
        user,
    };
    let record = TaskPublisher::record_with_key(catalog, &request, &submitter, key.as_deref()).map_err(invalid)?;
    if let Some(webhook) = &record.webhook {
        check_webhook(limits.webhooks, tenant, &webhook.url)?;
    }
    if !limits.lanes.allows(tenant, record.priority) {
        let allowed: Vec<&str> = limits.lanes.of(tenant).iter().map(|l| l.name()).collect();
        let message = format!(
            "tenant {tenant} may not use the {} lane; it may use {} (SLUICE_TENANT_LANES)",
            record.priority,
            allowed.join(", ")
        );
        return Err(
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", "invalid field(s): priority")
                .with_fields([field("priority", message)]),
        );
    }
    if images.init.is_some() && !limits.images_accepted {
        let message = "this deployment takes no input images (SLUICE_INPUT_URL is not set)";
        return Err(
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", "invalid field(s): init_image")
                .with_fields([field("init_image", message)]),
        );
    }
    Ok(Admitted { record, images })
}

/// The user the task is submitted for, from `X-Sluice-User`.
fn user_of(headers: &HeaderMap) -> Result<Option<String>, &'static str> {
    match headers.get("x-sluice-user").map(|v| v.to_str()) {
        None => Ok(None),
        Some(Ok(u)) if !u.is_empty() && u.len() <= 256 => Ok(Some(u.to_owned())),
        Some(_) => Err("X-Sluice-User must be 1 to 256 visible characters"),
    }
}

/// The `Idempotency-Key` header: at most 255 visible ASCII characters.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let message = "Idempotency-Key must be 1 to 255 visible ASCII characters";
    match value.to_str() {
        Ok(k) if !k.is_empty() && k.len() <= 255 && k.bytes().all(|b| (0x21..=0x7e).contains(&b)) => Ok(Some(k.to_owned())),
        _ => Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message).with_fields([field("Idempotency-Key", message)])),
    }
}

/// A request the record could not be made of: a 400 naming each invalid field once (the body as
/// a whole is `(body)`), with every violation in `fields`.
fn invalid(e: SubmitError) -> ApiError {
    match e {
        SubmitError::Invalid(violations) => {
            let mut names: Vec<&str> = violations
                .iter()
                .map(|v| if v.field.is_empty() { "(body)" } else { v.field.as_str() })
                .collect();
            let mut seen = std::collections::HashSet::new();
            names.retain(|n| seen.insert(*n));
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("invalid field(s): {}", names.join(", ")),
            )
            .with_fields(violations.into_iter().map(|v| field(&v.field, v.message)))
        }
        e => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()),
    }
}

/// A 400 for a webhook to `url` that `tenant` may not ask for: none are configured, or the URL
/// or the tenant fails the policy ([`Policy::check`]).
fn check_webhook(webhooks: Option<&Policy>, tenant: &str, url: &str) -> Result<(), ApiError> {
    let refusal = match webhooks {
        None => Some((
            "webhook",
            "webhooks are not configured on this deployment (SLUICE_WEBHOOK_SECRETS)".to_owned(),
        )),
        Some(policy) => policy.check(tenant, url).err(),
    };
    match refusal {
        Some((name, message)) => Err(
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", format!("invalid field(s): {name}"))
                .with_fields([field(name, message)]),
        ),
        None => Ok(()),
    }
}

/// What an idempotent request is to the status view.
pub(crate) enum Repeat {
    /// A retry of a task the view knows: the same answer as the first time, nothing published.
    Retry,
    /// A task the view does not know: new, or, while the view catches up, one it has not read yet.
    Unknown,
}

/// The idempotent submissions between their check and their publication, by task id (tenant
/// and key), with their request hash and how many hold it: within one producer, a request with
/// a key in flight for another body is refused, not published beside it; the same body goes
/// on (a retry: the worker runs the task once). Across replicas the worker catches the race:
/// [`sluice_schemas::DlqReason::IdempotencyConflict`].
#[derive(Default)]
pub struct KeysInFlight {
    held: std::sync::Mutex<std::collections::HashMap<uuid::Uuid, (String, usize)>>,
}

/// A key held in flight; released when dropped.
pub(crate) struct KeyClaim<'a> {
    keys: &'a KeysInFlight,
    task_id: uuid::Uuid,
}

impl Drop for KeyClaim<'_> {
    fn drop(&mut self) {
        let mut held = self.keys.held.lock().expect("keys in flight");
        if let Some((_, holders)) = held.get_mut(&self.task_id) {
            *holders -= 1;
            if *holders == 0 {
                held.remove(&self.task_id);
            }
        }
    }
}

impl KeysInFlight {
    /// Holds `task_id`'s key for this request, or refuses it with a 422 while another request
    /// with the key is in flight.
    pub(crate) fn claim(&self, task_id: uuid::Uuid, idempotency: &Idempotency) -> Result<KeyClaim<'_>, ApiError> {
        let mut held = self.held.lock().expect("keys in flight");
        let (hash, holders) = held.entry(task_id).or_insert_with(|| (idempotency.request_sha256.clone(), 0));
        if *hash != idempotency.request_sha256 {
            return Err(conflict(idempotency));
        }
        *holders += 1;
        Ok(KeyClaim { keys: self, task_id })
    }
}

fn conflict(idempotency: &Idempotency) -> ApiError {
    let message = format!("Idempotency-Key {:?} was used for another request", idempotency.key);
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_conflict", message.clone())
        .with_fields([field("Idempotency-Key", message)])
}

/// An idempotent request against what the view knows of its task id (`known`, as
/// [`crate::status::StatusStore::request_hash`] answers): a 422 when its key was used for
/// another request.
pub(crate) fn repeat(idempotency: &Idempotency, known: Option<Option<String>>) -> Result<Repeat, ApiError> {
    match known {
        Some(Some(hash)) if hash == idempotency.request_sha256 => Ok(Repeat::Retry),
        Some(_) => Err(conflict(idempotency)),
        None => Ok(Repeat::Unknown),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog() -> Catalog {
        Catalog::parse("[[model]]\nname = \"sd\"\nkind = \"stable-diffusion\"\nwidth = { min = 64, max = 256, default = 64 }\nheight = { min = 64, max = 256, default = 64 }\nsize_multiple = 16\n").unwrap()
    }

    #[test]
    fn a_key_in_flight_takes_the_same_body_again_and_refuses_another() {
        let keys = KeysInFlight::default();
        let idem = |hash: &str| Idempotency {
            key: "k".into(),
            request_sha256: hash.into(),
        };
        let id = uuid::Uuid::nil();
        let first = keys.claim(id, &idem("a")).unwrap();
        let retry = keys.claim(id, &idem("a")).unwrap();
        assert_eq!(keys.claim(id, &idem("b")).err().unwrap().status, StatusCode::UNPROCESSABLE_ENTITY);
        drop(first);
        assert!(keys.claim(id, &idem("b")).is_err(), "held while any holder is in flight");
        drop(retry);
        assert!(keys.claim(id, &idem("b")).is_ok(), "released with the last");
    }

    fn admit(images_accepted: bool, body: serde_json::Value) -> Result<Admitted, ApiError> {
        admit_with(images_accepted, &crate::auth::TenantLanes::default(), body)
    }

    fn admit_with(images_accepted: bool, lanes: &crate::auth::TenantLanes, body: serde_json::Value) -> Result<Admitted, ApiError> {
        let limits = Limits {
            webhooks: None,
            lanes,
            images_accepted,
            max_body_bytes: 64 * 1024,
        };
        record(&catalog(), &limits, "acme", &HeaderMap::new(), body.to_string().as_bytes())
    }

    fn accepted(result: Result<Admitted, ApiError>) -> Admitted {
        result.unwrap_or_else(|e| panic!("refused: {}", e.message))
    }

    #[test]
    fn a_lane_is_taken_only_where_the_tenant_may_use_it() {
        use sluice_schemas::Priority;
        let body = |lane: &str| serde_json::json!({"model": "sd", "prompt": "p", "priority": lane});
        let unlisted = crate::auth::TenantLanes::default();
        let refused = admit_with(false, &unlisted, body("interactive")).err().expect("refused");
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        assert_eq!(refused.fields[0].field, "priority");
        assert!(
            refused.fields[0].message.contains("standard, batch"),
            "{}",
            refused.fields[0].message
        );
        assert_eq!(
            accepted(admit_with(false, &unlisted, body("batch"))).record.priority,
            Priority::Batch
        );
        let granted = crate::auth::TenantLanes::parse(&["acme=interactive".into()]).unwrap();
        assert_eq!(
            accepted(admit_with(false, &granted, body("interactive"))).record.priority,
            Priority::Interactive
        );
        assert!(admit_with(false, &granted, body("batch")).is_err(), "only the lanes listed");
        // Left out: standard, and the record leaves it out too.
        let plain = accepted(admit(false, serde_json::json!({"model": "sd", "prompt": "p"})));
        assert_eq!(plain.record.priority, Priority::Standard);
        assert!(serde_json::to_value(&plain.record).unwrap().get("priority").is_none());
        let bad = admit(false, body("urgent")).err().expect("refused");
        assert_eq!(bad.fields[0].field, "priority");
    }

    #[test]
    fn input_images_are_refused_where_no_input_store_is_configured() {
        let body = serde_json::json!({"model": "sd", "prompt": "p", "init_image": "data:image/png;base64,iVBORw0KGgo="});
        let refused = admit(false, body.clone()).err().expect("refused");
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        assert_eq!(refused.fields[0].field, "init_image");
        assert!(refused.fields[0].message.contains("SLUICE_INPUT_URL"));
        // Configured: admitted with the data URL kept for storing, strength defaulted as diffusers.
        let admitted = accepted(admit(true, body));
        assert_eq!(admitted.images.init.as_deref(), Some("data:image/png;base64,iVBORw0KGgo="));
        assert_eq!(admitted.record.request.strength, Some(0.8));
        assert_eq!(admitted.record.request.init_image, None, "set once the image is stored");
        // Inpainting defaults to strength 1.
        let inpaint = serde_json::json!({"model": "sd", "prompt": "p", "init_image": "data:image/png;base64,iVBORw0KGgo=",
            "mask_image": "data:image/png;base64,iVBORw0KGgo="});
        assert_eq!(accepted(admit(true, inpaint)).record.request.strength, Some(1.0));
    }

    #[test]
    fn the_body_limit_leaves_the_images_out() {
        let image = format!("data:image/png;base64,{}", "A".repeat(200_000));
        let ok = serde_json::json!({"model": "sd", "prompt": "p", "init_image": image});
        // Over the limit as a whole, under it without the image: judged on its fields (the
        // image itself is decoded later).
        assert!(admit(true, ok).is_ok());
        let padded = serde_json::json!({"model": "sd", "prompt": "p", "init_image": image, "negative_prompt": "x".repeat(70_000)});
        let refused = admit(true, padded).err().expect("refused");
        assert_eq!(
            (refused.status, refused.error.as_str()),
            (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large")
        );
    }

    /// Only strings count as images: a large array in an image field, or anywhere else, is
    /// judged by its size before the body is parsed into a tree.
    #[test]
    fn only_image_strings_are_left_out_of_the_size_rule() {
        let zeros = vec![0u8; 200_000];
        let image = format!("data:image/png;base64,{}", "A".repeat(200_000));
        for body in [
            serde_json::json!({"model": "sd", "prompt": "p", "negative_prompt": zeros}),
            serde_json::json!({"model": "sd", "prompt": "p", "init_image": zeros}),
            serde_json::json!({"model": "sd", "prompt": "p", "init_image": image, "mask_image": {"a": zeros}}),
        ] {
            let refused = admit(true, body).err().expect("refused");
            assert_eq!(refused.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", refused.message);
        }
        // The same key twice is not two images' room.
        let twice = format!(r#"{{"model":"sd","prompt":"p","init_image":"{image}","init_image":"{image}"}}"#);
        assert_eq!(ImageText::len(twice.as_bytes()), 0);
        assert_eq!(ImageText::len(b"[1,2]"), 0);
        assert_eq!(ImageText::len(br#"{"init_image":"abc","mask_image":"de"}"#), 5);
    }
}
