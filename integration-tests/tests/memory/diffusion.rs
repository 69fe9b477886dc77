//! Memory discipline of the Stable Diffusion pipeline on real out-of-memory errors and reloads,
//! as [`terrain`](super::terrain) proves it for the terrain model: ONNX Runtime's CPU arena is capped, so a batch that
//! needs more fails inside ORT as a CUDA allocation does on a GPU.
//!
//! Measured here (tiny SD, euler, guidance on): under a 400 MB arena cap two 256×256 images run
//! in one call (UNet batch 4) but not four; one 512×512 image never fits (self-attention over
//! 4,096 latent positions).

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;
use sluice_integration_tests::cluster::{Worker, metric_sum, metric_value};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::process::on_cuda;
use sluice_integration_tests::stack::repo_root;
use sluice_integration_tests::{Outcomes, ReloadRss, Stack, Topics, assert_rss_bounded, diffusion_task, ids_of, publish_tasks, sd_task};
use sluice_schemas::CompletionStatus;
use tokio::sync::OnceCell;

static STACK: OnceCell<Stack> = OnceCell::const_new();

async fn stack() -> &'static Stack {
    STACK
        .get_or_init(|| async { Stack::start("sd-memory").expect("stack starts") })
        .await
}

/// A worker serving only `sd-tiny`, in a group of its own on its own topics.
async fn worker(stack: &Stack, scenario: &str, topics: &Topics, extra: &[(&str, &str)]) -> Worker {
    worker_of(stack, "sd-tiny", scenario, topics, extra).await
}

/// A worker serving only `model`, in a group of its own on its own topics.
async fn worker_of(stack: &Stack, model: &str, scenario: &str, topics: &Topics, extra: &[(&str, &str)]) -> Worker {
    let catalog = repo_root().join("deploy/models.demo.toml").display().to_string();
    let mut env = vec![("SLUICE_MODEL_CATALOG", catalog.as_str()), ("SLUICE_MODELS", model)];
    env.extend_from_slice(extra);
    Worker::on_topics(stack, scenario, &format!("sd-memory-{scenario}"), topics, &env)
        .await
        .expect("worker starts")
}

/// On a GPU node (`SLUICE_DEVICE=cuda`, `make gpu-check`) the cap is the CUDA arena's
/// `gpu_mem_limit`; elsewhere the shared CPU arena's.
fn memory_cap(bytes: &'static str) -> (&'static str, &'static str) {
    if on_cuda() {
        ("SLUICE_GPU_MEM_LIMIT", bytes)
    } else {
        ("SLUICE_ORT_CPU_ARENA_MAX_BYTES", bytes)
    }
}

fn outcomes(stack: &Stack, topics: &Topics, ids: &BTreeSet<String>) -> Outcomes {
    Outcomes::wait(stack.brokers(), topics, ids, Duration::from_secs(300)).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_large_sd_batch_halves_under_the_arena_cap_and_what_cannot_fit_alone_goes_to_the_dlq() {
    let stack = stack().await;
    let topics = stack.topics("sd-oom", 4).unwrap();
    let mut worker = worker(
        stack,
        "oom",
        &topics,
        &[
            memory_cap("400000000"),
            ("SLUICE_MAX_BATCH", "8"),
            ("SLUICE_MAX_WAIT_MS", "2000"),
            ("SLUICE_LOG_FORMAT", "json"),
        ],
    )
    .await;
    let large: Vec<_> = (0..4).map(|i| sd_task(10 + i, 256, 2, 1)).collect();
    let huge: Vec<_> = (0..2).map(|i| sd_task(20 + i, 512, 2, 1)).collect();
    let small: Vec<_> = (0..4).map(|i| sd_task(30 + i, 64, 4, 1)).collect();
    let kafka = producer(stack.brokers()).unwrap();
    publish_tasks(&kafka, &topics.tasks, &large).await.unwrap();
    publish_tasks(&kafka, &topics.tasks, &huge).await.unwrap();
    publish_tasks(&kafka, &topics.tasks, &small).await.unwrap();

    let all: Vec<_> = [large.clone(), huge.clone(), small.clone()].concat();
    let done = outcomes(stack, &topics, &ids_of(&all));
    let succeeded = done.with_status(CompletionStatus::Succeeded);
    for (id, _) in large.iter().chain(&small) {
        assert!(succeeded.contains(id), "{id} should have completed: {:?}", done.completions.get(id));
    }
    for (id, _) in &huge {
        assert_eq!(done.dlq_reason(id), Some("resource_exhausted"), "{id}");
        let message = &done.dlq[id][0].message;
        assert!(message.contains("512x512x1"), "the DLQ names width x height x images: {message}");
    }
    assert!(worker.service.running(), "the worker is still up");

    let events: Vec<Value> = worker
        .service
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let bucket = "sd-tiny:256x256:euler:2:cfg:1";
    let halvings: Vec<&Value> = events
        .iter()
        .filter(|e| e["message"] == "out of memory; retrying with a smaller batch" && e["bucket"] == bucket)
        .collect();
    assert!(!halvings.is_empty(), "the 256x256 group halved");
    assert_eq!(halvings[0]["level"], "WARN");
    let metrics = worker.metrics().await.unwrap();
    // Metrics label the size class (256 × 256 pixels × 1 image), logs the bucket.
    let ceiling = metric_value(&metrics, "sluice_worker_batch_ceiling{bucket=\"sd-tiny:le65536\"}").unwrap();
    assert!((1.0..=3.0).contains(&ceiling), "learned ceiling: {ceiling}");
    assert!(metric_value(&metrics, "sluice_worker_oom_total{bucket=\"sd-tiny:le262144\"}").unwrap() >= 1.0);
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

/// SDXL under a cap its UNet (no attention at full resolution) meets only with several images:
/// at 30 MB, four 256×256 images in one call run out of memory (in the UNet: the batch halves; or
/// in the VAE decoder: it decodes one image at a time) and complete; a 768×768 image does not fit
/// alone and goes to the DLQ naming its size; the worker stays up.
#[tokio::test(flavor = "multi_thread")]
async fn a_large_sdxl_batch_halves_under_the_arena_cap_and_what_cannot_fit_alone_goes_to_the_dlq() {
    large_batch_under_the_cap("sdxl-tiny", "oom-xl", "30000000", 256, (768, 1)).await;
}

/// The same for FLUX.1-dev (text encoders on demand, T5 256 in the demo catalog) and SD3 (text
/// encoders on the CPU): the transformer's batch halves or the VAE decodes one image at a time,
/// and a task that does not fit alone goes to the DLQ.
#[tokio::test(flavor = "multi_thread")]
async fn a_large_flux_batch_halves_under_the_arena_cap_and_what_cannot_fit_alone_goes_to_the_dlq() {
    large_batch_under_the_cap("flux-dev-tiny", "oom-flux", "30000000", 256, (768, 1)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_large_sd3_batch_halves_under_the_arena_cap_and_what_cannot_fit_alone_goes_to_the_dlq() {
    // sd3-tiny's positional embedding covers 256x256 at most, so its scale is smaller: under
    // 14 MB (measured with `generate`: one 128x128 image fits in 10 MB, four do not in 20 MB,
    // one 256x256 image does not in 20 MB) 128x128 images split and 256x256 goes to the DLQ.
    large_batch_under_the_cap("sd3-tiny", "oom-sd3", "14000000", 128, (256, 1)).await;
}

/// Four one-image tasks of `size`² under a `cap`-byte arena complete; the `huge` task (size,
/// images) goes to the DLQ as resource_exhausted naming its dimensions.
async fn large_batch_under_the_cap(model: &str, scenario: &str, cap: &'static str, size: u32, huge: (u32, u32)) {
    if on_cuda() {
        // The 30 MB cap is calibrated on the CPU arena; the CUDA path is the SD test's.
        eprintln!("calibrated for the CPU arena: not run with SLUICE_DEVICE=cuda");
        return;
    }
    let stack = stack().await;
    let topics = stack.topics(scenario, 4).unwrap();
    let mut worker = worker_of(
        stack,
        model,
        scenario,
        &topics,
        &[
            memory_cap(cap),
            ("SLUICE_MAX_BATCH", "8"),
            ("SLUICE_MAX_WAIT_MS", "2000"),
            ("SLUICE_LOG_FORMAT", "json"),
        ],
    )
    .await;
    let large: Vec<_> = (0..4).map(|i| diffusion_task(model, 10 + i, size, 2, 1)).collect();
    let request = &large[0].1["request"];
    let cfg = if request["guidance_scale"].as_f64() > Some(1.0) && request.get("negative_prompt").is_some() {
        "cfg"
    } else {
        "nocfg"
    };
    let bucket = format!("{model}:{size}x{size}:{}:2:{cfg}:1", request["sampler"].as_str().unwrap());
    let (huge_size, huge_images) = huge;
    let huge = vec![diffusion_task(model, 20, huge_size, 2, huge_images)];
    let kafka = producer(stack.brokers()).unwrap();
    publish_tasks(&kafka, &topics.tasks, &large).await.unwrap();
    publish_tasks(&kafka, &topics.tasks, &huge).await.unwrap();
    let done = outcomes(stack, &topics, &ids_of(&[large.clone(), huge.clone()].concat()));
    let succeeded = done.with_status(CompletionStatus::Succeeded);
    for (id, _) in &large {
        assert!(succeeded.contains(id), "{id} should have completed: {:?}", done.completions.get(id));
    }
    for (id, _) in &huge {
        assert_eq!(done.dlq_reason(id), Some("resource_exhausted"), "{id}");
        let message = &done.dlq[id][0].message;
        let dims = format!("{huge_size}x{huge_size}x{huge_images}");
        assert!(message.contains(&dims), "the DLQ names width x height x images: {message}");
    }
    assert!(worker.service.running(), "the worker is still up");
    // Which stage meets the cap first depends on what the arena holds: the UNet or transformer
    // (the batch halves) or the VAE decoder (it decodes one image at a time).
    let handled = worker
        .service
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| {
            (e["message"] == "out of memory; retrying with a smaller batch" && e["bucket"] == bucket)
                || e["message"] == "VAE decode ran out of memory; decoding one image at a time"
        })
        .count();
    assert!(handled >= 1, "the four {size}x{size} images met the cap and were split");
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

/// RSS bound after the warm-up reloads, above the warm baseline.
const RSS_BOUND_BYTES: u64 = 100 << 20;

/// On CUDA: how much more device memory a worker may hold after an unload than after the
/// warm-up reloads (the tiny models' weights are a few MB; CUDA's own per-context allocations
/// and cuDNN workspaces come and go by a few MB).
const DEVICE_BOUND_BYTES: u64 = 64 << 20;

#[tokio::test(flavor = "multi_thread")]
async fn twenty_reloads_of_the_sd_model_under_load_lose_nothing_and_memory_comes_back() {
    twenty_reloads_under_load("sd-tiny", "reload").await;
}

/// The same for SDXL, whose backend holds two text encoders and the VAE encoder too.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_reloads_of_the_sdxl_model_under_load_lose_nothing_and_memory_comes_back() {
    twenty_reloads_under_load("sdxl-tiny", "reload-xl").await;
}

/// And for FLUX.1-dev, whose text encoders (on demand in the demo catalog) load and drop with
/// every call besides every reload.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_reloads_of_the_flux_model_under_load_lose_nothing_and_memory_comes_back() {
    twenty_reloads_under_load("flux-dev-tiny", "reload-flux").await;
}

/// And for SD3, three text encoders (on the CPU in the demo catalog) and the transformer.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_reloads_of_the_sd3_model_under_load_lose_nothing_and_memory_comes_back() {
    twenty_reloads_under_load("sd3-tiny", "reload-sd3").await;
}

/// 20 reloads of `model`, each while two tasks are queued or running: every task completes, and
/// RSS after reloads 6..20 stays within [`RSS_BOUND_BYTES`] of the warm baseline.
async fn twenty_reloads_under_load(model: &str, scenario: &str) {
    let stack = stack().await;
    let topics = stack.topics(&format!("sd-{scenario}"), 4).unwrap();
    let mut worker = worker_of(stack, model, scenario, &topics, &[("SLUICE_MAX_WAIT_MS", "20")]).await;
    // Reloads under load: the worker owns its partitions before the first reload (joining the
    // group takes ~3 s on the broker; reloads before it measure an idle worker's baseline).
    worker.wait_assigned(Duration::from_secs(60)).await.unwrap();
    let kafka = producer(stack.brokers()).unwrap();
    let mut tasks = Vec::new();
    let mut rss = Vec::new();
    let mut device_used = Vec::new();
    for i in 0..20u64 {
        let wave: Vec<_> = (0..2).map(|j| diffusion_task(model, i * 2 + j, 64, 4, 1 + (j as u32))).collect();
        publish_tasks(&kafka, &topics.tasks, &wave).await.unwrap();
        tasks.extend(wave);
        let (status, report) = worker.reload(&serde_json::json!({ "model": model })).await;
        assert_eq!(status, 200, "{report}");
        let report = &report["reloads"][0];
        assert_eq!(report["result"], "reloaded", "{report}");
        rss.push(ReloadRss::of(report));
        device_used.push(report["after_unload"]["device_process_bytes"].as_u64());
    }
    let done = outcomes(stack, &topics, &ids_of(&tasks));
    assert_eq!(
        done.with_status(CompletionStatus::Succeeded).len(),
        tasks.len(),
        "every task completed across the reloads"
    );
    // The warm baseline is RSS after reload 5, against the worst after reloads 6..20.
    assert_rss_bounded(model, &rss, 4..5, 5.., RSS_BOUND_BYTES);
    // On a GPU node: the device memory the worker holds right after each unload (NVML's
    // process list: the suite's other workers share the GPU) comes back to what it held after
    // the warm-up reloads, within DEVICE_BOUND_BYTES.
    if on_cuda() {
        let used: Vec<u64> = device_used
            .iter()
            .map(|u| u.expect("NVML lists the CUDA worker's process"))
            .collect();
        let (baseline, highest) = (used[4], *used[5..].iter().max().unwrap());
        eprintln!(
            "{model} reload device memory held after an unload: after reload 5 {} MB, highest after reloads 6..20 {} MB, last {} MB; bound {} MB",
            baseline >> 20,
            highest >> 20,
            used[19] >> 20,
            DEVICE_BOUND_BYTES >> 20
        );
        assert!(
            highest <= baseline + DEVICE_BOUND_BYTES,
            "device memory held after an unload grew from {baseline} to {highest} bytes"
        );
    }
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

/// A worker keeps what it learned of memory across a restart: the same memory-capped workload
/// run again by the same worker restarted (same identity, same device class) handles at most a
/// third of the out-of-memory errors of the first run, because it starts from the ceilings the
/// first run kept in the compacted ceilings topic. No task of either run fails: each fits alone
/// on a clean arena.
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_worker_starts_from_the_ceilings_it_learned() {
    let stack = stack().await;
    let topics = stack.topics("sd-ceilings", 4).unwrap();
    let mut worker = worker(
        stack,
        "ceilings",
        &topics,
        &[memory_cap("400000000"), ("SLUICE_MAX_BATCH", "8"), ("SLUICE_MAX_WAIT_MS", "2000")],
    )
    .await;
    worker.wait_assigned(Duration::from_secs(60)).await.unwrap();
    let kafka = producer(stack.brokers()).unwrap();
    // Eight one-image tasks (two fit in one call under this cap, four do not) and one task of
    // three images, whose rows run in parts.
    let workload = |base: u64| -> Vec<(String, Value)> {
        let mut tasks: Vec<_> = (0..8).map(|i| sd_task(base + i, 256, 2, 1)).collect();
        tasks.push(sd_task(base + 8, 256, 2, 3));
        tasks
    };
    let mut ooms = Vec::new();
    for (run, base) in [(1, 100), (2, 200)] {
        let tasks = workload(base);
        publish_tasks(&kafka, &topics.tasks, &tasks).await.unwrap();
        let done = outcomes(stack, &topics, &ids_of(&tasks));
        assert_eq!(
            done.with_status(CompletionStatus::Succeeded).len(),
            tasks.len(),
            "run {run}: every task fits alone on a clean arena: {:?}",
            done.dlq
        );
        let metrics = worker.metrics().await.unwrap();
        ooms.push(metric_sum(&metrics, "sluice_worker_oom_total"));
        if run == 2 {
            let restored = metric_value(&metrics, "sluice_worker_ceilings_restored").unwrap();
            assert!(restored >= 1.0, "the restarted worker read back what it learned: {restored}");
            break;
        }
        worker.service.terminate(Duration::from_secs(30)).unwrap();
        worker.restart(stack).await.unwrap();
        worker.wait_assigned(Duration::from_secs(60)).await.unwrap();
    }
    eprintln!("out-of-memory errors handled: first run {}, after the restart {}", ooms[0], ooms[1]);
    assert!(ooms[0] >= 3.0, "the first run learns through out-of-memory errors: {}", ooms[0]);
    assert!(
        ooms[1] * 3.0 <= ooms[0],
        "after the restart: {} of the first run's {}",
        ooms[1],
        ooms[0]
    );
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}
