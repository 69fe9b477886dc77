//! Validation against the JSON Schema files, with errors that name the failing field.

use std::sync::LazyLock;

use jsonschema::{Resource, ValidationError, Validator, error::ValidationErrorKind};
use serde::Serialize;
use serde_json::Value;

const BASE: &str = "https://schemas.sluice.dev/v1/";

/// The schema files, embedded so that every binary validates against exactly the contract in
/// this crate.
pub const SCHEMA_FILES: [(&str, &str); 17] = [
    ("generation.schema.json", include_str!("../v1/generation.schema.json")),
    ("task-request.schema.json", include_str!("../v1/task-request.schema.json")),
    ("task.schema.json", include_str!("../v1/task.schema.json")),
    ("completion.schema.json", include_str!("../v1/completion.schema.json")),
    ("dlq.schema.json", include_str!("../v1/dlq.schema.json")),
    ("manifest.schema.json", include_str!("../v1/manifest.schema.json")),
    ("progress.schema.json", include_str!("../v1/progress.schema.json")),
    ("terrain-request.schema.json", include_str!("../v1/terrain-request.schema.json")),
    (
        "stable-diffusion-request.schema.json",
        include_str!("../v1/stable-diffusion-request.schema.json"),
    ),
    ("control.schema.json", include_str!("../v1/control.schema.json")),
    ("webhook.schema.json", include_str!("../v1/webhook.schema.json")),
    ("webhook-delivery.schema.json", include_str!("../v1/webhook-delivery.schema.json")),
    ("webhook-dlq.schema.json", include_str!("../v1/webhook-dlq.schema.json")),
    ("task-status.schema.json", include_str!("../v1/task-status.schema.json")),
    ("task-page.schema.json", include_str!("../v1/task-page.schema.json")),
    ("model-list.schema.json", include_str!("../v1/model-list.schema.json")),
    ("error.schema.json", include_str!("../v1/error.schema.json")),
];

/// The records that have a schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    TaskRequest,
    Task,
    Completion,
    Dlq,
    Manifest,
    Progress,
    /// The request rules of a model kind (after `TaskRequest`, once the catalog named the kind).
    TerrainRequest,
    StableDiffusionRequest,
    Control,
    /// A pending webhook retry (the retry topic).
    WebhookDelivery,
    /// A webhook event given up (the webhook DLQ).
    WebhookDlq,
    /// HTTP answers: a task's status, a page of tasks, the model list, an error.
    TaskStatus,
    TaskPage,
    ModelList,
    Error,
}

impl RecordKind {
    pub const ALL: [RecordKind; 15] = [
        RecordKind::TaskRequest,
        RecordKind::Task,
        RecordKind::Completion,
        RecordKind::Dlq,
        RecordKind::Manifest,
        RecordKind::Progress,
        RecordKind::TerrainRequest,
        RecordKind::StableDiffusionRequest,
        RecordKind::Control,
        RecordKind::WebhookDelivery,
        RecordKind::WebhookDlq,
        RecordKind::TaskStatus,
        RecordKind::TaskPage,
        RecordKind::ModelList,
        RecordKind::Error,
    ];

    /// The request schema of a model kind.
    pub fn request_of(kind: crate::ModelKind) -> RecordKind {
        match kind {
            crate::ModelKind::Terrain => RecordKind::TerrainRequest,
            crate::ModelKind::Diffusion => RecordKind::StableDiffusionRequest,
        }
    }

    pub fn file_name(self) -> &'static str {
        match self {
            RecordKind::TaskRequest => "task-request.schema.json",
            RecordKind::Task => "task.schema.json",
            RecordKind::Completion => "completion.schema.json",
            RecordKind::Dlq => "dlq.schema.json",
            RecordKind::Manifest => "manifest.schema.json",
            RecordKind::Progress => "progress.schema.json",
            RecordKind::TerrainRequest => "terrain-request.schema.json",
            RecordKind::StableDiffusionRequest => "stable-diffusion-request.schema.json",
            RecordKind::Control => "control.schema.json",
            RecordKind::WebhookDelivery => "webhook-delivery.schema.json",
            RecordKind::WebhookDlq => "webhook-dlq.schema.json",
            RecordKind::TaskStatus => "task-status.schema.json",
            RecordKind::TaskPage => "task-page.schema.json",
            RecordKind::ModelList => "model-list.schema.json",
            RecordKind::Error => "error.schema.json",
        }
    }
}

/// One reason a value does not match its schema.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// Dotted path of the failing field (`params.difficulty`, `request.width`); empty for the
    /// record itself.
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

const UNKNOWN_FIELD: &str = "unknown field";

struct Validators([Validator; 15]);

static VALIDATORS: LazyLock<Validators> = LazyLock::new(|| {
    let resources: Vec<(String, Resource)> = SCHEMA_FILES
        .iter()
        .map(|(name, text)| {
            let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
            let resource = Resource::from_contents(value).unwrap_or_else(|e| panic!("{name} is not a schema resource: {e}"));
            (format!("{BASE}{name}"), resource)
        })
        .collect();
    let build = |kind: RecordKind| {
        let text = SCHEMA_FILES.iter().find(|(n, _)| *n == kind.file_name()).expect("schema file").1;
        let schema: Value = serde_json::from_str(text).expect("schema JSON");
        jsonschema::options()
            .should_validate_formats(true)
            .with_resources(resources.clone().into_iter())
            .build(&schema)
            .unwrap_or_else(|e| panic!("{} does not compile: {e}", kind.file_name()))
    };
    Validators(RecordKind::ALL.map(build))
});

/// Checks `value` against the schema of `kind`. All violations are returned, each naming its field.
pub fn validate(kind: RecordKind, value: &Value) -> Result<(), Vec<Violation>> {
    let validator = &VALIDATORS.0[kind as usize];
    let mut violations: Vec<Violation> = validator.iter_errors(value).flat_map(violations_of).collect();
    if violations.is_empty() {
        return Ok(());
    }
    // Under `unevaluatedProperties`, a property whose own subschema failed also counts as
    // unevaluated; report it once, for what is wrong with it, not as unknown too.
    let failed: Vec<String> = violations
        .iter()
        .filter(|v| v.message != UNKNOWN_FIELD)
        .map(|v| v.field.clone())
        .collect();
    let failed_within = |field: &str| {
        failed
            .iter()
            .any(|f| f == field || f.strip_prefix(field).is_some_and(|rest| rest.starts_with('.')))
    };
    violations.retain(|v| v.message != UNKNOWN_FIELD || !failed_within(&v.field));
    violations.sort_by(|a, b| a.field.cmp(&b.field));
    violations.dedup();
    Err(violations)
}

fn violations_of(error: ValidationError<'_>) -> Vec<Violation> {
    let base: Vec<String> = error
        .instance_path
        .as_str()
        .split('/')
        .skip(1)
        .map(|s| s.replace("~1", "/").replace("~0", "~"))
        .collect();
    let field = |extra: Option<&str>| {
        let mut parts = base.clone();
        parts.extend(extra.map(str::to_owned));
        parts.join(".")
    };
    let message = error.masked().to_string();
    match &error.kind {
        // Name each unexpected field rather than its parent object.
        ValidationErrorKind::AdditionalProperties { unexpected } | ValidationErrorKind::UnevaluatedProperties { unexpected } => unexpected
            .iter()
            .map(|name| Violation {
                field: field(Some(name)),
                message: UNKNOWN_FIELD.to_owned(),
            })
            .collect(),
        ValidationErrorKind::Required { property } => {
            let name = property.as_str().unwrap_or_default();
            vec![Violation {
                field: field(Some(name)),
                message: "is required".to_owned(),
            }]
        }
        _ => vec![Violation {
            field: field(None),
            message,
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bad_field_is_named_once_for_what_is_wrong() {
        let value = serde_json::json!({"model": "terrain", "num_images": 0, "colour": "red"});
        let violations = validate(RecordKind::TaskRequest, &value).unwrap_err();
        assert_eq!(
            violations,
            vec![
                Violation {
                    field: "colour".into(),
                    message: UNKNOWN_FIELD.into()
                },
                Violation {
                    field: "num_images".into(),
                    message: "value is less than the minimum of 1".into()
                },
            ]
        );
    }
}
