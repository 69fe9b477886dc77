//! When a consumer stops fetching: past a bound of work in flight, until half of it is done.
//! The worker's poll loop (tasks in flight) and the webhook notifier (events pending) both read
//! a topic faster than they finish what they read; one type decides for both, with the same
//! hysteresis, so a loop neither holds unbounded work nor flips between paused and resumed on
//! every record.

/// Pause at `max` in flight, resume at `max / 2` or fewer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backpressure {
    max: usize,
    paused: bool,
}

impl Backpressure {
    /// Starts fetching; `max` below 1 counts as 1.
    pub fn new(max: usize) -> Backpressure {
        Backpressure {
            max: max.max(1),
            paused: false,
        }
    }

    /// Whether fetching is paused now.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Updates the state with `in_flight` items in flight; `Some(paused)` when it changed.
    pub fn update(&mut self, in_flight: usize) -> Option<bool> {
        let paused = in_flight >= self.max || (self.paused && in_flight > self.max / 2);
        (paused != std::mem::replace(&mut self.paused, paused)).then_some(paused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_at_the_bound_and_resumes_at_half() {
        let mut b = Backpressure::new(10);
        assert_eq!(b.update(9), None);
        assert!(!b.is_paused());
        assert_eq!(b.update(10), Some(true));
        assert_eq!(b.update(12), None, "already paused");
        assert_eq!(b.update(6), None, "above half: still paused");
        assert!(b.is_paused());
        assert_eq!(b.update(5), Some(false));
        assert_eq!(b.update(9), None, "below the bound: fetching");
        assert_eq!(Backpressure::new(0).update(1), Some(true), "a bound of at least one");
    }
}
