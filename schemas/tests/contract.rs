//! The schema files and the Rust types, checked against each other.
//!
//! - every valid example validates, and survives a round trip through its Rust type unchanged
//!   (a schema field the type lacks would be dropped or rejected);
//! - a fully populated value of every type validates (a type field the schema lacks would be
//!   rejected: every schema closes its objects);
//! - every invalid example is rejected, naming the fields it expects.

use std::fs;
use std::path::{Path, PathBuf};

use chrono::{TimeZone, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sluice_schemas::*;
use uuid::Uuid;

fn examples(kind: &str, validity: &str) -> Vec<(PathBuf, Value)> {
    // At run time, Cargo names this package's directory; the compile-time one may be another
    // clone's (the target directory is shared between clones).
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned());
    let dir = Path::new(&root).join("examples/v1").join(kind).join(validity);
    let mut files: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert!(!files.is_empty(), "no examples in {}", dir.display());
    files
        .into_iter()
        .map(|p| {
            let v = serde_json::from_str(&fs::read_to_string(&p).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, v)
        })
        .collect()
}

fn round_trip<T: Serialize + DeserializeOwned>(kind: RecordKind, dir: &str) {
    for (path, value) in examples(dir, "valid") {
        if let Err(v) = validate(kind, &value) {
            panic!("{} should be valid: {v:?}", path.display());
        }
        let typed: T = serde_json::from_value(value.clone()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let back = serde_json::to_value(&typed).unwrap();
        assert_eq!(back, value, "{} changed in a round trip through its type", path.display());
    }
}

fn rejects(kind: RecordKind, dir: &str) {
    for (path, case) in examples(dir, "invalid") {
        let expected: Vec<String> = serde_json::from_value(case["expect_fields"].clone()).unwrap();
        let violations = validate(kind, &case["value"]).expect_err(&format!("{} should be invalid", path.display()));
        let fields: Vec<&str> = violations.iter().map(|v| v.field.as_str()).collect();
        for field in &expected {
            assert!(
                fields.contains(&field.as_str()),
                "{}: expected a violation on {field}, got {violations:?}",
                path.display()
            );
        }
    }
}

#[test]
fn task_requests() {
    round_trip::<TaskRequest>(RecordKind::TaskRequest, "task-request");
    rejects(RecordKind::TaskRequest, "task-request");
}

#[test]
fn per_kind_requests() {
    round_trip::<TaskRequest>(RecordKind::TerrainRequest, "terrain-request");
    rejects(RecordKind::TerrainRequest, "terrain-request");
    round_trip::<TaskRequest>(RecordKind::StableDiffusionRequest, "stable-diffusion-request");
    rejects(RecordKind::StableDiffusionRequest, "stable-diffusion-request");
    // Every valid example of a kind is a valid generic request too.
    for kind in ["terrain-request", "stable-diffusion-request"] {
        for (path, value) in examples(kind, "valid") {
            assert!(validate(RecordKind::TaskRequest, &value).is_ok(), "{}", path.display());
        }
    }
}

#[test]
fn tasks() {
    round_trip::<TaskRecord>(RecordKind::Task, "task");
    rejects(RecordKind::Task, "task");
}

#[test]
fn completions() {
    round_trip::<CompletionEvent>(RecordKind::Completion, "completion");
    rejects(RecordKind::Completion, "completion");
}

#[test]
fn progress_records() {
    round_trip::<ProgressRecord>(RecordKind::Progress, "progress");
    rejects(RecordKind::Progress, "progress");
}

#[test]
fn control_records() {
    round_trip::<ControlRecord>(RecordKind::Control, "control");
    rejects(RecordKind::Control, "control");
}

#[test]
fn webhook_records() {
    round_trip::<WebhookDelivery>(RecordKind::WebhookDelivery, "webhook-delivery");
    rejects(RecordKind::WebhookDelivery, "webhook-delivery");
    round_trip::<WebhookDlqRecord>(RecordKind::WebhookDlq, "webhook-dlq");
    rejects(RecordKind::WebhookDlq, "webhook-dlq");
}

#[test]
fn dlq_records() {
    round_trip::<DlqRecord>(RecordKind::Dlq, "dlq");
    rejects(RecordKind::Dlq, "dlq");
}

fn must_validate(kind: RecordKind, value: &impl Serialize) {
    let json = serde_json::to_value(value).unwrap();
    if let Err(v) = validate(kind, &json) {
        panic!("{kind:?} built from the Rust type does not validate: {v:?}\n{json:#}");
    }
}

#[test]
fn manifests() {
    round_trip::<ResultManifest>(RecordKind::Manifest, "manifest");
    rejects(RecordKind::Manifest, "manifest");
}

#[test]
fn fully_populated_types_validate() {
    let when = Utc.with_ymd_and_hms(2026, 11, 22, 9, 30, 0).unwrap();
    let source = SourceRef {
        topic: topics::TASKS.into(),
        partition: 2,
        offset: 9,
    };
    let request = TaskRequest {
        model: "terrain".into(),
        prompt: Some("p".into()),
        negative_prompt: Some("n".into()),
        steps: Some(1),
        guidance_scale: Some(1.0),
        seed: Some(normalize::MAX_SEED),
        sampler: Some("onestep".into()),
        width: Some(2048),
        height: Some(16),
        num_images: Some(8),
        params: Some(normalize::terrain::Params::default().to_map()),
        deadline: None,
        ttl_seconds: Some(3600),
        priority: Some(sluice_schemas::Priority::Interactive),
        webhook: Some(WebhookSpec {
            url: "https://hooks.example.com/sluice".into(),
            events: vec![WebhookEvent::Started, WebhookEvent::Progress, WebhookEvent::Completed],
        }),
        init_image: None,
        mask_image: None,
        strength: None,
    };
    must_validate(RecordKind::TaskRequest, &request);

    let webhook = request.webhook.clone();
    let (model, generation) = sluice_schemas::Catalog::default().normalize(request, || unreachable!()).unwrap();
    let task = TaskRecord {
        version: SCHEMA_VERSION,
        task_id: Uuid::new_v4(),
        submitted_at: when,
        tenant: "t".into(),
        user: Some("u".into()),
        model,
        request: generation,
        idempotency: None,
        deadline: Some(when),
        priority: sluice_schemas::Priority::Interactive,
        webhook,
    };
    must_validate(RecordKind::Task, &task);

    let completion = CompletionEvent {
        version: SCHEMA_VERSION,
        task_id: task.task_id,
        status: CompletionStatus::Succeeded,
        model: "terrain".into(),
        tenant: "t".into(),
        user: Some("u".into()),
        outputs: vec![OutputRef {
            index: 0,
            url: "s3://b/k/0.png".into(),
            key: "k/0.png".into(),
            content_type: "image/png".into(),
            bytes: 1,
            sha256: "0".repeat(64),
            width: 1,
            height: 1,
        }],
        error: None,
        timings: Timings {
            queued_ms: 1,
            inference_ms: 2,
            upload_ms: 3,
            total_ms: 6,
        },
        worker_id: "w".into(),
        attempt: 1,
        completed_at: when,
        source: source.clone(),
    };
    must_validate(RecordKind::Completion, &completion);
    let manifest = ResultManifest {
        version: SCHEMA_VERSION,
        task_id: task.task_id,
        outputs: completion.outputs.clone(),
        inference_ms: Some(5),
        created_at: when,
        worker_id: "w".into(),
        request_sha256: Some("ab".repeat(32)),
    };
    must_validate(RecordKind::Manifest, &manifest);
    for reason in DlqReason::ALL {
        let failed = CompletionEvent {
            status: CompletionStatus::Failed,
            outputs: vec![],
            error: Some(CompletionError {
                reason,
                message: "m".into(),
            }),
            ..completion.clone()
        };
        must_validate(RecordKind::Completion, &failed);
        assert_eq!(DlqReason::parse(reason.as_str()), Some(reason));

        let dlq = DlqRecord {
            version: SCHEMA_VERSION,
            reason,
            message: "m".into(),
            attempts: 3,
            task_id: Some(task.task_id),
            source: source.clone(),
            first_failed_at: when,
            last_failed_at: when,
            worker_id: "w".into(),
            details: Some(json!({"width": 1}).as_object().unwrap().clone()),
            original: OriginalRecord::new(
                Some(b"k"),
                &[0xff, 0x00],
                &[("h".into(), Some(vec![1])), ("e".into(), None)],
                Some(5),
            ),
        };
        must_validate(RecordKind::Dlq, &dlq);
    }
    let payload = json!({"task_id": task.task_id, "status": "succeeded"}).as_object().unwrap().clone();
    let delivery = WebhookDelivery {
        version: SCHEMA_VERSION,
        event_id: format!("msg_{}", "0a".repeat(16)),
        event: WebhookEvent::Completed,
        task_id: task.task_id,
        tenant: "t".into(),
        url: "https://hooks.example.com/x".into(),
        attempt: 2,
        due_at: when,
        first_attempt_at: when,
        last_error: "503 Service Unavailable".into(),
        payload: payload.clone(),
    };
    must_validate(RecordKind::WebhookDelivery, &delivery);
    for reason in [
        WebhookFailure::Refused,
        WebhookFailure::Gone,
        WebhookFailure::Rejected,
        WebhookFailure::Exhausted,
    ] {
        let given_up = WebhookDlqRecord {
            version: SCHEMA_VERSION,
            event_id: delivery.event_id.clone(),
            event: WebhookEvent::Progress,
            task_id: task.task_id,
            tenant: "t".into(),
            url: delivery.url.clone(),
            attempts: 8,
            first_attempt_at: when,
            failed_at: when,
            reason,
            message: "m".into(),
            last_status: Some(503),
            payload: payload.clone(),
        };
        must_validate(RecordKind::WebhookDlq, &given_up);
        let json = serde_json::to_value(reason).unwrap();
        assert_eq!(json.as_str(), Some(reason.as_str()));
    }
}

#[test]
fn completion_status_names_are_their_serialized_names() {
    for status in CompletionStatus::ALL {
        assert_eq!(serde_json::to_value(status).unwrap().as_str(), Some(status.as_str()));
    }
}

#[test]
fn normalized_minimal_request_is_a_valid_task() {
    let request: TaskRequest = serde_json::from_str(r#"{"model":"terrain"}"#).unwrap();
    let (model, generation) = sluice_schemas::Catalog::default().normalize(request, || 1234).unwrap();
    assert_eq!(generation.seed, 1234);
    assert_eq!((generation.width, generation.height, generation.steps), (128, 128, 1));
    let task = TaskRecord {
        version: SCHEMA_VERSION,
        task_id: Uuid::new_v4(),
        submitted_at: Utc::now(),
        tenant: "default".into(),
        user: None,
        model,
        request: generation,
        idempotency: None,
        deadline: None,
        priority: Default::default(),
        webhook: None,
    };
    must_validate(RecordKind::Task, &task);
}

#[test]
fn original_record_keeps_bytes() {
    let headers = vec![("a".to_string(), Some(vec![0u8, 1, 2])), ("b".to_string(), None)];
    let original = OriginalRecord::new(Some(&[9, 9]), &[0xff, 0xfe, 0x00], &headers, None);
    let json = serde_json::to_string(&original).unwrap();
    let back: OriginalRecord = serde_json::from_str(&json).unwrap();
    assert_eq!(back.value().unwrap(), vec![0xff, 0xfe, 0x00]);
    assert_eq!(back.key().unwrap(), Some(vec![9, 9]));
    assert_eq!(back.headers().unwrap(), headers);
}

/// An enum of a schema file, as its strings.
fn schema_enum(file: &str, pointer: &str) -> Vec<String> {
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned());
    let schema: Value = serde_json::from_str(&fs::read_to_string(Path::new(&root).join("v1").join(file)).unwrap()).unwrap();
    let values = schema.pointer(pointer).unwrap_or_else(|| panic!("{file}: nothing at {pointer}"));
    values.as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect()
}

#[test]
fn the_schemas_schema_enums_are_the_sampler_type() {
    let names: Vec<String> = Sampler::ALL.map(|s| s.name().to_owned()).to_vec();
    // The generation of any task: terrain's `onestep` first, then every diffusion sampler.
    let generation = schema_enum("generation.schema.json", "/$defs/generation/properties/sampler/enum");
    assert_eq!(generation.first().map(String::as_str), Some("onestep"));
    assert_eq!(generation[1..], names[..], "generation.schema.json");
    let request = schema_enum("stable-diffusion-request.schema.json", "/properties/sampler/enum");
    assert_eq!(request, names, "stable-diffusion-request.schema.json");
}

#[test]
fn the_schemas_priority_enum_is_the_priority_type() {
    let names: Vec<String> = sluice_schemas::Priority::ALL.map(|p| p.name().to_owned()).to_vec();
    assert_eq!(schema_enum("generation.schema.json", "/$defs/priority/enum"), names);
}
