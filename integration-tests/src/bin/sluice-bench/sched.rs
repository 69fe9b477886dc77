//! sched: step-level scheduling against request-level, on one worker under an open-loop mixed
//! load of the tiny diffusion models:
//! - a background of long tasks (`SLUICE_BENCH_SCHED_LONG`, default sdxl-tiny, at
//!   `SLUICE_BENCH_SCHED_LONG_SIZE`² and `SLUICE_BENCH_SCHED_LONG_STEPS` steps, default 256² and
//!   20), `SLUICE_BENCH_SCHED_BACKGROUND` of them (default 4) always outstanding: each one that
//!   completes is replaced at once, so the worker never runs out of long work. A long model of
//!   real size comes from `SLUICE_BENCH_SCHED_CATALOG`, a catalog whose entries (with absolute
//!   paths) are added to the demo catalog's (`make gpu-bench`'s sched step: the SD-1.5-shaped
//!   model at 512²);
//! - Poisson arrivals of short tasks (sd-tiny, 64², 4 steps), `SLUICE_BENCH_SCHED_SHORT_PER_MIN`
//!   a minute (default 240);
//! - a trickle of interactive ones (the same short task in the `interactive` lane),
//!   `SLUICE_BENCH_SCHED_INTERACTIVE_PER_MIN` a minute (default 30).
//!
//! Each for `SLUICE_BENCH_SCHED_SECONDS` (default 60) with `SLUICE_STEPS_PER_CALL=0` (a call
//! runs all of a batch's steps: request-level) and `=1` (a call runs one step: step-level), twice
//! alternating. `SLUICE_BENCH_SCHED_MODES` picks the modes (default `request,step`; `in-step` is
//! step-level with `SLUICE_STEP_JOINS=false`: a batch's rows start together, nothing joins it;
//! `step-kept` is step-level with `SLUICE_INTERACTIVE_SLOTS=1`, a slot kept for the interactive
//! lane; `step-2` step-level with `SLUICE_ENGINE_SLOTS=2`; `step-2-kept` both).
//! After each run, the worker's own figures per model: its model calls and their seconds
//! (`sluice_worker_model_call_seconds`), and tasks a batch (the whole run's, warm-up included):
//! where the device's time went. Latency is from a task's send to its completion visible `read_committed` (the
//! worker's default, exactly-once delivery); the first `SLUICE_BENCH_SCHED_WARM_S` seconds
//! (default 10) are left out, as are the tasks still outstanding at the end. Before the load,
//! the same worker runs interactive tasks alone, one at a time: the unloaded latency.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use sluice_integration_tests::TopicReader;
use sluice_integration_tests::cluster::{Worker, metric_value, series_sum};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::records::diffusion_task_of;
use sluice_integration_tests::stack::{Stack, Topics};
use sluice_schemas::{Catalog, CompletionEvent, CompletionStatus};

use super::env_or;

/// What kind of task it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Class {
    Background,
    Short,
    Interactive,
}

/// The load.
struct Load {
    seconds: f64,
    warm: f64,
    background: usize,
    short_per_s: f64,
    interactive_per_s: f64,
    long_model: String,
    long_size: u32,
    long_steps: u32,
    /// The catalog the worker serves ([`sched_catalog`]).
    catalog: std::path::PathBuf,
}

/// One run's figures.
struct Run {
    /// Seconds from send to visible, sorted, per class.
    latency: HashMap<Class, Vec<f64>>,
    /// The unloaded interactive latency, sorted.
    unloaded: Vec<f64>,
    /// Images completed a second, every class, after the warm-up.
    images_per_s: f64,
    /// Per model served: model calls, seconds in them, tasks a batch (the worker's metrics).
    calls: Vec<(String, f64, f64, f64)>,
}

/// The `q` quantile of `sorted`, or NaN.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

pub async fn run(stack: &Stack) -> anyhow::Result<()> {
    let load = Load {
        seconds: env_or("SLUICE_BENCH_SCHED_SECONDS", 60) as f64,
        warm: env_or("SLUICE_BENCH_SCHED_WARM_S", 10) as f64,
        background: env_or("SLUICE_BENCH_SCHED_BACKGROUND", 4),
        short_per_s: env_or("SLUICE_BENCH_SCHED_SHORT_PER_MIN", 240) as f64 / 60.0,
        interactive_per_s: env_or("SLUICE_BENCH_SCHED_INTERACTIVE_PER_MIN", 30) as f64 / 60.0,
        long_model: std::env::var("SLUICE_BENCH_SCHED_LONG").unwrap_or_else(|_| "sdxl-tiny".into()),
        long_size: env_or("SLUICE_BENCH_SCHED_LONG_SIZE", 256) as u32,
        long_steps: env_or("SLUICE_BENCH_SCHED_LONG_STEPS", 20) as u32,
        catalog: sched_catalog(stack)?,
    };
    let modes: Vec<(&str, &[(&str, &str)])> = std::env::var("SLUICE_BENCH_SCHED_MODES")
        .unwrap_or_else(|_| "request,step".into())
        .split(',')
        .map(|m| match m.trim() {
            "request" => Ok(("request-level", &[("SLUICE_STEPS_PER_CALL", "0")][..])),
            "step" => Ok(("step-level", &[("SLUICE_STEPS_PER_CALL", "1")][..])),
            "in-step" => Ok((
                "step-level, rows in step",
                &[("SLUICE_STEPS_PER_CALL", "1"), ("SLUICE_STEP_JOINS", "false")][..],
            )),
            "step-kept" => Ok((
                "step-level, an interactive slot",
                &[("SLUICE_STEPS_PER_CALL", "1"), ("SLUICE_INTERACTIVE_SLOTS", "1")][..],
            )),
            "step-2" => Ok((
                "step-level, 2 slots",
                &[("SLUICE_STEPS_PER_CALL", "1"), ("SLUICE_ENGINE_SLOTS", "2")][..],
            )),
            "step-2-kept" => Ok((
                "step-level, 2 slots and an interactive one",
                &[
                    ("SLUICE_STEPS_PER_CALL", "1"),
                    ("SLUICE_ENGINE_SLOTS", "2"),
                    ("SLUICE_INTERACTIVE_SLOTS", "1"),
                ][..],
            )),
            other => Err(anyhow::anyhow!(
                "SLUICE_BENCH_SCHED_MODES: request, step, in-step, step-kept, step-2 or step-2-kept, not {other:?}"
            )),
        })
        .collect::<anyhow::Result<_>>()?;
    let mut runs: Vec<(&str, Run)> = Vec::new();
    for round in 0..env_or("SLUICE_BENCH_SCHED_ROUNDS", 2) {
        for &(mode, settings) in &modes {
            eprintln!("== sched {mode}, round {}", round + 1);
            runs.push((mode, once(stack, &load, settings, round as u64).await?));
        }
    }
    println!();
    println!(
        "## sched: one worker, {}s of open-loop load: {} {} {}² {}-step tasks always outstanding, sd-tiny 64² 4-step tasks at {:.1}/s (Poisson), the same in the interactive lane at {:.2}/s; latency send → completion visible read_committed, exactly-once",
        load.seconds, load.background, load.long_model, load.long_size, load.long_steps, load.short_per_s, load.interactive_per_s
    );
    println!();
    println!(
        "| scheduling | short p50 / p99 s | interactive p50 / p99 s | interactive alone p50 / p99 s | long p50 / p99 s | images/s, all |"
    );
    println!("|---|---|---|---|---|---|");
    let pair = |s: &[f64]| format!("{:.2} / {:.2}", quantile(s, 0.5), quantile(s, 0.99));
    for (mode, r) in &runs {
        println!(
            "| {mode} | {} | {} | {} | {} | {:.2} |",
            pair(&r.latency[&Class::Short]),
            pair(&r.latency[&Class::Interactive]),
            pair(&r.unloaded),
            pair(&r.latency[&Class::Background]),
            r.images_per_s
        );
    }
    println!();
    println!("| scheduling | model | model calls | seconds in calls | tasks a batch (a running one: the most at once) |");
    println!("|---|---|---|---|---|");
    for (mode, r) in &runs {
        for (model, calls, seconds, per_call) in &r.calls {
            println!("| {mode} | {model} | {calls:.0} | {seconds:.1} | {per_call:.2} |");
        }
    }
    // The goals, as ratios of the runs' medians (each mode ran as often as the other).
    let median = |mode: &str, f: &dyn Fn(&Run) -> f64| {
        let mut v: Vec<f64> = runs.iter().filter(|(m, _)| *m == mode).map(|(_, r)| f(r)).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 0 => (v[n / 2 - 1] + v[n / 2]) / 2.0,
            n => v[n / 2],
        }
    };
    let short_p99 = |r: &Run| quantile(&r.latency[&Class::Short], 0.99);
    let interactive = |r: &Run| quantile(&r.latency[&Class::Interactive], 0.99) / quantile(&r.unloaded, 0.99);
    let images = |r: &Run| r.images_per_s;
    println!();
    for &(mode, _) in modes.iter().filter(|(m, _)| m.starts_with("step-level")) {
        println!(
            "{mode}: short p99, request-level / {mode}: {:.1}× (goal ≥ 3×); interactive p99 under load / alone: {:.2}× (goal < 2×); images/s, against request-level: {:.3} (goal ≥ 0.95)",
            median("request-level", &short_p99) / median(mode, &short_p99),
            median(mode, &interactive),
            median(mode, &images) / median("request-level", &images),
        );
    }
    Ok(())
}

/// The completions of `topic` as they become visible, on a thread of its own, until `stop`.
fn completions(stack: &Stack, topic: &str, stop: Arc<AtomicBool>) -> mpsc::Receiver<(CompletionEvent, Instant)> {
    let (tx, rx) = mpsc::channel();
    let (brokers, topic) = (stack.brokers().to_owned(), topic.to_owned());
    std::thread::spawn(move || -> anyhow::Result<()> {
        let mut reader = TopicReader::new(&brokers, &topic)?;
        reader.read_each(Duration::from_secs(3600), |r| {
            if let Ok(c) = serde_json::from_slice::<CompletionEvent>(&r.value) {
                let _ = tx.send((c, r.received));
            }
            stop.load(Ordering::Relaxed)
        })
    });
    rx
}

/// A Poisson process's arrival times in `[0, seconds)` at `per_s`, from a fixed seed.
fn arrivals(per_s: f64, seconds: f64, seed: u64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    let mut uniform = move || {
        // xorshift64*: enough for arrival gaps.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        ((state.wrapping_mul(2685821657736338717) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut at = Vec::new();
    let mut t = 0.0;
    if per_s <= 0.0 {
        return at;
    }
    loop {
        t += -uniform().ln() / per_s;
        if t >= seconds {
            return at;
        }
        at.push(t);
    }
}

/// One worker with `settings` (the mode's): its unloaded interactive latency, then the mixed
/// load.
async fn once(stack: &Stack, load: &Load, settings: &[(&str, &str)], round: u64) -> anyhow::Result<Run> {
    let topics = stack.topics(&format!("sched-{}", uuid::Uuid::new_v4().simple()), 4)?;
    let catalog_path = &load.catalog;
    let catalog = Catalog::parse(&std::fs::read_to_string(catalog_path)?)?;
    let task = |model: &str, seed: u64, size: u32, steps: u32, class: Class| -> anyhow::Result<(String, serde_json::Value)> {
        let entry = catalog
            .get(model)
            .ok_or_else(|| anyhow::anyhow!("{model} is not in {}", catalog_path.display()))?;
        let (id, mut record) = diffusion_task_of(model, entry, seed, size, steps, 1);
        if class == Class::Interactive {
            record["priority"] = "interactive".into();
        }
        Ok((id, record))
    };
    let models = stack.dir.join("models").display().to_string();
    let catalog_arg = catalog_path.display().to_string();
    let served = format!("sd-tiny,{}", load.long_model);
    let mut env = vec![
        ("SLUICE_MODEL_DIR", models.as_str()),
        ("SLUICE_MODEL_CATALOG", catalog_arg.as_str()),
        ("SLUICE_MODELS", served.as_str()),
    ];
    env.extend(settings.iter().copied());
    let w = worker(stack, &topics, &env).await?;
    let kafka = producer(stack.brokers())?;
    let stop = Arc::new(AtomicBool::new(false));
    let seen = completions(stack, &topics.completions, stop.clone());
    let wait_for = |id: &str| -> anyhow::Result<Instant> {
        loop {
            let (c, at) = seen.recv_timeout(Duration::from_secs(300))?;
            anyhow::ensure!(c.status == CompletionStatus::Succeeded, "task {} ended {:?}", c.task_id, c.status);
            if c.task_id.to_string() == id {
                return Ok(at);
            }
        }
    };
    // Warm-up, one of each, and the unloaded interactive latency.
    let base = 1_000_000 * (round + 1);
    let long = (load.long_model.as_str(), load.long_size, load.long_steps);
    for (i, (model, size, steps)) in [long, ("sd-tiny", 64, 4)].into_iter().enumerate() {
        let t = task(model, base + i as u64, size, steps, Class::Background)?;
        sluice_integration_tests::publish_to_partition(&kafka, &topics.tasks, 0, &t).await?;
        tokio::task::block_in_place(|| wait_for(&t.0))?;
    }
    let mut unloaded = Vec::new();
    for i in 0..env_or("SLUICE_BENCH_SCHED_ALONE", 12) {
        let t = task("sd-tiny", base + 100 + i as u64, 64, 4, Class::Interactive)?;
        let sent = Instant::now();
        sluice_integration_tests::publish_to_partition(&kafka, &topics.tasks, (i % 4) as i32, &t).await?;
        let at = tokio::task::block_in_place(|| wait_for(&t.0))?;
        unloaded.push((at - sent).as_secs_f64());
    }
    unloaded.sort_by(f64::total_cmp);
    // The load: arrivals planned from fixed seeds, the background kept at its count.
    let mut planned: Vec<(f64, Class)> = arrivals(load.short_per_s, load.seconds, 11 + round)
        .into_iter()
        .map(|t| (t, Class::Short))
        .chain(
            arrivals(load.interactive_per_s, load.seconds, 23 + round)
                .into_iter()
                .map(|t| (t, Class::Interactive)),
        )
        .collect();
    planned.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut planned = planned.into_iter().peekable();
    let mut sent: HashMap<String, (Class, Instant)> = HashMap::new();
    let mut done: Vec<(Class, Instant, Instant)> = Vec::new();
    let mut outstanding_background = 0;
    let mut seed = base + 1000;
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(load.seconds);
    let mut send = async |class: Class, sent: &mut HashMap<String, (Class, Instant)>| -> anyhow::Result<()> {
        seed += 1;
        let t = match class {
            Class::Background => task(&load.long_model, seed, load.long_size, load.long_steps, class)?,
            Class::Short | Class::Interactive => task("sd-tiny", seed, 64, 4, class)?,
        };
        let at = Instant::now();
        sluice_integration_tests::publish_to_partition(&kafka, &topics.tasks, (seed % 4) as i32, &t).await?;
        sent.insert(t.0, (class, at));
        Ok(())
    };
    while Instant::now() < end || !sent.is_empty() {
        anyhow::ensure!(
            Instant::now() < end + Duration::from_secs(600),
            "the load's last tasks did not complete"
        );
        while let Ok((c, at)) = seen.try_recv() {
            anyhow::ensure!(c.status == CompletionStatus::Succeeded, "task {} ended {:?}", c.task_id, c.status);
            if let Some((class, was)) = sent.remove(&c.task_id.to_string()) {
                done.push((class, was, at));
                if class == Class::Background {
                    outstanding_background -= 1;
                }
            }
        }
        if Instant::now() >= end {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        while outstanding_background < load.background {
            send(Class::Background, &mut sent).await?;
            outstanding_background += 1;
        }
        while let Some(&(t, class)) = planned.peek() {
            if start + Duration::from_secs_f64(t) > Instant::now() {
                break;
            }
            planned.next();
            send(class, &mut sent).await?;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let metrics = w.metrics().await.unwrap_or_default();
    let calls = [load.long_model.as_str(), "sd-tiny"]
        .iter()
        .map(|&m| {
            let model = format!("{{model=\"{m}\"}}");
            let calls = metric_value(&metrics, &format!("sluice_worker_model_call_seconds_count{model}")).unwrap_or(0.0);
            let seconds = metric_value(&metrics, &format!("sluice_worker_model_call_seconds_sum{model}")).unwrap_or(0.0);
            let of = |name: &str| series_sum(&metrics, &format!("{name}{{bucket=\"{m}:"));
            let per_call = of("sluice_worker_batch_size_sum") / of("sluice_worker_batch_size_count");
            (m.to_owned(), calls, seconds, per_call)
        })
        .collect();
    drop(w);
    let counted = start + Duration::from_secs_f64(load.warm);
    let mut latency: HashMap<Class, Vec<f64>> = HashMap::new();
    for class in [Class::Background, Class::Short, Class::Interactive] {
        latency.entry(class).or_default();
    }
    for (class, was, at) in &done {
        if *was >= counted && *was < end {
            latency.entry(*class).or_default().push((*at - *was).as_secs_f64());
        }
    }
    for v in latency.values_mut() {
        v.sort_by(f64::total_cmp);
    }
    // Throughput: images that became visible between the warm-up's end and the load's end.
    let images = done.iter().filter(|(_, _, at)| *at >= counted && *at < end).count();
    Ok(Run {
        latency,
        unloaded,
        images_per_s: images as f64 / (load.seconds - load.warm),
        calls,
    })
}

/// The catalog the worker serves: the demo catalog, with `SLUICE_BENCH_SCHED_CATALOG`'s entries
/// added when it is set (written beside the stack's other files).
fn sched_catalog(stack: &Stack) -> anyhow::Result<std::path::PathBuf> {
    let demo = sluice_integration_tests::stack::repo_root().join("deploy/models.demo.toml");
    let Ok(extra) = std::env::var("SLUICE_BENCH_SCHED_CATALOG") else {
        return Ok(demo);
    };
    let merged = stack.dir.join("sched-catalog.toml");
    let text = format!("{}\n{}", std::fs::read_to_string(&demo)?, std::fs::read_to_string(&extra)?);
    std::fs::write(&merged, text)?;
    Ok(merged)
}

/// One worker on `topics`, with the worker's own batch caps and a 20 ms wait for a batch to fill.
async fn worker(stack: &Stack, topics: &Topics, more: &[(&str, &str)]) -> anyhow::Result<Worker> {
    let group = format!("sched-{}", uuid::Uuid::new_v4());
    let mut settings = vec![("SLUICE_GROUP_ID", group.as_str()), ("SLUICE_MAX_WAIT_MS", "20")];
    settings.extend(topics.worker_env());
    settings.extend(more.iter().copied());
    let extra = std::env::var("SLUICE_BENCH_WORKER_ENV").unwrap_or_default();
    settings.extend(extra.split(';').filter_map(|kv| kv.split_once('=')));
    Worker::start(stack, "sched", &settings).await
}
