//! Retrying transient failures: exponential backoff with "equal" jitter (each delay is drawn
//! uniformly between half and all of the exponential step), bounded in attempts and in total
//! time. Only errors that can succeed on retry are retried ([`Retriable`], after vector's
//! `RetryLogic::is_retriable_error`); a permanent one gives up at once. Attempts are counted so
//! the DLQ can report them.

use std::future::Future;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::events::{Emit, RetryScheduled};
use crate::metrics::Metrics;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RetryPolicy {
    pub max_attempts: u32,
    pub max_elapsed: Duration,
    pub base_delay: Duration,
    pub max_delay: Duration,
}

impl RetryPolicy {
    /// Retry until cancelled: for publishing to the broker, where giving up would mean losing
    /// the record (the offset is never committed without it).
    pub(crate) fn forever(base_delay: Duration) -> RetryPolicy {
        RetryPolicy {
            max_attempts: u32::MAX,
            max_elapsed: Duration::MAX,
            base_delay,
            max_delay: Duration::from_secs(10),
        }
    }

    /// The delay before attempt `attempt + 1`: base·2^(attempt-1), capped at `max_delay`, times a
    /// uniform factor in [0.5, 1) (equal jitter: spread, yet never much shorter than the step).
    pub(crate) fn delay(&self, attempt: u32) -> Duration {
        let exp = self
            .base_delay
            .saturating_mul(1u32.checked_shl(attempt.saturating_sub(1).min(20)).unwrap_or(u32::MAX));
        let ceiling = exp.min(self.max_delay);
        ceiling.mul_f64(0.5 + fastrand::f64() * 0.5)
    }
}

/// Whether a failed operation can succeed if tried again (a timeout, a connection refused, a
/// 5xx, throttling), or never will (a 4xx other than 408/429, an unreadable object, bad
/// credentials).
pub(crate) trait Retriable {
    fn is_retriable(&self) -> bool;
}

/// Why an operation was given up.
#[derive(Debug)]
pub(crate) enum GaveUp<E> {
    /// Out of attempts or time.
    Exhausted {
        error: E,
        attempts: u32,
        first_failed_at: DateTime<Utc>,
    },
    /// Failed in a way that retrying cannot fix.
    Permanent { error: E, attempts: u32 },
    /// Shutting down; the caller must leave the task unacknowledged.
    Cancelled,
}

/// Runs `op` until it succeeds, fails permanently, the policy is exhausted, or `cancel` fires.
pub(crate) async fn retry<T, E, F, Fut>(
    policy: RetryPolicy,
    operation: &'static str,
    metrics: &Metrics,
    cancel: &CancellationToken,
    mut op: F,
) -> Result<T, GaveUp<E>>
where
    E: std::fmt::Display + Retriable,
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
        if !error.is_retriable() {
            return Err(GaveUp::Permanent { error, attempts: attempt });
        }
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

    /// A test error: `Err(Flaky(..))` may pass next time, `Err(Broken(..))` never will.
    #[derive(Debug, PartialEq)]
    enum TestError {
        Flaky(&'static str),
        Broken(&'static str),
    }

    impl std::fmt::Display for TestError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{self:?}")
        }
    }

    impl Retriable for TestError {
        fn is_retriable(&self) -> bool {
            matches!(self, TestError::Flaky(_))
        }
    }

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
        let r: Result<u32, GaveUp<TestError>> = retry(policy(5), "t", &Metrics::new(), &CancellationToken::new(), || {
            calls += 1;
            let n = calls;
            async move { if n < 3 { Err(TestError::Flaky("fail")) } else { Ok(n) } }
        })
        .await;
        assert_eq!(r.unwrap(), 3);
    }

    #[tokio::test]
    async fn gives_up_after_max_attempts_and_counts_them() {
        let metrics = Metrics::new();
        let r: Result<(), GaveUp<TestError>> = retry(policy(4), "upload", &metrics, &CancellationToken::new(), || async {
            Err(TestError::Flaky("down"))
        })
        .await;
        match r {
            Err(GaveUp::Exhausted { attempts, error, .. }) => assert_eq!((attempts, error), (4, TestError::Flaky("down"))),
            other => panic!("{other:?}"),
        }
        assert_eq!(metrics.retries.with_label_values(&["upload"]).get(), 3);
    }

    #[tokio::test]
    async fn a_permanent_error_is_not_retried() {
        let metrics = Metrics::new();
        let mut calls = 0;
        let r: Result<(), GaveUp<TestError>> = retry(policy(20), "upload", &metrics, &CancellationToken::new(), || {
            calls += 1;
            async { Err(TestError::Broken("403")) }
        })
        .await;
        assert!(
            matches!(
                r,
                Err(GaveUp::Permanent {
                    attempts: 1,
                    error: TestError::Broken("403")
                })
            ),
            "{r:?}"
        );
        assert_eq!(calls, 1);
        assert_eq!(metrics.retries.with_label_values(&["upload"]).get(), 0);
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
        let r: Result<(), GaveUp<TestError>> = retry(p, "t", &Metrics::new(), &cancel, || async { Err(TestError::Flaky("x")) }).await;
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
