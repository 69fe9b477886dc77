//! The OpenAPI 3.1 document of the HTTP API, served at `/openapi.json`.
//!
//! Its schemas are the JSON Schema files of `sluice-schemas` — the very files requests are
//! validated against and responses are tested against — embedded under `components/schemas`
//! with their references rewritten, so the document cannot drift from the contract. The
//! operations are listed here; `make test` runs schemathesis against a live producer to check
//! that the answers conform to them.

use serde_json::{Map, Value, json};
use sluice_schemas::validate::SCHEMA_FILES;

/// The component name of a schema file: its stem in CamelCase (`task-request.schema.json` →
/// `TaskRequest`).
fn component_names() -> Vec<(&'static str, String)> {
    SCHEMA_FILES
        .iter()
        .map(|(file, _)| {
            let stem = file.trim_end_matches(".schema.json");
            let name = stem
                .split('-')
                .map(|w| {
                    let mut c = w.chars();
                    c.next()
                        .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                        .unwrap_or_default()
                })
                .collect();
            (*file, name)
        })
        .collect()
}

/// `file.schema.json#/pointer` → `#/components/schemas/Title/pointer`; `#/pointer` inside
/// `current` → `#/components/schemas/Current/pointer`.
fn rewrite_refs(value: &mut Value, current: &str, names: &[(&'static str, String)]) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get_mut("$ref") {
                let (file, pointer) = r.split_once('#').unwrap_or((r.as_str(), ""));
                let name = if file.is_empty() {
                    current.to_owned()
                } else {
                    names
                        .iter()
                        .find(|(f, _)| *f == file)
                        .map(|(_, n)| n.clone())
                        .unwrap_or_else(|| panic!("reference to an unknown schema file {file}"))
                };
                *r = format!("#/components/schemas/{name}{pointer}");
            }
            for v in map.values_mut() {
                rewrite_refs(v, current, names);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rewrite_refs(v, current, names)),
        _ => {}
    }
}

fn components() -> Map<String, Value> {
    let names = component_names();
    let mut schemas = Map::new();
    for ((_, text), (_, name)) in SCHEMA_FILES.iter().zip(&names) {
        let mut schema: Value = serde_json::from_str(text).expect("schema files are JSON");
        let map = schema.as_object_mut().expect("schemas are objects");
        map.remove("$schema");
        map.remove("$id");
        rewrite_refs(&mut schema, name, &names);
        schemas.insert(name.clone(), schema);
    }
    schemas
}

fn json_body(schema: &str, description: &str) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}})
}

fn error(description: &str) -> Value {
    json_body("Error", description)
}

fn task_id_parameter() -> Value {
    json!({"name": "id", "in": "path", "required": true, "description": "The task id from the 202 answer.", "schema": {"type": "string"}})
}

/// The document.
pub fn document() -> Value {
    let unauthorized = error("No valid API key (`Authorization: Bearer <key>`).");
    let not_found = error("No such task of the caller's tenant (another tenant's task is a 404 too).");
    let catching_up = error(
        "`catching_up`: the status view is still reading its topics after a start, so an unknown id or key may yet exist; retry after `Retry-After` seconds.",
    );
    let unavailable_or_catching_up = error(
        "The broker did not acknowledge in time (`unavailable`), or, for a request with an `Idempotency-Key` the view does not know yet, it is still reading its topics after a start (`catching_up`); retry after `Retry-After` seconds.",
    );
    json!({
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {
            "title": "Sluice producer API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Submit text-to-image and other model tasks, follow them (poll, Server-Sent Events, signed webhooks), cancel them. Every error is JSON (`Error`)."
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/tasks": {
                "post": {
                    "operationId": "submitTask",
                    "summary": "Queue a task",
                    "description": "Validated against the request schema and the model's catalog entry (`GET /v1/models` narrows the bounds), published to the tasks topic once the broker acknowledged it. With `Idempotency-Key`, a retry with the same body is the same task.",
                    "parameters": [
                        {"name": "Idempotency-Key", "in": "header", "required": false, "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"}},
                        {"name": "X-Sluice-User", "in": "header", "required": false, "schema": {"type": "string", "minLength": 1, "maxLength": 256}},
                        {"name": "traceparent", "in": "header", "required": false, "description": "W3C trace context, continued in the task.", "schema": {"type": "string"}}
                    ],
                    "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TaskRequest"}}}},
                    "responses": {
                        "202": {
                            "description": "Queued.",
                            "headers": {"Location": {"required": true, "schema": {"type": "string"}, "description": "`/v1/tasks/{task_id}`"}},
                            "content": {"application/json": {"schema": {
                                "type": "object", "required": ["task_id", "status"], "additionalProperties": false,
                                "properties": {"task_id": {"type": "string", "format": "uuid"}, "status": {"const": "queued"}}
                            }}}
                        },
                        "400": error("Not JSON, or invalid fields (each named in `fields`), or a refused webhook."),
                        "401": unauthorized,
                        "413": error("The body is larger than the limit."),
                        "422": error("The `Idempotency-Key` was used for another request (`idempotency_conflict`), or is being used by one right now."),
                        "503": unavailable_or_catching_up
                    }
                },
                "get": {
                    "operationId": "listTasks",
                    "summary": "The caller's tasks, newest first",
                    "description": "Pages of at most `limit` tasks; follow `next_cursor` while it is present. One request examines at most 2,000 tasks: with a `status` filter that skips most of them a page may hold fewer than `limit` tasks, even none, and still a `next_cursor`.",
                    "parameters": [
                        {"name": "status", "in": "query", "required": false, "schema": {"enum": ["queued", "running", "succeeded", "failed", "cancelled", "expired"]}},
                        {"name": "since", "in": "query", "required": false, "schema": {"type": "string", "format": "date-time"}},
                        {"name": "limit", "in": "query", "required": false, "schema": {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}},
                        {"name": "cursor", "in": "query", "required": false, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": json_body("TaskPage", "A page of tasks."),
                        "400": error("An invalid query parameter (named in `fields`)."),
                        "401": unauthorized,
                        "503": catching_up.clone()
                    }
                }
            },
            "/v1/tasks/{id}": {
                "get": {
                    "operationId": "getTask",
                    "summary": "A task's status",
                    "parameters": [task_id_parameter()],
                    "responses": {"200": json_body("TaskStatus", "The task."), "401": unauthorized, "404": not_found, "503": catching_up.clone()}
                }
            },
            "/v1/tasks/{id}/events": {
                "get": {
                    "operationId": "watchTask",
                    "summary": "A task's changes as Server-Sent Events",
                    "description": "The current state at once, then `status` and `progress` events, and a terminal `completed` event whose data is the `TaskStatus`, after which the stream ends. Heartbeat comments every 15 s; `Last-Event-ID` resumes.",
                    "parameters": [task_id_parameter(), {"name": "Last-Event-ID", "in": "header", "required": false, "schema": {"type": "string"}}],
                    "responses": {
                        "200": {"description": "The event stream; each event's `data` is the task's `TaskStatus` as JSON.", "content": {"text/event-stream": {"schema": {
                            "type": "object",
                            "required": ["event", "id", "data"],
                            "properties": {
                                "event": {"enum": ["status", "progress", "completed"]},
                                "id": {"type": "string"},
                                "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {"$ref": "#/components/schemas/TaskStatus"}}
                            }
                        }}}},
                        "401": unauthorized,
                        "404": not_found,
                        "429": error("Too many event streams are open: the tenant's (`SLUICE_EVENTS_MAX_STREAMS_PER_TENANT`) or the replica's (`SLUICE_EVENTS_MAX_STREAMS`); `too_many_streams`, retry after `Retry-After` seconds."),
                        "503": catching_up.clone()
                    }
                }
            },
            "/v1/tasks/{id}/cancel": {
                "post": {
                    "operationId": "cancelTask",
                    "summary": "Cancel a task",
                    "description": "A queued task is never run; a running diffusion task stops between steps. Either way its status becomes `cancelled`.",
                    "parameters": [task_id_parameter()],
                    "responses": {
                        "202": {"description": "Cancelling.", "content": {"application/json": {"schema": {
                            "type": "object", "required": ["task_id", "status"], "additionalProperties": false,
                            "properties": {"task_id": {"type": "string", "format": "uuid"}, "status": {"const": "cancelling"}}
                        }}}},
                        "401": unauthorized,
                        "404": not_found,
                        "409": error("The task already finished."),
                        "503": error("The broker did not acknowledge in time (`unavailable`), or the status view is still reading its topics after a start (`catching_up`); retry after `Retry-After` seconds.")
                    }
                }
            },
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "summary": "The served models, their bounds and defaults, and the priority lanes",
                    "description": "Open to every caller. With an API key (or on a producer without keys), `lanes.granted` lists the lanes the key's tenant may ask for; a key that is not valid is refused.",
                    "security": [{}, {"bearer": []}],
                    "responses": {"200": json_body("ModelList", "The catalog and the lanes."), "401": unauthorized}
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "health",
                    "security": [],
                    "responses": {"200": {"description": "Alive.", "content": {"application/json": {"schema": {
                        "type": "object", "required": ["status", "status_view"],
                        "properties": {"status": {"const": "ok"}, "status_view": {"enum": ["caught_up", "catching_up", "none"]}}
                    }}}}}
                }
            },
            "/readyz": {
                "get": {
                    "operationId": "ready",
                    "summary": "Readiness: the status view has read what its topics held at start",
                    "security": [],
                    "responses": {
                        "200": {"description": "Ready.", "content": {"application/json": {"schema": {
                            "type": "object", "required": ["status", "status_view"],
                            "properties": {"status": {"const": "ready"}, "status_view": {"enum": ["caught_up", "none"]}}
                        }}}},
                        "503": catching_up
                    }
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "security": [],
                    "responses": {"200": {"description": "This document.", "content": {"application/json": {"schema": {"type": "object"}}}}}
                }
            }
        },
        "components": {
            "schemas": components(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "An API key of `SLUICE_API_KEYS`."}}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `$ref` of the document points at something in it.
    #[test]
    fn every_reference_resolves() {
        let doc = document();
        fn walk(v: &Value, doc: &Value, refs: &mut usize) {
            match v {
                Value::Object(m) => {
                    if let Some(Value::String(r)) = m.get("$ref") {
                        let pointer = r.strip_prefix('#').expect("local reference");
                        assert!(doc.pointer(pointer).is_some(), "{r} does not resolve");
                        *refs += 1;
                    }
                    m.values().for_each(|v| walk(v, doc, refs));
                }
                Value::Array(a) => a.iter().for_each(|v| walk(v, doc, refs)),
                _ => {}
            }
        }
        let mut refs = 0;
        walk(&doc, &doc, &mut refs);
        assert!(refs > 20, "{refs}");
    }

    /// The answers' Rust types and their schemas agree: fully populated values validate.
    #[test]
    fn answer_types_validate_against_their_schemas() {
        use crate::status::{Page, Progress, Status, TaskStatus};
        use sluice_schemas::{CompletionError, DlqReason, OutputRef, RecordKind, Timings, validate};
        let at = chrono::Utc::now();
        let status = TaskStatus {
            task_id: uuid::Uuid::now_v7(),
            status: Status::Failed,
            model: "sd".into(),
            created_at: at,
            updated_at: at,
            progress: Some(Progress {
                step: 3,
                steps: 4,
                resumed_from: None,
            }),
            outputs: vec![OutputRef {
                index: 0,
                url: "https://s3.example/b/k?X-Amz-Signature=1".into(),
                key: "k".into(),
                content_type: "image/png".into(),
                bytes: 10,
                sha256: "0".repeat(64),
                width: 8,
                height: 8,
            }],
            error: Some(CompletionError {
                reason: DlqReason::ModelError,
                message: "m".into(),
            }),
            timings: Some(Timings::default()),
            attempt: 2,
        };
        let queued = TaskStatus {
            status: Status::Queued,
            progress: None,
            outputs: vec![],
            error: None,
            timings: None,
            attempt: 1,
            ..status.clone()
        };
        for s in [&status, &queued] {
            let v = serde_json::to_value(s).unwrap();
            validate(RecordKind::TaskStatus, &v).unwrap_or_else(|e| panic!("{e:?}\n{v}"));
        }
        let page = Page {
            tasks: vec![status, queued],
            next_cursor: Some("c".into()),
        };
        validate(RecordKind::TaskPage, &serde_json::to_value(&page).unwrap()).unwrap();
        let error = sluice_service::http_error::ApiError::new(axum::http::StatusCode::BAD_REQUEST, "invalid_request", "m").with_fields([
            sluice_service::http_error::FieldError {
                field: "width".into(),
                message: "m".into(),
            },
        ]);
        validate(RecordKind::Error, &serde_json::to_value(&error).unwrap()).unwrap();
        let catalog = sluice_schemas::Catalog::load(Some(
            // Cargo's run-time value: the compile-time one may be another clone's.
            &std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned()))
                .join("../deploy/models.demo.toml"),
        ))
        .unwrap();
        validate(RecordKind::ModelList, &crate::api::model_list(&catalog, None)).unwrap();
        let granted = crate::auth::TenantLanes::UNLISTED;
        let list = crate::api::model_list(&catalog, Some(&granted));
        validate(RecordKind::ModelList, &list).unwrap();
        assert_eq!(
            list["lanes"],
            serde_json::json!({"names": ["interactive", "standard", "batch"], "default": "standard", "granted": ["standard", "batch"]})
        );
    }

    /// The document's request schema is the validator's: a sample of requests gets the same
    /// verdict from both.
    #[test]
    fn the_documented_request_schema_is_the_validated_one() {
        let doc = document();
        let validator = jsonschema::options()
            .build(&json!({"$ref": "#/components/schemas/TaskRequest", "components": doc["components"]}))
            .expect("the document's TaskRequest compiles");
        for (request, valid) in [
            (json!({"model": "terrain"}), true),
            (
                json!({"model": "sd", "prompt": "p", "webhook": {"url": "https://h.example/x", "events": ["completed"]}}),
                true,
            ),
            (json!({"model": "terrain", "colour": "red"}), false),
            (json!({"model": "terrain", "webhook": {"url": "ftp://h/x"}}), false),
            (json!({}), false),
        ] {
            let ours = sluice_schemas::validate(sluice_schemas::RecordKind::TaskRequest, &request).is_ok();
            assert_eq!(ours, valid, "{request}");
            assert_eq!(validator.is_valid(&request), valid, "{request}");
        }
    }
}
