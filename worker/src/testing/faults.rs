//! Fault injection for tests of real worker processes (`SLUICE_TEST_FAULTS`, hidden; never set in
//! production): model code that panics on chosen tasks, so that tests can show a panic fails its
//! task and nothing else. A task is chosen by its seed:
//!
//! - `panic-prepare=SEED`: preparing the task's inputs panics;
//! - `panic-run=SEED`: the backend call of any batch holding the task panics;
//! - `panic-render=SEED`: rendering the task's images panics;
//! - `abort-run=SEED`: the backend call of any batch holding the task aborts the process, as a
//!   crash in native code would (no panic handler sees it);
//! - `hold-run=SEED`: the backend call of any batch holding the task waits until the task is
//!   cancelled (two minutes at most), then runs: a task that is certainly running, or queued
//!   behind one, when a test cancels it, however fast the device;
//! - `leak-load=1`: every load of the model loads it twice and never drops the second copy, as
//!   a reload that leaks its weights would (what the reload's memory bound must catch).
//!
//! Every other method of the adapter is the real one's.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_schemas::TaskRecord;

use crate::engine::{Backend, Call, CallTask, EngineError, Placement, SessionOptions, Tensor};
use crate::models::encode::Image;
use crate::models::{Bucket, ModelAdapter, ModelError, Prepared, Render};

/// The faults to inject, by seed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    prepare: HashSet<u64>,
    run: HashSet<u64>,
    render: HashSet<u64>,
    abort: HashSet<u64>,
    hold: HashSet<u64>,
    leak_load: bool,
}

impl Faults {
    /// Parses `kind=seed` entries.
    pub fn parse(entries: &[String]) -> Result<Faults, String> {
        let mut faults = Faults::default();
        for entry in entries.iter().filter(|e| !e.trim().is_empty()) {
            let (kind, seed) = entry
                .split_once('=')
                .ok_or_else(|| format!("fault {entry:?}: expected kind=seed"))?;
            let seed: u64 = seed.trim().parse().map_err(|_| format!("fault {entry:?}: bad seed"))?;
            let set = match kind.trim() {
                "panic-prepare" => &mut faults.prepare,
                "panic-run" => &mut faults.run,
                "panic-render" => &mut faults.render,
                "abort-run" => &mut faults.abort,
                "hold-run" => &mut faults.hold,
                "leak-load" => {
                    faults.leak_load = seed != 0;
                    continue;
                }
                other => {
                    return Err(format!(
                        "fault {entry:?}: unknown kind {other:?} (panic-prepare, panic-run, panic-render, abort-run, hold-run, leak-load)"
                    ));
                }
            };
            set.insert(seed);
        }
        Ok(faults)
    }

    pub fn is_empty(&self) -> bool {
        self.prepare.is_empty()
            && self.run.is_empty()
            && self.render.is_empty()
            && self.abort.is_empty()
            && self.hold.is_empty()
            && !self.leak_load
    }

    /// `adapter` with these faults injected.
    pub(crate) fn inject(self: &Arc<Self>, adapter: Arc<dyn ModelAdapter>) -> Arc<dyn ModelAdapter> {
        Arc::new(Faulty {
            inner: adapter,
            faults: self.clone(),
            doomed: Arc::new(Mutex::new(HashMap::new())),
        })
    }
}

struct Faulty {
    inner: Arc<dyn ModelAdapter>,
    faults: Arc<Faults>,
    /// Ids of prepared tasks whose backend call must fail, and how.
    doomed: Arc<Mutex<HashMap<String, Doom>>>,
}

#[derive(Debug, Clone, Copy)]
enum Doom {
    Panic,
    Abort,
    Hold,
}

/// How long a held call waits for its task's cancel before it runs anyway.
const HOLD_AT_MOST: Duration = Duration::from_secs(120);

impl ModelAdapter for Faulty {
    fn bucket(&self, task: &TaskRecord) -> Result<Bucket, ModelError> {
        self.inner.bucket(task)
    }

    fn prepare(&self, task: &TaskRecord, inputs: &crate::models::InputImages) -> Result<Prepared, ModelError> {
        let seed = task.request.seed;
        if self.faults.prepare.contains(&seed) {
            panic!("injected fault: prepare of task {} (seed {seed})", task.task_id);
        }
        if self.faults.run.contains(&seed) {
            self.doomed.lock().expect("doomed").insert(task.task_id.to_string(), Doom::Panic);
        }
        if self.faults.abort.contains(&seed) {
            self.doomed.lock().expect("doomed").insert(task.task_id.to_string(), Doom::Abort);
        }
        if self.faults.hold.contains(&seed) {
            self.doomed.lock().expect("doomed").insert(task.task_id.to_string(), Doom::Hold);
        }
        let mut prepared = self.inner.prepare(task, inputs)?;
        if self.faults.render.contains(&seed) {
            prepared.render = Box::new(PanickingRender {
                task: task.task_id.to_string(),
            });
        }
        Ok(prepared)
    }

    fn entry(&self) -> Option<&'static str> {
        self.inner.entry()
    }

    fn load(&self, path: &Path, options: &SessionOptions) -> Result<Box<dyn Backend>, EngineError> {
        if self.faults.leak_load {
            let leaked = self.inner.load(path, options)?;
            tracing::warn!(path = %path.display(), "injected fault: a second copy of the model is loaded and never dropped");
            std::mem::forget(leaked);
        }
        Ok(Box::new(FaultyBackend {
            inner: self.inner.load(path, options)?,
            doomed: self.doomed.clone(),
        }))
    }

    fn steps(&self, task: &TaskRecord) -> Option<u32> {
        self.inner.steps(task)
    }

    fn describe(&self, task: &TaskRecord) -> serde_json::Map<String, serde_json::Value> {
        self.inner.describe(task)
    }
}

struct FaultyBackend {
    inner: Box<dyn Backend>,
    doomed: Arc<Mutex<HashMap<String, Doom>>>,
}

impl Backend for FaultyBackend {
    fn run(&mut self, call: &Call) -> Result<Vec<Tensor>, EngineError> {
        let doomed = self.doomed.lock().expect("doomed").clone();
        for task in &call.tasks {
            match doomed.get(&task.id) {
                Some(Doom::Panic) => panic!("injected fault: a batch of {} holding task {}", call.tasks.len(), task.id),
                Some(Doom::Abort) => {
                    eprintln!(
                        "injected fault: aborting in a batch of {} holding task {}",
                        call.tasks.len(),
                        task.id
                    );
                    std::process::abort();
                }
                Some(Doom::Hold) => hold_until_cancelled(task),
                None => {}
            }
        }
        self.inner.run(call)
    }

    fn release_memory(&mut self) {
        self.inner.release_memory();
    }

    fn placement(&self) -> Placement {
        self.inner.placement()
    }
}

/// Waits until `task` is cancelled, or [`HOLD_AT_MOST`].
fn hold_until_cancelled(task: &CallTask) {
    let started = Instant::now();
    eprintln!("injected fault: holding the call of task {} until it is cancelled", task.id);
    while !task.hooks.as_ref().is_some_and(|h| h.cancelled()) && started.elapsed() < HOLD_AT_MOST {
        std::thread::sleep(Duration::from_millis(10));
    }
}

struct PanickingRender {
    task: String,
}

impl Render for PanickingRender {
    fn render(&self, _: &[Tensor], _: Range<usize>) -> Result<Vec<Image>, ModelError> {
        panic!("injected fault: render of task {}", self.task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_faults_and_refuses_unknown_ones() {
        let f = Faults::parse(&["panic-run=7".into(), " panic-prepare = 8".into(), "".into(), "abort-run=9".into()]).unwrap();
        assert!(f.run.contains(&7) && f.prepare.contains(&8) && f.render.is_empty() && f.abort.contains(&9));
        let f = Faults::parse(&["hold-run=5".into(), "leak-load=1".into()]).unwrap();
        assert!(f.hold.contains(&5) && f.leak_load && !f.is_empty());
        assert!(Faults::parse(&["explode=1".into()]).is_err());
        assert!(Faults::parse(&["panic-run".into()]).is_err());
        assert!(Faults::default().is_empty());
    }
}
