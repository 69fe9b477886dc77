//! The merge rules: how one state change updates what the view keeps of a task. Topics are read
//! independently, so changes of one task arrive in any order; these rules make every order end in
//! the same state.

use sluice_schemas::{CompletionStatus, ProgressEvent};
use uuid::Uuid;

use super::{Change, Progress, Status, Stored, TaskStatus};

impl Change {
    pub(super) fn task_id(&self) -> Uuid {
        match self {
            Change::Queued(r) | Change::Redriven { record: r, .. } => r.task_id,
            Change::Progress(p) => p.task_id,
            Change::Completed(c) => c.task_id,
        }
    }

    fn tenant(&self) -> Option<&str> {
        match self {
            Change::Queued(r) | Change::Redriven { record: r, .. } => Some(&r.tenant),
            Change::Completed(c) => Some(&c.tenant),
            Change::Progress(_) => None,
        }
    }

    /// A status for a task seen first through this change.
    pub(super) fn first(&self) -> Option<Stored> {
        let (model, at) = match self {
            Change::Queued(r) | Change::Redriven { record: r, .. } => (r.model.clone(), r.submitted_at),
            Change::Completed(c) => (c.model.clone(), c.completed_at),
            // Progress carries no tenant: it waits for the task record (the topics are read
            // from their beginning, so it comes).
            Change::Progress(_) => return None,
        };
        Some(Stored {
            request_sha256: None,
            webhook: None,
            awaiting_record: matches!(self, Change::Completed(_)),
            tenant: self.tenant().unwrap_or_default().to_owned(),
            status: TaskStatus {
                task_id: self.task_id(),
                status: Status::Queued,
                model,
                created_at: at,
                updated_at: at,
                progress: None,
                outputs: Vec::new(),
                error: None,
                timings: None,
                attempt: 1,
            },
        })
    }
}

impl Stored {
    /// Applies a change. Topics are read independently, so changes of one task can arrive in
    /// any order: a terminal state is never undone, and a later attempt's completion replaces
    /// an earlier one.
    pub(super) fn apply(&mut self, change: &Change) {
        let s = &mut self.status;
        match change {
            Change::Queued(r) => {
                let hash = r.idempotency.as_ref().map(|i| &i.request_sha256);
                if self.request_sha256.is_some() && hash != self.request_sha256.as_ref() {
                    // Another request that reused the key (it raced past the check): the view
                    // shows the one that first used it; this one is dead-lettered by the worker.
                    return;
                }
                self.awaiting_record = false;
                let s = &mut self.status;
                s.created_at = r.submitted_at;
                s.model = r.model.clone();
                self.tenant = r.tenant.clone();
                self.request_sha256 = r.idempotency.as_ref().map(|i| i.request_sha256.clone());
                self.webhook = r.webhook.clone();
            }
            Change::Redriven { record, attempt, at } => {
                self.apply(&Change::Queued(record.clone()));
                let s = &mut self.status;
                // A new attempt starts over: queued, cancellable, nothing of the old one shown.
                // An older or repeated redrive changes nothing.
                if *attempt > s.attempt || (*attempt == s.attempt && s.status == Status::Queued) {
                    s.status = Status::Queued;
                    s.attempt = *attempt;
                    s.progress = None;
                    s.outputs.clear();
                    s.error = None;
                    s.timings = None;
                    s.updated_at = s.updated_at.max(*at);
                }
            }
            Change::Progress(p) => {
                if !s.status.is_terminal() {
                    s.status = Status::Running;
                    // A `started` record past step 0: the task carried on from a checkpoint.
                    let resumed = (p.event == ProgressEvent::Started && p.step > 0).then_some(p.step);
                    let before = s.progress.and_then(|old| old.resumed_from);
                    if s.progress.is_none_or(|old| p.step >= old.step) {
                        s.progress = Some(Progress {
                            step: p.step,
                            steps: p.steps,
                            resumed_from: None,
                        });
                    }
                    if let Some(progress) = &mut s.progress {
                        progress.resumed_from = before.max(resumed);
                    }
                    s.updated_at = s.updated_at.max(p.at);
                }
            }
            Change::Completed(c) => {
                if c.attempt < s.attempt {
                    return; // an earlier attempt's, read after the redrive that replaced it
                }
                // An attempt that succeeded stays succeeded, in either order: a late outcome of
                // the same attempt (from an owner that lost the partition while it ran, or
                // another request's record refused as an idempotency conflict) does not
                // overwrite it; its images exist.
                if c.attempt == s.attempt && s.status == Status::Succeeded && c.status != CompletionStatus::Succeeded {
                    return;
                }
                s.status = c.status.into();
                s.outputs = c.outputs.clone();
                s.error = c.error.clone();
                s.timings = Some(c.timings);
                s.attempt = c.attempt;
                s.updated_at = s.updated_at.max(c.completed_at);
                if let Some(p) = &mut s.progress {
                    p.step = p.steps;
                }
            }
        }
    }
}
