//! OTLP export of spans, switched on by the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`): OTLP/HTTP with the JSON encoding, to
//! `<endpoint>/v1/traces`, batched every `OTEL_BSP_SCHEDULE_DELAY` ms (default 5000) or 512 spans.
//! `OTEL_EXPORTER_OTLP_HEADERS` (`k=v,…`) are sent with each request, `OTEL_SERVICE_NAME` names the
//! service. Only the `http/json` protocol is spoken; another `OTEL_EXPORTER_OTLP_PROTOCOL` is
//! refused at start.
//!
//! The spans are the ones [`crate::trace`] already carries through Kafka (their ids are the ones
//! in the `traceparent` headers), so an exported trace and the records' headers agree. Attributes
//! follow OpenTelemetry's messaging conventions for Kafka. Export never blocks the caller: spans
//! queue (4,096 at most, then they are dropped and counted in the log) and a task sends them.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};

use crate::trace::TraceContext;

#[derive(Debug, Error)]
pub enum OtlpError {
    #[error("OTEL_EXPORTER_OTLP_PROTOCOL={0}: only http/json is supported")]
    Protocol(String),
    #[error("OTEL_EXPORTER_OTLP_HEADERS: {0}")]
    Headers(String),
    #[error("OTLP client: {0}")]
    Client(String),
}

/// OpenTelemetry's span kinds (the OTLP enum values) that Sluice's spans have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Producer = 4,
    Consumer = 5,
}

/// What a Kafka span does with its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KafkaOperation {
    /// Writes it (a PRODUCER span).
    Send,
    /// Handles it (a CONSUMER span).
    Process,
}

/// An attribute value.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    Str(String),
    Int(i64),
}

impl From<&str> for Attr {
    fn from(v: &str) -> Attr {
        Attr::Str(v.to_owned())
    }
}

impl From<String> for Attr {
    fn from(v: String) -> Attr {
        Attr::Str(v)
    }
}

impl From<i64> for Attr {
    fn from(v: i64) -> Attr {
        Attr::Int(v)
    }
}

/// One finished span.
#[derive(Debug, Clone)]
pub struct Span {
    /// Its trace and its own span id.
    pub context: TraceContext,
    pub parent: Option<[u8; 8]>,
    pub name: String,
    pub kind: SpanKind,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<(&'static str, Attr)>,
    /// An error message: the span's status is ERROR.
    pub error: Option<String>,
}

impl Span {
    /// A span of `operation` on Kafka topic `topic` from `start` until now, named and attributed
    /// per OpenTelemetry's messaging conventions (`send <topic>` / `process <topic>`).
    pub fn kafka(operation: KafkaOperation, topic: &str, context: TraceContext, parent: Option<[u8; 8]>, start: SystemTime) -> Span {
        let (name, kind) = match operation {
            KafkaOperation::Send => ("send", SpanKind::Producer),
            KafkaOperation::Process => ("process", SpanKind::Consumer),
        };
        Span {
            context,
            parent,
            name: format!("{name} {topic}"),
            kind,
            start,
            end: SystemTime::now(),
            attributes: Vec::new(),
            error: None,
        }
        .attr("messaging.system", "kafka")
        .attr("messaging.operation.type", name)
        .attr("messaging.operation.name", name)
        .attr("messaging.destination.name", topic)
    }

    /// The record a Kafka span is about: its key, and its partition and offset where known.
    pub fn message(mut self, key: Option<&str>, place: Option<(i32, i64)>) -> Span {
        if let Some(key) = key {
            self = self.attr("messaging.kafka.message.key", key);
        }
        if let Some((partition, offset)) = place {
            self = self
                .attr("messaging.destination.partition.id", partition.to_string())
                .attr("messaging.kafka.offset", offset);
        }
        self
    }

    /// The span's status: ERROR with `error`'s message, when there is one.
    pub fn failed(mut self, error: Option<String>) -> Span {
        self.error = error;
        self
    }

    pub fn attr(mut self, key: &'static str, value: impl Into<Attr>) -> Span {
        self.attributes.push((key, value.into()));
        self
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn nanos(t: SystemTime) -> String {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos().to_string()
}

/// A span as OTLP/JSON: ids in hex, 64-bit integers as strings, enums as numbers.
fn span_json(span: &Span) -> Value {
    let attributes: Vec<Value> = span
        .attributes
        .iter()
        .map(|(key, value)| {
            let value = match value {
                Attr::Str(s) => json!({"stringValue": s}),
                Attr::Int(i) => json!({"intValue": i.to_string()}),
            };
            json!({"key": key, "value": value})
        })
        .collect();
    let mut out = json!({
        "traceId": hex(&span.context.trace_id),
        "spanId": hex(&span.context.span_id),
        "name": span.name,
        "kind": span.kind as i32,
        "startTimeUnixNano": nanos(span.start),
        "endTimeUnixNano": nanos(span.end.max(span.start)),
        "attributes": attributes,
        "status": match &span.error {
            Some(message) => json!({"code": 2, "message": message}),
            None => json!({"code": 0}),
        },
    });
    if let Some(parent) = span.parent {
        out["parentSpanId"] = json!(hex(&parent));
    }
    out
}

/// An `ExportTraceServiceRequest` of one service's spans.
fn request_json(service: &str, spans: &[Span]) -> Value {
    json!({
        "resourceSpans": [{
            "resource": {"attributes": [
                {"key": "service.name", "value": {"stringValue": service}},
                {"key": "telemetry.sdk.name", "value": {"stringValue": "sluice"}},
                {"key": "telemetry.sdk.language", "value": {"stringValue": "rust"}},
            ]},
            "scopeSpans": [{
                "scope": {"name": "sluice", "version": env!("CARGO_PKG_VERSION")},
                "spans": spans.iter().map(span_json).collect::<Vec<_>>(),
            }],
        }],
    })
}

enum Message {
    Span(Box<Span>),
    Flush(oneshot::Sender<()>),
}

static EXPORTER: OnceLock<mpsc::Sender<Message>> = OnceLock::new();

/// Where and how to export, from the standard variables; `None` when export is off.
struct Settings {
    url: String,
    headers: Vec<(String, String)>,
    service: String,
    delay: Duration,
}

fn settings(default_service: &str, var: impl Fn(&str) -> Option<String>) -> Result<Option<Settings>, OtlpError> {
    let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
    let url = match (var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), var("OTEL_EXPORTER_OTLP_ENDPOINT")) {
        (Some(url), _) => url,
        (None, Some(base)) => format!("{}/v1/traces", base.trim_end_matches('/')),
        (None, None) => return Ok(None),
    };
    if let Some(protocol) = var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        && protocol != "http/json"
    {
        return Err(OtlpError::Protocol(protocol));
    }
    let mut headers = Vec::new();
    for pair in var("OTEL_EXPORTER_OTLP_HEADERS")
        .unwrap_or_default()
        .split(',')
        .filter(|p| !p.trim().is_empty())
    {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| OtlpError::Headers(format!("{pair:?} is not key=value")))?;
        headers.push((k.trim().to_owned(), v.trim().to_owned()));
    }
    let delay = var("OTEL_BSP_SCHEDULE_DELAY")
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(Duration::from_secs(5), Duration::from_millis);
    Ok(Some(Settings {
        url,
        headers,
        service: var("OTEL_SERVICE_NAME").unwrap_or_else(|| default_service.to_owned()),
        delay,
    }))
}

/// Starts exporting when the environment asks for it (call inside a Tokio runtime); returns
/// whether it does.
pub fn init(default_service: &str) -> Result<bool, OtlpError> {
    let Some(settings) = settings(default_service, |name| std::env::var(name).ok())? else {
        return Ok(false);
    };
    let client = crate::http_client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| OtlpError::Client(e.to_string()))?;
    let (tx, rx) = mpsc::channel(4096);
    if EXPORTER.set(tx).is_err() {
        return Ok(true);
    }
    tracing::info!(url = %settings.url, service = %settings.service, "exporting spans over OTLP/HTTP");
    tokio::spawn(export_loop(settings, client, rx));
    Ok(true)
}

/// Queues a finished span for export (nothing when export is off or the trace is not sampled).
pub fn record(span: Span) {
    let Some(tx) = EXPORTER.get() else { return };
    if !span.context.sampled {
        return;
    }
    if tx.try_send(Message::Span(Box::new(span))).is_err() {
        static DROPPED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = DROPPED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n.is_power_of_two() {
            tracing::warn!(dropped = n + 1, "OTLP export queue full: spans dropped");
        }
    }
}

/// Sends what is queued; waits at most `timeout` (call before the process exits).
pub async fn flush(timeout: Duration) {
    let Some(tx) = EXPORTER.get() else { return };
    let (done, wait) = oneshot::channel();
    if tx.send(Message::Flush(done)).await.is_ok() {
        let _ = tokio::time::timeout(timeout, wait).await;
    }
}

async fn export_loop(settings: Settings, client: reqwest::Client, mut rx: mpsc::Receiver<Message>) {
    let mut batch: Vec<Span> = Vec::new();
    let mut ticker = tokio::time::interval(settings.delay);
    loop {
        let flushed = tokio::select! {
            message = rx.recv() => match message {
                Some(Message::Span(span)) => {
                    batch.push(*span);
                    if batch.len() < 512 {
                        continue;
                    }
                    None
                }
                Some(Message::Flush(done)) => Some(done),
                None => return,
            },
            _ = ticker.tick() => None,
        };
        if !batch.is_empty() {
            send(&settings, &client, std::mem::take(&mut batch)).await;
        }
        if let Some(done) = flushed {
            let _ = done.send(());
        }
    }
}

/// One export request; retried once on a transport error or a retryable status.
async fn send(settings: &Settings, client: &reqwest::Client, spans: Vec<Span>) {
    let body = request_json(&settings.service, &spans).to_string();
    for attempt in 1..=2 {
        let mut request = client
            .post(&settings.url)
            .header("content-type", "application/json")
            .body(body.clone());
        for (k, v) in &settings.headers {
            request = request.header(k, v);
        }
        match request.send().await {
            Ok(r) if r.status().is_success() => return,
            Ok(r) if attempt == 1 && matches!(r.status().as_u16(), 429 | 502 | 503 | 504) => {}
            Ok(r) => {
                tracing::warn!(status = r.status().as_u16(), spans = spans.len(), "OTLP export refused");
                return;
            }
            Err(e) if attempt == 1 => tracing::debug!(error = %e, "OTLP export failed; trying again"),
            Err(e) => {
                tracing::warn!(error = %e, spans = spans.len(), "OTLP export failed");
                return;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_follow_the_standard_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
        };
        assert!(settings("svc", env(&[])).unwrap().is_none());
        let s = settings("svc", env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (s.url.as_str(), s.service.as_str(), s.delay),
            ("http://collector:4318/v1/traces", "svc", Duration::from_secs(5))
        );
        let s = settings(
            "svc",
            env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://ignored"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c/traces"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer x, x-team=ml"),
                ("OTEL_SERVICE_NAME", "api"),
                ("OTEL_BSP_SCHEDULE_DELAY", "200"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.url, "http://c/traces");
        assert_eq!(
            s.headers,
            [
                ("authorization".to_owned(), "Bearer x".to_owned()),
                ("x-team".to_owned(), "ml".to_owned())
            ]
        );
        assert_eq!((s.service.as_str(), s.delay), ("api", Duration::from_millis(200)));
        assert!(matches!(
            settings(
                "svc",
                env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")])
            ),
            Err(OtlpError::Protocol(_))
        ));
    }

    #[test]
    fn spans_are_otlp_json() {
        let context = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let start = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let span = Span {
            end: start + Duration::from_millis(5),
            ..Span::kafka(
                KafkaOperation::Process,
                "sluice.tasks.v1",
                context,
                Some([1, 2, 3, 4, 5, 6, 7, 8]),
                start,
            )
        }
        .message(Some("k"), Some((3, 42)))
        .failed(Some("model_error".into()));
        let json = request_json("sluice-worker", &[span]);
        let s = &json["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(s["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(s["spanId"], "00f067aa0ba902b7");
        assert_eq!(s["parentSpanId"], "0102030405060708");
        assert_eq!(s["kind"], 5);
        assert_eq!(s["startTimeUnixNano"], "1700000000123456789");
        assert_eq!(s["endTimeUnixNano"], "1700000000128456789");
        assert_eq!(s["name"], "process sluice.tasks.v1");
        let attributes: Vec<(&str, &Value)> = s["attributes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| (a["key"].as_str().unwrap(), &a["value"]))
            .collect();
        assert_eq!(
            attributes,
            [
                ("messaging.system", &json!({"stringValue": "kafka"})),
                ("messaging.operation.type", &json!({"stringValue": "process"})),
                ("messaging.operation.name", &json!({"stringValue": "process"})),
                ("messaging.destination.name", &json!({"stringValue": "sluice.tasks.v1"})),
                ("messaging.kafka.message.key", &json!({"stringValue": "k"})),
                ("messaging.destination.partition.id", &json!({"stringValue": "3"})),
                ("messaging.kafka.offset", &json!({"intValue": "42"})),
            ]
        );
        assert_eq!(s["status"], json!({"code": 2, "message": "model_error"}));
        assert_eq!(
            json["resourceSpans"][0]["resource"]["attributes"][0]["value"]["stringValue"],
            "sluice-worker"
        );
    }
}
