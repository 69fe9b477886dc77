//! A step-by-step bucket's batch ([`Stepped`]) run as calls of a few steps: each row's step, the
//! state a call hands the next (the key's `carry` outputs, fed back under their input names), and
//! where each task stands when a call fails part way, so that the task carries on from there in
//! a smaller batch rather than from its first step.

use std::collections::HashMap;
use std::time::Instant;

use crate::engine::{Call, CallTask, Stepped, Tensor};
use crate::models::Bucket;

/// Where a task's rows stand in their bucket's steps: the step they reached, and the inputs that
/// carry them on from it (the key's carry inputs, the task's rows only).
#[derive(Debug, Clone, PartialEq)]
pub struct Resume {
    pub step: usize,
    pub carried: Vec<Tensor>,
}

/// The resume points of a batch's tasks, by task id, kept between its calls.
pub(crate) type Resumes = HashMap<String, Resume>;

/// Where the resume points of tasks of buckets that keep checkpoints
/// ([`Stepped::checkpoint_every`]) are kept, outside the process.
pub(crate) trait Checkpoints: Send + Sync {
    /// Keeps the resume point of `task` (its attempt's). It must not hold up the engine: the
    /// write runs on its own, and may be skipped when writes are behind.
    fn save(&self, task: &CallTask, bucket: &Bucket, resume: Resume);
}

/// `rows` rows of zeros shaped as `like`'s.
fn zero_rows(like: &Tensor, rows: usize) -> Tensor {
    let mut shape = like.shape.clone();
    shape[0] = rows;
    let n = shape.iter().product();
    Tensor::f32(like.name.clone(), shape, vec![0.0; n])
}

/// A batch's rows as its calls advance them.
pub(super) struct Progress<'a> {
    stepped: &'a Stepped,
    /// Each row's next step, and before the last call.
    at: Vec<usize>,
    before: Vec<usize>,
    /// What the last call handed on, for every row (empty while no row has moved).
    carried: Vec<Tensor>,
    /// When each row's state was last kept, or its run here began (for
    /// [`Stepped::checkpoint_seconds`]).
    kept: Vec<Instant>,
}

impl<'a> Progress<'a> {
    /// The rows of `call` at the bucket's first step, or where their task's resume point says.
    pub(super) fn start(call: &Call, stepped: &'a Stepped, resumes: &Resumes) -> Progress<'a> {
        let points: Vec<Option<&Resume>> = call.tasks.iter().map(|t| resumes.get(&t.id)).collect();
        let at: Vec<usize> = call
            .tasks
            .iter()
            .zip(&points)
            .flat_map(|(t, r)| std::iter::repeat_n(r.map_or(stepped.steps.start, |r| r.step), t.rows))
            .collect();
        let mut carried = Vec::new();
        if let Some(some) = points.iter().flatten().next() {
            for like in &some.carried {
                let parts: Vec<Tensor> = call
                    .tasks
                    .iter()
                    .zip(&points)
                    .map(|(t, r)| {
                        r.and_then(|r| r.carried.iter().find(|c| c.name == like.name).cloned())
                            .unwrap_or_else(|| zero_rows(like, t.rows))
                    })
                    .collect();
                carried.push(Tensor::concat(&parts.iter().collect::<Vec<_>>()));
            }
        }
        Progress {
            stepped,
            before: at.clone(),
            kept: vec![Instant::now(); at.len()],
            at,
            carried,
        }
    }

    /// Whether every row has run its last step.
    pub(super) fn done(&self) -> bool {
        self.at.iter().all(|&s| s >= self.stepped.steps.end)
    }

    /// Whether the batch needs no more than one call of its whole steps (nothing resumed, and
    /// no more steps than a call may run).
    pub(super) fn in_one_call(&self, per_call: usize) -> bool {
        self.carried.is_empty() && self.stepped.steps.len() <= per_call
    }

    /// The next call: `call`'s inputs, each row's next `per_call` steps, and what the last call
    /// handed on.
    pub(super) fn next_call(&self, call: &Call, per_call: usize) -> Call {
        let end = self.stepped.steps.end;
        let rows = self.at.len();
        let mut inputs = call.inputs.clone();
        let begin: Vec<i64> = self.at.iter().map(|&s| s as i64).collect();
        let until: Vec<i64> = self.at.iter().map(|&s| (s + per_call).min(end) as i64).collect();
        inputs.push(Tensor::i64("step_begin", vec![rows], begin));
        inputs.push(Tensor::i64("step_end", vec![rows], until));
        inputs.extend(self.carried.iter().cloned());
        Call {
            key: call.key.clone(),
            inputs,
            tasks: call.tasks.clone(),
        }
    }

    /// After a call of `per_call` steps returned `outputs`: each row `per_call` steps on, and
    /// the carry outputs kept for the next call.
    pub(super) fn advance(&mut self, outputs: &[Tensor], per_call: usize) {
        let end = self.stepped.steps.end;
        self.before.clone_from(&self.at);
        for s in &mut self.at {
            *s = (*s + per_call).min(end);
        }
        self.carried = self
            .stepped
            .carry
            .iter()
            .filter_map(|&(output, input)| {
                let t = outputs.iter().find(|t| t.name == output)?;
                Some(Tensor {
                    name: input.to_owned(),
                    ..t.clone()
                })
            })
            .collect();
    }

    /// Per task of `call`, whether its rows ran their last step, or it was cancelled (the call's
    /// `cancelled` output, 1 for each row of a task cancelled mid-loop): it leaves the running
    /// set.
    pub(super) fn finished(&self, call: &Call, outputs: &[Tensor]) -> Vec<bool> {
        let cancelled = outputs.iter().find(|t| t.name == "cancelled").and_then(|t| t.floats().ok());
        call.task_rows()
            .map(|(_, rows)| {
                let ended = rows.clone().all(|r| self.at[r] >= self.stepped.steps.end);
                let stopped = cancelled.is_some_and(|c| c.get(rows.start).is_some_and(|&v| v > 0.5));
                ended || stopped
            })
            .collect()
    }

    /// Keeps the rows of the tasks of `call` that `keep` says, in order; the others left.
    pub(super) fn retain(&mut self, call: &Call, keep: &[bool]) {
        let spans: Vec<std::ops::Range<usize>> = call
            .task_rows()
            .zip(keep)
            .filter(|(_, kept)| **kept)
            .map(|((_, rows), _)| rows)
            .collect();
        let pick = |v: &[usize]| spans.iter().flat_map(|s| v[s.clone()].iter().copied()).collect::<Vec<_>>();
        self.at = pick(&self.at);
        self.before = pick(&self.before);
        self.kept = spans.iter().flat_map(|s| self.kept[s.clone()].iter().copied()).collect();
        self.carried = self
            .carried
            .iter()
            .map(|t| {
                Tensor::concat(
                    &spans
                        .iter()
                        .map(|s| t.slice_rows(s.start, s.end))
                        .collect::<Vec<_>>()
                        .iter()
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
    }

    /// A task of `rows` rows joins after the others: at the bucket's first step, or where its
    /// resume point says.
    pub(super) fn join(&mut self, rows: usize, resume: Option<&Resume>) {
        let step = resume.map_or(self.stepped.steps.start, |r| r.step);
        let had = self.at.len();
        self.at.extend(std::iter::repeat_n(step, rows));
        self.before.extend(std::iter::repeat_n(step, rows));
        self.kept.extend(std::iter::repeat_n(Instant::now(), rows));
        let resumed = resume.map(|r| r.carried.as_slice()).unwrap_or_default();
        if self.carried.is_empty() && !resumed.is_empty() {
            // Nothing carried yet: the rows before it carry zeros (they are at their first step).
            self.carried = resumed.iter().map(|t| zero_rows(t, had)).collect();
        }
        for carried in &mut self.carried {
            let theirs = resumed
                .iter()
                .find(|t| t.name == carried.name)
                .cloned()
                .unwrap_or_else(|| zero_rows(carried, rows));
            *carried = Tensor::concat(&[&*carried, &theirs]);
        }
    }

    /// The resume points of the tasks due a checkpoint, with steps left: their rows passed a
    /// multiple of the bucket's `checkpoint_every` steps (from its first) in the last call, or
    /// moved with `checkpoint_seconds` gone by since their state was last kept (or their run here
    /// began). Draining (the worker, or a task's partition: [`crate::engine::TaskHooks::handed_off`]), every
    /// task whose rows moved. Their state counts as kept from now.
    pub(super) fn due<'c>(&mut self, call: &'c Call, draining: bool) -> Vec<(&'c CallTask, Resume)> {
        let (first, end) = (self.stepped.steps.start, self.stepped.steps.end);
        let (every, seconds) = (self.stepped.checkpoint_every, self.stepped.checkpoint_seconds);
        let mut handed_off = vec![draining; self.at.len()];
        for (task, rows) in call.task_rows() {
            if task.hooks.as_ref().is_some_and(|h| h.handed_off()) {
                handed_off[rows].fill(true);
            }
        }
        let points = self.points(call, |from| {
            let (was, is) = (self.before[from], self.at[from]);
            let by_steps = every.is_some_and(|every| (is - first) / every.max(1) > (was - first) / every.max(1));
            let by_time = seconds.is_some_and(|s| self.kept[from].elapsed() >= s);
            is < end && is > was && (handed_off[from] || by_steps || by_time)
        });
        for (task, rows) in call.task_rows() {
            if points.iter().any(|(due, _)| due.id == task.id) {
                self.kept[rows].fill(Instant::now());
            }
        }
        points
    }

    /// Each task's resume point into `resumes`, for tasks whose rows have moved past the
    /// bucket's first step (after a call that failed, the state before it).
    pub(super) fn keep(&self, call: &Call, resumes: &mut Resumes) {
        if self.carried.is_empty() {
            return;
        }
        let points = self.points(call, |from| self.at[from] != self.stepped.steps.start);
        resumes.extend(points.into_iter().map(|(task, resume)| (task.id.clone(), resume)));
    }

    /// The resume points of the tasks of `call` whose first row `chosen` picks: their step and
    /// their rows of what the last call handed on.
    fn points<'c>(&self, call: &'c Call, chosen: impl Fn(usize) -> bool) -> Vec<(&'c CallTask, Resume)> {
        let mut points = Vec::new();
        for (task, rows) in call.task_rows() {
            let (from, to) = (rows.start, rows.end);
            if chosen(from) {
                let carried = self.carried.iter().map(|t| t.slice_rows(from, to)).collect();
                points.push((
                    task,
                    Resume {
                        step: self.at[from],
                        carried,
                    },
                ));
            }
        }
        points
    }
}
