//! An in-process fake model for unit tests of the worker's state machines: a "device" of a fixed
//! number of rows shared by every engine thread (a call that would hold more fails with an
//! out-of-memory error, as ONNX Runtime's arena does), a fixed latency per call, and tasks that
//! make the backend panic or fail by their seed. Nothing here runs in the worker binary.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_schemas::TaskRecord;

use crate::engine::{Backend, Call, CallKey, EngineError, Placement, SessionOptions, Tensor};
use crate::models::encode::{self, Image};
use crate::models::{Bucket, ModelAdapter, ModelError, Prepared, Render};

/// A task with this seed makes the backend panic.
pub(crate) const PANIC_SEED: u64 = 666;
/// A task with this seed makes the backend fail with a model error.
pub(crate) const ERROR_SEED: u64 = 404;

/// The fake device: rows in use right now, and how many fit. A fragmenting one loses rows to
/// every out-of-memory error, as an arena whose failed runs left it in pieces, until the model
/// is loaded again — or, on one that shrinks (as ONNX Runtime's arenas do), until a run asked to
/// give back what the arena holds ends, failed or not.
#[derive(Debug)]
pub(crate) struct Device {
    capacity: usize,
    in_use: AtomicUsize,
    latency: Duration,
    lost_per_oom: usize,
    lost: AtomicUsize,
    shrinks: bool,
    /// Times the model was loaded.
    pub loads: AtomicUsize,
    /// Calls that ran, and the largest number of rows that ran at once.
    pub calls: AtomicUsize,
    pub peak: AtomicUsize,
    /// The step range of each call that ran step by step (its first row's `step_begin`..`step_end`).
    pub steps: Mutex<Vec<Range<i64>>>,
    /// A step-by-step call of more than one row from this step on runs out of memory (never
    /// while 0).
    pub oom_from_step: AtomicUsize,
}

impl Device {
    pub(crate) fn new(capacity: usize, latency: Duration) -> Arc<Device> {
        Device::fragmenting(capacity, latency, 0)
    }

    /// A fragmenting device whose runs give back the pieces when asked to (`release_memory`).
    pub(crate) fn shrinking(capacity: usize, latency: Duration, lost_per_oom: usize) -> Arc<Device> {
        let mut device = Device::fragmenting(capacity, latency, lost_per_oom);
        Arc::get_mut(&mut device).expect("new").shrinks = true;
        device
    }

    /// A device that loses `lost_per_oom` rows of its capacity to every out-of-memory error.
    pub(crate) fn fragmenting(capacity: usize, latency: Duration, lost_per_oom: usize) -> Arc<Device> {
        Arc::new(Device {
            capacity,
            in_use: AtomicUsize::new(0),
            latency,
            lost_per_oom,
            lost: AtomicUsize::new(0),
            shrinks: false,
            loads: AtomicUsize::new(0),
            calls: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            steps: Mutex::new(Vec::new()),
            oom_from_step: AtomicUsize::new(0),
        })
    }
}

/// The fake model: a task of `num_images` images is that many rows, each row one value (its
/// seed); the output is the input doubled.
pub(crate) struct FakeModel {
    pub device: Arc<Device>,
}

impl ModelAdapter for FakeModel {
    fn bucket(&self, task: &TaskRecord) -> Result<Bucket, ModelError> {
        Ok(Bucket {
            key: CallKey::none(),
            model: task.model.clone(),
            rows_per_task: task.request.num_images as usize,
            alone: None,
        })
    }

    fn prepare(&self, task: &TaskRecord, _inputs: &crate::models::InputImages) -> Result<Prepared, ModelError> {
        let rows = task.request.num_images as usize;
        Ok(Prepared {
            inputs: vec![Tensor::f32("x", vec![rows, 1], vec![task.request.seed as f32; rows])],
            rows,
            render: Box::new(FakeRender),
        })
    }

    fn load(&self, _: &Path, _: &SessionOptions) -> Result<Box<dyn Backend>, EngineError> {
        self.device.lost.store(0, Ordering::SeqCst);
        self.device.loads.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(FakeBackend {
            device: self.device.clone(),
            shrink: false,
        }))
    }
}

/// Prepared inputs of one task of `rows` rows and seed `seed`, outside any task record.
pub(crate) fn prepared(seed: u64, rows: usize) -> Prepared {
    Prepared {
        inputs: vec![Tensor::f32("x", vec![rows, 1], vec![seed as f32; rows])],
        rows,
        render: Box::new(FakeRender),
    }
}

/// As [`prepared`], with one more input that is not per row: the task's rows can't be cut apart.
pub(crate) fn prepared_whole(seed: u64, rows: usize) -> Prepared {
    let mut p = prepared(seed, rows);
    p.inputs.push(Tensor::f32("scale", vec![1], vec![1.0]));
    p
}

struct FakeBackend {
    device: Arc<Device>,
    /// This run gives back what the device's failed runs left in pieces when it ends.
    shrink: bool,
}

impl Backend for FakeBackend {
    fn run(&mut self, call: &Call) -> Result<Vec<Tensor>, EngineError> {
        let x = &call.inputs[0];
        let values = x.f32_rows(0, x.rows()).expect("f32 input").to_vec();
        if values.contains(&(PANIC_SEED as f32)) {
            panic!("fake model: a panicking task in a batch of {}", call.tasks.len());
        }
        if values.contains(&(ERROR_SEED as f32)) {
            return Err(EngineError::Run("fake model: a task it cannot run".into()));
        }
        let rows = x.rows();
        let d = self.device.clone();
        let oom_from = d.oom_from_step.load(Ordering::SeqCst) as i64;
        if step_range(call).is_some_and(|s| rows > 1 && oom_from > 0 && s.start >= oom_from) {
            return Err(EngineError::OutOfMemory(format!(
                "fake device: {rows} rows from step {oom_from} do not fit"
            )));
        }
        let shrink = std::mem::take(&mut self.shrink) && d.shrinks;
        let _shrink = Shrink(shrink.then_some(&d));
        let before = d.in_use.fetch_add(rows, Ordering::SeqCst);
        let capacity = d.capacity.saturating_sub(d.lost.load(Ordering::SeqCst));
        if before + rows > capacity {
            d.in_use.fetch_sub(rows, Ordering::SeqCst);
            let lost = (d.lost.load(Ordering::SeqCst) + d.lost_per_oom).min(d.capacity);
            d.lost.store(lost, Ordering::SeqCst);
            return Err(EngineError::OutOfMemory(format!(
                "fake device: Available memory of {} is smaller than requested bytes of {rows}",
                capacity - before.min(capacity)
            )));
        }
        d.peak.fetch_max(before + rows, Ordering::SeqCst);
        std::thread::sleep(d.latency);
        d.in_use.fetch_sub(rows, Ordering::SeqCst);
        d.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(steps) = step_range(call) {
            // Step by step: `y` counts the steps each row has run (rows may be at different
            // steps), carried on from `y_before`.
            let before = call.inputs.iter().find(|t| t.name == "y_before");
            let before = before.and_then(|t| t.f32_rows(0, rows)).map_or(vec![0.0; rows], <[f32]>::to_vec);
            d.steps.lock().expect("steps").push(steps);
            let row_steps = |name: &str| call.inputs.iter().find(|t| t.name == name).and_then(|t| t.i64_rows(0, rows));
            let (begin, end) = (row_steps("step_begin").expect("steps"), row_steps("step_end").expect("steps"));
            let y = (0..rows).map(|r| before[r] + (end[r] - begin[r]) as f32).collect();
            return Ok(vec![Tensor::f32("y", vec![rows, 1], y)]);
        }
        Ok(vec![Tensor::f32("y", vec![rows, 1], values.iter().map(|v| v * 2.0).collect())])
    }

    fn release_memory(&mut self) {
        self.shrink = true;
    }

    fn placement(&self) -> Placement {
        Placement::Cpu
    }
}

/// A call's step range (its first row's), when it runs step by step.
fn step_range(call: &Call) -> Option<Range<i64>> {
    let first = |name: &str| call.inputs.iter().find(|t| t.name == name)?.i64_rows(0, 1)?.first().copied();
    Some(first("step_begin")?..first("step_end")?)
}

/// At the end of a run asked to shrink (whatever its outcome), the device's pieces are whole.
struct Shrink<'a>(Option<&'a Arc<Device>>);

impl Drop for Shrink<'_> {
    fn drop(&mut self) {
        if let Some(d) = self.0 {
            d.lost.store(0, Ordering::SeqCst);
        }
    }
}

/// One grey pixel per row.
struct FakeRender;

impl Render for FakeRender {
    fn render(&self, outputs: &[Tensor], rows: Range<usize>) -> Result<Vec<Image>, ModelError> {
        let values = outputs[0]
            .f32_rows(rows.start, rows.end)
            .ok_or_else(|| ModelError::Failed("no rows".into()))?;
        values
            .iter()
            .map(|v| encode::png_grey16(1, 1, &[*v as u16]).map_err(ModelError::Failed))
            .collect()
    }
}
