//! Memory discipline on real out-of-memory errors: ONNX Runtime's CPU arena is capped
//! (`SLUICE_ORT_CPU_ARENA_MAX_BYTES`), so a batch that needs more than the cap fails inside ORT
//! exactly as a CUDA allocation does on a GPU. Batches halve, a task whose tiles don't fit
//! together runs them in parts, the worker stays up; concurrent singles don't fail each other; reloads neither
//! lose tasks nor leak memory, fall back on a broken model and exit when they cannot.
//!
//! Measured here (terrain UNet, 128×128 tiles): a 1 GB cap runs 8 tiles in one call but not 18;
//! 700 MB runs one 320×320 map (9 tiles) at a time, not two side by side.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;
use sluice_integration_tests::cluster::{Worker, http_get, metric_sum, metric_value};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{Outcomes, ReloadRss, Stack, Topics, assert_rss_bounded, ids_of, publish_tasks, terrain_task};
use sluice_schemas::CompletionStatus;
use tokio::sync::OnceCell;

static STACK: OnceCell<Stack> = OnceCell::const_new();

async fn stack() -> &'static Stack {
    STACK.get_or_init(|| async { Stack::start("memory").expect("stack starts") }).await
}

/// A worker of its own group on its own topics.
async fn worker(stack: &Stack, scenario: &str, topics: &Topics, extra: &[(&str, &str)]) -> Worker {
    Worker::on_topics(stack, scenario, &format!("memory-{scenario}"), topics, extra)
        .await
        .expect("worker starts")
}

fn outcomes(stack: &Stack, topics: &Topics, ids: &BTreeSet<String>, timeout: Duration) -> Outcomes {
    Outcomes::wait(stack.brokers(), topics, ids, timeout).unwrap()
}

/// The worker's log as JSON lines.
fn log_events(worker: &Worker) -> Vec<Value> {
    worker
        .service
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn large_maps_halve_their_batch_and_huge_ones_run_their_tiles_in_parts() {
    let stack = stack().await;
    let topics = stack.topics("oom", 4).unwrap();
    let mut worker = worker(
        stack,
        "oom",
        &topics,
        &[
            ("SLUICE_ORT_CPU_ARENA_MAX_BYTES", "1000000000"),
            ("SLUICE_MAX_BATCH", "8"),
            ("SLUICE_MAX_WAIT_MS", "2000"),
            // Production's log format, so the test reads the fields.
            ("SLUICE_LOG_FORMAT", "json"),
        ],
    )
    .await;
    // Small maps (one tile each), a group of 320×320 maps (9 tiles: 6 of them, 54 rows, overflow
    // the cap together; one fits alone) and 1024×1024 maps (121 tiles: never fit together; their
    // tiles run in parts). What does not fit even as one row goes to the DLQ: `memory/diffusion.rs`.
    let small: Vec<_> = (0..8).map(|i| terrain_task(i, 128, 128, 10 + i as u32)).collect();
    let large: Vec<_> = (0..6).map(|i| terrain_task(100 + i, 320, 320, 50)).collect();
    let huge: Vec<_> = (0..2).map(|i| terrain_task(200 + i, 1024, 1024, 90)).collect();
    let kafka = producer(stack.brokers()).unwrap();
    // The large group first, all at once, so that it batches at the configured maximum.
    publish_tasks(&kafka, &topics.tasks, &large).await.unwrap();
    publish_tasks(&kafka, &topics.tasks, &huge).await.unwrap();
    publish_tasks(&kafka, &topics.tasks, &small).await.unwrap();

    let all: Vec<_> = [small.clone(), large.clone(), huge.clone()].concat();
    let done = outcomes(stack, &topics, &ids_of(&all), Duration::from_secs(240));
    let succeeded = done.with_status(CompletionStatus::Succeeded);
    for (id, _) in small.iter().chain(&large).chain(&huge) {
        assert!(succeeded.contains(id), "{id} should have completed: {:?}", done.completions.get(id));
    }

    // The worker never exited, and says so.
    assert!(worker.service.running(), "the worker is still up");
    assert!(http_get(&format!("{}/readyz", worker.url)).await.status().is_success());

    // One WARN per handled OOM, naming bucket, sizes, dimensions and task ids; never an ERROR.
    let events = log_events(&worker);
    let halvings: Vec<&Value> = events
        .iter()
        .filter(|e| e["message"] == "out of memory; retrying with a smaller batch" && e["bucket"] == "terrain:9")
        .collect();
    assert!(!halvings.is_empty(), "the large group halved");
    let first = halvings[0];
    assert_eq!(first["level"], "WARN");
    // All six arrive within the batch wait, so the first run is the configured size (capped by
    // rows: 64 / 9 = 7 ≥ 6) — unless the fetch split them; either way it halves.
    let before = first["batch_before"].as_u64().unwrap();
    assert!(before >= 4, "{first}");
    assert_eq!(first["batch_after"].as_u64().unwrap(), before / 2, "{first}");
    assert!(first["dimensions"].as_str().unwrap().contains("320x320x1"));
    for (id, _) in &large {
        assert!(
            halvings.iter().any(|e| e["task_ids"].as_str().unwrap().contains(id.as_str())),
            "{id} named in a halving"
        );
    }
    // The huge maps' tiles ran in halves (the first of them learned it; the second starts in
    // the parts learned), each halving one WARN naming the task and its rows.
    let parts: Vec<&Value> = events
        .iter()
        .filter(|e| e["message"] == "out of memory; running the task's rows in smaller parts")
        .collect();
    assert!(!parts.is_empty(), "the huge maps ran their tiles in parts");
    for part in &parts {
        assert_eq!(part["level"], "WARN");
        assert!(huge.iter().any(|(id, _)| part["task_id"] == id.as_str()), "{part}");
        assert!(part["dimensions"].as_str().unwrap().contains("1024x1024"), "{part}");
        let before = part["rows_before"].as_u64().unwrap();
        assert_eq!(part["rows_after"].as_u64().unwrap(), before / 2, "{part}");
    }
    let memory_error = events.iter().find(|e| e["level"] == "ERROR" && e.to_string().contains("memory"));
    assert!(memory_error.is_none(), "no ERROR for handled OOMs: {memory_error:?}");

    // The learned ceiling and the counters on /metrics.
    let metrics = worker.metrics().await.unwrap();
    let ceiling = metric_value(&metrics, "sluice_worker_batch_ceiling{bucket=\"terrain:le16\"}").unwrap();
    assert!((1.0..=2.0).contains(&ceiling), "learned ceiling of the 9-tile bucket: {ceiling}");
    assert!(metric_value(&metrics, "sluice_worker_oom_total{bucket=\"terrain:le16\"}").unwrap() >= 2.0);
    assert!(metric_value(&metrics, "sluice_worker_oom_total{bucket=\"terrain:le128\"}").unwrap() >= 2.0);
    assert_eq!(
        metric_value(&metrics, "sluice_worker_dlq_records_total{reason=\"resource_exhausted\"}"),
        None,
        "nothing that fits one tile at a time fails"
    );
    assert!(metrics.contains("sluice_worker_batch_size_bucket{bucket=\"terrain:le16\""));
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

/// A task with more rows than one call may take (`SLUICE_MAX_BATCH_ROWS`) runs in parts of at
/// most that many: under a cap that holds 8 tiles, a 512×512 map (25 tiles) completes with 8
/// rows a call, where one call of 25 would run out of memory and dead-letter it.
#[tokio::test(flavor = "multi_thread")]
async fn a_task_larger_than_the_row_cap_runs_in_parts_within_the_cap() {
    let stack = stack().await;
    let topics = stack.topics("parts", 1).unwrap();
    let mut worker = worker(
        stack,
        "parts",
        &topics,
        &[("SLUICE_ORT_CPU_ARENA_MAX_BYTES", "1000000000"), ("SLUICE_MAX_BATCH_ROWS", "8")],
    )
    .await;
    let tasks = vec![terrain_task(400, 512, 512, 70)];
    publish_tasks(&producer(stack.brokers()).unwrap(), &topics.tasks, &tasks)
        .await
        .unwrap();
    let done = outcomes(stack, &topics, &ids_of(&tasks), Duration::from_secs(240));
    let id = &tasks[0].0;
    assert_eq!(
        done.completions[id][0].status,
        CompletionStatus::Succeeded,
        "{:?}",
        done.dlq.get(id)
    );
    let metrics = worker.metrics().await.unwrap();
    assert_eq!(
        metric_value(&metrics, "sluice_worker_oom_total{bucket=\"terrain:le32\"}").unwrap_or(0.0),
        0.0
    );
    assert!(worker.service.running());
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

/// Eight 320×320 maps at batch 1 on two engine slots, under a cap that holds one at a time:
/// tasks completed, failed, and out-of-memory errors handled.
async fn singles(scenario: &str, serialize: bool) -> (usize, usize, f64) {
    let stack = stack().await;
    let topics = stack.topics(scenario, 4).unwrap();
    let no_serialize = (!serialize).to_string();
    let mut worker = worker(
        stack,
        scenario,
        &topics,
        &[
            ("SLUICE_ORT_CPU_ARENA_MAX_BYTES", "700000000"),
            ("SLUICE_MAX_BATCH", "1"),
            ("SLUICE_ENGINE_SLOTS", "2"),
            ("SLUICE_NO_SERIALIZE_SINGLES", &no_serialize),
        ],
    )
    .await;
    let tasks: Vec<_> = (0..8).map(|i| terrain_task(300 + i, 320, 320, 40)).collect();
    publish_tasks(&producer(stack.brokers()).unwrap(), &topics.tasks, &tasks)
        .await
        .unwrap();
    let done = outcomes(stack, &topics, &ids_of(&tasks), Duration::from_secs(240));
    assert!(worker.service.running());
    let metrics = worker.metrics().await.unwrap();
    let ooms = metric_sum(&metrics, "sluice_worker_oom_total");
    worker.service.terminate(Duration::from_secs(30)).unwrap();
    let ok = done.with_status(CompletionStatus::Succeeded).len();
    (ok, tasks.len() - ok, ooms)
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_singles_do_not_make_each_other_fail() {
    let (ok, failed, ooms) = singles("singles", true).await;
    assert_eq!(
        (ok, failed, ooms),
        (8, 0, 0.0),
        "serialized singles all complete, none runs out of memory"
    );
    // The same load with the device permit switched off: side-by-side runs overflow the cap and
    // run each other out of memory (that this happens is what makes the assertion above mean
    // something); the clean-arena retry, which has the device to itself, still runs them all.
    let (ok, failed, ooms) = singles("singles-unserialized", false).await;
    assert!(ooms > 0.0, "without serialization concurrent singles ran out of memory");
    assert_eq!((ok, failed), (8, 0), "and the clean-arena retry ran them ({ooms} OOMs)");
}

async fn reload(worker: &Worker) -> (u16, Value) {
    worker.reload(&serde_json::json!({"model": "terrain"})).await
}

/// How much higher RSS may be after the last reloads than after the first ones.
const RSS_BOUND_BYTES: u64 = 150 << 20;

#[tokio::test(flavor = "multi_thread")]
async fn fifty_reloads_under_load_lose_nothing_leak_nothing_and_fall_back_or_exit() {
    let stack = stack().await;
    let topics = stack.topics("reload", 4).unwrap();
    // A model directory of its own, with a real copy of the model (the file is replaced and
    // corrupted below; the stack's model is a link to the shared cache).
    let models = stack.dir.join("reload-models/terrain");
    std::fs::create_dir_all(&models).unwrap();
    let model = models.join("model.onnx");
    std::fs::copy(stack.dir.join("models/terrain/model.onnx"), &model).unwrap();
    let model_dir = stack.dir.join("reload-models").display().to_string();
    let mut worker = worker(
        stack,
        "reload",
        &topics,
        &[("SLUICE_MODEL_DIR", &model_dir), ("SLUICE_MAX_WAIT_MS", "20")],
    )
    .await;
    let kafka = producer(stack.brokers()).unwrap();

    // Warm-up: the worker reaches its working set (allocator, Kafka buffers, thread pools)
    // before any sample counts; on a busy machine the first reloads can come before any work.
    let warm_up: Vec<_> = (0..8).map(|i| terrain_task(500 + i, 128, 128, 1 + i as u32)).collect();
    publish_tasks(&kafka, &topics.tasks, &warm_up).await.unwrap();
    let done = outcomes(stack, &topics, &ids_of(&warm_up), Duration::from_secs(120));
    assert_eq!(done.with_status(CompletionStatus::Succeeded).len(), warm_up.len());

    // Tasks flow while the model is reloaded 50 times.
    let mut tasks = Vec::new();
    let mut rss = Vec::new();
    for i in 0..50u64 {
        let wave: Vec<_> = (0..2).map(|j| terrain_task(i * 2 + j, 128, 128, 1 + (i as u32 % 100))).collect();
        publish_tasks(&kafka, &topics.tasks, &wave).await.unwrap();
        tasks.extend(wave);
        let (status, report) = reload(&worker).await;
        assert_eq!(status, 200, "{report}");
        let report = &report["reloads"][0];
        assert_eq!(report["result"], "reloaded", "{report}");
        rss.push(ReloadRss::of(report));
    }
    let done = outcomes(stack, &topics, &ids_of(&tasks), Duration::from_secs(300));
    assert_eq!(
        done.with_status(CompletionStatus::Succeeded).len(),
        tasks.len(),
        "every task completed across the reloads"
    );
    eprintln!(
        "reload RSS (MB, after unload/after): {}",
        rss.iter()
            .map(|r| format!("{}/{}", r.after_unload >> 20, r.after >> 20))
            .collect::<Vec<_>>()
            .join(" ")
    );
    // The highest RSS after reloads 36..50 against the highest after reloads 1..15: a leak of a
    // fifth of the 45 MB model per reload is more than the bound.
    assert_rss_bounded("terrain", &rss, 0..15, 35.., RSS_BOUND_BYTES);

    // A broken new file (atomically replaced, as a deployment does): the reload falls back to
    // the previous model, which keeps serving.
    let previous = models.join("model.onnx.previous");
    std::fs::hard_link(&model, &previous).unwrap();
    let broken = models.join("model.onnx.new");
    std::fs::write(&broken, b"not an onnx model").unwrap();
    std::fs::rename(&broken, &model).unwrap();
    let (status, report) = reload(&worker).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["reloads"][0]["result"], "fell_back", "{report}");
    assert!(report["reloads"][0]["error"].as_str().unwrap().contains("model.onnx"), "{report}");
    let after: Vec<_> = (0..3).map(|i| terrain_task(900 + i, 128, 128, 70)).collect();
    publish_tasks(&kafka, &topics.tasks, &after).await.unwrap();
    let done = outcomes(stack, &topics, &ids_of(&after), Duration::from_secs(120));
    assert_eq!(done.with_status(CompletionStatus::Succeeded).len(), after.len());
    let ready = format!("{}/readyz", worker.url);
    worker.service.wait_ready(&ready, Duration::from_secs(10)).await.unwrap();

    // Now the previous model is corrupted too (in place, through its other name): the reload
    // cannot load either, and the worker exits non-zero rather than stay up unable to serve.
    std::fs::write(&previous, b"corrupted in place").unwrap();
    let (status, report) = reload(&worker).await;
    assert_eq!(status, 500, "{report}");
    let exit = worker.service.wait(Duration::from_secs(40)).unwrap();
    assert!(!exit.success(), "exit status {exit:?}");
    assert_eq!(exit.code(), Some(1));
}

/// A reload that leaks its model (`SLUICE_TEST_FAULTS=leak-load=1`: every load keeps a second
/// copy of the 45 MB terrain model that is never dropped) trips the worker's reload bound: the
/// memory in use right after an unload (the process's RSS on the CPU; on a GPU node, the device
/// memory the worker holds, from NVML) grows by a copy per reload, the bound here is 32 MB, and the worker exits
/// non-zero naming the leak instead of serving on until it runs out of memory. Without the leak
/// the same worker reloads as often as it is asked (the fifty-reload test above, default bound).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_leaks_the_model_trips_the_bound_and_the_worker_exits_non_zero() {
    let stack = stack().await;
    let topics = stack.topics("leak", 1).unwrap();
    let mut worker = worker(
        stack,
        "leak",
        &topics,
        &[
            ("SLUICE_TEST_FAULTS", "leak-load=1"),
            ("SLUICE_RELOAD_LEAK_BOUND_BYTES", "33554432"),
            ("SLUICE_LOG_FORMAT", "json"),
        ],
    )
    .await;
    let mut reloads = 0;
    let report = loop {
        let (status, report) = reload(&worker).await;
        reloads += 1;
        if status != 200 {
            break report;
        }
        assert!(reloads < 6, "six leaking reloads and the bound never tripped: {report}");
    };
    let exit = worker.service.wait(Duration::from_secs(40)).unwrap();
    assert!(!exit.success(), "exit status {exit:?}");
    let message = report.to_string();
    assert!(message.contains("SLUICE_RELOAD_LEAK_BOUND_BYTES"), "{report}");
    eprintln!("leaking reloads: the bound tripped at reload {reloads}: {message}");
}
