//! Turning the bytes of a tasks-topic record into a [`TaskRecord`], or into the reason it can't be.

use serde_json::Value;
use thiserror::Error;
use uuid::Uuid;

use crate::validate::{RecordKind, Violation, validate};
use crate::{DlqReason, SCHEMA_VERSION, TaskRecord};

/// Why a record on the tasks topic is not a task this version can run. Every variant is
/// permanent: the same bytes fail the same way on every attempt, so they go to the DLQ at once.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum DecodeError {
    #[error("record value is not UTF-8 (invalid byte at {valid_up_to})")]
    NotUtf8 { valid_up_to: usize },
    #[error("record value is not JSON: {0}")]
    NotJson(String),
    #[error("record value is a JSON {0}, not an object")]
    NotObject(&'static str),
    #[error("unsupported schema version {found} (this worker reads version {SCHEMA_VERSION})")]
    UnsupportedVersion { found: String },
    #[error("record does not match task.schema.json: {}", join(.0))]
    Schema(Vec<Violation>),
}

fn join(violations: &[Violation]) -> String {
    violations.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

impl DecodeError {
    /// The DLQ reason class of this error.
    pub fn reason(&self) -> DlqReason {
        match self {
            DecodeError::NotUtf8 { .. } | DecodeError::NotJson(_) | DecodeError::NotObject(_) => DlqReason::Malformed,
            DecodeError::UnsupportedVersion { .. } => DlqReason::UnsupportedVersion,
            DecodeError::Schema(_) => DlqReason::SchemaViolation,
        }
    }
}

/// A record that failed to decode, with whatever identity could still be read from it, so that
/// the failure can be announced for that task.
#[derive(Debug, Clone, PartialEq)]
pub struct Undecodable {
    pub error: DecodeError,
    /// The task id, when the record is a JSON object with a valid `task_id`.
    pub task_id: Option<Uuid>,
    /// The tenant and model, when present as strings.
    pub tenant: Option<String>,
    pub model: Option<String>,
}

/// Decodes and validates one tasks-topic record.
///
/// `header_version` is the value of the `sluice-schema-version` header, if the record has one; a
/// record without it is judged by its `version` field alone.
pub fn decode_task(value: &[u8], header_version: Option<&[u8]>) -> Result<TaskRecord, Box<Undecodable>> {
    let fail = |error: DecodeError, json: Option<&Value>| {
        let text = |name: &str| json.and_then(|j| j.get(name)).and_then(Value::as_str).map(str::to_owned);
        Box::new(Undecodable {
            error,
            task_id: text("task_id").and_then(|s| Uuid::parse_str(&s).ok()),
            tenant: text("tenant"),
            model: text("model"),
        })
    };
    let text = std::str::from_utf8(value).map_err(|e| {
        fail(
            DecodeError::NotUtf8 {
                valid_up_to: e.valid_up_to(),
            },
            None,
        )
    })?;
    let json: Value = serde_json::from_str(text).map_err(|e| fail(DecodeError::NotJson(e.to_string()), None))?;
    if !json.is_object() {
        let kind = match json {
            Value::Array(_) => "array",
            Value::String(_) => "string",
            Value::Number(_) => "number",
            Value::Bool(_) => "boolean",
            _ => "null",
        };
        return Err(fail(DecodeError::NotObject(kind), None));
    }
    if let Some(header) = header_version {
        let header = String::from_utf8_lossy(header);
        if header.trim() != SCHEMA_VERSION.to_string() {
            return Err(fail(
                DecodeError::UnsupportedVersion {
                    found: header.into_owned(),
                },
                Some(&json),
            ));
        }
    }
    match json.get("version") {
        Some(Value::Number(n)) if n.as_u64() == Some(SCHEMA_VERSION as u64) => {}
        Some(Value::Number(n)) => return Err(fail(DecodeError::UnsupportedVersion { found: n.to_string() }, Some(&json))),
        _ => {} // missing or not a number: the schema names it below
    }
    if let Err(violations) = validate(RecordKind::Task, &json) {
        return Err(fail(DecodeError::Schema(violations), Some(&json)));
    }
    serde_json::from_value::<TaskRecord>(json.clone()).map_err(|e| {
        fail(
            DecodeError::Schema(vec![Violation {
                field: String::new(),
                message: e.to_string(),
            }]),
            Some(&json),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> Value {
        serde_json::from_str(include_str!("../examples/v1/task/valid/terrain-512.json")).unwrap()
    }

    #[test]
    fn decodes_a_valid_record() {
        let bytes = serde_json::to_vec(&valid()).unwrap();
        let task = decode_task(&bytes, Some(b"1")).unwrap();
        assert_eq!(task.model, "terrain");
        assert_eq!(task.request.width, 512);
    }

    #[test]
    fn classifies_each_kind_of_bad_record() {
        let cases: Vec<(Vec<u8>, Option<&[u8]>, DlqReason)> = vec![
            (vec![0xff, 0xfe, b'{'], None, DlqReason::Malformed),
            (b"{\"task_id\": ".to_vec(), None, DlqReason::Malformed),
            (b"[1,2]".to_vec(), None, DlqReason::Malformed),
            (serde_json::to_vec(&valid()).unwrap(), Some(b"2"), DlqReason::UnsupportedVersion),
            (
                {
                    let mut v = valid();
                    v["version"] = 7.into();
                    serde_json::to_vec(&v).unwrap()
                },
                None,
                DlqReason::UnsupportedVersion,
            ),
            (
                {
                    let mut v = valid();
                    v["request"]["width"] = 1_000_000.into();
                    serde_json::to_vec(&v).unwrap()
                },
                None,
                DlqReason::SchemaViolation,
            ),
        ];
        for (bytes, header, reason) in cases {
            let err = decode_task(&bytes, header).unwrap_err();
            assert_eq!(err.error.reason(), reason, "{:?}", err.error);
        }
    }

    #[test]
    fn keeps_the_task_id_of_an_invalid_record() {
        let mut v = valid();
        v["request"]["params"]["difficulty"] = 0.into();
        let err = decode_task(&serde_json::to_vec(&v).unwrap(), None).unwrap_err();
        assert_eq!(err.task_id.unwrap().to_string(), v["task_id"].as_str().unwrap());
        match &err.error {
            DecodeError::Schema(violations) => {
                assert!(violations.iter().any(|x| x.field == "request.params.difficulty"), "{violations:?}")
            }
            other => panic!("{other:?}"),
        }
    }
}
