//! One error shape for every HTTP error of Sluice's services:
//!
//! ```json
//! {"error": "invalid_request", "message": "invalid field(s): width", "fields": [{"field": "width", "message": "..."}]}
//! ```
//!
//! with `Content-Type: application/json`. Handlers return [`ApiError`]; [`json_errors`] turns
//! every other error response (axum's own rejections: 404, 405, 413, unreadable bodies) into the
//! same shape, so a client never meets an empty or plain-text error.

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde::Serialize;

/// One field that made a request invalid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FieldError {
    /// Dotted path of the field (`params.difficulty`), a header name, or empty for the body.
    pub field: String,
    pub message: String,
}

/// An HTTP error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    pub status: StatusCode,
    /// A stable machine-readable code (`invalid_request`, `not_found`, …).
    pub error: String,
    pub message: String,
    pub fields: Vec<FieldError>,
    #[serde(skip)]
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl ApiError {
    pub fn new(status: StatusCode, error: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            error: error.to_owned(),
            message: message.into(),
            fields: Vec::new(),
            headers: Vec::new(),
        }
    }

    pub fn with_fields(mut self, fields: impl IntoIterator<Item = FieldError>) -> ApiError {
        self.fields.extend(fields);
        self
    }

    /// Adds a response header (`Retry-After`, `WWW-Authenticate`).
    pub fn with_header(mut self, name: HeaderName, value: &str) -> ApiError {
        if let Ok(value) = HeaderValue::from_str(value) {
            self.headers.push((name, value));
        }
        self
    }

    /// The code of an error response that came without one, from its status.
    fn code_of(status: StatusCode) -> &'static str {
        match status {
            StatusCode::BAD_REQUEST => "bad_request",
            StatusCode::UNAUTHORIZED => "unauthorized",
            StatusCode::FORBIDDEN => "forbidden",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
            StatusCode::CONFLICT => "conflict",
            StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
            StatusCode::UNPROCESSABLE_ENTITY => "unprocessable_entity",
            StatusCode::TOO_MANY_REQUESTS => "too_many_requests",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable",
            s if s.is_server_error() => "internal",
            _ => "error",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(&self)).into_response();
        for (name, value) in self.headers {
            response.headers_mut().append(name, value);
        }
        response
    }
}

/// Largest plain-text error body read to become the message.
const MAX_MESSAGE_BYTES: usize = 4096;

/// Rewrites an error response that is not JSON (a rejection of axum's, a fallback) as an
/// [`ApiError`] with its status, headers and text.
async fn to_json_error(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, MAX_MESSAGE_BYTES)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    };
    let mut error = ApiError::new(status, ApiError::code_of(status), message).into_response();
    for (name, value) in parts.headers.iter() {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            error.headers_mut().append(name, value.clone());
        }
    }
    error
}

/// Gives `router` JSON errors everywhere: unknown paths (404), wrong methods (405), and every
/// rejection axum answers in plain text (413 body too large, unreadable bodies).
pub fn json_errors<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    router
        .fallback(|uri: axum::http::Uri| async move { ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no route for {uri}")) })
        .method_not_allowed_fallback(|method: axum::http::Method, uri: axum::http::Uri| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{method} is not allowed on {}", uri.path()),
            )
        })
        .layer(axum::middleware::map_response(to_json_error))
}

/// A body of `Response` as JSON, for tests of the shape.
#[doc(hidden)]
pub async fn body_json(response: Response<Body>) -> serde_json::Value {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap_or_default();
    serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::post;
    use tower::ServiceExt;

    async fn call(router: Router, method: &str, uri: &str, body: &'static str) -> (StatusCode, Option<String>, serde_json::Value) {
        let request = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let response = router.oneshot(request).await.unwrap();
        let status = response.status();
        let content_type = response.headers().get(header::CONTENT_TYPE).map(|v| v.to_str().unwrap().to_owned());
        (status, content_type, body_json(response).await)
    }

    fn router() -> Router {
        #[derive(serde::Deserialize)]
        struct Body {
            #[allow(dead_code)]
            n: u32,
        }
        json_errors(
            Router::new()
                .route("/echo", post(|Json(_): Json<Body>| async { "ok" }))
                .route(
                    "/teapot",
                    post(|| async { ApiError::new(StatusCode::IM_A_TEAPOT, "teapot", "short and stout") }),
                )
                .layer(axum::extract::DefaultBodyLimit::max(16)),
        )
    }

    #[tokio::test]
    async fn every_error_is_json_with_code_message_and_fields() {
        for (method, uri, body, status, code) in [
            ("GET", "/nowhere", "", StatusCode::NOT_FOUND, "not_found"),
            ("GET", "/echo", "", StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            (
                "POST",
                "/echo",
                "{\"n\": 1, \"pad\": \"xxxxxxxxxxxxxxxx\"}",
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
            ),
            ("POST", "/echo", "{nope", StatusCode::BAD_REQUEST, "bad_request"),
            (
                "POST",
                "/echo",
                "{\"n\": \"x\"}",
                StatusCode::UNPROCESSABLE_ENTITY,
                "unprocessable_entity",
            ),
            ("POST", "/teapot", "", StatusCode::IM_A_TEAPOT, "teapot"),
        ] {
            let (got, content_type, json) = call(router(), method, uri, body).await;
            assert_eq!(got, status, "{method} {uri}: {json}");
            assert_eq!(content_type.as_deref(), Some("application/json"), "{method} {uri}");
            assert_eq!(json["error"], code, "{json}");
            assert!(!json["message"].as_str().unwrap().is_empty(), "{json}");
            assert!(json["fields"].is_array(), "{json}");
        }
        let (status, _, _) = call(router(), "POST", "/echo", "{\"n\": 1}").await;
        assert_eq!(status, StatusCode::OK);
    }
}
