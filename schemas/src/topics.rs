//! Default topic names (each binary lets them be overridden), and where each lane's tasks are.

use crate::Priority;

pub const TASKS: &str = "sluice.tasks.v1";
pub const COMPLETIONS: &str = "sluice.completions.v1";
pub const DLQ: &str = "sluice.dlq.v1";
pub const PROGRESS: &str = "sluice.progress.v1";
pub const CONTROL: &str = "sluice.control.v1";
/// Pending webhook retries, one partition per delay of the retry schedule.
pub const WEBHOOK_RETRY: &str = "sluice.webhooks.retry.v1";
/// Webhook events that were given up.
pub const WEBHOOK_DLQ: &str = "sluice.webhooks.dlq.v1";
/// Workers' learned batch ceilings, compacted: the latest per device class and bucket.
pub const CEILINGS: &str = "sluice.ceilings.v1";
/// The interactive lane's topic in the chart and the local stack: a topic of its own.
pub const TASKS_INTERACTIVE: &str = "sluice.tasks.interactive.v1";
/// The batch lane's topic in the chart and the local stack.
pub const TASKS_BATCH: &str = "sluice.tasks.batch.v1";

/// Where each lane's tasks are published and read: the `interactive` and `batch` lanes in topics
/// of their own, or in the tasks topic with the `standard` lane. A lane of its own is a work
/// source of its own: a worker bounds and pauses its reading per topic, so a backlog of batch
/// records never stands in front of an interactive one, and each lane's lag is its topic's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskTopics {
    tasks: String,
    interactive: Option<String>,
    batch: Option<String>,
}

impl TaskTopics {
    /// `interactive` and `batch` empty: that lane shares `tasks`.
    pub fn new(tasks: &str, interactive: &str, batch: &str) -> TaskTopics {
        let own = |t: &str| (!t.is_empty() && t != tasks).then(|| t.to_owned());
        TaskTopics {
            tasks: tasks.to_owned(),
            interactive: own(interactive),
            batch: own(batch),
        }
    }

    /// All lanes in one topic.
    pub fn single(tasks: &str) -> TaskTopics {
        TaskTopics::new(tasks, "", "")
    }

    /// The tasks topic: the standard lane's, and the others' where they have none of their own.
    pub fn tasks(&self) -> &str {
        &self.tasks
    }

    /// The topic `lane`'s tasks are published to.
    pub fn of(&self, lane: Priority) -> &str {
        match lane {
            Priority::Interactive => self.interactive.as_deref(),
            Priority::Standard => None,
            Priority::Batch => self.batch.as_deref(),
        }
        .unwrap_or(&self.tasks)
    }

    /// Every distinct topic, the tasks topic first.
    pub fn all(&self) -> Vec<&str> {
        let mut all = vec![self.tasks.as_str()];
        for t in [&self.interactive, &self.batch].into_iter().flatten() {
            if !all.contains(&t.as_str()) {
                all.push(t);
            }
        }
        all
    }

    /// [`TaskTopics::all`], owned.
    pub fn names(&self) -> Vec<String> {
        self.all().into_iter().map(str::to_owned).collect()
    }

    /// Whether some lane has a topic of its own.
    pub fn has_lane_topics(&self) -> bool {
        self.all().len() > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_without_a_topic_of_its_own_shares_the_tasks_topic() {
        let one = TaskTopics::single("t");
        assert!(Priority::ALL.iter().all(|&p| one.of(p) == "t"));
        assert_eq!(one.all(), ["t"]);
        assert!(!one.has_lane_topics());
        assert_eq!(TaskTopics::new("t", "t", ""), one, "naming the tasks topic is sharing it");

        let lanes = TaskTopics::new("t", "t.i", "t.b");
        assert_eq!(
            Priority::ALL.map(|p| lanes.of(p)),
            ["t.i", "t", "t.b"],
            "interactive, standard, batch"
        );
        assert_eq!(lanes.all(), ["t", "t.i", "t.b"]);
        assert!(lanes.has_lane_topics());

        let shared = TaskTopics::new("t", "t.x", "t.x");
        assert_eq!(shared.all(), ["t", "t.x"], "two lanes in one topic of their own: listed once");
        assert_eq!(TaskTopics::new("t", "", "t.b").of(Priority::Interactive), "t");
    }
}
