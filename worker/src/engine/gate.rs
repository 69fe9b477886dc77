//! The device gate: how many model calls run at once (one permit per engine slot; an exclusive
//! call takes them all), and whose turn it is when calls wait ([`super::turns`]): the best lane
//! first, in order of asking within a lane, none overtaken more than a bounded number of times.
//! A batch asks again for each of its calls, so batches of one lane take turns call by call.
//! The waiter whose turn it is waits for its permits; nobody passes it meanwhile, so an
//! exclusive call is not starved by single ones. The one exception is a slot kept for the
//! interactive lane (`SLUICE_INTERACTIVE_SLOTS`): an interactive call takes a kept slot first,
//! even past the waiter whose turn it is, unless that waiter needs every slot.

use std::sync::Mutex;

use sluice_schemas::Priority;
use tokio::sync::oneshot;

use super::turns::{self, Turn, Waiter};

pub(crate) struct Gate {
    state: Mutex<State>,
}

struct State {
    /// Free shared permits.
    free: u32,
    /// Free permits kept for the interactive lane.
    kept_free: u32,
    /// Every permit, kept ones included: what an exclusive call takes.
    total: u32,
    arrivals: u64,
    waiting: Vec<Waiting>,
}

struct Waiting {
    turn: Waiter,
    permits: u32,
    grant: oneshot::Sender<Taken>,
}

/// Permits taken from each pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Taken {
    shared: u32,
    kept: u32,
}

impl State {
    /// The permits `permits` in `lane` would take now, if they are free: an exclusive call
    /// (every permit) takes both pools whole; an interactive call takes kept permits first, so
    /// that the shared ones stay with the other lanes' calls (a running batch gives its permit
    /// back between its calls), then shared ones; any other only shared ones.
    fn fits(&self, permits: u32, lane: Priority) -> Option<Taken> {
        if permits >= self.total {
            (self.free + self.kept_free == self.total).then_some(Taken {
                shared: self.free,
                kept: self.kept_free,
            })
        } else if lane == Priority::Interactive && permits <= self.free + self.kept_free {
            let kept = permits.min(self.kept_free);
            Some(Taken {
                shared: permits - kept,
                kept,
            })
        } else if permits <= self.free {
            Some(Taken { shared: permits, kept: 0 })
        } else {
            None
        }
    }

    fn take(&mut self, taken: Taken) {
        self.free -= taken.shared;
        self.kept_free -= taken.kept;
    }

    fn give_back(&mut self, taken: Taken) {
        self.free += taken.shared;
        self.kept_free += taken.kept;
    }

    /// Grants permits to whoever's turn it is, while they are free; meanwhile, interactive
    /// calls that fit take the kept permits.
    fn grant(&mut self) {
        while let Some(i) = turns::next(self.waiting.iter().map(|w| w.turn)) {
            let first = &self.waiting[i];
            let chosen = match self.fits(first.permits, first.turn.lane) {
                Some(taken) => (i, taken),
                None if first.permits >= self.total || self.kept_free == 0 => return,
                None => {
                    // The interactive waiters that fit, with what each would take.
                    let fitting: Vec<(usize, Taken)> = self
                        .waiting
                        .iter()
                        .enumerate()
                        .filter(|(_, w)| w.turn.lane == Priority::Interactive)
                        .filter_map(|(j, w)| Some((j, self.fits(w.permits, w.turn.lane)?)))
                        .collect();
                    match turns::next(fitting.iter().map(|&(j, _)| self.waiting[j].turn)) {
                        Some(k) => fitting[k],
                        None => return,
                    }
                }
            };
            let chosen_waiter = self.waiting.remove(chosen.0);
            turns::went_first(&chosen_waiter.turn, self.waiting.iter_mut().map(|w| &mut w.turn));
            self.take(chosen.1);
            // The receiver is alive: a waiter that goes away removes itself under this lock
            // first, and takes back what was granted and not taken.
            let _ = chosen_waiter.grant.send(chosen.1);
        }
    }
}

/// Permits held; given back when dropped.
pub(crate) struct Permit<'a> {
    gate: &'a Gate,
    taken: Taken,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        let mut state = self.gate.state.lock().expect("gate");
        state.give_back(self.taken);
        state.grant();
    }
}

/// A waiter's place in the queue: gone from it, or its permits given back, if dropped while
/// waiting.
struct Pending<'a> {
    gate: &'a Gate,
    arrival: u64,
    rx: Option<oneshot::Receiver<Taken>>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        let mut state = self.gate.state.lock().expect("gate");
        if let Some(i) = state.waiting.iter().position(|w| w.turn.arrival == self.arrival) {
            state.waiting.remove(i);
        } else if let Ok(taken) = rx.try_recv() {
            // Granted, never taken.
            state.give_back(taken);
        }
        state.grant();
    }
}

impl Gate {
    /// `shared` permits for any call, and `kept` more that only interactive calls (and an
    /// exclusive one, which takes every permit) may take.
    pub fn new(shared: u32, kept: u32) -> Gate {
        Gate {
            state: Mutex::new(State {
                free: shared,
                kept_free: kept,
                total: shared + kept,
                arrivals: 0,
                waiting: Vec::new(),
            }),
        }
    }

    /// `permits` for a call, in its turn.
    pub async fn acquire(&self, permits: u32, turn: Turn) -> Permit<'_> {
        let mut pending = {
            let mut state = self.state.lock().expect("gate");
            state.arrivals += 1;
            let arrival = state.arrivals;
            if state.waiting.is_empty()
                && let Some(taken) = state.fits(permits, turn.lane)
            {
                state.take(taken);
                return Permit { gate: self, taken };
            }
            let (grant, rx) = oneshot::channel();
            state.waiting.push(Waiting {
                turn: Waiter {
                    had: turn.had,
                    ..Waiter::new(turn.lane, arrival)
                },
                permits,
                grant,
            });
            // An interactive call may fit a kept permit past those waiting.
            state.grant();
            Pending {
                gate: self,
                arrival,
                rx: Some(rx),
            }
        };
        // The gate lives as long as the engine: its sender is only dropped by a grant.
        let taken = pending.rx.as_mut().expect("waiting").await.expect("granted");
        pending.rx = None;
        Permit { gate: self, taken }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use sluice_schemas::Priority;

    use super::*;

    fn lane(lane: Priority) -> Turn {
        Turn { lane, had: 0 }
    }

    /// A call of `l` that asks `gate` for `permits` on a task of its own and holds them `hold`.
    fn call(gate: &Arc<Gate>, permits: u32, l: Priority, hold: Duration) -> tokio::task::JoinHandle<()> {
        let gate = gate.clone();
        tokio::spawn(async move {
            let _permit = gate.acquire(permits, lane(l)).await;
            tokio::time::sleep(hold).await;
        })
    }

    /// Calls queued behind one that holds the gate, each recording its turn when it gets in.
    async fn turns_of(gate: Arc<Gate>, calls: Vec<(Priority, u32)>) -> Vec<usize> {
        let holder = gate.acquire(1, lane(Priority::Standard)).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (i, (l, permits)) in calls.into_iter().enumerate() {
            let (gate, order) = (gate.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _permit = gate.acquire(permits, lane(l)).await;
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }));
            // Each in the queue before the next asks.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(holder);
        for t in tasks {
            t.await.unwrap();
        }
        Arc::try_unwrap(order).unwrap().into_inner().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn calls_go_by_lane_then_in_order_of_asking() {
        use Priority::*;
        let order = turns_of(
            Arc::new(Gate::new(1, 0)),
            vec![(Batch, 1), (Standard, 1), (Interactive, 1), (Standard, 1)],
        )
        .await;
        assert_eq!(order, vec![2, 1, 3, 0]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_exclusive_call_in_its_turn_is_not_passed_by_single_ones() {
        // Two slots: one held; an exclusive call (both) asks, then a single one. The single would
        // fit beside the holder, but it is not its turn.
        let gate = Arc::new(Gate::new(2, 0));
        let order = turns_of(gate, vec![(Priority::Standard, 2), (Priority::Standard, 1)]).await;
        assert_eq!(order, vec![0, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_goes_away_leaves_no_trace() {
        let gate = Gate::new(1, 0);
        let held = gate.acquire(1, lane(Priority::Standard)).await;
        // Gives up while queued.
        assert!(
            tokio::time::timeout(Duration::from_millis(5), gate.acquire(1, lane(Priority::Interactive)))
                .await
                .is_err()
        );
        drop(held);
        // The permit is free again, and nobody is queued ahead.
        let again = tokio::time::timeout(Duration::from_millis(5), gate.acquire(1, lane(Priority::Batch))).await;
        assert!(again.is_ok(), "the permit came back");
        assert!(gate.state.lock().unwrap().waiting.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn an_interactive_call_takes_the_kept_slot_first() {
        let gate = Gate::new(1, 1);
        let interactive = gate.acquire(1, lane(Priority::Interactive)).await;
        {
            let state = gate.state.lock().unwrap();
            assert_eq!((state.free, state.kept_free), (1, 0), "the shared slot stays with the other lanes");
        }
        let standard = tokio::time::timeout(Duration::from_millis(5), gate.acquire(1, lane(Priority::Standard))).await;
        assert!(standard.is_ok(), "a standard call runs beside it");
        drop(interactive);
    }

    #[tokio::test(start_paused = true)]
    async fn an_interactive_call_takes_the_kept_slot_while_the_shared_one_is_busy() {
        let gate = Arc::new(Gate::new(1, 1));
        let held = gate.acquire(1, lane(Priority::Batch)).await;
        let standard = call(&gate, 1, Priority::Standard, Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let interactive = tokio::time::timeout(Duration::from_millis(5), gate.acquire(1, lane(Priority::Interactive))).await;
        assert!(interactive.is_ok(), "the kept slot was free");
        // A second interactive call finds both slots busy; the standard one never takes the kept.
        assert!(
            tokio::time::timeout(Duration::from_millis(5), gate.acquire(1, lane(Priority::Interactive)))
                .await
                .is_err()
        );
        drop(interactive);
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(!standard.is_finished(), "a standard call waits for the shared slot");
        drop(held);
        tokio::time::timeout(Duration::from_millis(5), standard).await.expect("in").unwrap();
        let state = gate.state.lock().unwrap();
        assert_eq!(
            (state.free, state.kept_free, state.waiting.len()),
            (1, 1, 0),
            "every permit back in its pool"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_exclusive_call_in_its_turn_takes_the_kept_slot_too_and_is_not_passed_for_it() {
        let gate = Arc::new(Gate::new(1, 1));
        let held = gate.acquire(1, lane(Priority::Standard)).await;
        // An exclusive call first in turn (a rebuild asks as interactive, with no turns had).
        let exclusive = call(&gate, 2, Priority::Interactive, Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(1)).await;
        // The kept slot is free, but an interactive single does not pass the exclusive call.
        let single = call(&gate, 1, Priority::Interactive, Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(!single.is_finished() && !exclusive.is_finished());
        drop(held);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!single.is_finished(), "the exclusive call holds both slots");
        exclusive.await.unwrap();
        single.await.unwrap();
        let state = gate.state.lock().unwrap();
        assert_eq!((state.free, state.kept_free), (1, 1), "every permit back in its pool");
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_permit_granted_and_never_taken_goes_back_to_its_pool() {
        let gate = Gate::new(1, 1);
        let held = gate.acquire(1, lane(Priority::Standard)).await;
        {
            let mut state = gate.state.lock().unwrap();
            // What a grant leaves when its waiter is dropped before it wakes.
            let (grant, rx) = oneshot::channel();
            state.take(Taken { shared: 0, kept: 1 });
            grant.send(Taken { shared: 0, kept: 1 }).unwrap();
            drop(state);
            drop(Pending {
                gate: &gate,
                arrival: 99,
                rx: Some(rx),
            });
        }
        drop(held);
        let state = gate.state.lock().unwrap();
        assert_eq!((state.free, state.kept_free), (1, 1));
    }
}
