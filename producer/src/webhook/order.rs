//! The order of one task's events at its receiver. Its `started`, `progress` and `completed`
//! events come from two topics (progress and completions) and are handled concurrently, so
//! without care the last step's `progress` can overtake `completed`. Here, one task's events take
//! turns (a FIFO lock per task, held through the first attempt), `completed` is the last event a
//! receiver gets (any `started` or `progress` handled after it is superseded), `progress` steps
//! only move forward, and at most one `progress` per interval goes out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_schemas::WebhookEvent;
use uuid::Uuid;

/// What to do with an event, decided in its task's turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    Send,
    /// A `progress` sooner than the interval after the last one.
    Throttled,
    /// A `started` or `progress` after the task's `completed`, or a step not past the last one.
    Superseded,
}

struct TaskEvents {
    turn: Arc<tokio::sync::Mutex<()>>,
    /// When the last `progress` went out, and its step.
    last_progress: Option<(Instant, u32)>,
    completed: bool,
    touched: Instant,
}

pub(super) struct EventOrder {
    interval: Duration,
    tasks: Mutex<Tasks>,
}

/// The tasks remembered, and when to prune them.
struct Tasks {
    by_id: HashMap<Uuid, TaskEvents>,
    /// The size at which the next prune runs: a prune scans every task, so it runs only after
    /// half as many tasks again were added (O(1) amortised per event, however many are recent).
    prune_at: usize,
}

impl Tasks {
    /// Forgets idle tasks past their memory once the map has grown by half since the last
    /// prune; under sustained load, the least recently touched idle ones down to the bound.
    fn prune_if_due(&mut self) {
        if self.by_id.len() <= self.prune_at {
            return;
        }
        let idle = |t: &TaskEvents| Arc::strong_count(&t.turn) == 1;
        self.by_id.retain(|_, t| !idle(t) || t.touched.elapsed() < MEMORY);
        if self.by_id.len() > 2 * REMEMBERED {
            // More recent tasks than remembered (an O(n log n) sort, after n/2 additions).
            let mut by_age: Vec<(Instant, Uuid)> = self.by_id.iter().filter(|(_, t)| idle(t)).map(|(id, t)| (t.touched, *id)).collect();
            by_age.sort_unstable();
            let excess = self.by_id.len() - REMEMBERED;
            for (_, id) in by_age.into_iter().take(excess) {
                self.by_id.remove(&id);
            }
        }
        self.prune_at = self.by_id.len().max(REMEMBERED) + REMEMBERED / 2;
    }
}

/// Tasks remembered before idle ones are forgotten.
const REMEMBERED: usize = 100_000;
/// How long a task's events are remembered after its last one.
const MEMORY: Duration = Duration::from_secs(600);

impl EventOrder {
    pub(super) fn new(interval: Duration) -> EventOrder {
        EventOrder {
            interval,
            tasks: Mutex::new(Tasks {
                by_id: HashMap::new(),
                prune_at: REMEMBERED,
            }),
        }
    }

    /// The task's turn: hold its lock while deciding and making the first attempt.
    pub(super) fn turn(&self, task: Uuid) -> Arc<tokio::sync::Mutex<()>> {
        let mut tasks = self.tasks.lock().expect("not poisoned");
        tasks.prune_if_due();
        let entry = tasks.by_id.entry(task).or_insert_with(|| TaskEvents {
            turn: Arc::default(),
            last_progress: None,
            completed: false,
            touched: Instant::now(),
        });
        entry.touched = Instant::now();
        entry.turn.clone()
    }

    /// Decides on one event; call it in the task's turn.
    pub(super) fn admit(&self, task: Uuid, event: WebhookEvent, step: u32) -> Verdict {
        let mut tasks = self.tasks.lock().expect("not poisoned");
        let Some(t) = tasks.by_id.get_mut(&task) else {
            return Verdict::Send;
        };
        match event {
            WebhookEvent::Completed => {
                t.completed = true;
                Verdict::Send
            }
            _ if t.completed => Verdict::Superseded,
            WebhookEvent::Started if t.last_progress.is_some() => Verdict::Superseded,
            WebhookEvent::Started => Verdict::Send,
            WebhookEvent::Progress => match t.last_progress {
                Some((_, last)) if step <= last => Verdict::Superseded,
                Some((at, _)) if at.elapsed() < self.interval => Verdict::Throttled,
                _ => {
                    t.last_progress = Some((Instant::now(), step));
                    Verdict::Send
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completed_is_last_and_steps_only_move_forward_at_most_once_per_interval() {
        let order = EventOrder::new(Duration::from_millis(50));
        let task = Uuid::new_v4();
        let _ = order.turn(task);
        assert_eq!(order.admit(task, WebhookEvent::Started, 0), Verdict::Send);
        assert_eq!(order.admit(task, WebhookEvent::Progress, 1), Verdict::Send);
        assert_eq!(order.admit(task, WebhookEvent::Progress, 2), Verdict::Throttled);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(order.admit(task, WebhookEvent::Progress, 1), Verdict::Superseded);
        assert_eq!(order.admit(task, WebhookEvent::Started, 0), Verdict::Superseded);
        assert_eq!(order.admit(task, WebhookEvent::Progress, 3), Verdict::Send);
        assert_eq!(order.admit(task, WebhookEvent::Completed, 0), Verdict::Send);
        std::thread::sleep(Duration::from_millis(60));
        // The last step handled after the completion (it came from the other topic) is dropped.
        assert_eq!(order.admit(task, WebhookEvent::Progress, 4), Verdict::Superseded);
        // A completion announced again (a replay) goes out again: receivers dedupe by webhook-id.
        assert_eq!(order.admit(task, WebhookEvent::Completed, 0), Verdict::Send);
    }

    #[test]
    fn remembered_tasks_stay_bounded_under_sustained_load() {
        let order = EventOrder::new(Duration::from_secs(1));
        // Three times as many tasks as remembered, all recent: the least recently touched go.
        let first = Uuid::new_v4();
        drop(order.turn(first));
        for _ in 0..3 * REMEMBERED {
            drop(order.turn(Uuid::new_v4()));
        }
        let remembered = order.tasks.lock().unwrap();
        let tasks = &remembered.by_id;
        assert!(tasks.len() <= 2 * REMEMBERED + 1, "{}", tasks.len());
        assert!(!tasks.contains_key(&first), "the oldest went first");
    }

    #[tokio::test]
    async fn one_task_takes_turns_others_do_not_wait() {
        let order = EventOrder::new(Duration::ZERO);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let turn_a = order.turn(a);
        let held = turn_a.lock().await;
        assert!(order.turn(a).try_lock().is_err(), "a second event of the task waits");
        assert!(order.turn(b).try_lock().is_ok(), "another task does not");
        drop(held);
        assert!(order.turn(a).try_lock().is_ok());
    }
}
