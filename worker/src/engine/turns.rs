//! Whose turn it is among waiting work: the best lane first (interactive, standard, batch);
//! within a lane, the work that has had the fewest turns so far (a batch's calls before this
//! one: a short task is not held behind every part of a long one), then the earliest arrival;
//! and none is overtaken by more than [`MAX_OVERTAKEN`] later arrivals, so that neither batch
//! work nor a long task is ever starved: each waits at most that many turns of work that came
//! after it. The batcher's queues and the device gate's calls both take turns by it.

use sluice_schemas::Priority;

/// How many later arrivals may go ahead of a waiter before it goes first, whatever its lane.
pub const MAX_OVERTAKEN: u32 = 8;

/// What a model call brings to its turn: its lane, and how many calls its batch has run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Turn {
    pub lane: Priority,
    pub had: u32,
}

/// One waiter, as the rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Waiter {
    pub lane: Priority,
    /// Turns this work had before (the calls its batch has run).
    pub had: u32,
    /// Arrival order: smaller came first.
    pub arrival: u64,
    /// How many later arrivals went ahead of it so far.
    pub overtaken: u32,
}

impl Waiter {
    pub fn new(lane: Priority, arrival: u64) -> Waiter {
        Waiter {
            lane,
            had: 0,
            arrival,
            overtaken: 0,
        }
    }

    /// Whether `chosen` going first overtakes this waiter: it came later.
    pub fn overtaken_by(&self, chosen: &Waiter) -> bool {
        chosen.arrival > self.arrival
    }

    fn order(&self) -> (bool, Priority, u32, u64) {
        if self.overtaken >= MAX_OVERTAKEN {
            // Overtaken enough: before every waiter that was not, by arrival alone.
            (false, Priority::Interactive, 0, self.arrival)
        } else {
            (true, self.lane, self.had, self.arrival)
        }
    }
}

/// The index, among `waiting`, of the waiter whose turn it is.
pub(crate) fn next(waiting: impl IntoIterator<Item = Waiter>) -> Option<usize> {
    waiting.into_iter().enumerate().min_by_key(|(_, w)| w.order()).map(|(i, _)| i)
}

/// Counts the overtaking once `chosen` has gone first: each of `others` (still waiting) that
/// came before it was overtaken once more.
pub(crate) fn went_first<'a>(chosen: &Waiter, others: impl IntoIterator<Item = &'a mut Waiter>) {
    for w in others {
        if w.overtaken_by(chosen) {
            w.overtaken += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(waiting: &mut Vec<Waiter>) -> Option<Waiter> {
        let chosen = waiting.remove(next(waiting.iter().copied())?);
        went_first(&chosen, waiting.iter_mut());
        Some(chosen)
    }

    fn order_of(arrivals: &[(Priority, u64)], turns: usize) -> Vec<u64> {
        let mut waiting: Vec<Waiter> = arrivals.iter().map(|(l, a)| Waiter::new(*l, *a)).collect();
        (0..turns).filter_map(|_| take(&mut waiting).map(|w| w.arrival)).collect()
    }

    #[test]
    fn best_lane_first_then_arrival() {
        use Priority::*;
        let order = order_of(&[(Batch, 1), (Standard, 2), (Interactive, 3), (Standard, 4), (Interactive, 5)], 5);
        assert_eq!(order, vec![3, 5, 2, 4, 1]);
    }

    #[test]
    fn a_batch_waiter_is_overtaken_at_most_max_overtaken_times() {
        // One batch waiter, and interactive work that keeps arriving after it: two new
        // arrivals per turn, so the interactive queue never empties.
        let mut waiting = vec![Waiter::new(Priority::Batch, 0)];
        let mut arrivals = 1;
        let mut turns_before = None;
        for turn in 0..100 {
            for _ in 0..2 {
                waiting.push(Waiter::new(Priority::Interactive, arrivals));
                arrivals += 1;
            }
            let chosen = take(&mut waiting).unwrap();
            if chosen.lane == Priority::Batch {
                turns_before = Some(turn);
                break;
            }
        }
        assert_eq!(
            turns_before,
            Some(MAX_OVERTAKEN as usize),
            "overtaken exactly the bound, then served"
        );
    }

    #[test]
    fn within_a_lane_the_work_with_fewer_turns_goes_first_and_a_long_one_is_not_starved() {
        // A long batch on its 5th call, then short batches arriving one per turn, each with
        // no call before: they go first, until the long one was overtaken MAX_OVERTAKEN times.
        let mut waiting = vec![Waiter {
            had: 4,
            ..Waiter::new(Priority::Standard, 0)
        }];
        let mut served_before = 0;
        for arrival in 1..100 {
            waiting.push(Waiter::new(Priority::Standard, arrival));
            if take(&mut waiting).unwrap().arrival == 0 {
                break;
            }
            served_before += 1;
        }
        assert_eq!(served_before, MAX_OVERTAKEN);
    }

    #[test]
    fn earlier_arrivals_are_not_overtaken_by_the_bound_itself() {
        // Two batch waiters overtaken alike: they go in arrival order.
        let mut a = Waiter::new(Priority::Batch, 1);
        let mut b = Waiter::new(Priority::Batch, 2);
        a.overtaken = MAX_OVERTAKEN;
        b.overtaken = MAX_OVERTAKEN;
        let i = Waiter::new(Priority::Interactive, 3);
        assert_eq!(next([i, b, a]), Some(2));
    }
}
