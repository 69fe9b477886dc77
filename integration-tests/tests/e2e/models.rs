//! The models: the catalog bounds requests and lists its models, a model repository synced
//! from S3 generates what the original does, and a model handed in process through
//! `Models::Custom` serves tasks like the built-in ones.

use std::time::Duration;

use serde_json::{Value, json};
use sluice_integration_tests::cluster::http_get;
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{Outcomes, png_info, rejected_fields, sha256_hex, terrain_task};
use sluice_schemas::CompletionStatus;

use crate::stacks::{diffusion_cluster, terrain_cluster};

#[tokio::test(flavor = "multi_thread")]
async fn the_catalog_bounds_requests_and_lists_the_models() {
    let c = diffusion_cluster().await;
    let models: Value = http_get(&format!("{}/v1/models", c.producer_url)).await.json().await.unwrap();
    let names: Vec<&str> = models["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "terrain",
            "sd-tiny",
            "sdxl-tiny",
            "sd-tiny-inpaint",
            "flux-schnell-tiny",
            "flux-dev-tiny",
            "sd3-tiny"
        ]
    );
    let sd = &models["models"][1];
    assert_eq!(sd["kind"], "diffusion");
    assert_eq!(sd["width"], json!({"min": 64, "max": 256, "default": 64}));
    assert_eq!(sd["default_sampler"], "euler");

    for (body, field) in [
        (json!({"model": "sd-xl", "prompt": "x"}), "model"),
        (json!({"model": "sd-tiny"}), "prompt"),
        (json!({"model": "sd-tiny", "prompt": "x", "width": 1024}), "width"),
        (json!({"model": "sd-tiny", "prompt": "x", "width": 100}), "width"),
        (json!({"model": "sd-tiny", "prompt": "x", "steps": 21}), "steps"),
        (json!({"model": "sd-tiny", "prompt": "x", "sampler": "lcm", "steps": 12}), "steps"),
        (json!({"model": "sd-tiny", "prompt": "x", "sampler": "plms"}), "sampler"),
        (json!({"model": "sd-tiny", "prompt": "x", "num_images": 5}), "num_images"),
    ] {
        let (status, reply) = c.submit(&body).await.unwrap();
        assert_eq!(status, 400, "{body}: {reply}");
        let fields: Vec<&str> = rejected_fields(&reply).into_iter().map(|(f, _)| f).collect();
        assert!(fields.contains(&field), "{body}: {reply}");
        if field == "model" {
            assert!(
                reply
                    .to_string()
                    .contains("terrain, sd-tiny, sdxl-tiny, sd-tiny-inpaint, flux-schnell-tiny"),
                "lists the served models: {reply}"
            );
        }
    }
}

fn files_under(root: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let name = path.strip_prefix(root).unwrap().display().to_string();
                out.push((name, std::fs::read(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// What the chart's initContainer runs: `sluice-worker sync-models` copies a model repository out
/// of the S3 server; the copy generates the very image the original does, and a second run over
/// the same directory copies nothing.
#[tokio::test(flavor = "multi_thread")]
async fn models_synced_from_s3_generate_the_same_image_as_the_originals() {
    let stack = &diffusion_cluster().await.stack;
    let original = std::path::PathBuf::from(&stack.env["SLUICE_SD_TINY"]).join("sd-tiny");
    let files = files_under(&original);
    let sink = stack.sink().unwrap();
    for (name, bytes) in &files {
        sink.write(&format!("model-repo/sd-tiny/{name}"), bytes.clone().into())
            .await
            .unwrap();
    }
    let synced = stack.dir.join("synced-models");
    let worker = |args: &[&str]| {
        let output = std::process::Command::new(sluice_integration_tests::process::bin("sluice-worker"))
            .args(args)
            .envs(stack.vars())
            .env("SLUICE_LOG_FORMAT", "text")
            .output()
            .unwrap();
        assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    let sync = || -> Value {
        let url = format!(
            "s3://{}/model-repo",
            stack.env["SLUICE_OUTPUT_URL"]
                .trim_start_matches("s3://")
                .split('/')
                .next()
                .unwrap()
        );
        serde_json::from_str(worker(&["sync-models", "--from", &url, "--to", &synced.display().to_string()]).trim()).unwrap()
    };
    let first = sync();
    assert_eq!(
        (first["copied"].as_u64(), first["unchanged"].as_u64()),
        (Some(files.len() as u64), Some(0)),
        "{first}"
    );
    let again = sync();
    assert_eq!(
        (again["copied"].as_u64(), again["unchanged"].as_u64()),
        (Some(0), Some(files.len() as u64)),
        "{again}"
    );
    let copied: Vec<(String, Vec<u8>)> = files_under(&synced.join("sd-tiny"));
    assert_eq!(copied, files, "byte for byte");

    let generate = |model: &std::path::Path, out: &str| {
        let out = stack.dir.join(out);
        let args = [
            "generate",
            "--model-path",
            &model.display().to_string(),
            "--prompt",
            "a harbour at dawn",
            "--seed",
            "11",
            "--out",
            &out.display().to_string(),
        ];
        worker(&args);
        std::fs::read(out).unwrap()
    };
    let from_original = generate(&original, "original.png");
    let from_copy = generate(&synced.join("sd-tiny"), "synced.png");
    assert!(png_info(&from_copy).is_ok());
    assert_eq!(sha256_hex(&from_copy), sha256_hex(&from_original));
}

/// The in-process seam docs/architecture.md promises: a model that is not ONNX at all, handed to
/// `sluice_worker::run` through `Models::Custom`, serves tasks from the real broker as the built-in
/// models do — the same pipeline, storage and completion events. Its "model file" holds an RGB
/// colour, read by its `load` from the directory the catalog names, and every image it renders
/// is that colour at the task's size.
#[tokio::test(flavor = "multi_thread")]
async fn a_model_injected_through_models_custom_serves_tasks_in_process() {
    use clap::Parser;
    use sluice_worker::engine::{Backend, Call, CallKey, EngineError, Placement, SessionOptions, Tensor};
    use sluice_worker::models::encode::{Image, png_rgb8};
    use sluice_worker::models::{Bucket, ModelAdapter, ModelError, Prepared, Registry, Render};
    use sluice_worker::{Exit, Models};

    struct Fill;
    struct FillBackend([u8; 3]);
    struct FillRender(u32, u32);
    impl ModelAdapter for Fill {
        fn bucket(&self, task: &sluice_schemas::TaskRecord) -> Result<Bucket, ModelError> {
            let r = &task.request;
            Ok(Bucket {
                model: task.model.clone(),
                key: CallKey::new(format!("{}x{}", r.width, r.height), Some(u64::from(r.width * r.height))),
                rows_per_task: 1,
                alone: None,
            })
        }
        fn prepare(&self, task: &sluice_schemas::TaskRecord, _inputs: &sluice_worker::models::InputImages) -> Result<Prepared, ModelError> {
            let r = &task.request;
            Ok(Prepared {
                inputs: vec![Tensor::f32("seed", vec![1], vec![r.seed as f32])],
                rows: 1,
                render: Box::new(FillRender(r.width, r.height)),
            })
        }
        fn load(&self, path: &std::path::Path, _: &SessionOptions) -> Result<Box<dyn Backend>, EngineError> {
            let text = std::fs::read_to_string(path).map_err(|e| EngineError::Load(e.to_string()))?;
            let c: Vec<u8> = text.split_whitespace().map(|v| v.parse().expect("a colour")).collect();
            Ok(Box::new(FillBackend([c[0], c[1], c[2]])))
        }
    }
    impl Backend for FillBackend {
        fn run(&mut self, call: &Call) -> Result<Vec<Tensor>, EngineError> {
            let rows = call.inputs[0].rows();
            let colour = self.0.map(f32::from).repeat(rows);
            Ok(vec![Tensor::f32("colour", vec![rows, 3], colour)])
        }
        fn release_memory(&mut self) {}
        fn placement(&self) -> Placement {
            Placement::Cpu
        }
    }
    impl Render for FillRender {
        fn render(&self, outputs: &[Tensor], rows: std::ops::Range<usize>) -> Result<Vec<Image>, ModelError> {
            let c = outputs[0]
                .f32_rows(rows.start, rows.end)
                .ok_or_else(|| ModelError::Failed("no colour".into()))?;
            let pixel = [c[0] as u8, c[1] as u8, c[2] as u8];
            let image = png_rgb8(self.0, self.1, &pixel.repeat((self.0 * self.1) as usize)).map_err(ModelError::Failed)?;
            Ok(vec![image])
        }
    }

    let c = terrain_cluster().await;
    let topics = c.stack.topics("custom-model", 1).unwrap();
    let dir = std::env::temp_dir().join(format!("sluice-custom-model-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(dir.join("models/terrain")).unwrap();
    std::fs::write(dir.join("models/terrain/model.onnx"), "7 99 200").unwrap();
    let (brokers, out, models) = (
        c.stack.brokers().to_owned(),
        format!("file://{}", dir.join("out").display()),
        dir.join("models").display().to_string(),
    );
    let config = sluice_worker::config::Config::try_parse_from([
        "sluice-worker",
        "--kafka-brokers",
        &brokers,
        "--output-url",
        &out,
        "--model-dir",
        &models,
        "--models",
        "terrain",
        "--listen",
        "127.0.0.1:0",
        "--worker-id",
        "custom-0",
        "--group-id",
        "custom-model",
        "--tasks-topic",
        &topics.tasks,
        "--completions-topic",
        &topics.completions,
        "--dlq-topic",
        &topics.dlq,
        "--ceilings-topic",
        &topics.ceilings,
    ])
    .expect("worker flags");
    let registry = Registry::default().with("terrain", std::sync::Arc::new(Fill));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(sluice_worker::run(config, Models::Custom(registry), async move {
        let _ = stopped.await;
    }));

    let tasks = [
        terrain_task(1, 64, 48, 10),
        terrain_task(2, 32, 32, 10),
        terrain_task(3, 64, 48, 10),
    ];
    sluice_integration_tests::publish_tasks(&producer(&brokers).unwrap(), &topics.tasks, &tasks)
        .await
        .unwrap();
    let ids = sluice_integration_tests::ids_of(&tasks);
    let outcomes = Outcomes::wait(&brokers, &topics, &ids, Duration::from_secs(60)).unwrap();
    let store = sluice_worker::storage::images::ImageStore::from_url(&out).unwrap();
    for (id, record) in &tasks {
        let event = &outcomes.completions[id][0];
        assert_eq!(event.status, CompletionStatus::Succeeded, "{event:?}");
        assert_eq!(event.worker_id, "custom-0");
        let bytes = store.read(&event.outputs[0].key).await.unwrap();
        assert_eq!(sha256_hex(&bytes), event.outputs[0].sha256);
        let mut reader = png::Decoder::new(std::io::Cursor::new(bytes.to_vec())).read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut pixels).unwrap();
        let (w, h) = (
            record["request"]["width"].as_u64().unwrap(),
            record["request"]["height"].as_u64().unwrap(),
        );
        assert_eq!((info.width as u64, info.height as u64), (w, h));
        assert!(
            pixels[..info.buffer_size()].chunks(3).all(|p| p == [7, 99, 200]),
            "every pixel is the model file's colour"
        );
    }
    stop.send(()).unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(60), worker)
        .await
        .expect("the worker stops");
    assert_eq!(exit.unwrap().expect("the worker started"), Exit::Clean);
    let _ = std::fs::remove_dir_all(&dir);
}
