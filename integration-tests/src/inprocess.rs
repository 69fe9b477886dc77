//! Diffusion models run in this process, as the reference tests run them: ONNX Runtime from the
//! assets, one call of a prepared request on a fresh backend.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use sluice_worker::engine::{Call, CallTask, Runtime, RuntimeOptions, SessionOptions, Tensor};
use sluice_worker::models::diffusion::StableDiffusion;
use sluice_worker::models::diffusion::request::{Draws, Mode, SdBucket, SdRequest};
use sluice_worker::models::{ModelAdapter, Prepared};

/// The process's ONNX Runtime (one environment per process), from `fetch-assets.sh`'s library.
pub fn runtime() -> Arc<Runtime> {
    static RUNTIME: OnceLock<Arc<Runtime>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            let a = crate::assets().expect("the assets");
            Arc::new(
                Runtime::init(&RuntimeOptions {
                    dylib_path: Some(a["ORT_DYLIB_PATH"].clone().into()),
                    cpu_arena_max_bytes: None,
                })
                .expect("ONNX Runtime loads"),
            )
        })
        .clone()
}

/// Runs `request` from `draws` in one call of a fresh backend of `model` (from `dir`, one
/// intra-op thread, as the reference ran), with `extra` inputs added to the prepared ones.
/// Returns the final latents and the PNG bytes of each image.
pub fn run_alone(model: &StableDiffusion, dir: &Path, request: &SdRequest, draws: Draws, extra: Vec<Tensor>) -> (Vec<f32>, Vec<Vec<u8>>) {
    let n = request.num_images;
    let (bucket, prepared) = model.prepare_request(request, Some(draws)).expect("the request is valid");
    let mut backend = model
        .load(
            dir,
            &SessionOptions {
                intra_threads: 1,
                ..SessionOptions::default()
            },
        )
        .expect("the model loads");
    let mut inputs = prepared.inputs.clone();
    inputs.extend(extra);
    let call = Call {
        key: bucket.key.clone(),
        inputs,
        tasks: vec![CallTask {
            id: "case".into(),
            attempt: 1,
            rows: n,
            hooks: None,
        }],
    };
    let outputs = backend.run(&call).expect("the call runs");
    let latents = outputs
        .iter()
        .find(|t| t.name == "latents")
        .and_then(|t| t.f32_rows(0, n))
        .expect("final latents")
        .to_vec();
    let images = prepared
        .render
        .render(&outputs, 0..n)
        .expect("the images render")
        .into_iter()
        .map(|i| i.bytes)
        .collect();
    (latents, images)
}

/// One row's result in a call shared with a row at other steps, against the same request alone.
#[derive(Debug, Clone, Copy)]
pub struct RowAgainstAlone {
    /// Max |Δ| of its final latents.
    pub latents: f32,
    /// Whether its PNG is byte for byte the one it gets alone.
    pub same_png: bool,
}

/// Step-level batching on the backend of `model`: `a` runs the first half of its steps in one
/// call and stops; a second call then takes `a` from there (its `step_latents` and, for the
/// multistep solver, `solver_previous`: the first call's outputs) beside `b` from its first step,
/// so the two share the call at different steps. Returns how far each row lands from the same
/// request run alone, or `None` when `a`'s bucket runs fewer than two steps (nothing to split).
/// The requests must fall in one bucket (one image each).
pub fn rows_at_different_steps(
    model: &StableDiffusion,
    dir: &Path,
    (a, a_draws): (&SdRequest, Draws),
    (b, b_draws): (&SdRequest, Draws),
) -> Option<(RowAgainstAlone, RowAgainstAlone)> {
    let (bucket, pa) = model.prepare_request(a, Some(a_draws)).expect("a is valid");
    let (b_bucket, pb) = model.prepare_request(b, Some(b_draws)).expect("b is valid");
    assert_eq!(bucket.key, b_bucket.key, "a and b fall in one bucket");
    let spec = bucket.key.get::<SdBucket>().expect("a diffusion bucket").clone();
    let first = if spec.mode == Mode::Text { 0 } else { spec.begin };
    let (steps, mid) = (spec.steps, first + (spec.steps - first) / 2);
    if mid == first {
        return None;
    }
    let options = SessionOptions {
        intra_threads: 1,
        ..SessionOptions::default()
    };
    let mut backend = model.load(dir, &options).expect("the model loads");
    let mut run = |inputs: Vec<Tensor>, tasks: &[&str]| {
        let call = Call {
            key: bucket.key.clone(),
            inputs,
            tasks: tasks
                .iter()
                .map(|id| CallTask {
                    id: (*id).into(),
                    attempt: 1,
                    rows: 1,
                    hooks: None,
                })
                .collect(),
        };
        backend.run(&call).expect("the call runs")
    };
    let output = |outputs: &[Tensor], name: &str, row: usize| {
        outputs
            .iter()
            .find(|t| t.name == name)
            .and_then(|t| t.f32_rows(row, row + 1))
            .map(<[f32]>::to_vec)
    };
    let range = |begin: Vec<i64>, end: Vec<i64>| {
        let n = begin.len();
        [Tensor::i64("step_begin", vec![n], begin), Tensor::i64("step_end", vec![n], end)]
    };
    let alone_a = run(pa.inputs.clone(), &["a"]);
    let alone_b = run(pb.inputs.clone(), &["b"]);
    let mut half = pa.inputs.clone();
    half.extend(range(vec![first as i64], vec![mid as i64]));
    let half = run(half, &["a"]);
    let latents = output(&half, "latents", 0).expect("latents");
    assert!(
        max_diff(&latents, &output(&alone_a, "latents", 0).unwrap()) > 1e-3,
        "half the steps are not all of them"
    );

    let mut inputs: Vec<Tensor> = pa
        .inputs
        .iter()
        .zip(&pb.inputs)
        .map(|(x, y)| {
            assert_eq!(x.name, y.name);
            Tensor::concat(&[x, y])
        })
        .collect();
    inputs.extend(range(vec![mid as i64, first as i64], vec![steps as i64; 2]));
    let shape = |t: &str| half.iter().find(|o| o.name == t).map(|o| o.shape.clone());
    for (name, values) in [
        ("step_latents", Some(latents)),
        ("solver_previous", output(&half, "solver_previous", 0)),
    ] {
        if let (Some(values), Some(mut shape)) = (values, shape(name).or(shape("latents"))) {
            shape[0] = 2;
            let zeros = vec![0.0; values.len()];
            inputs.push(Tensor::f32(name, shape, [values, zeros].concat()));
        }
    }
    let mixed = run(inputs, &["a", "b"]);
    let png = |prepared: &Prepared, outputs: &[Tensor], row: usize| {
        prepared.render.render(outputs, row..row + 1).expect("the image renders")[0]
            .bytes
            .clone()
    };
    let against = |row: usize, prepared: &Prepared, alone: &[Tensor]| RowAgainstAlone {
        latents: max_diff(&output(&mixed, "latents", row).unwrap(), &output(alone, "latents", 0).unwrap()),
        same_png: png(prepared, &mixed, row) == png(prepared, alone, 0),
    };
    Some((against(0, &pa, &alone_a), against(1, &pb, &alone_b)))
}

/// Asserts that both rows of [`rows_at_different_steps`] ended where they end alone: latents
/// within 1e-5 and the same PNG bytes.
pub fn assert_as_alone(name: &str, (a, b): (RowAgainstAlone, RowAgainstAlone)) {
    assert!(
        a.latents <= 1e-5 && b.latents <= 1e-5,
        "{name}: rows at different steps moved: A {:.2e}, B {:.2e}",
        a.latents,
        b.latents
    );
    assert!(
        a.same_png && b.same_png,
        "{name}: PNGs differ from alone (A {}, B {})",
        a.same_png,
        b.same_png
    );
}

/// Max |Δ| between two equally long vectors.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}
