//! One delivery attempt: a signed POST through the SSRF guard, and what its answer means.
//!
//! 2xx is delivered. Connection errors, timeouts, 408, 429 and 5xx are retried (honouring
//! `Retry-After`); a 410 stops deliveries to that URL; anything else — a 3xx (redirects are not
//! followed) or another 4xx — is not retried. Each receiver host gets a bounded share of the
//! concurrent deliveries of each tenant, and after repeated failures its circuit opens for a
//! while for that tenant (attempts then fail at once), so a slow or dead receiver cannot hold
//! up everybody else's, and one tenant's failing endpoints on a shared host cannot use up
//! another tenant's attempts there.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER, USER_AGENT};
use tokio::sync::Semaphore;

use super::guard::{Guard, GuardedResolver, refusal_in};
use super::signing::Secrets;

/// Failures in a row after which a tenant's circuit to a host opens.
const BREAKER_FAILURES: u32 = 5;
/// How long an open circuit fails attempts at once.
const BREAKER_OPEN: Duration = Duration::from_secs(30);
/// URLs remembered as gone (410), at most.
const MAX_GONE: usize = 100_000;
/// Tenant and host pairs with failures remembered, at most; past it those with nothing in
/// flight and no open circuit are forgotten. (A pair with no failures and nothing in flight has
/// no entry at all.)
const MAX_HOSTS: usize = 10_000;

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Attempt {
    Delivered {
        status: u16,
    },
    /// Worth another attempt later, not before `retry_after`.
    Retry {
        error: String,
        status: Option<u16>,
        retry_after: Option<Duration>,
    },
    /// Not worth another attempt.
    GiveUp {
        reason: sluice_schemas::WebhookFailure,
        error: String,
        status: Option<u16>,
    },
}

/// What one request carries.
pub struct Request<'a> {
    pub url: &'a str,
    pub tenant: &'a str,
    pub event_id: &'a str,
    pub event: sluice_schemas::WebhookEvent,
    pub body: &'a [u8],
    pub traceparent: Option<&'a str>,
}

#[derive(Default)]
struct Host {
    failures: u32,
    open_until: Option<Instant>,
    permits: Option<Arc<Semaphore>>,
}

pub struct Deliverer {
    guard: Arc<Guard>,
    secrets: Secrets,
    https: reqwest::Client,
    http: reqwest::Client,
    host_concurrency: usize,
    /// By tenant and receiver host.
    hosts: Mutex<HashMap<(String, String), Host>>,
    gone: Mutex<HashSet<String>>,
}

impl Deliverer {
    pub fn new(guard: Guard, secrets: Secrets, timeout: Duration, host_concurrency: usize) -> Result<Deliverer, reqwest::Error> {
        let guard = Arc::new(guard);
        let client = |https: bool| {
            sluice_service::http_client::builder()
                .dns_resolver(Arc::new(GuardedResolver::new(guard.clone(), https)))
                .redirect(reqwest::redirect::Policy::none())
                .no_proxy()
                .https_only(https)
                .timeout(timeout)
                .connect_timeout(timeout.min(Duration::from_secs(5)))
                .pool_max_idle_per_host(host_concurrency)
                .build()
        };
        Ok(Deliverer {
            https: client(true)?,
            http: client(false)?,
            guard,
            secrets,
            host_concurrency: host_concurrency.max(1),
            hosts: Mutex::default(),
            gone: Mutex::default(),
        })
    }

    /// Concurrent attempts per tenant and receiver host.
    pub fn host_concurrency(&self) -> usize {
        self.host_concurrency
    }

    /// Tenant and host pairs with an entry (failures, an open circuit or attempts in flight).
    #[cfg(test)]
    pub(crate) fn hosts_known(&self) -> usize {
        self.hosts.lock().expect("not poisoned").len()
    }

    /// One attempt at `request`.
    pub async fn attempt(&self, request: &Request<'_>) -> Attempt {
        use sluice_schemas::WebhookFailure::*;
        let give_up = |reason, error: String| Attempt::GiveUp {
            reason,
            error,
            status: None,
        };
        if self.gone.lock().expect("not poisoned").contains(request.url) {
            return give_up(Gone, "the receiver answered 410 Gone before; nothing more is sent there".into());
        }
        let url = match self.guard.check_url(request.url) {
            Ok(u) => u,
            Err(r) => return give_up(Refused, r.0),
        };
        let host = host_of(url.as_str());
        let timestamp = chrono::Utc::now().timestamp();
        let Some(signature) = self.secrets.signature(request.tenant, request.event_id, timestamp, request.body) else {
            return give_up(Refused, format!("no webhook secret is configured for tenant {:?}", request.tenant));
        };
        let key = (request.tenant.to_owned(), host.clone());
        let permits = {
            let mut hosts = self.hosts.lock().expect("not poisoned");
            let h = hosts.entry(key.clone()).or_default();
            if let Some(until) = h.open_until {
                if Instant::now() < until {
                    return Attempt::Retry {
                        error: format!("{host} failed {} times in a row; not tried for now", h.failures),
                        status: None,
                        retry_after: None,
                    };
                }
                h.open_until = None;
            }
            h.permits
                .get_or_insert_with(|| Arc::new(Semaphore::new(self.host_concurrency)))
                .clone()
        };
        let permit = permits.clone().acquire_owned().await.expect("never closed");
        let client = if url.scheme() == "https" { &self.https } else { &self.http };
        let mut builder = client
            .post(url)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(USER_AGENT, concat!("Sluice-Webhooks/", env!("CARGO_PKG_VERSION")))
            .header("webhook-id", request.event_id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .header("sluice-event", request.event.as_str())
            .body(request.body.to_vec());
        if let Some(tp) = request.traceparent {
            builder = builder.header(sluice_service::trace::TRACEPARENT, tp);
        }
        let outcome = match builder.send().await {
            Ok(response) => classify(response.status().as_u16(), response.headers().get(RETRY_AFTER)),
            Err(e) => match refusal_in(&e) {
                Some(r) => give_up(Refused, r.0),
                None => Attempt::Retry {
                    error: describe(&e),
                    status: None,
                    retry_after: None,
                },
            },
        };
        drop(permit);
        let mut hosts = self.hosts.lock().expect("not poisoned");
        let h = hosts.entry(key.clone()).or_default();
        match &outcome {
            Attempt::Retry { .. } => {
                h.failures += 1;
                if h.failures >= BREAKER_FAILURES {
                    h.open_until = Some(Instant::now() + BREAKER_OPEN);
                }
            }
            _ => h.failures = 0,
        }
        // In use: held by the map, by this attempt (`permits`) and by any other attempt.
        let idle = |h: &Host| h.permits.as_ref().is_none_or(|p| Arc::strong_count(p) <= 2);
        if h.failures == 0 && idle(h) {
            hosts.remove(&key);
        } else if hosts.len() > MAX_HOSTS {
            let now = Instant::now();
            hosts.retain(|_, h| !idle(h) || h.open_until.is_some_and(|t| t > now));
        }
        if let Attempt::GiveUp { reason: Gone, .. } = outcome {
            let mut gone = self.gone.lock().expect("not poisoned");
            if gone.len() >= MAX_GONE {
                gone.clear();
            }
            gone.insert(request.url.to_owned());
        }
        outcome
    }
}

/// An error with its sources, e.g. "error sending request for url (host:port): connection
/// refused". The URL is cut to its host: paths and queries often carry tokens, and this text is
/// logged and kept in retry and DLQ records.
fn describe(e: &reqwest::Error) -> String {
    let mut text = if e.is_timeout() { "timed out".to_owned() } else { e.to_string() };
    if let Some(url) = e.url() {
        text = text.replace(url.as_str(), &host_of(url.as_str()));
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// `host:port` of a URL, for logs: never its path or query (they often carry tokens).
pub fn host_of(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) => format!("{}:{}", u.host_str().unwrap_or_default(), u.port_or_known_default().unwrap_or(0)),
        Err(_) => "(not a URL)".to_owned(),
    }
}

/// What an HTTP answer means.
pub fn classify(status: u16, retry_after: Option<&HeaderValue>) -> Attempt {
    use sluice_schemas::WebhookFailure::*;
    let reason = reqwest::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let error = format!("{status} {reason}").trim().to_owned();
    match status {
        200..=299 => Attempt::Delivered { status },
        408 | 429 | 500..=599 => Attempt::Retry {
            error,
            status: Some(status),
            retry_after: retry_after.and_then(|v| v.to_str().ok()).and_then(parse_retry_after),
        },
        410 => Attempt::GiveUp {
            reason: Gone,
            error,
            status: Some(status),
        },
        300..=399 => Attempt::GiveUp {
            reason: Rejected,
            error: format!("{error}: redirects are not followed"),
            status: Some(status),
        },
        _ => Attempt::GiveUp {
            reason: Rejected,
            error,
            status: Some(status),
        },
    }
}

/// `Retry-After`: delay seconds or an HTTP date.
fn parse_retry_after(value: &str) -> Option<Duration> {
    if let Ok(secs) = value.trim().parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = chrono::DateTime::parse_from_rfc2822(value.trim()).ok()?;
    (when.with_timezone(&chrono::Utc) - chrono::Utc::now()).to_std().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_schemas::WebhookFailure;

    /// A receiver on a local port answering every request with `status`.
    async fn receiver(status: &'static str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    let _ = socket.read(&mut buf).await;
                    let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                    let _ = socket.write_all(answer.as_bytes()).await;
                });
            }
        });
        url
    }

    #[tokio::test]
    async fn hosts_are_remembered_only_while_they_fail_or_are_in_use() {
        let guard = Guard::new(&["127.0.0.0/8".into()], false).unwrap();
        let secrets =
            super::super::signing::Secrets::load(&["acme:whsec_c2x1aWNlLXRlc3Qtd2ViaG9vay1zZWNyZXQtMzJieXQ=".into()], None).unwrap();
        let deliverer = Deliverer::new(guard, secrets, Duration::from_secs(5), 2).unwrap();
        let attempt = async |url: &str| {
            deliverer
                .attempt(&Request {
                    url,
                    tenant: "acme",
                    event_id: "msg_1",
                    event: sluice_schemas::WebhookEvent::Completed,
                    body: b"{}",
                    traceparent: None,
                })
                .await
        };
        for _ in 0..20 {
            let url = receiver("204 No Content").await;
            assert!(matches!(attempt(&url).await, Attempt::Delivered { .. }));
        }
        assert_eq!(deliverer.hosts_known(), 0, "twenty hosts delivered to, none kept");
        let failing = receiver("503 Service Unavailable").await;
        assert!(matches!(attempt(&failing).await, Attempt::Retry { .. }));
        assert_eq!(deliverer.hosts_known(), 1, "a failing host's count is kept");
    }

    #[tokio::test]
    async fn one_tenants_open_circuit_leaves_another_tenant_its_attempts_on_a_shared_host() {
        let guard = Guard::new(&["127.0.0.0/8".into()], false).unwrap();
        let secret = "whsec_c2x1aWNlLXRlc3Qtd2ViaG9vay1zZWNyZXQtMzJieXQ=";
        let secrets = super::super::signing::Secrets::load(&[format!("acme:{secret}"), format!("rival:{secret}")], None).unwrap();
        let deliverer = Deliverer::new(guard, secrets, Duration::from_secs(5), 2).unwrap();
        let failing = receiver("503 Service Unavailable").await;
        let attempt = async |tenant: &str| {
            deliverer
                .attempt(&Request {
                    url: &failing,
                    tenant,
                    event_id: "msg_1",
                    event: sluice_schemas::WebhookEvent::Completed,
                    body: b"{}",
                    traceparent: None,
                })
                .await
        };
        for _ in 0..BREAKER_FAILURES {
            assert!(matches!(attempt("acme").await, Attempt::Retry { status: Some(503), .. }));
        }
        assert!(
            matches!(attempt("acme").await, Attempt::Retry { status: None, .. }),
            "acme's circuit to the host is open: failed at once"
        );
        assert!(
            matches!(attempt("rival").await, Attempt::Retry { status: Some(503), .. }),
            "rival's attempt still reaches the host"
        );
    }

    #[test]
    fn answers_are_classified_as_the_contract_says() {
        assert_eq!(classify(204, None), Attempt::Delivered { status: 204 });
        for retried in [408, 429, 500, 502, 503, 504] {
            assert!(matches!(classify(retried, None), Attempt::Retry { .. }), "{retried}");
        }
        assert!(matches!(
            classify(410, None),
            Attempt::GiveUp {
                reason: WebhookFailure::Gone,
                ..
            }
        ));
        for rejected in [301, 302, 307, 400, 401, 403, 404, 413, 422] {
            assert!(
                matches!(
                    classify(rejected, None),
                    Attempt::GiveUp {
                        reason: WebhookFailure::Rejected,
                        ..
                    }
                ),
                "{rejected}"
            );
        }
        let after = HeaderValue::from_static("120");
        assert!(matches!(classify(429, Some(&after)), Attempt::Retry { retry_after: Some(d), .. } if d == Duration::from_secs(120)));
        let date = (chrono::Utc::now() + chrono::Duration::seconds(600)).to_rfc2822();
        let d = parse_retry_after(&date).unwrap();
        assert!(d > Duration::from_secs(590) && d <= Duration::from_secs(600), "{d:?}");
    }
}
