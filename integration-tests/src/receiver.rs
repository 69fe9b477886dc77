//! A webhook receiver for tests: a real HTTP server on a local port that records every request.
//! `/hook/flaky` answers 503 to the first three attempts of each event and 204 after,
//! `/hook/gone` answers 410, `/hook/busy` 503 with `Retry-After: 999999` to every attempt, any
//! other `/hook/{name}` 204.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use base64::Engine as _;

#[derive(Debug, Clone)]
pub struct Received {
    pub mode: String,
    pub id: String,
    pub timestamp: String,
    pub signature: String,
    pub event: String,
    pub body: Bytes,
    pub answered: u16,
    pub at: Instant,
    pub received_at: chrono::DateTime<chrono::Utc>,
}

impl Received {
    /// Whether a Standard Webhooks signature of the request was made with `key` (checked here,
    /// independently of the producer's code).
    pub fn signed_with(&self, key: &[u8]) -> bool {
        use hmac::{Hmac, Mac};
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key).expect("any key length");
        mac.update(format!("{}.{}.", self.id, self.timestamp).as_bytes());
        mac.update(&self.body);
        let expected = format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
        );
        self.signature.split(' ').any(|s| s == expected)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_default()
    }
}

#[derive(Clone, Default)]
pub struct Receiver(Arc<Mutex<Vec<Received>>>);

impl Receiver {
    pub fn all(&self) -> Vec<Received> {
        self.0.lock().expect("not poisoned").clone()
    }

    /// Starts a receiver; returns it and its base URL.
    pub async fn start() -> (Receiver, String) {
        let receiver = Receiver::default();
        let app = axum::Router::new()
            .route("/hook/{mode}", axum::routing::post(hook))
            .with_state(receiver.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a local port");
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        (receiver, url)
    }
}

async fn hook(State(r): State<Receiver>, Path(mode): Path<String>, headers: HeaderMap, body: Bytes) -> (StatusCode, HeaderMap) {
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let id = header("webhook-id");
    let mut all = r.0.lock().expect("not poisoned");
    let earlier = all.iter().filter(|x| x.id == id && x.mode == mode).count();
    let mode_is_busy = mode == "busy";
    let answer = match mode.as_str() {
        "gone" => StatusCode::GONE,
        "busy" => StatusCode::SERVICE_UNAVAILABLE,
        "flaky" if earlier < 3 => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::NO_CONTENT,
    };
    all.push(Received {
        mode,
        id,
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        event: header("sluice-event"),
        body,
        answered: answer.as_u16(),
        at: Instant::now(),
        received_at: chrono::Utc::now(),
    });
    let mut reply = HeaderMap::new();
    if mode_is_busy {
        reply.insert("retry-after", axum::http::HeaderValue::from_static("999999"));
    }
    (answer, reply)
}
