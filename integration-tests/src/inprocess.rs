//! Diffusion models run in this process, as the reference tests run them: ONNX Runtime from the
//! assets, one call of a prepared request on a fresh backend.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use sluice_worker::engine::{Call, CallTask, Runtime, RuntimeOptions, SessionOptions, Tensor};
use sluice_worker::models::ModelAdapter;
use sluice_worker::models::diffusion::StableDiffusion;
use sluice_worker::models::diffusion::request::{Draws, SdRequest};

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
