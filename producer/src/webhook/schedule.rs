//! The retry schedule of terminal webhook events, and where its retries wait.
//!
//! Pending retries are records on the retry topic, so they survive restarts. Each distinct delay
//! of the schedule has a partition of its own: every record in a partition waited the same
//! delay, so records are due in the order they are stored, and the owner of a partition only
//! ever waits for its head — a 10-hour retry never holds up a 5-second one.

use std::time::Duration;

use thiserror::Error;

#[derive(Debug, Error)]
#[error("retry schedule {0:?}: {1}")]
pub struct ScheduleError(String, String);

#[derive(Debug, Clone, PartialEq)]
pub struct RetrySchedule {
    /// The wait before attempt 2, 3, …
    delays: Vec<Duration>,
    /// The distinct delays, shortest first: tier `i` is partition `i` of the retry topic.
    tiers: Vec<Duration>,
}

/// `5s`, `30m`, `2h`, `1d`, `250ms`.
fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    Some(match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        "d" => Duration::from_secs(n * 86_400),
        _ => return None,
    })
}

impl RetrySchedule {
    /// The default: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h — eight attempts over 32.6 hours.
    pub const DEFAULT: &'static str = "5s,5m,30m,2h,5h,10h,10h";

    pub fn parse(text: &str) -> Result<RetrySchedule, ScheduleError> {
        let delays: Vec<Duration> = text
            .split(',')
            .filter(|d| !d.trim().is_empty())
            .map(|d| parse_duration(d).ok_or_else(|| ScheduleError(text.into(), format!("{d:?} is not a duration like 5s, 30m, 2h"))))
            .collect::<Result<_, _>>()?;
        let mut tiers = delays.clone();
        tiers.sort();
        tiers.dedup();
        Ok(RetrySchedule { delays, tiers })
    }

    /// Every delay (the horizon).
    pub fn horizon(&self) -> Duration {
        self.delays.iter().sum()
    }

    /// Attempts in all: the first and one per delay.
    pub fn attempts(&self) -> u32 {
        self.delays.len() as u32 + 1
    }

    pub fn tiers(&self) -> usize {
        self.tiers.len()
    }

    /// The shortest delay (tier 0's; 5 s when the schedule is empty).
    pub fn shortest(&self) -> Duration {
        self.tiers.first().copied().unwrap_or(Duration::from_secs(5))
    }

    /// After attempt `attempt` failed and asked to wait at least `retry_after`: the delay and
    /// the tier of the next attempt, or `None` when the schedule is over. A `Retry-After`
    /// longer than the scheduled delay moves the retry to the first tier that waits long enough,
    /// but never past the schedule's following delay: the receiver may put a retry off by one
    /// step of the schedule, not by however long it names (`Retry-After: 999999` would take
    /// every event of its tenant to the longest tier at once).
    pub fn next(&self, attempt: u32, retry_after: Option<Duration>) -> Option<(Duration, usize)> {
        let index = attempt.checked_sub(1)? as usize;
        let scheduled = *self.delays.get(index)?;
        let cap = self.delays.get(index + 1).copied().unwrap_or(scheduled).max(scheduled);
        let wanted = scheduled.max(retry_after.unwrap_or_default().min(cap));
        let tier = self.tiers.iter().position(|t| *t >= wanted).unwrap_or(self.tiers.len() - 1);
        Some((self.tiers[tier].max(scheduled), tier))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_covers_more_than_a_day() {
        let s = RetrySchedule::parse(RetrySchedule::DEFAULT).unwrap();
        assert_eq!(s.attempts(), 8);
        assert!(s.horizon() >= Duration::from_secs(24 * 3600), "{:?}", s.horizon());
        assert_eq!(s.tiers(), 6);
        assert_eq!(s.next(1, None), Some((Duration::from_secs(5), 0)));
        assert_eq!(s.next(7, None), Some((Duration::from_secs(36_000), 5)));
        assert_eq!(s.next(8, None), None);
        assert_eq!(s.next(0, None), None);
    }

    #[test]
    fn retry_after_moves_to_a_longer_tier() {
        let s = RetrySchedule::parse(RetrySchedule::DEFAULT).unwrap();
        assert_eq!(s.next(1, Some(Duration::from_secs(60))), Some((Duration::from_secs(300), 1)));
        assert_eq!(s.next(1, Some(Duration::from_secs(2))), Some((Duration::from_secs(5), 0)));
        // A huge Retry-After moves the retry one step of the schedule, no further.
        assert_eq!(s.next(1, Some(Duration::from_secs(999_999))), Some((Duration::from_secs(300), 1)));
        assert_eq!(s.next(2, Some(Duration::from_secs(999_999))), Some((Duration::from_secs(1_800), 2)));
        assert_eq!(
            s.next(7, Some(Duration::from_secs(999_999))),
            Some((Duration::from_secs(36_000), 5))
        );
        assert!(RetrySchedule::parse("5s,soon").is_err());
        assert_eq!(RetrySchedule::parse("250ms,1s,1s").unwrap().tiers(), 2);
    }
}
