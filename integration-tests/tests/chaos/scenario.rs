//! What the chaos scenarios share: one stack, one scenario at a time, workers of the tiny model
//! with static membership, tasks published at a pace, their outcomes read back, and the
//! summary tables.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use sluice_integration_tests::cluster::{API_KEY, Worker};
use sluice_integration_tests::kafka::{Isolation, producer};
use sluice_integration_tests::process::{Service, bin};
use sluice_integration_tests::{Outcomes, Stack, TopicReader, Topics, produce_raw, terrain_task};
use tokio::sync::{Mutex, OnceCell};

static STACK: OnceCell<Stack> = OnceCell::const_new();
/// One scenario at a time.
pub(crate) static SERIAL: Mutex<()> = Mutex::const_new(());

pub(crate) fn full() -> bool {
    std::env::var("SLUICE_CHAOS").is_ok_and(|v| v == "full")
}

pub(crate) async fn stack() -> &'static Stack {
    STACK.get_or_init(|| async { Stack::start("chaos").expect("stack starts") }).await
}

/// The group protocol and membership the suite's workers use, as its tables name them.
pub(crate) fn membership() -> String {
    let protocol = std::env::var("SLUICE_CHAOS_GROUP_PROTOCOL").unwrap_or_else(|_| "classic".into());
    let kind = if std::env::var("SLUICE_CHAOS_STATIC").map_or(true, |v| v != "0") {
        "static"
    } else {
        "dynamic"
    };
    format!("{protocol} protocol, {kind} membership")
}

/// A worker serving the tiny model, in `group` on `topics`, with static membership (its id is
/// its `group.instance.id`, as a pod name would be), so a restarted worker takes its
/// partitions back at once.
pub(crate) async fn worker(stack: &Stack, id: &str, group: &str, topics: &Topics) -> Worker {
    worker_with(stack, id, group, topics, &[]).await
}

/// [`worker`] with extra settings.
pub(crate) async fn worker_with(stack: &Stack, id: &str, group: &str, topics: &Topics, extra: &[(&str, &str)]) -> Worker {
    let models = stack.tiny_models().unwrap().display().to_string();
    let mut env = vec![
        ("SLUICE_MODEL_DIR", models.as_str()),
        ("SLUICE_MAX_BATCH", "16"),
        ("SLUICE_MAX_WAIT_MS", "20"),
    ];
    if std::env::var("SLUICE_CHAOS_STATIC").map_or(true, |v| v != "0") {
        env.push(("SLUICE_GROUP_INSTANCE_ID", id));
    }
    // SLUICE_CHAOS_GROUP_PROTOCOL=consumer runs the suite on KIP-848 groups (default: classic).
    let protocol = std::env::var("SLUICE_CHAOS_GROUP_PROTOCOL").ok();
    if let Some(p) = &protocol {
        env.push(("SLUICE_GROUP_PROTOCOL", p.as_str()));
    }
    env.extend_from_slice(extra);
    Worker::on_topics(stack, id, group, topics, &env).await.unwrap()
}

pub(crate) fn tasks(n: usize, seed: u64) -> Vec<(String, Value)> {
    (0..n as u64)
        .map(|i| terrain_task(seed + i, 128, 128, 1 + (i % 100) as u32))
        .collect()
}

/// Publishes `tasks` in waves spread over `spread`, in the background. Returns the ids the
/// broker acknowledged (a wave sent while the broker is down may fail: those were never
/// accepted, so they are not owed a result).
pub(crate) fn publish_paced(
    stack: &Stack,
    topic: &str,
    tasks: Vec<(String, Value)>,
    spread: Duration,
) -> tokio::task::JoinHandle<BTreeSet<String>> {
    let kafka = producer(stack.brokers()).unwrap();
    let topic = topic.to_owned();
    tokio::spawn(async move {
        let waves = (spread.as_millis() / 250).max(1) as usize;
        let per_wave = tasks.len().div_ceil(waves);
        let mut acked = BTreeSet::new();
        for wave in tasks.chunks(per_wave) {
            let sends = wave.iter().map(|(id, record)| {
                let kafka = &kafka;
                let topic = &topic;
                async move {
                    let value = serde_json::to_vec(record).unwrap();
                    produce_raw(kafka, topic, Some(id.as_bytes()), &value, &[("sluice-schema-version", b"1")])
                        .await
                        .map(|_| id.clone())
                }
            });
            acked.extend(futures::future::join_all(sends).await.into_iter().flatten());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        acked
    })
}

pub(crate) fn outcomes(stack: &Stack, topics: &Topics, ids: &BTreeSet<String>, timeout: Duration) -> Outcomes {
    Outcomes::wait(stack.brokers(), topics, ids, timeout).unwrap()
}

/// PNG objects per task id, from the S3 server's own storage.
pub(crate) fn stored_images(stack: &Stack) -> HashMap<String, usize> {
    fn walk(dir: &Path, out: &mut HashMap<String, usize>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "png")
                && let Some(task) = path.parent().and_then(|p| p.file_name())
            {
                *out.entry(task.to_string_lossy().into_owned()).or_default() += 1;
            }
        }
    }
    let mut out = HashMap::new();
    walk(&stack.dir.join("s3"), &mut out);
    out
}

pub(crate) fn table(title: &str, rows: &[(&str, String)]) {
    println!("\n## chaos: {title}{}\n", if full() { " (full)" } else { " (fast)" });
    println!("| measure | value |\n|---|---|");
    for (k, v) in rows {
        println!("| {k} | {v} |");
    }
}

/// Completion records beyond the first of each task in `ids`, as a reader of `isolation` sees
/// them once every task has one (call after [`outcomes`]).
pub(crate) fn extra_completions(stack: &Stack, topics: &Topics, ids: &BTreeSet<String>, isolation: Isolation) -> usize {
    tokio::task::block_in_place(|| {
        let mut reader = TopicReader::with_isolation(stack.brokers(), &topics.completions, isolation).unwrap();
        let key = |r: &sluice_integration_tests::kafka::Consumed| r.key.as_ref().map(|k| String::from_utf8_lossy(k).into_owned());
        let mut seen: BTreeSet<String> = BTreeSet::new();
        reader
            .read_each(Duration::from_secs(120), |r| {
                seen.extend(key(r).filter(|id| ids.contains(id)));
                seen.len() == ids.len()
            })
            .unwrap();
        // And whatever else was written by then.
        reader.poll_for(Duration::from_secs(3));
        let total = reader.records.iter().filter(|r| key(r).is_some_and(|id| ids.contains(&id))).count();
        total - ids.len()
    })
}

/// Duplicate completions, and tasks whose completions disagree on their images.
pub(crate) fn duplicates(done: &Outcomes) -> (usize, usize) {
    let extra = done.completions.values().map(|cs| cs.len() - 1).sum();
    let differing = done
        .completions
        .values()
        .filter(|cs| cs.iter().any(|c| c.outputs != cs[0].outputs))
        .count();
    (extra, differing)
}

/// A producer serving HTTP on `topics`, its webhooks off (this suite is about tasks).
pub(crate) async fn producer_service(stack: &Stack, topics: &Topics, name: &str) -> (Service, String) {
    let port = sluice_integration_tests::free_port();
    let mut env = stack.vars();
    env.extend(
        [
            ("SLUICE_LISTEN", format!("127.0.0.1:{port}")),
            (
                "SLUICE_METRICS_LISTEN",
                format!("127.0.0.1:{}", sluice_integration_tests::free_port()),
            ),
            ("SLUICE_API_KEYS", format!("acme:{API_KEY}")),
            (
                "SLUICE_STATUS_PATH",
                stack.dir.join(format!("status-{name}/view.redb")).display().to_string(),
            ),
            ("SLUICE_TASKS_TOPIC", topics.tasks.clone()),
            ("SLUICE_COMPLETIONS_TOPIC", topics.completions.clone()),
            ("SLUICE_WEBHOOKS", "false".into()),
        ]
        .map(|(k, v)| (k.to_owned(), v)),
    );
    let mut service = Service::spawn(name, &bin("sluice-producer"), &["serve"], &env, &stack.dir.join("logs")).unwrap();
    let url = format!("http://127.0.0.1:{port}");
    service
        .wait_ready(&format!("{url}/healthz"), Duration::from_secs(30))
        .await
        .unwrap();
    (service, url)
}

/// Waits (up to a minute) until `w` holds at least `n` tasks in flight.
pub(crate) async fn in_flight(w: &Worker, n: f64) {
    sluice_integration_tests::wait_for(&format!("{n} tasks in flight"), Duration::from_secs(60), async || {
        (w.metric("sluice_worker_in_flight_tasks").await? >= n).then_some(())
    })
    .await
    .unwrap();
}
