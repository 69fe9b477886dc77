//! Retrying transient failures: exponential backoff with full jitter, bounded in attempts and in
//! total time. Attempts are counted so the DLQ can report them.

use std::future::Future;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::events::{Emit, RetryScheduled};
use crate::metrics::Metrics;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub max_elapsed: Duration,
    pub base_delay: Duration,
    pub max_delay: Duration,
}

impl RetryPolicy {
    /// Retry until cancelled: for publishing to the broker, where giving up would mean losing
    /// the record (the offset is never committed without it).
    pub fn forever(base_delay: Duration) -> RetryPolicy {
        RetryPolicy {
            max_attempts: u32::MAX,
            max_elapsed: Duration::MAX,
            base_delay,
            max_delay: Duration::from_secs(10),
        }
    }

    /// The delay before attempt `attempt + 1`: uniformly random up to base·2^(attempt-1), capped.
    pub fn delay(&self, attempt: u32) -> Duration {
        let exp = self
            .base_delay
            .saturating_mul(1u32.checked_shl(attempt.saturating_sub(1).min(20)).unwrap_or(u32::MAX));
        let ceiling = exp.min(self.max_delay);
        ceiling.mul_f64(0.5 + fastrand::f64() * 0.5)
    }
}

/// Why an operation was given up.
#[derive(Debug)]
pub enum GaveUp<E> {
    /// Out of attempts or time.
    Exhausted {
        error: E,
        attempts: u32,
        first_failed_at: DateTime<Utc>,
    },
    /// Shutting down; the caller must leave the task unacknowledged.
    Cancelled,
}

/// Runs `op` until it succeeds, the policy is exhausted, or `cancel` fires.
pub async fn retry<T, E, F, Fut>(
    policy: RetryPolicy,
    operation: &'static str,
    metrics: &Metrics,
    cancel: &CancellationToken,
    mut op: F,
) -> Result<T, GaveUp<E>>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    let mut first_failed_at = None;
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let error = match op().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let first = *first_failed_at.get_or_insert_with(Utc::now);
        let delay = policy.delay(attempt);
        if attempt >= policy.max_attempts || started.elapsed() + delay > policy.max_elapsed {
            return Err(GaveUp::Exhausted {
                error,
                attempts: attempt,
                first_failed_at: first,
            });
        }
        RetryScheduled {
            operation,
            attempt,
            delay,
            error: &error.to_string(),
        }
        .emit(metrics);
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = cancel.cancelled() => return Err(GaveUp::Cancelled),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(max_attempts: u32) -> RetryPolicy {
        RetryPolicy {
            max_attempts,
            max_elapsed: Duration::from_secs(60),
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(4),
        }
    }

    #[tokio::test]
    async fn succeeds_after_transient_failures() {
        let mut calls = 0;
        let r: Result<u32, GaveUp<String>> = retry(policy(5), "t", &Metrics::new(), &CancellationToken::new(), || {
            calls += 1;
            let n = calls;
            async move { if n < 3 { Err(format!("fail {n}")) } else { Ok(n) } }
        })
        .await;
        assert_eq!(r.unwrap(), 3);
    }

    #[tokio::test]
    async fn gives_up_after_max_attempts_and_counts_them() {
        let metrics = Metrics::new();
        let r: Result<(), GaveUp<&str>> = retry(policy(4), "upload", &metrics, &CancellationToken::new(), || async { Err("down") }).await;
        match r {
            Err(GaveUp::Exhausted { attempts, error, .. }) => assert_eq!((attempts, error), (4, "down")),
            other => panic!("{other:?}"),
        }
        assert_eq!(metrics.retries.with_label_values(&["upload"]).get(), 3);
    }

    #[tokio::test]
    async fn stops_when_cancelled() {
        let cancel = CancellationToken::new();
        cancel.cancel();
        let p = RetryPolicy {
            base_delay: Duration::from_secs(60),
            max_delay: Duration::from_secs(60),
            ..policy(10)
        };
        let r: Result<(), GaveUp<&str>> = retry(p, "t", &Metrics::new(), &cancel, || async { Err("x") }).await;
        assert!(matches!(r, Err(GaveUp::Cancelled)));
    }

    #[test]
    fn delays_grow_and_stay_capped() {
        let p = RetryPolicy {
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            ..policy(10)
        };
        for attempt in 1..30 {
            let d = p.delay(attempt);
            assert!(d <= Duration::from_secs(1));
            let ceiling = Duration::from_millis(100) * 2u32.pow((attempt - 1).min(4));
            assert!(d >= ceiling.min(Duration::from_secs(1)) / 2, "attempt {attempt}: {d:?}");
        }
    }
}
