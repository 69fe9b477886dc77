//! The device gate: how many model calls run at once (one permit per engine slot; an exclusive
//! call takes them all), and whose turn it is when calls wait ([`super::turns`]): the best lane
//! first, in order of asking within a lane, none overtaken more than a bounded number of times.
//! A batch asks again for each of its calls, so batches of one lane take turns call by call.
//! The waiter whose turn it is waits for its permits; nobody passes it meanwhile, so an
//! exclusive call is not starved by single ones.

use std::sync::Mutex;

use tokio::sync::oneshot;

use super::turns::{self, Turn, Waiter};

pub(crate) struct Gate {
    state: Mutex<State>,
}

struct State {
    free: u32,
    arrivals: u64,
    waiting: Vec<Waiting>,
}

struct Waiting {
    turn: Waiter,
    permits: u32,
    grant: oneshot::Sender<()>,
}

impl State {
    /// Grants permits to whoever's turn it is, while they are free.
    fn grant(&mut self) {
        while let Some(i) = turns::next(self.waiting.iter().map(|w| w.turn)) {
            if self.waiting[i].permits > self.free {
                return;
            }
            let chosen = self.waiting.remove(i);
            turns::went_first(&chosen.turn, self.waiting.iter_mut().map(|w| &mut w.turn));
            self.free -= chosen.permits;
            // The receiver is alive: a waiter that goes away removes itself under this lock first.
            let _ = chosen.grant.send(());
        }
    }
}

/// Permits held; given back when dropped.
pub(crate) struct Permit<'a> {
    gate: &'a Gate,
    permits: u32,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        let mut state = self.gate.state.lock().expect("gate");
        state.free += self.permits;
        state.grant();
    }
}

/// A waiter's place in the queue: gone from it, or its permits given back, if dropped while
/// waiting.
struct Pending<'a> {
    gate: &'a Gate,
    arrival: u64,
    permits: u32,
    rx: Option<oneshot::Receiver<()>>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        let mut state = self.gate.state.lock().expect("gate");
        if let Some(i) = state.waiting.iter().position(|w| w.turn.arrival == self.arrival) {
            state.waiting.remove(i);
        } else if rx.try_recv().is_ok() {
            // Granted, never taken.
            state.free += self.permits;
        }
        state.grant();
    }
}

impl Gate {
    pub fn new(permits: u32) -> Gate {
        Gate {
            state: Mutex::new(State {
                free: permits,
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
            if state.waiting.is_empty() && state.free >= permits {
                state.free -= permits;
                return Permit { gate: self, permits };
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
            Pending {
                gate: self,
                arrival,
                permits,
                rx: Some(rx),
            }
        };
        // The gate lives as long as the engine: its sender is only dropped by a grant.
        let _ = pending.rx.as_mut().expect("waiting").await;
        pending.rx = None;
        Permit { gate: self, permits }
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
            Arc::new(Gate::new(1)),
            vec![(Batch, 1), (Standard, 1), (Interactive, 1), (Standard, 1)],
        )
        .await;
        assert_eq!(order, vec![2, 1, 3, 0]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_exclusive_call_in_its_turn_is_not_passed_by_single_ones() {
        // Two slots: one held; an exclusive call (both) asks, then a single one. The single would
        // fit beside the holder, but it is not its turn.
        let gate = Arc::new(Gate::new(2));
        let order = turns_of(gate, vec![(Priority::Standard, 2), (Priority::Standard, 1)]).await;
        assert_eq!(order, vec![0, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_goes_away_leaves_no_trace() {
        let gate = Gate::new(1);
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
}
