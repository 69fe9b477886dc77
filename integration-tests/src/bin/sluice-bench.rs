//! `make bench`: Sluice's benchmarks, printed as tables. Each compares things measured side by side
//! in this one run (the machine is shared and noisy: absolute numbers vary, ratios less so).
//!
//! adaptive: under a CPU arena cap, adaptive batching against every fixed batch size and batch 1
//! (in process, on the worker's engine), with how long a cold start takes to settle.
//!
//! sched: step-level scheduling against request-level under a mixed open-loop load of the tiny
//! diffusion models (`sluice-bench/sched.rs`).
//!
//! pipeline: for the same model and batch size, raw in-process ONNX Runtime images/s against
//! end-to-end images/s through one worker, Kafka and S3 (tasks pre-loaded on the topic; rate
//! measured at steady state, from the worker's completion timestamps), for the pretrained
//! terrain model and for a tiny generated model with the same inputs (~1 ms per call: how fast
//! the pipeline itself goes when the model is as fast as on a GPU). Each model's last row is the
//! baseline, a plain Python consumer (`scripts/bench/peer_consumer.py`) on the same tasks. With
//! `SLUICE_BENCH_WORKER_CPUS` (a `taskset` list, e.g. `0`) the workers run on those cores and the
//! stack's servers on the others, so that a rate is per worker core.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use sluice_integration_tests::cluster::Worker;
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::process::on_cuda;
use sluice_integration_tests::stack::Stack;
use sluice_integration_tests::{TopicReader, publish_tasks, sd_task, terrain_task};
use sluice_schemas::{CompletionEvent, CompletionStatus, TaskRecord};
use sluice_worker::engine::{Backend, Call, CallTask, Engine, EngineError, Loader, OrtBackend, Runtime, RuntimeOptions, SessionOptions};
use sluice_worker::models::{ModelAdapter, concat_inputs, terrain::Terrain};

#[path = "sluice-bench/sched.rs"]
mod sched;

struct Row {
    scenario: String,
    /// CPU seconds per 1000 tasks: worker, broker, S3 server.
    cpu: [f64; 3],
    batch: usize,
    tasks: usize,
    raw: f64,
    e2e: f64,
    /// Per task inference + upload, p50 / p99 (the worker's completion timings); `None` for the
    /// plain Python consumer, which writes no completions.
    latency_ms: Option<(u64, u64)>,
    /// The GPU's mean busy % during the raw and the end-to-end rows (on CUDA).
    device_busy: Option<(f64, f64)>,
}

impl Row {
    /// A row measured end to end, with the CPU seconds of its three processes (worker or
    /// consumer, broker, S3 server) before and after, as seconds per 1000 tasks.
    fn measured(
        scenario: &str,
        (batch, tasks): (usize, usize),
        (raw, e2e): (f64, f64),
        (before, after): ([f64; 3], [f64; 3]),
        latency_ms: Option<(u64, u64)>,
    ) -> Row {
        Row {
            cpu: std::array::from_fn(|i| (after[i] - before[i]) / tasks as f64 * 1000.0),
            scenario: scenario.into(),
            batch,
            tasks,
            raw,
            e2e,
            latency_ms,
            device_busy: None,
        }
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let which = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    if std::env::var_os("RUST_LOG").is_some() {
        // The worker's own log lines (each handled OOM, each rebuild), for a closer look.
        sluice_service::telemetry::init(sluice_service::telemetry::LogFormat::Text);
    }
    if which == "all" {
        // One process per benchmark: ONNX Runtime has one environment per process, and the
        // adaptive benchmark caps its CPU arena.
        for which in [
            "pipeline",
            "delivery",
            "turns",
            "sched",
            "group",
            "adaptive",
            "adaptive-sd",
            "adaptive-sdxl",
            "status-view",
        ] {
            let status = std::process::Command::new(std::env::current_exe()?).arg(which).status()?;
            anyhow::ensure!(status.success(), "benchmark {which} failed");
        }
        return Ok(());
    }
    if which == "status-view" {
        return status_view::run();
    }
    let stack = Stack::start("bench")?;
    if which == "adaptive" {
        return adaptive::run(&stack).await;
    }
    if which == "adaptive-sd" {
        return adaptive::run_sd(&stack, "sd-tiny").await;
    }
    if which == "adaptive-sdxl" {
        return adaptive::run_sd(&stack, "sdxl-tiny").await;
    }
    if which == "delivery" {
        return delivery::run(&stack).await;
    }
    if which == "group" {
        return group::run(&stack).await;
    }
    if which == "turns" {
        return turns::run(&stack).await;
    }
    if which == "sched" {
        return sched::run(&stack).await;
    }
    if which == "reloads" {
        return reloads(&stack).await;
    }
    anyhow::ensure!(
        which == "pipeline",
        "unknown benchmark {which:?}: all, pipeline, delivery, turns, sched, group, adaptive, adaptive-sd, adaptive-sdxl, reloads or status-view"
    );
    // `sluice-bench pipeline [terrain|tiny|sd|sdxl|flux|sd3]`: one model only.
    let only = std::env::args().nth(2);
    let device = if on_cuda() {
        sluice_worker::engine::gpu::device_name(0).unwrap_or_else(|| "CUDA".into())
    } else {
        "CPU".into()
    };
    let pinned = match pinning::worker_cpus() {
        Some(cpus) => {
            let rest = pinning::stack_to_other_cpus(&stack, &cpus)?;
            format!(", the workers pinned to CPUs {cpus} and the stack to {rest}")
        }
        None => String::new(),
    };
    println!();
    println!(
        "## pipeline: raw in-process ONNX Runtime vs end to end through Kafka (Apache Kafka 4.3.1, a KRaft controller and one broker) and S3 (s3s-fs), one worker, {device}{pinned}"
    );
    println!();
    println!(
        "| model | batch | tasks | raw ORT images/s | end-to-end images/s | ratio | per task inference + upload ms, p50 / p99 | CPU s per 1000 tasks: worker (or consumer) / broker / S3 | GPU busy %: raw / end to end |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let report = |r: &Row| {
        println!(
            "| {} | {} | {} | {} | {:.2} | {} | {} | {:.2} / {:.2} / {:.2} | {} |",
            r.scenario,
            r.batch,
            r.tasks,
            if r.raw.is_nan() {
                "out of memory".into()
            } else {
                format!("{:.2}", r.raw)
            },
            r.e2e,
            if r.raw.is_nan() {
                "-".into()
            } else {
                format!("{:.2}", r.e2e / r.raw)
            },
            r.latency_ms.map_or("-".into(), |(p50, p99)| format!("{p50} / {p99}")),
            r.cpu[0],
            r.cpu[1],
            r.cpu[2],
            r.device_busy.map_or("-".into(), |(raw, e2e)| format!("{raw:.0} / {e2e:.0}"))
        );
    };
    // Each row as it is measured: a later row that fails leaves the earlier ones printed.
    if only.as_deref().is_none_or(|o| o == "terrain") {
        let terrain = stack.dir.join("models");
        pipeline(&stack, "terrain (pretrained UNet)", &terrain, (8, 240, 40), &report).await?;
    }
    if only.as_deref().is_none_or(|o| o == "tiny") {
        let tiny = stack.tiny_models()?;
        pipeline(&stack, "terrain-tiny (~1 ms model)", &tiny, (64, 20_000, 2_000), &report).await?;
    }
    if only.as_deref().is_none_or(|o| o == "sd") {
        report(&sd_pipeline(&stack, "sd-tiny", 64, 4, 8, 400).await?);
        report(&sd_pipeline(&stack, "sd-tiny", 256, 20, 2, 16).await?);
    }
    if only.as_deref().is_none_or(|o| o == "sdxl") {
        report(&sd_pipeline(&stack, "sdxl-tiny", 64, 4, 8, 200).await?);
        report(&sd_pipeline(&stack, "sdxl-tiny", 256, 20, 2, 16).await?);
    }
    if only.as_deref().is_none_or(|o| o == "flux") {
        report(&sd_pipeline(&stack, "flux-schnell-tiny", 64, 4, 8, 200).await?);
        report(&sd_pipeline(&stack, "flux-dev-tiny", 256, 20, 2, 16).await?);
    }
    if only.as_deref().is_none_or(|o| o == "sd3") {
        report(&sd_pipeline(&stack, "sd3-tiny", 64, 4, 8, 200).await?);
        report(&sd_pipeline(&stack, "sd3-tiny", 256, 20, 2, 16).await?);
    }
    // `sluice-bench pipeline model`: a diffusion model of any size outside the demo catalog,
    // what `make gpu-bench` runs on the SD-1.5-shaped model (scripts/gpu/bench.sh).
    if only.as_deref() == Some("model") {
        let var = |name: &str| std::env::var(name).with_context(|| format!("{name} is needed for `pipeline model`"));
        let served = Served {
            model: Box::leak(var("SLUICE_BENCH_MODEL")?.into_boxed_str()),
            models_dir: var("SLUICE_BENCH_MODEL_DIR")?.into(),
            catalog: var("SLUICE_BENCH_CATALOG")?.into(),
        };
        // Rows as `size:steps:batch`; tasks per row: SLUICE_BENCH_TASKS at 512x512, fewer for
        // larger images (the same pixels), at least two calls' worth.
        let rows_spec = std::env::var("SLUICE_BENCH_ROWS").unwrap_or_else(|_| "512:20:1".into());
        for row in rows_spec.split(',') {
            let v: Vec<usize> = row.split(':').filter_map(|v| v.trim().parse().ok()).collect();
            let [size, steps, batch] = v[..] else {
                anyhow::bail!("SLUICE_BENCH_ROWS: {row:?} is not size:steps:batch");
            };
            let tasks = (env_or("SLUICE_BENCH_TASKS", 8) * 512 * 512 / (size * size).max(512 * 512)).max(2 * batch);
            report(&diffusion_pipeline(&stack, &served, size as u32, steps as u32, batch, tasks).await?);
        }
    }
    Ok(())
}

/// `sluice-bench reloads` (run by `make gpu-bench` on the SD-1.5-shaped model): a worker serving
/// `SLUICE_BENCH_MODEL` (from `SLUICE_BENCH_MODEL_DIR`, `SLUICE_BENCH_CATALOG`) reloaded
/// `SLUICE_BENCH_RELOADS` times (default 5), with the memory right after each unload and after
/// each load (free device memory through NVML on a GPU, RSS on the CPU); then the same model in a
/// worker whose every load leaks a copy (`SLUICE_TEST_FAULTS=leak-load=1`), reloaded until the
/// reload bound (`SLUICE_BENCH_LEAK_BOUND_BYTES`, default 1 GiB) stops it.
async fn reloads(stack: &Stack) -> anyhow::Result<()> {
    let var = |name: &str| std::env::var(name).with_context(|| format!("{name} is needed for `reloads`"));
    let model = var("SLUICE_BENCH_MODEL")?;
    let (models_dir, catalog) = (var("SLUICE_BENCH_MODEL_DIR")?, var("SLUICE_BENCH_CATALOG")?);
    let settings = [
        ("SLUICE_MODEL_DIR", models_dir.as_str()),
        ("SLUICE_MODEL_CATALOG", catalog.as_str()),
        ("SLUICE_MODELS", model.as_str()),
    ];
    let body = serde_json::json!({ "model": model });
    let mb = |v: &serde_json::Value| v.as_u64().map_or("-".into(), |b| (b >> 20).to_string());
    let (free, what) = if on_cuda() {
        ("device_process_bytes", "device memory the worker holds (NVML), MB")
    } else {
        ("rss_bytes", "RSS, MB")
    };
    let worker = Worker::start(stack, "reloads", &settings).await?;
    println!("\n## reloads of {model}: {what}\n");
    println!("| reload | after the unload | after the load | ms |");
    println!("|---|---|---|---|");
    for i in 1..=env_or("SLUICE_BENCH_RELOADS", 5) {
        let (status, report) = worker.reload(&body).await;
        anyhow::ensure!(status == 200, "reload {i}: {report}");
        let r = &report["reloads"][0];
        println!(
            "| {i} | {} | {} | {} |",
            mb(&r["after_unload"][free]),
            mb(&r["after"][free]),
            r["total_ms"]
        );
    }
    drop(worker);
    let bound = env_or("SLUICE_BENCH_LEAK_BOUND_BYTES", 1 << 30).to_string();
    let mut leaking: Vec<(&str, &str)> = settings.to_vec();
    leaking.extend([
        ("SLUICE_TEST_FAULTS", "leak-load=1"),
        ("SLUICE_RELOAD_LEAK_BOUND_BYTES", bound.as_str()),
    ]);
    let mut worker = Worker::start(stack, "reloads-leaking", &leaking).await?;
    for i in 1..=6 {
        let (status, report) = worker.reload(&body).await;
        if status != 200 {
            let exit = worker.service.wait(Duration::from_secs(60))?;
            println!(
                "\nleaking each load, bound {} MB: reload {i} answered {status}, the worker exited with {exit}: {report}",
                bound.parse::<u64>()? >> 20
            );
            anyhow::ensure!(!exit.success(), "the leaking worker exited cleanly");
            return Ok(());
        }
    }
    anyhow::bail!("six leaking reloads did not trip the bound")
}

/// Where `SLUICE_BENCH_WORKER_CPUS` asks for it, the workers on some cores and the stack's
/// servers on the others (`taskset`), so that a rate measured is per worker core.
mod pinning {
    use super::*;

    /// The workers' CPU list, as `taskset` reads it (`0`, `0-1`, `0,2`).
    pub(super) fn worker_cpus() -> Option<String> {
        std::env::var("SLUICE_BENCH_WORKER_CPUS").ok().filter(|c| !c.trim().is_empty())
    }

    /// Every thread of `pid` (and the threads it starts later) onto `cpus`.
    pub(super) fn pin(pid: u32, cpus: &str) -> anyhow::Result<()> {
        let status = std::process::Command::new("taskset")
            .args(["--all-tasks", "--cpu-list", "--pid", cpus, &pid.to_string()])
            .stdout(std::process::Stdio::null())
            .status()
            .context("running taskset")?;
        anyhow::ensure!(status.success(), "taskset {cpus} for process {pid} failed");
        Ok(())
    }

    /// The stack's servers onto the CPUs that `workers` leaves; returns their list.
    pub(super) fn stack_to_other_cpus(stack: &Stack, workers: &str) -> anyhow::Result<String> {
        let ours = cpu_set(workers)?;
        let online = std::fs::read_to_string("/sys/devices/system/cpu/online").context("the online CPUs")?;
        let rest: Vec<String> = cpu_set(online.trim())?.difference(&ours).map(usize::to_string).collect();
        anyhow::ensure!(!rest.is_empty(), "SLUICE_BENCH_WORKER_CPUS={workers} leaves no CPU for the stack");
        let rest = rest.join(",");
        for server in ["controller", "broker", "s3"] {
            pin(pid_of(&stack.dir, server), &rest)?;
        }
        Ok(rest)
    }

    /// A CPU list (`0-2,5`) as a set.
    fn cpu_set(list: &str) -> anyhow::Result<std::collections::BTreeSet<usize>> {
        let mut set = std::collections::BTreeSet::new();
        for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let (a, b): (usize, usize) = (a.parse().context("a CPU number")?, b.parse().context("a CPU number")?);
            set.extend(a..=b);
        }
        Ok(set)
    }
}

/// A benchmark's size setting: `name` from the environment, else `default`.
fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn pid_of(dir: &Path, name: &str) -> u32 {
    std::fs::read_to_string(dir.join(format!("{name}.pid")))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// User + system CPU seconds a process has used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which may contain spaces): utime is the 12th, stime the 13th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

/// Terrain tile `i` of the benchmarks: 128×128, its seed `i`, 1 to 100 steps.
fn tile_task(i: usize) -> (String, serde_json::Value) {
    terrain_task(i as u64, 128, 128, 1 + (i % 100) as u32)
}

fn task_record(i: usize) -> serde_json::Value {
    tile_task(i).1
}

/// Raw: the model alone, in this process, on prepared inputs (no Kafka, no encoding, no storage).
/// ONNX Runtime allows one environment per process: every scenario shares this one.
fn runtime(stack: &Stack) -> anyhow::Result<Arc<Runtime>> {
    runtime_with(stack, None)
}

/// The session options a worker started in this environment uses (`SLUICE_DEVICE`,
/// `SLUICE_CUDA_*`, `SLUICE_GPU_MEM_LIMIT`, …, read by the worker's own flags), so that the raw
/// rows run on the device and with the settings of the end-to-end rows they are compared with.
fn worker_session_options() -> anyhow::Result<SessionOptions> {
    use clap::{Args, FromArgMatches};
    let command = sluice_worker::config::DeviceArgs::augment_args(clap::Command::new("sluice-bench"));
    let matches = command.try_get_matches_from(["sluice-bench"])?;
    Ok(sluice_worker::config::DeviceArgs::from_arg_matches(&matches)?.session_options())
}

/// The process's runtime; `cpu_arena_max_bytes` applies when this call creates it.
fn runtime_with(stack: &Stack, cpu_arena_max_bytes: Option<usize>) -> anyhow::Result<Arc<Runtime>> {
    static RUNTIME: std::sync::OnceLock<Arc<Runtime>> = std::sync::OnceLock::new();
    if let Some(r) = RUNTIME.get() {
        return Ok(r.clone());
    }
    // On a GPU node (`make gpu-check`) the CUDA flavour of ONNX Runtime is the one exported.
    let dylib = match std::env::var("ORT_DYLIB_PATH") {
        Ok(path) if on_cuda() => path,
        _ => stack.env["ORT_DYLIB_PATH"].clone(),
    };
    let r = Arc::new(Runtime::init(&RuntimeOptions {
        dylib_path: Some(dylib.into()),
        cpu_arena_max_bytes,
    })?);
    Ok(RUNTIME.get_or_init(|| r).clone())
}

/// Loads `<model_dir>/terrain/model.onnx` on ONNX Runtime with the workers' session options.
fn ort_loader(runtime: &Arc<Runtime>, model_dir: &Path) -> anyhow::Result<Loader> {
    let (runtime, path, options) = (runtime.clone(), model_dir.join("terrain/model.onnx"), worker_session_options()?);
    Ok(Arc::new(move || {
        Ok(Box::new(OrtBackend::load(&runtime, &path, &options)?) as Box<dyn Backend>)
    }))
}

async fn raw_images_per_second(stack: &Stack, model_dir: &Path, batch: usize, batches: usize) -> anyhow::Result<f64> {
    let engine = Engine::start(1);
    let runtime = runtime(stack)?;
    engine.load("terrain", ort_loader(&runtime, model_dir)?).await?;
    let adapter = Terrain::new(runtime);
    let tasks: Vec<TaskRecord> = (0..batch).map(|i| serde_json::from_value(task_record(i)).unwrap()).collect();
    images_per_second(&engine, "terrain", &adapter, &tasks, batches).await
}

/// Images per second of `batches` in-process calls of `tasks` as one batch (after two to warm up).
async fn images_per_second(
    engine: &Engine,
    model: &str,
    adapter: &dyn ModelAdapter,
    tasks: &[TaskRecord],
    batches: usize,
) -> anyhow::Result<f64> {
    let prepared: Vec<_> = tasks
        .iter()
        .map(|t| adapter.prepare(t, &Default::default()))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    let call = Call {
        key: adapter.bucket(&tasks[0]).map_err(anyhow::Error::msg)?.key,
        inputs: concat_inputs(&prepared.iter().collect::<Vec<_>>()),
        tasks: prepared
            .iter()
            .enumerate()
            .map(|(i, p)| CallTask {
                id: i.to_string(),
                attempt: 1,
                rows: p.rows,
                hooks: None,
            })
            .collect(),
    };
    for _ in 0..2 {
        engine.run(model, call.clone(), false, Default::default()).await?;
    }
    let started = Instant::now();
    for _ in 0..batches {
        engine.run(model, call.clone(), false, Default::default()).await?;
    }
    Ok((batches * prepared.iter().map(|p| p.rows).sum::<usize>()) as f64 / started.elapsed().as_secs_f64())
}

/// The delivery modes each `pipeline` model is run end to end in, beside one raw figure: the
/// default, at-least-once, and at-least-once without the crash guard's start records (what a
/// hand-written consumer that commits after each batch does); each with its short name in
/// `SLUICE_BENCH_PIPELINE_MODES`.
const DELIVERY_MODES: [(&str, &str, &[(&str, &str)]); 3] = [
    ("exactly-once", "exactly-once (default)", &[]),
    ("at-least-once", "at-least-once", &[("SLUICE_DELIVERY", "at-least-once")]),
    (
        "guard-off",
        "at-least-once, crash guard off",
        &[("SLUICE_DELIVERY", "at-least-once"), ("SLUICE_MAX_CRASHES", "0")],
    ),
];

/// Modes `pipeline` runs only where `SLUICE_BENCH_PIPELINE_MODES` names them: exactly-once with
/// its transactions back to back, as before `SLUICE_TRANSACTION_INTERVAL_MS`.
const OTHER_MODES: [(&str, &str, &[(&str, &str)]); 1] = [(
    "back-to-back",
    "exactly-once, transactions back to back",
    &[("SLUICE_TRANSACTION_INTERVAL_MS", "0")],
)];

/// The rows `pipeline` runs after its raw figure, in order: `SLUICE_BENCH_PIPELINE_MODES`, a
/// comma-separated list of [`DELIVERY_MODES`]' and [`OTHER_MODES`]' short names and `peer` (the
/// plain Python consumer), a name may come more than once; by default each of
/// [`DELIVERY_MODES`] once, the peer last.
fn pipeline_modes() -> anyhow::Result<Vec<String>> {
    let names: Vec<&str> = DELIVERY_MODES.iter().map(|(name, _, _)| *name).chain(["peer"]).collect();
    let Ok(list) = std::env::var("SLUICE_BENCH_PIPELINE_MODES") else {
        return Ok(names.iter().map(|n| n.to_string()).collect());
    };
    let names: Vec<&str> = names.into_iter().chain(OTHER_MODES.iter().map(|(name, _, _)| *name)).collect();
    let modes: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(str::to_owned)
        .collect();
    for m in &modes {
        anyhow::ensure!(
            names.contains(&m.as_str()),
            "SLUICE_BENCH_PIPELINE_MODES: unknown mode {m:?} (one of {names:?})"
        );
    }
    Ok(modes)
}

/// Tasks of [`warm_up`]'s pass.
const WARM_UP_TASKS: usize = 5_000;

/// An untimed pass through the stack before a benchmark's first row: a just-started broker spends
/// its first minutes compiling (its JIT) the fetch, produce and transaction paths, and that cost
/// must not fall on whichever row runs first. The ~1 ms model, exactly-once: thousands of tasks,
/// each of those paths taken as often as in minutes of the pretrained model, in seconds.
async fn warm_up(stack: &Stack) -> anyhow::Result<()> {
    eprintln!("== warm-up, not measured ({WARM_UP_TASKS} tasks of the ~1 ms model end to end)");
    let tiny = stack.tiny_models()?;
    end_to_end(
        stack,
        "warm-up",
        &tiny,
        64,
        WARM_UP_TASKS,
        f64::NAN,
        &tile_task,
        DELIVERY_MODES[0].2,
    )
    .await?;
    Ok(())
}

/// A terrain model (the pretrained or the ~1 ms one) end to end in each of [`pipeline_modes`],
/// each row reported as it is measured against raw in-process images/s at `batch`.
///
/// Two things the machine does, not the pipeline, are kept out of the ratios:
/// - **A fresh broker's warm-up** ([`warm_up`]). Measured without it: the first row's broker CPU
///   per task was 2–3× the later rows', and the first row was always the default mode.
/// - **Drift.** On a shared machine the raw rate moves by more than the differences measured.
///   Raw is measured before each row and after the last, and each row's ratio is against the
///   mean of the raw figures on either side of it.
async fn pipeline(
    stack: &Stack,
    scenario: &str,
    model_dir: &Path,
    (batch, tasks, raw_images): (usize, usize, usize),
    report: &dyn Fn(&Row),
) -> anyhow::Result<()> {
    let modes = pipeline_modes()?;
    warm_up(stack).await?;
    let raw = || async {
        eprintln!("== {scenario}: raw ({raw_images} images at batch {batch})");
        raw_images_per_second(stack, model_dir, batch, raw_images.div_ceil(batch)).await
    };
    let mut raw_before = raw().await?;
    for mode in &modes {
        let mut row = if let Some((_, label, settings)) = DELIVERY_MODES.iter().chain(&OTHER_MODES).find(|(name, _, _)| name == mode) {
            let scenario = format!("{scenario}, {label}");
            end_to_end(stack, &scenario, model_dir, batch, tasks, raw_before, &tile_task, settings).await?
        } else {
            let peer = format!("{scenario}, plain Python consumer");
            match peer_consumer(stack, &peer, model_dir, batch, tasks.min(2_000), raw_before, &tile_task).await {
                Ok(row) => row,
                Err(e) => {
                    eprintln!("== {scenario}: the plain Python consumer's row is left out: {e:#}");
                    continue;
                }
            }
        };
        let raw_after = raw().await?;
        row.raw = (raw_before + raw_after) / 2.0;
        report(&row);
        raw_before = raw_after;
    }
    Ok(())
}

/// The baseline: `scripts/bench/peer_consumer.py`, a plain Python consumer of the same tasks
/// (confluent-kafka, onnxruntime, boto3, Pillow; at least once, a commit after each batch), on
/// this stack with the same model and batch, in a venv that `scripts/install-tools.sh
/// peer-consumer` keeps. Its rate is measured as the other rows' are (from the first tenth of its
/// uploads to the last); it writes no completions, so it has no latency column.
async fn peer_consumer(
    stack: &Stack,
    scenario: &str,
    model_dir: &Path,
    batch: usize,
    tasks: usize,
    raw: f64,
    make: &dyn Fn(usize) -> (String, serde_json::Value),
) -> anyhow::Result<Row> {
    let root = sluice_integration_tests::stack::repo_root();
    let install = std::process::Command::new(root.join("scripts/install-tools.sh"))
        .arg("peer-consumer")
        .stderr(std::process::Stdio::inherit())
        .output()?;
    anyhow::ensure!(install.status.success(), "installing its venv failed");
    let python = String::from_utf8(install.stdout)?.lines().last().unwrap_or_default().to_owned();
    eprintln!("== {scenario}: end to end ({tasks} tasks)");
    let topics = topics_with_tasks(stack, "peer", tasks, make).await?;
    let model = model_dir.join("terrain/model.onnx");
    let child = tokio::process::Command::new(&python)
        .arg(root.join("scripts/bench/peer_consumer.py"))
        .args(["--brokers", stack.brokers(), "--topic", &topics.tasks, "--bucket", "sluice"])
        .args(["--prefix", &format!("peer/{}", topics.tasks), "--tasks", &tasks.to_string()])
        .args(["--batch", &batch.to_string()])
        .arg("--model")
        .arg(&model)
        .envs(stack.vars())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pids = [child.id().unwrap_or(0), pid_of(&stack.dir, "broker"), pid_of(&stack.dir, "s3")];
    if let Some(cpus) = pinning::worker_cpus() {
        pinning::pin(pids[0], &cpus)?;
    }
    // Its CPU from its start: its imports and session creation (about a second) count too, where
    // the worker's start does not.
    let mut cpu_before = pids.map(cpu_seconds);
    cpu_before[0] = 0.0;
    let sampler = std::thread::spawn(move || {
        // The child's CPU at its last sample: /proc forgets it once it has been reaped.
        let mut last = 0.0;
        while std::path::Path::new(&format!("/proc/{}", pids[0])).exists() {
            last = cpu_seconds(pids[0]).max(last);
            std::thread::sleep(Duration::from_millis(100));
        }
        last
    });
    let output = tokio::time::timeout(Duration::from_secs(1800), child.wait_with_output()).await??;
    let mut cpu_after = pids.map(cpu_seconds);
    cpu_after[0] = sampler.join().unwrap_or(0.0);
    anyhow::ensure!(output.status.success(), "it exited with {}", output.status);
    let result: serde_json::Value =
        serde_json::from_slice(output.stdout.split(|&b| b == b'\n').rfind(|l| !l.is_empty()).unwrap_or_default())
            .context("its last line of output")?;
    let e2e = result["images_per_s"].as_f64().context("images_per_s in its output")?;
    Ok(Row::measured(scenario, (batch, tasks), (raw, e2e), (cpu_before, cpu_after), None))
}

/// A tiny diffusion model of the demo catalog (`sd-tiny`, `sdxl-tiny`, `flux-schnell-tiny`,
/// `flux-dev-tiny`, `sd3-tiny`): raw in-process calls of its backend at `batch` (with the
/// catalog's settings), against the same tasks end to end (`size`×`size`, `steps` steps of
/// euler with guidance, or flow_euler).
async fn sd_pipeline(stack: &Stack, model: &'static str, size: u32, steps: u32, batch: usize, tasks: usize) -> anyhow::Result<Row> {
    // Another catalog of the same models (checkpoints on, say): SLUICE_BENCH_SD_CATALOG.
    let catalog = std::env::var_os("SLUICE_BENCH_SD_CATALOG")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| sluice_integration_tests::stack::repo_root().join("deploy/models.demo.toml"));
    let served = Served {
        model,
        models_dir: stack.dir.join("models"),
        catalog,
    };
    diffusion_pipeline(stack, &served, size, steps, batch, tasks).await
}

/// A diffusion model as a worker serves it: its name, the directory of model directories, the
/// catalog that has it.
struct Served {
    model: &'static str,
    models_dir: PathBuf,
    catalog: PathBuf,
}

/// Raw in-process calls of a diffusion model's backend at `batch` (with its catalog entry's
/// settings, on the workers' device), against the same tasks end to end.
async fn diffusion_pipeline(stack: &Stack, served: &Served, size: u32, steps: u32, batch: usize, tasks: usize) -> anyhow::Result<Row> {
    use sluice_worker::models::diffusion::{FlowSettings, StableDiffusion};
    let model = served.model;
    let scenario = format!("{model} {size}x{size}, {steps} steps");
    let dir = served.models_dir.join(model);
    let catalog = sluice_schemas::Catalog::parse(&std::fs::read_to_string(&served.catalog)?)?;
    let entry = catalog.get(model).context("the model is in its catalog")?.clone();
    let make = {
        let entry = entry.clone();
        move |i: usize| sluice_integration_tests::records::diffusion_task_of(model, &entry, i as u64, size, steps, 1)
    };
    eprintln!("== {scenario}: raw ({} images at batch {batch})", tasks);
    let runtime = runtime(stack)?;
    let adapter = Arc::new(StableDiffusion::open_with(runtime, model, &dir, FlowSettings::of(&entry))?);
    let engine = Engine::start(1);
    let (a, d, options) = (adapter.clone(), dir.clone(), worker_session_options()?);
    engine.load(model, Arc::new(move || a.load(&d, &options))).await?;
    let records: Vec<TaskRecord> = (0..batch).map(|i| serde_json::from_value(make(i).1).unwrap()).collect();
    let busy = DeviceBusy::start();
    // A fixed batch that does not fit the device is a result (the end-to-end worker's adaptive
    // batches still run): the raw column says so instead of ending the benchmark.
    let raw = match images_per_second(&engine, model, adapter.as_ref(), &records, tasks.div_ceil(batch)).await {
        Ok(rate) => rate,
        Err(e) if matches!(e.downcast_ref(), Some(EngineError::OutOfMemory(_))) => {
            eprintln!("== {scenario}: raw at batch {batch} ran out of memory");
            f64::NAN
        }
        Err(e) => return Err(e),
    };
    let raw_busy = busy.stop();
    engine.unload(model).await;
    let catalog = served.catalog.display().to_string();
    let busy = DeviceBusy::start();
    let mut row = end_to_end(
        stack,
        &scenario,
        &served.models_dir,
        batch,
        tasks,
        raw,
        &make,
        &[("SLUICE_MODEL_CATALOG", &catalog), ("SLUICE_MODELS", model)],
    )
    .await?;
    row.device_busy = raw_busy.zip(busy.stop());
    Ok(row)
}

/// The GPU's busy share (NVML's utilization, sampled every 100 ms) while a row runs; nothing on
/// the CPU.
struct DeviceBusy {
    stop: Arc<std::sync::atomic::AtomicBool>,
    sampler: Option<std::thread::JoinHandle<Vec<u32>>>,
}

impl DeviceBusy {
    fn start() -> DeviceBusy {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = on_cuda().then(|| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut samples = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    samples.extend(sluice_worker::engine::gpu::utilization(0));
                    std::thread::sleep(Duration::from_millis(100));
                }
                samples
            })
        });
        DeviceBusy { stop, sampler }
    }

    /// The mean busy percentage over the row.
    fn stop(self) -> Option<f64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let samples = self.sampler?.join().ok()?;
        (!samples.is_empty()).then(|| samples.iter().map(|&s| s as f64).sum::<f64>() / samples.len() as f64)
    }
}

/// Topics of a row's own (another row's completions must not count for it), with `tasks`
/// tasks made by `make` on its tasks topic.
async fn topics_with_tasks(
    stack: &Stack,
    prefix: &str,
    tasks: usize,
    make: &dyn Fn(usize) -> (String, serde_json::Value),
) -> anyhow::Result<sluice_integration_tests::stack::Topics> {
    let topics = stack.topics(&format!("{prefix}-{tasks}-{}", uuid::Uuid::new_v4().simple()), 8)?;
    let kafka = producer(stack.brokers())?;
    let all: Vec<_> = (0..tasks).map(make).collect();
    for chunk in all.chunks(2000) {
        publish_tasks(&kafka, &topics.tasks, chunk).await?;
    }
    Ok(topics)
}

#[allow(clippy::too_many_arguments)]
async fn end_to_end(
    stack: &Stack,
    scenario: &str,
    model_dir: &Path,
    batch: usize,
    tasks: usize,
    raw: f64,
    make: &dyn Fn(usize) -> (String, serde_json::Value),
    extra_settings: &[(&str, &str)],
) -> anyhow::Result<Row> {
    // Every task is on the topic before the worker starts, so the worker runs as fast as it
    // can and the rate measured is the pipeline's own, not the feeder's.
    eprintln!("== {scenario}: end to end ({tasks} tasks through one worker)");
    let topics = topics_with_tasks(stack, "bench", tasks, make).await?;
    let model_dir = model_dir.display().to_string();
    let batch_s = batch.to_string();
    // A group of its own: a member of another scenario's group would still be expiring.
    let group = format!("bench-{}", uuid::Uuid::new_v4());
    let mut settings = vec![
        ("SLUICE_GROUP_ID", group.as_str()),
        ("SLUICE_MODEL_DIR", model_dir.as_str()),
        ("SLUICE_MAX_BATCH", batch_s.as_str()),
        ("SLUICE_MAX_BATCH_ROWS", batch_s.as_str()),
        ("SLUICE_MAX_WAIT_MS", "20"),
    ];
    settings.extend(topics.worker_env());
    settings.extend_from_slice(extra_settings);
    // Extra worker settings, `NAME=value;NAME=value`, to compare configurations.
    let extra = std::env::var("SLUICE_BENCH_WORKER_ENV").unwrap_or_default();
    settings.extend(extra.split(';').filter_map(|kv| kv.split_once('=')));
    let brokers = stack.brokers().to_owned();
    let completions = topics.completions.clone();
    let reader = std::thread::spawn(move || -> anyhow::Result<Vec<CompletionEvent>> {
        let mut reader = TopicReader::new(&brokers, &completions)?;
        let mut done: Vec<CompletionEvent> = Vec::new();
        reader.read_each(Duration::from_secs(1800), |r| {
            if let Ok(c) = serde_json::from_slice::<CompletionEvent>(&r.value) {
                done.push(c);
            }
            done.len() >= tasks
        })?;
        Ok(done)
    });
    let worker = Worker::start(stack, &format!("bench-{tasks}"), &settings).await?;
    if let Some(cpus) = pinning::worker_cpus() {
        pinning::pin(worker.service.pid().unwrap_or(0), &cpus)?;
    }
    let pids = [
        worker.service.pid().unwrap_or(0),
        pid_of(&stack.dir, "broker"),
        pid_of(&stack.dir, "s3"),
    ];
    let cpu_before = pids.map(cpu_seconds);
    let mut done = tokio::task::spawn_blocking(move || reader.join().expect("reader thread"))
        .await?
        .context("waiting for completions")?;
    let cpu_after = pids.map(cpu_seconds);
    // What the worker's delivery mode cost in round trips: each commit is a transaction in
    // exactly-once mode.
    if let Ok(text) = worker.metrics().await {
        use sluice_integration_tests::cluster::{metric_sum, metric_value};
        eprintln!(
            "== {scenario}: {} commits in {} model calls",
            metric_value(&text, "sluice_worker_commit_seconds_count").unwrap_or(0.0),
            metric_sum(&text, "sluice_worker_model_call_seconds_count"),
        );
    }
    drop(worker);
    anyhow::ensure!(done.iter().all(|c| c.status == CompletionStatus::Succeeded), "some tasks failed");
    done.sort_by_key(|c| c.completed_at);
    // Steady state: skip the first 10% (group join, first batches), measure the rest.
    let skip = done.len() / 10;
    let (first, last): (DateTime<Utc>, DateTime<Utc>) = (done[skip].completed_at, done[done.len() - 1].completed_at);
    let e2e = (done.len() - skip - 1) as f64 / ((last - first).num_microseconds().unwrap_or(1) as f64 / 1e6);
    let mut latencies: Vec<u64> = done[skip..].iter().map(|c| c.timings.inference_ms + c.timings.upload_ms).collect();
    latencies.sort();
    let latency = (latencies[latencies.len() / 2], latencies[latencies.len() * 99 / 100]);
    Ok(Row::measured(
        scenario,
        (batch, tasks),
        (raw, e2e),
        (cpu_before, cpu_after),
        Some(latency),
    ))
}

/// delivery: the ~1 ms model through one worker in each delivery mode, side by side on one
/// stack. Throughput: tasks all on the topic before the worker starts, counted as a
/// `read_committed` consumer sees their completions (in exactly-once mode a completion is
/// visible only once its transaction commits). Latency: tasks fed at a steady rate well below
/// capacity, from the send to the completion being visible to that consumer. Mixed: in every
/// partition a slow task ahead of fast ones, on a worker with two engine slots so that the
/// engine lets the fast ones pass; the fast tasks' latency, send to visible, is what a delivery
/// mode adds when a neighbour is slow. The slow task is held in its model call
/// (`SLUICE_TEST_FAULTS=hold-run`) until it is cancelled after `SLUICE_BENCH_DELIVERY_SLOW_S`
/// (6 s): a model call that costs no CPU, so that what is measured is the delivery, not two
/// model calls sharing this machine's two cores.
mod delivery {
    use super::*;
    use std::collections::HashMap;

    const MODES: [&str; 2] = ["at-least-once", "exactly-once"];

    struct Row {
        mode: &'static str,
        throughput: f64,
        rate: usize,
        p50_ms: f64,
        p99_ms: f64,
        max_ms: f64,
    }

    pub async fn run(stack: &Stack) -> anyhow::Result<()> {
        let tasks = env_or("SLUICE_BENCH_DELIVERY_TASKS", 10_000);
        let paced = env_or("SLUICE_BENCH_DELIVERY_PACED_TASKS", 2_000);
        let rate = env_or("SLUICE_BENCH_DELIVERY_RATE", 200);
        let mixed = Mixed {
            // One partition: its slow task is one held call, in one of the two slots.
            partitions: env_or("SLUICE_BENCH_DELIVERY_MIXED_PARTITIONS", 1) as i32,
            slow: Duration::from_secs(env_or("SLUICE_BENCH_DELIVERY_SLOW_S", 6) as u64),
            fast: env_or("SLUICE_BENCH_DELIVERY_FAST_PER_PARTITION", 40),
        };
        // `SLUICE_BENCH_DELIVERY_ROWS=mixed`: the mixed rows alone.
        let only_mixed = std::env::var("SLUICE_BENCH_DELIVERY_ROWS").is_ok_and(|r| r == "mixed");
        warm_up(stack).await?;
        let mut rows = Vec::new();
        let mut mixed_rows = Vec::new();
        // Twice, alternating, so neither mode always runs on the warmer machine.
        for round in 0..2 {
            for mode in MODES {
                eprintln!("== delivery {mode}, round {}", round + 1);
                mixed_rows.push((mode, mixed.run(stack, mode).await?));
                if only_mixed {
                    continue;
                }
                let throughput = throughput(stack, mode, tasks).await?;
                let (p50_ms, p99_ms, max_ms) = latency(stack, mode, paced, rate).await?;
                rows.push(Row {
                    mode,
                    throughput,
                    rate,
                    p50_ms,
                    p99_ms,
                    max_ms,
                });
            }
        }
        println!();
        println!("## delivery modes: the ~1 ms model through one worker, completions read read_committed");
        println!();
        println!(
            "| mode | throughput, tasks/s ({tasks} queued) | completion latency at {rate} tasks/s, ms p50 / p99 / max ({paced} tasks) |"
        );
        println!("|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {:.0} | {:.0} / {:.0} / {:.0} (at {}/s) |",
                r.mode, r.throughput, r.p50_ms, r.p99_ms, r.max_ms, r.rate
            );
        }
        for mode in MODES.into_iter().filter(|_| !rows.is_empty()) {
            let of: Vec<&Row> = rows.iter().filter(|r| r.mode == mode).collect();
            let mean = |f: fn(&Row) -> f64| of.iter().map(|r| f(r)).sum::<f64>() / of.len() as f64;
            println!(
                "| {mode}, mean of {} | {:.0} | {:.0} / {:.0} / {:.0} |",
                of.len(),
                mean(|r| r.throughput),
                mean(|r| r.p50_ms),
                mean(|r| r.p99_ms),
                mean(|r| r.max_ms)
            );
        }
        println!();
        println!(
            "## delivery modes, mixed: per partition ({}) a task held {} s in its model call ahead of {} tasks of the ~1 ms model, two engine slots",
            mixed.partitions,
            mixed.slow.as_secs(),
            mixed.fast
        );
        println!();
        println!("| mode | slow tasks, s (min) | fast tasks' completion latency, ms p50 / p99 |");
        println!("|---|---|---|");
        for (mode, m) in &mixed_rows {
            println!("| {mode} | {:.1} | {:.0} / {:.0} |", m.slow_s, m.p50_ms, m.p99_ms);
        }
        let p50 = |mode: &str| {
            let of: Vec<f64> = mixed_rows.iter().filter(|(m, _)| *m == mode).map(|(_, r)| r.p50_ms).collect();
            of.iter().sum::<f64>() / of.len() as f64
        };
        println!(
            "| exactly-once p50 / at-least-once p50, mean of rounds | | {:.2}× |",
            p50("exactly-once") / p50("at-least-once")
        );
        Ok(())
    }

    /// The mixed row's shape.
    struct Mixed {
        partitions: i32,
        slow: Duration,
        fast: usize,
    }

    struct MixedRow {
        /// The quickest slow task, send to visible: the fast ones are measured while it runs.
        slow_s: f64,
        p50_ms: f64,
        p99_ms: f64,
    }

    impl Mixed {
        async fn run(&self, stack: &Stack, mode: &str) -> anyhow::Result<MixedRow> {
            let topics = stack.topics(&format!("delivery-mix-{}", uuid::Uuid::new_v4().simple()), self.partitions as u32)?;
            let kafka = producer(stack.brokers())?;
            // The slow tasks, one per partition, in one call that their seed holds (a diffusion
            // model: a held call notices a cancel through its step hooks); the fast ones on the
            // ~1 ms model.
            const HELD: u64 = 3_000_000;
            let slow: Vec<_> = (0..self.partitions)
                .map(|_| sluice_integration_tests::diffusion_task("sd-tiny", HELD, 64, 2, 1))
                .collect();
            let fast: Vec<_> = (0..self.fast * self.partitions as usize)
                .map(|i| tile_task(i + 2_000_000))
                .collect();
            // Warm-up: the worker's first tasks on these topics (first transactions, first calls
            // of the bucket) are not what is measured.
            let warm: Vec<_> = (0..10 * self.partitions as usize).map(|i| tile_task(i + 1_000_000)).collect();
            let reader = read(stack, &topics.completions, warm.len() + slow.len() + fast.len());
            let fault = format!("hold-run={HELD}");
            let models = mixed_models(stack)?;
            let catalog = sluice_integration_tests::stack::repo_root().join("deploy/models.demo.toml");
            let catalog = catalog.display().to_string();
            // A bucket down to batch 1 (as every new one starts) otherwise takes the whole
            // device for each call: the held call would hold the fast ones too.
            let more = [
                ("SLUICE_ENGINE_SLOTS", "2"),
                ("SLUICE_NO_SERIALIZE_SINGLES", "true"),
                ("SLUICE_TEST_FAULTS", fault.as_str()),
                ("SLUICE_MODEL_DIR", models.as_str()),
                ("SLUICE_MODEL_CATALOG", catalog.as_str()),
                ("SLUICE_MODELS", "terrain,sd-tiny"),
            ];
            let w = worker(stack, mode, &topics, &more).await?;
            for (i, task) in warm.iter().enumerate() {
                sluice_integration_tests::publish_to_partition(&kafka, &topics.tasks, i as i32 % self.partitions, task).await?;
            }
            let warm_ids: std::collections::HashSet<&String> = warm.iter().map(|(id, _)| id).collect();
            let warmed = tokio::task::spawn_blocking({
                let ids: std::collections::BTreeSet<String> = warm_ids.iter().map(|id| (*id).clone()).collect();
                let (brokers, topics) = (stack.brokers().to_owned(), topics.clone());
                move || sluice_integration_tests::Outcomes::wait(&brokers, &topics, &ids, Duration::from_secs(120))
            });
            warmed.await??;
            let mut sent: HashMap<String, Instant> = HashMap::new();
            for (p, task) in slow.iter().enumerate() {
                sluice_integration_tests::publish_to_partition(&kafka, &topics.tasks, p as i32, task).await?;
                sent.insert(task.0.clone(), Instant::now());
            }
            let slow_sent = Instant::now();
            tokio::time::sleep(Duration::from_millis(500)).await; // the slow ones are in their call
            for (i, task) in fast.iter().enumerate() {
                sluice_integration_tests::publish_to_partition(&kafka, &topics.tasks, i as i32 % self.partitions, task).await?;
                sent.insert(task.0.clone(), Instant::now());
            }
            // The slow ones' call ends when they are cancelled.
            tokio::time::sleep_until((slow_sent + self.slow).into()).await;
            for (id, _) in &slow {
                let cancel = serde_json::json!({"version": 1, "task_id": id, "tenant": "acme", "action": "cancel", "at": Utc::now()});
                let cancel = serde_json::to_vec(&cancel)?;
                sluice_integration_tests::produce_raw(&kafka, sluice_schemas::topics::CONTROL, Some(id.as_bytes()), &cancel, &[]).await?;
            }
            let seen = tokio::task::spawn_blocking(move || reader.join().expect("reader thread")).await??;
            drop(w);
            let seen: Vec<_> = seen.into_iter().filter(|(id, _)| !warm_ids.contains(id)).collect();
            let latency = |id: &String, at: &Instant| (*at - sent[id]).as_secs_f64();
            let is_slow = |id: &String| slow.iter().any(|(s, _)| s == id);
            let slow_s = seen
                .iter()
                .filter(|(id, _)| is_slow(id))
                .map(|(id, at)| latency(id, at))
                .fold(f64::INFINITY, f64::min);
            let mut ms: Vec<f64> = seen
                .iter()
                .filter(|(id, _)| !is_slow(id))
                .map(|(id, at)| latency(id, at) * 1000.0)
                .collect();
            anyhow::ensure!(ms.len() == fast.len(), "{} fast completions of {}", ms.len(), fast.len());
            ms.sort_by(f64::total_cmp);
            let at = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
            Ok(MixedRow {
                slow_s,
                p50_ms: at(0.5),
                p99_ms: at(0.99),
            })
        }
    }

    /// A model directory with the ~1 ms model as `terrain` and the stack's tiny `sd-tiny`.
    fn mixed_models(stack: &Stack) -> anyhow::Result<String> {
        let dir = stack.dir.join("models-mixed");
        if !dir.exists() {
            std::fs::create_dir_all(&dir)?;
            std::os::unix::fs::symlink(stack.tiny_models()?.join("terrain"), dir.join("terrain"))?;
            std::os::unix::fs::symlink(stack.dir.join("models/sd-tiny"), dir.join("sd-tiny"))?;
        }
        Ok(dir.display().to_string())
    }

    pub(super) async fn worker(
        stack: &Stack,
        mode: &str,
        topics: &sluice_integration_tests::stack::Topics,
        more: &[(&str, &str)],
    ) -> anyhow::Result<Worker> {
        let models = stack.tiny_models()?.display().to_string();
        let group = format!("delivery-{}", uuid::Uuid::new_v4());
        let mut settings = vec![
            ("SLUICE_GROUP_ID", group.as_str()),
            ("SLUICE_MODEL_DIR", models.as_str()),
            ("SLUICE_MAX_BATCH", "64"),
            ("SLUICE_MAX_BATCH_ROWS", "64"),
            ("SLUICE_MAX_WAIT_MS", "20"),
            ("SLUICE_DELIVERY", mode),
        ];
        settings.extend(topics.worker_env());
        settings.retain(|(k, _)| !more.iter().any(|(m, _)| m == k));
        settings.extend(more.iter().copied());
        // Extra worker settings, as in the pipeline benchmark.
        let extra = std::env::var("SLUICE_BENCH_WORKER_ENV").unwrap_or_default();
        settings.extend(extra.split(';').filter_map(|kv| kv.split_once('=')));
        Worker::start(stack, &format!("delivery-{mode}"), &settings).await
    }

    /// Reads `n` completions `read_committed` on a thread of its own, handing each one's task id
    /// and the moment it became visible.
    pub(super) fn read(stack: &Stack, topic: &str, n: usize) -> std::thread::JoinHandle<anyhow::Result<Vec<(String, Instant)>>> {
        let events = read_events(stack, topic, n);
        std::thread::spawn(move || {
            let events = events.join().expect("reader thread")?;
            Ok(events.into_iter().map(|(c, at)| (c.task_id.to_string(), at)).collect())
        })
    }

    /// [`read`], with each completion whole.
    pub(super) fn read_events(
        stack: &Stack,
        topic: &str,
        n: usize,
    ) -> std::thread::JoinHandle<anyhow::Result<Vec<(CompletionEvent, Instant)>>> {
        let (brokers, topic) = (stack.brokers().to_owned(), topic.to_owned());
        std::thread::spawn(move || {
            let mut reader = TopicReader::new(&brokers, &topic)?;
            let mut seen = Vec::new();
            reader.read_each(Duration::from_secs(900), |r| {
                if let Ok(c) = serde_json::from_slice::<CompletionEvent>(&r.value) {
                    seen.push((c, r.received));
                }
                seen.len() >= n
            })?;
            Ok(seen)
        })
    }

    async fn throughput(stack: &Stack, mode: &str, tasks: usize) -> anyhow::Result<f64> {
        let topics = stack.topics(&format!("delivery-tp-{}", uuid::Uuid::new_v4().simple()), 8)?;
        let kafka = producer(stack.brokers())?;
        let all: Vec<_> = (0..tasks).map(tile_task).collect();
        for chunk in all.chunks(2000) {
            publish_tasks(&kafka, &topics.tasks, chunk).await?;
        }
        let reader = read(stack, &topics.completions, tasks);
        let w = worker(stack, mode, &topics, &[]).await?;
        let mut seen = tokio::task::spawn_blocking(move || reader.join().expect("reader thread")).await??;
        drop(w);
        seen.sort_by_key(|(_, t)| *t);
        // Steady state: skip the first 10% (group join, first batches).
        let skip = seen.len() / 10;
        let span = seen[seen.len() - 1].1 - seen[skip].1;
        Ok((seen.len() - skip - 1) as f64 / span.as_secs_f64())
    }

    async fn latency(stack: &Stack, mode: &str, tasks: usize, rate: usize) -> anyhow::Result<(f64, f64, f64)> {
        let topics = stack.topics(&format!("delivery-lat-{}", uuid::Uuid::new_v4().simple()), 8)?;
        let kafka = producer(stack.brokers())?;
        let reader = read(stack, &topics.completions, tasks);
        let w = worker(stack, mode, &topics, &[]).await?;
        // Tasks in groups of 10 every 10 / rate seconds; each group's send time noted.
        let all: Vec<_> = (0..tasks).map(|i| tile_task(i + 1_000_000)).collect();
        let mut sent: HashMap<String, Instant> = HashMap::new();
        let tick = Duration::from_secs_f64(10.0 / rate as f64);
        let mut next = Instant::now();
        for chunk in all.chunks(10) {
            tokio::time::sleep_until(next.into()).await;
            let at = Instant::now();
            publish_tasks(&kafka, &topics.tasks, chunk).await?;
            sent.extend(chunk.iter().map(|(id, _)| (id.clone(), at)));
            next += tick;
        }
        let seen = tokio::task::spawn_blocking(move || reader.join().expect("reader thread")).await??;
        drop(w);
        // The first second (group join) is left out.
        let warm = rate;
        let mut ms: Vec<f64> = seen
            .iter()
            .filter_map(|(id, at)| sent.get(id).map(|s| (*at - *s).as_secs_f64() * 1000.0))
            .collect();
        anyhow::ensure!(ms.len() == seen.len(), "completions of tasks never sent");
        let mut ms = ms.split_off(warm.min(ms.len() / 2));
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
        Ok((at(0.5), at(0.99), ms[ms.len() - 1]))
    }
}

/// turns: short tasks behind long ones of another bucket, on the pretrained terrain model with
/// one worker (one engine slot), in both delivery modes. `SLUICE_BENCH_TURNS_MAPS` maps of
/// `SLUICE_BENCH_TURNS_MAP_SIZE`² (each run as calls of at most 64 tiles), then
/// `SLUICE_BENCH_TURNS_TILES` single-tile tasks, on one partition; each task's latency from send
/// to its completion visible `read_committed`, and from send to the start of its call.
mod turns {
    use super::*;
    use std::collections::HashMap;

    pub async fn run(stack: &Stack) -> anyhow::Result<()> {
        let maps = env_or("SLUICE_BENCH_TURNS_MAPS", 4);
        let size = env_or("SLUICE_BENCH_TURNS_MAP_SIZE", 1024) as u32;
        let tiles = env_or("SLUICE_BENCH_TURNS_TILES", 20);
        let mut rows = Vec::new();
        for round in 0..2 {
            for mode in ["exactly-once", "at-least-once"] {
                eprintln!("== turns {mode}, round {}", round + 1);
                rows.push((mode, once(stack, mode, maps, size, tiles).await?));
            }
        }
        println!();
        println!(
            "## turns: {maps} terrain maps of {size}² then {tiles} single tiles, one partition, one worker (one engine slot), pretrained terrain UNet"
        );
        println!();
        println!("| mode | tiles' calls started, s p50 | tiles visible, s p50 / p99 | maps visible, s first / last |");
        println!("|---|---|---|---|");
        for (mode, r) in &rows {
            println!(
                "| {mode} | {:.1} | {:.1} / {:.1} | {:.1} / {:.1} |",
                r.tiles_started, r.tiles.0, r.tiles.1, r.maps.0, r.maps.1
            );
        }
        Ok(())
    }

    /// One run in `mode`.
    async fn once(stack: &Stack, mode: &str, maps: usize, size: u32, tiles: usize) -> anyhow::Result<Turns> {
        let topics = stack.topics(&format!("turns-{}", uuid::Uuid::new_v4().simple()), 1)?;
        let kafka = producer(stack.brokers())?;
        let models = stack.dir.join("models").display().to_string();
        let w = delivery::worker(stack, mode, &topics, &[("SLUICE_MODEL_DIR", models.as_str())]).await?;
        // Warm-up: the first calls of both buckets are not what is measured.
        let warm = [terrain_task(1, 256, 256, 50), terrain_task(2, 128, 128, 50)];
        let reader = delivery::read(stack, &topics.completions, warm.len());
        for task in &warm {
            sluice_integration_tests::publish_to_partition(&kafka, &topics.tasks, 0, task).await?;
        }
        tokio::task::spawn_blocking(move || reader.join().expect("reader thread")).await??;
        let map_tasks: Vec<_> = (0..maps).map(|i| terrain_task(100 + i as u64, size, size, 50)).collect();
        let tile_tasks: Vec<_> = (0..tiles).map(|i| terrain_task(200 + i as u64, 128, 128, 50)).collect();
        // The topic read from its start: the warm-up's completions are read again.
        let reader = delivery::read_events(stack, &topics.completions, warm.len() + maps + tiles);
        let mut sent: HashMap<String, Instant> = HashMap::new();
        for task in map_tasks.iter().chain(&tile_tasks) {
            sluice_integration_tests::publish_to_partition(&kafka, &topics.tasks, 0, task).await?;
            sent.insert(task.0.clone(), Instant::now());
        }
        let seen = tokio::task::spawn_blocking(move || reader.join().expect("reader thread")).await??;
        drop(w);
        let of = |ids: &[(String, serde_json::Value)]| -> anyhow::Result<Vec<(&CompletionEvent, Instant)>> {
            let of: Vec<_> = seen
                .iter()
                .filter(|(c, _)| ids.iter().any(|(i, _)| *i == c.task_id.to_string()))
                .map(|(c, at)| (c, *at))
                .collect();
            anyhow::ensure!(of.len() == ids.len(), "{} completions of {}", of.len(), ids.len());
            Ok(of)
        };
        let sorted = |mut s: Vec<f64>| {
            s.sort_by(f64::total_cmp);
            s
        };
        // Visible: send to read_committed; started: send to the start of its call (queued_ms).
        let visible = |ids| -> anyhow::Result<Vec<f64>> {
            Ok(sorted(
                of(ids)?
                    .iter()
                    .map(|(c, at)| (*at - sent[&c.task_id.to_string()]).as_secs_f64())
                    .collect(),
            ))
        };
        let started = sorted(of(&tile_tasks)?.iter().map(|(c, _)| c.timings.queued_ms as f64 / 1000.0).collect());
        let (t, m) = (visible(&tile_tasks)?, visible(&map_tasks)?);
        let at = |s: &[f64], q: f64| s[((s.len() as f64 * q) as usize).min(s.len() - 1)];
        Ok(Turns {
            tiles: (at(&t, 0.5), at(&t, 0.99)),
            tiles_started: at(&started, 0.5),
            maps: (m[0], m[m.len() - 1]),
        })
    }

    /// One run's figures, seconds from each task's send.
    struct Turns {
        /// The tiles' completions visible, p50 and p99.
        tiles: (f64, f64),
        /// The tiles' calls started, p50.
        tiles_started: f64,
        /// The maps' completions visible, first and last.
        maps: (f64, f64),
    }
}

/// group: how long partitions stop when a worker joins a running group and when it leaves
/// again (SIGTERM, as a scale-down sends), for each consumer group protocol, both with static
/// membership as the chart runs them. Tasks are fed at a steady rate; a `read_committed` reader
/// notes when each completion becomes visible; a partition's stop is the longest gap between its
/// completions around the event. Partitions that stay with the first worker should not stop at
/// all (an incremental rebalance); the ones that move stop for the handover.
mod group {
    use super::*;
    use std::collections::BTreeMap;

    struct Seen {
        partition: i32,
        worker: String,
        at: Instant,
    }

    /// Longest gaps (s) around an event at `t`: among partitions that stayed where they were,
    /// and among those that `moved`. A partition's gap: from its last completion before `t` (or `t`)
    /// to each next one, while the next one falls within `window` after `t`.
    fn stops(seen: &[Seen], t: Instant, window: Duration, moved: &dyn Fn(i32) -> bool) -> (f64, f64, usize) {
        let mut by: BTreeMap<i32, Vec<Instant>> = BTreeMap::new();
        for s in seen {
            by.entry(s.partition).or_default().push(s.at);
        }
        let (mut stayed, mut moving, mut n_moved) = (0f64, 0f64, 0);
        for (p, times) in by {
            let before = times.iter().filter(|a| **a < t).max().copied().unwrap_or(t);
            let mut prev = before;
            let mut gap = 0f64;
            for a in times.iter().filter(|a| **a >= t && **a <= t + window) {
                gap = gap.max((*a - prev).as_secs_f64());
                prev = *a;
            }
            if moved(p) {
                n_moved += 1;
                moving = moving.max(gap);
            } else {
                stayed = stayed.max(gap);
            }
        }
        (stayed, moving, n_moved)
    }

    pub async fn run(stack: &Stack) -> anyhow::Result<()> {
        let rate = env_or("SLUICE_BENCH_GROUP_RATE", 200);
        let phase = Duration::from_secs(env_or("SLUICE_BENCH_GROUP_PHASE_S", 15) as u64);
        let mut rows = Vec::new();
        let runs = [
            ("classic, cooperative-sticky, static", "classic", true),
            ("consumer (KIP-848), static", "consumer", true),
            ("consumer (KIP-848), dynamic", "consumer", false),
        ];
        for (label, protocol, static_membership) in runs {
            eprintln!("== {label}");
            let topics = stack.topics(&format!("group-{}", uuid::Uuid::new_v4().simple()), 8)?;
            let group = format!("group-{}", uuid::Uuid::new_v4());
            let models = stack.tiny_models()?.display().to_string();
            let env = |id: &'static str| {
                let mut env = vec![
                    ("SLUICE_MODEL_DIR", models.clone()),
                    ("SLUICE_MAX_BATCH", "16".to_owned()),
                    ("SLUICE_MAX_WAIT_MS", "20".to_owned()),
                    ("SLUICE_GROUP_PROTOCOL", protocol.to_owned()),
                ];
                if static_membership {
                    env.push(("SLUICE_GROUP_INSTANCE_ID", format!("{id}-{protocol}")));
                }
                env
            };
            let start = |id: &'static str| {
                let env = env(id);
                let (group, topics) = (group.clone(), topics.clone());
                async move {
                    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    Worker::on_topics(stack, &format!("{id}-{protocol}"), &group, &topics, &env).await
                }
            };
            let first = start("a").await?;
            first.wait_assigned(Duration::from_secs(60)).await?;
            let total = rate * phase.as_secs() as usize * 3;
            let (brokers, completions) = (stack.brokers().to_owned(), topics.completions.clone());
            let reader = std::thread::spawn(move || -> anyhow::Result<Vec<Seen>> {
                let mut reader = TopicReader::new(&brokers, &completions)?;
                let mut seen = Vec::new();
                reader.read_each(Duration::from_secs(600), |r| {
                    if let Ok(c) = serde_json::from_slice::<CompletionEvent>(&r.value) {
                        seen.push(Seen {
                            partition: c.source.partition,
                            worker: c.worker_id,
                            at: r.received,
                        });
                    }
                    seen.len() >= total
                })?;
                Ok(seen)
            });
            // Feed for three phases: alone, joined by a second worker, alone again.
            let kafka = producer(stack.brokers())?;
            let feeder = {
                let topic = topics.tasks.clone();
                tokio::spawn(async move {
                    let tick = Duration::from_secs_f64(10.0 / rate as f64);
                    let mut next = Instant::now();
                    for i in (0..total).step_by(10) {
                        tokio::time::sleep_until(next.into()).await;
                        let chunk: Vec<_> = (i..i + 10)
                            .map(|j| terrain_task(j as u64, 128, 128, 1 + (j % 100) as u32))
                            .collect();
                        publish_tasks(&kafka, &topic, &chunk).await?;
                        next += tick;
                    }
                    anyhow::Ok(())
                })
            };
            tokio::time::sleep(phase).await;
            let joined = Instant::now();
            let mut second = start("b").await?;
            tokio::time::sleep(phase).await;
            let left = Instant::now();
            second.service.terminate(Duration::from_secs(60))?;
            feeder.await??;
            let seen = tokio::task::spawn_blocking(move || reader.join().expect("reader thread")).await??;
            drop(first);
            let b = format!("b-{protocol}");
            // Partitions the second worker served while it was there.
            let on_b: std::collections::BTreeSet<i32> = seen.iter().filter(|s| s.worker == b).map(|s| s.partition).collect();
            let window = phase;
            let steady = stops(&seen, joined - phase / 2, phase / 2, &|_| false).0;
            let (join_stayed, join_moved, moved) = stops(&seen, joined, window, &|p| on_b.contains(&p));
            let (leave_stayed, leave_moved, _) = stops(&seen, left, window, &|p| on_b.contains(&p));
            rows.push((label, steady, join_stayed, join_moved, moved, leave_stayed, leave_moved, seen.len()));
        }
        println!();
        println!(
            "## consumer group protocols: a second worker joins a running one, then leaves (SIGTERM); 8 partitions, {rate} tasks/s, longest stop of a partition in seconds"
        );
        println!();
        println!(
            "| protocol | steady state | join: partitions that stayed | join: partitions that moved (n) | leave: partitions that stayed | leave: partitions that moved back | completions |"
        );
        println!("|---|---|---|---|---|---|---|");
        for (label, steady, js, jm, n, ls, lm, total) in rows {
            println!("| {label} | {steady:.2} | {js:.2} | {jm:.2} ({n}) | {ls:.2} | {lm:.2} | {total} |");
        }
        Ok(())
    }
}

/// adaptive: under a CPU arena cap, the same tasks through [`Adaptive`] with a large maximum
/// (it learns what fits) against each fixed batch size, batch 1 included. In process, on the
/// engine the worker uses, so that the table measures batching and not the broker.
mod adaptive {
    use super::*;
    use futures::future::BoxFuture;
    use sluice_worker::batching::adaptive::{Adaptive, BatchItem, BatchSize, CeilingStore, CleanArena, Cleaned, Done, Learned};
    use sluice_worker::engine::EngineError;
    use sluice_worker::metrics::Metrics;
    use sluice_worker::models::{Bucket, Prepared};

    struct Item(Prepared, usize, String);

    impl BatchItem for Item {
        fn prepared(&self) -> &Prepared {
            &self.0
        }
        fn id(&self) -> String {
            self.1.to_string()
        }
        fn dimensions(&self) -> String {
            self.2.clone()
        }
    }

    /// A clean arena as the worker makes one: every session rebuilt, the shared CPU arena reset
    /// while none is alive.
    struct Rebuild {
        engine: Engine,
        runtime: Arc<Runtime>,
        baseline: Option<u64>,
    }

    impl CleanArena for Rebuild {
        fn clean(&self) -> BoxFuture<'_, Result<Cleaned, EngineError>> {
            Box::pin(async move {
                let before = self.runtime.cpu_arena_stats();
                let started = Instant::now();
                self.engine.rebuild(|| self.runtime.reset_cpu_arena().map(drop)).await?;
                let cleaned = Cleaned {
                    before: before.map(|a| a.total_allocated),
                    after: self.runtime.cpu_arena_stats().map(|a| a.total_allocated),
                    baseline: self.baseline,
                };
                eprintln!(
                    "clean arena: {:.0} ms; arena allocated {:?} (in use {:?}) before, {:?} after, {:?} after the first load",
                    started.elapsed().as_secs_f64() * 1e3,
                    cleaned.before,
                    before.map(|a| a.in_use),
                    cleaned.after,
                    cleaned.baseline
                );
                Ok(cleaned)
            })
        }
    }

    /// Learned ceilings kept in memory, as the worker keeps them in the ceilings topic: the
    /// "restarted" row starts from what the first adaptive row learned.
    #[derive(Default)]
    struct Kept(std::sync::Mutex<std::collections::HashMap<String, Learned>>);

    impl CeilingStore for Kept {
        fn get(&self, bucket: &str) -> Option<Learned> {
            self.0.lock().expect("kept").get(bucket).copied()
        }
        fn put(&self, bucket: &str, learned: Option<Learned>) {
            let mut kept = self.0.lock().expect("kept");
            match learned {
                Some(l) => kept.insert(bucket.to_owned(), l),
                None => kept.remove(bucket),
            };
        }
    }

    /// What one table measures: a model, its loader and adapter, and its tasks.
    struct Subject<'a> {
        runtime: Arc<Runtime>,
        model: &'a str,
        loader: Loader,
        adapter: &'a dyn ModelAdapter,
        task: &'a dyn Fn(usize) -> TaskRecord,
    }

    struct Outcome {
        images_per_s: f64,
        ooms: u64,
        failed: usize,
        steady_batch: usize,
        /// Seconds from the start until the learned size last changed, and batches run by then.
        steady_after: (f64, usize),
    }

    /// Runs `tasks` tasks in calls of at most `max`, as the batcher hands them over: each batch
    /// as large as the bucket's current limit.
    async fn measure(
        engine: &Engine,
        subject: &Subject<'_>,
        max: usize,
        tasks: usize,
        store: Option<Arc<Kept>>,
    ) -> anyhow::Result<Outcome> {
        // Every strategy starts on a fresh arena, as a started worker does.
        subject.runtime.reset_cpu_arena()?;
        engine.load(subject.model, subject.loader.clone()).await?;
        let metrics = Metrics::new();
        let cleaner = Rebuild {
            engine: engine.clone(),
            runtime: subject.runtime.clone(),
            baseline: subject.runtime.cpu_arena_stats().map(|a| a.total_allocated),
        };
        let adaptive = Adaptive::new(
            engine.clone(),
            BatchSize {
                max_tasks: max,
                max_rows: max,
            },
            16,
            true,
            metrics.clone(),
        )
        .with_cleaner(Arc::new(cleaner));
        let adaptive = match store {
            Some(store) => adaptive.with_store(store),
            None => adaptive,
        };
        let bucket: Bucket = subject.adapter.bucket(&(subject.task)(0)).map_err(anyhow::Error::msg)?;
        // Inputs prepared beforehand: the table compares batching, not input preparation.
        // A pool of prepared inputs, recycled as runs finish.
        let mut pending: std::collections::VecDeque<Item> = (0..tasks.min(1024))
            .map(|i| {
                let task = (subject.task)(i);
                let r = &task.request;
                let dims = format!("{}x{}x{}", r.width, r.height, r.num_images);
                Item(subject.adapter.prepare(&task, &Default::default()).expect("prepared"), i, dims)
            })
            .collect();
        let (mut issued, mut done, mut failed, mut batches) = (0usize, 0usize, 0usize, 0usize);
        // (seconds, batches run, limit after them) at every change of the learned limit.
        let mut changes = vec![(0.0, 0, adaptive.limit(&bucket))];
        let started = Instant::now();
        while issued < tasks {
            let n = adaptive.limit(&bucket).min(tasks - issued).min(pending.len());
            issued += n;
            let items: Vec<Item> = pending.drain(..n).collect();
            let mut returned = Vec::new();
            adaptive
                .run(&bucket, items, |d| match d {
                    Done::Ran { items, .. } => {
                        done += items.len();
                        returned.extend(items);
                    }
                    Done::Failed { item, error } => {
                        if failed == 0 {
                            eprintln!("first failed task: {error}");
                        }
                        failed += 1;
                        returned.push(item);
                    }
                })
                .await;
            pending.extend(returned);
            batches += 1;
            let limit = adaptive.limit(&bucket);
            if limit != changes.last().expect("one").2 {
                changes.push((started.elapsed().as_secs_f64(), batches, limit));
            }
        }
        // Steady size: the one it ran at most of the time, i.e. where it ended after probes
        // failed; reached when the limit first came down to it.
        let steady_batch = changes.last().expect("one").2;
        let steady_after = changes
            .iter()
            .find(|c| c.2 == steady_batch)
            .map(|c| (c.0, c.1))
            .expect("the last one matches");
        let elapsed = started.elapsed().as_secs_f64();
        engine.unload(subject.model).await;
        let ooms = metrics.ooms(&bucket.label());
        Ok(Outcome {
            images_per_s: done as f64 / elapsed,
            ooms,
            failed,
            steady_batch,
            steady_after,
        })
    }

    /// terrain-tiny (~1 ms per 128x128 image) under a 64 MiB CPU arena cap.
    pub async fn run(stack: &Stack) -> anyhow::Result<()> {
        let cap = env_or("SLUICE_BENCH_ARENA_BYTES", 64 << 20);
        let tasks = env_or("SLUICE_BENCH_ADAPTIVE_TASKS", 32_768);
        let runtime = runtime_with(stack, Some(cap))?;
        let tiny = stack.tiny_models()?;
        let adapter = Terrain::new(runtime.clone());
        let task = |i: usize| -> TaskRecord { serde_json::from_value(task_record(i)).expect("task") };
        let subject = Subject {
            runtime: runtime.clone(),
            model: "terrain",
            loader: ort_loader(&runtime, &tiny)?,
            adapter: &adapter,
            task: &task,
        };
        let sizes = [256, 1, 4, 16, 32, 64, 128, 256];
        let title = format!(
            "terrain-tiny, CPU arena capped at {} MiB, {tasks} tasks of 128x128, one engine thread",
            cap >> 20
        );
        table(&subject, &sizes, tasks, cap, &title).await
    }

    /// A tiny Stable Diffusion model (`sd-tiny` or `sdxl-tiny`), 256x256 at 2 euler steps with
    /// guidance, under a CPU arena cap (sd-tiny: 400 MB, two images fit in one call, four do not;
    /// sdxl-tiny: 30 MB, likewise); with `SLUICE_DEVICE=cuda`, the same cap as the CUDA arena's
    /// `gpu_mem_limit`.
    pub async fn run_sd(stack: &Stack, model: &'static str) -> anyhow::Result<()> {
        use sluice_worker::engine::Device;
        // sdxl-tiny's UNet has no attention at full resolution: 16 images of 256x256 fit in
        // 100 MB, four do not in 30 MB.
        let cap = env_or(
            "SLUICE_BENCH_SD_ARENA_BYTES",
            if model == "sdxl-tiny" { 30_000_000 } else { 400_000_000 },
        );
        // On a GPU a 16-task row takes ~0.1 s, so that the rebuilds after its first OOMs would
        // be most of an adaptive row: GPU rows run 16 times as many tasks.
        let tasks = env_or("SLUICE_BENCH_SD_ADAPTIVE_TASKS", if on_cuda() { 768 } else { 48 });
        let (runtime, options, arena) = if on_cuda() {
            let mut options = worker_session_options()?;
            if let Device::Cuda { mem_limit, require, .. } = &mut options.device {
                *mem_limit = Some(cap);
                *require = true;
            }
            (runtime_with(stack, None)?, options, "CUDA arena (gpu_mem_limit)")
        } else {
            (runtime_with(stack, Some(cap))?, SessionOptions::default(), "CPU arena")
        };
        let dir = stack.dir.join("models").join(model);
        let adapter = Arc::new(sluice_worker::models::diffusion::StableDiffusion::open(
            runtime.clone(),
            model,
            &dir,
        )?);
        let (a, d) = (adapter.clone(), dir.clone());
        let task = |i: usize| -> TaskRecord {
            let mut record = sd_task(i as u64, 256, 2, 1).1;
            record["model"] = model.into();
            serde_json::from_value(record).expect("task")
        };
        let subject = Subject {
            runtime,
            model,
            loader: Arc::new(move || a.load(&d, &options)),
            adapter: adapter.as_ref(),
            task: &task,
        };
        let sizes = [16, 1, 2, 4, 8, 16];
        let title = format!(
            "{model}, {arena} capped at {} MB, {tasks} tasks of 256x256 at 2 steps, one engine thread",
            cap / 1_000_000
        );
        table(&subject, &sizes, tasks, cap, &title).await
    }

    /// Adaptive (at `sizes[0]` at most) against each fixed size of `sizes[1..]`, as a table.
    /// The machine's busy share of the last `window`, all cores together, from `/proc/stat`.
    fn busy_share(window: Duration) -> Option<f64> {
        let sample = || -> Option<(u64, u64)> {
            let stat = std::fs::read_to_string("/proc/stat").ok()?;
            let cpu: Vec<u64> = stat
                .lines()
                .next()?
                .split_whitespace()
                .skip(1)
                .filter_map(|v| v.parse().ok())
                .collect();
            let idle = cpu.get(3)? + cpu.get(4).unwrap_or(&0);
            Some((cpu.iter().sum(), idle))
        };
        let (total0, idle0) = sample()?;
        std::thread::sleep(window);
        let (total1, idle1) = sample()?;
        let total = total1.saturating_sub(total0).max(1);
        Some(1.0 - idle1.saturating_sub(idle0) as f64 / total as f64)
    }

    /// Waits (at most a minute) until the machine is nearly idle: the stack was just started, and
    /// the broker's JVM spends its first tens of seconds compiling and collecting, which would
    /// fall on the first rows only.
    fn wait_idle() {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            match busy_share(Duration::from_secs(2)) {
                Some(busy) if busy > 0.10 => continue,
                _ => break,
            }
        }
        eprintln!("== adaptive: machine idle after {:.0} s", started.elapsed().as_secs_f64());
    }

    async fn table(subject: &Subject<'_>, sizes: &[usize], tasks: usize, cap: usize, title: &str) -> anyhow::Result<()> {
        wait_idle();
        let engine = Engine::start(1);
        // Not measured: the first model calls of a process pay for its warm-up (thread pools,
        // page faults, the allocator growing to the sizes the rows use), which would otherwise
        // fall on the first row only. So a few singles, then the first row's strategy once with
        // nothing kept, over as many tasks as its largest call takes twice.
        measure(&engine, subject, 1, 4.min(tasks), None).await?;
        measure(&engine, subject, sizes[0], (2 * sizes[0]).min(tasks), None).await?;
        let kept = Arc::new(Kept::default());
        let mut rows = Vec::new();
        for (i, &max) in sizes.iter().enumerate() {
            let label = if i == 0 {
                format!("adaptive (max {max})")
            } else {
                format!("fixed {max}")
            };
            eprintln!("== adaptive: {label}, {tasks} tasks, arena capped at {} MiB", cap >> 20);
            let store = (i == 0).then(|| kept.clone());
            rows.push((label, max, measure(&engine, subject, max, tasks, store).await?));
            if i == 0 {
                // The same again as a restarted worker: from the ceiling the first run kept.
                let label = format!("adaptive (max {max}), restarted");
                eprintln!("== adaptive: {label}, {tasks} tasks");
                rows.push((label, max, measure(&engine, subject, max, tasks, Some(kept.clone())).await?));
            }
        }
        let best_fixed = rows
            .iter()
            .filter(|(l, _, o)| l.starts_with("fixed") && o.ooms == 0)
            .map(|(_, _, o)| o.images_per_s)
            .fold(0.0, f64::max);
        let single = rows
            .iter()
            .find(|(l, _, _)| l == "fixed 1")
            .map(|r| r.2.images_per_s)
            .unwrap_or(f64::NAN);
        println!();
        println!("## adaptive batching under a memory cap ({title})");
        println!();
        println!(
            "| strategy | images/s | vs best fixed that fits | vs batch 1 | OOMs handled | tasks failed | steady batch size | first reached after |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for (label, _, o) in &rows {
            let fits = if label.starts_with("fixed") && o.ooms > 0 {
                format!(" (does not fit: halved to {})", o.steady_batch)
            } else {
                String::new()
            };
            let steady = if o.steady_after.1 == 0 {
                "start".to_owned()
            } else {
                format!("{:.3} s ({} batches)", o.steady_after.0, o.steady_after.1)
            };
            println!(
                "| {label}{fits} | {:.0} | {:.2} | {:.2} | {} | {} | {} | {steady} |",
                o.images_per_s,
                o.images_per_s / best_fixed,
                o.images_per_s / single,
                o.ooms,
                o.failed,
                o.steady_batch
            );
        }
        Ok(())
    }
}

/// status-view: the producer's status store (redb) fed as the view feeds it — a task record, a
/// progress record and a completion per task, applied 1,024 at a time — then read back. Gives
/// the rebuild rate (how long a replica takes to rebuild from the topics, store side), the disk
/// per million tasks, and the latency of `GET /v1/tasks/{id}` and of a list page, store side.
mod status_view {
    use super::*;
    use sluice_producer::status::{Change, StatusStore};

    fn percentile(sorted: &[Duration], p: f64) -> f64 {
        sorted[((sorted.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6
    }

    pub fn run() -> anyhow::Result<()> {
        let tasks: usize = std::env::var("SLUICE_BENCH_VIEW_TASKS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200_000);
        let dir = std::env::temp_dir().join(format!("sluice-bench-view-{}", std::process::id()));
        let path = dir.join("view.redb");
        let store = StatusStore::create(&path, None)?;
        eprintln!("== status view: {tasks} tasks, 3 records each");
        let mut ids = Vec::with_capacity(tasks);
        let started = Instant::now();
        let mut batch = Vec::with_capacity(1024);
        for i in 0..tasks {
            let (id, mut record) = sd_task(i as u64, 512, 25, 1);
            record["tenant"] = serde_json::json!(format!("tenant-{}", i % 100));
            let task: TaskRecord = serde_json::from_value(record)?;
            let progress: sluice_schemas::ProgressRecord = serde_json::from_value(serde_json::json!({
                "version": 1, "task_id": id, "model": "sd-tiny", "worker_id": "w", "event": "step", "step": 12, "steps": 25,
                "at": Utc::now().to_rfc3339()}))?;
            let completion: CompletionEvent = serde_json::from_value(serde_json::json!({
                "version": 1, "task_id": id, "status": "succeeded", "model": "sd-tiny", "tenant": task.tenant, "user": null,
                "outputs": [{"index": 0, "url": format!("s3://sluice/outputs/{id}/0.png"), "key": format!("outputs/{id}/0.png"),
                    "content_type": "image/png", "bytes": 412345, "sha256": "0".repeat(64), "width": 512, "height": 512}],
                "error": null, "timings": {"queued_ms": 5, "inference_ms": 2100, "upload_ms": 40, "total_ms": 2150},
                "worker_id": "w", "attempt": 1, "completed_at": Utc::now().to_rfc3339(),
                "source": {"topic": "sluice.tasks.v1", "partition": 0, "offset": i}}))?;
            batch.push(Change::Queued(task));
            batch.push(Change::Progress(progress));
            batch.push(Change::Completed(completion));
            ids.push((format!("tenant-{}", i % 100), uuid::Uuid::parse_str(&id)?));
            if batch.len() >= 1024 {
                store.apply(&batch)?;
                batch.clear();
            }
        }
        store.apply(&batch)?;
        let rebuild = started.elapsed();
        let bytes = std::fs::metadata(&path)?.len();
        let mut gets = Vec::new();
        for k in 0..10_000 {
            let (tenant, id) = &ids[(k * 7919) % ids.len()];
            let t = Instant::now();
            anyhow::ensure!(store.get(tenant, *id)?.is_some(), "task {id} missing");
            gets.push(t.elapsed());
        }
        gets.sort();
        let mut lists = Vec::new();
        for k in 0..1_000 {
            let t = Instant::now();
            let page = store.list(&format!("tenant-{}", k % 100), None, None, 50, None)?;
            anyhow::ensure!(page.tasks.len() == 50.min(tasks / 100));
            lists.push(t.elapsed());
        }
        lists.sort();
        std::fs::remove_dir_all(&dir).ok();
        println!();
        println!("## status view store (redb): {tasks} tasks, 3 records each, applied 1,024 records per transaction");
        println!();
        println!(
            "| rebuild records/s | rebuild time per million tasks | disk per million tasks | GET p50 / p99 | list page of 50 p50 / p99 |"
        );
        println!("|---|---|---|---|---|");
        let per_million = 1_000_000.0 / tasks as f64;
        println!(
            "| {:.0} | {:.0} s | {:.2} GB | {:.0} / {:.0} µs | {:.0} / {:.0} µs |",
            (3 * tasks) as f64 / rebuild.as_secs_f64(),
            rebuild.as_secs_f64() * per_million,
            bytes as f64 * per_million / 1e9,
            percentile(&gets, 0.5),
            percentile(&gets, 0.99),
            percentile(&lists, 0.5),
            percentile(&lists, 0.99)
        );
        Ok(())
    }
}
