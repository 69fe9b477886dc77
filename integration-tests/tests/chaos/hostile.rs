//! Floods of hostile records: each reaches the DLQ with its reason, the valid tasks around
//! them complete, and the worker's memory stays bounded.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_integration_tests::cluster::metric_value;
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{TopicReader, ids_of, produce_raw, publish_tasks, terrain_task};
use sluice_schemas::{CompletionStatus, DlqRecord};

use crate::scenario::{SERIAL, full, outcomes, stack, table, tasks, worker};

/// A hostile record of kind `i % KINDS`: its bytes and the DLQ reason it must get.
fn hostile(i: usize) -> (Vec<u8>, &'static str) {
    let (_, mut task) = terrain_task(i as u64, 128, 128, 50);
    let bytes = |v: &Value| serde_json::to_vec(v).unwrap();
    match i % 12 {
        0 => (vec![0xc3, 0x28, 0xa0, 0xa1, b'{', 0xff], "malformed"),
        1 => (b"definitely not json".to_vec(), "malformed"),
        2 => (b"[1, 2, 3]".to_vec(), "malformed"),
        3 => (Vec::new(), "malformed"),
        4 => {
            let text = String::from_utf8(bytes(&task))
                .unwrap()
                .replace("\"guidance_scale\":1.0", "\"guidance_scale\":NaN");
            (text.into_bytes(), "malformed")
        }
        5 => {
            task["request"]["seed"] = json!("seven");
            (bytes(&task), "schema_violation")
        }
        6 => {
            task["request"]["width"] = json!(1_000_000_000u64);
            task["request"]["height"] = json!(1_000_000_000u64);
            (bytes(&task), "schema_violation")
        }
        7 => {
            task["version"] = json!(99);
            (bytes(&task), "unsupported_version")
        }
        8 => {
            task.as_object_mut().unwrap().remove("request");
            (bytes(&task), "schema_violation")
        }
        9 => {
            task["request"]["steps"] = json!(-3);
            (bytes(&task), "schema_violation")
        }
        10 => {
            task["task_id"] = json!("not-a-uuid");
            (bytes(&task), "schema_violation")
        }
        // A megabyte prompt, a few times (every 500th record; the rest of this kind: a deep
        // nesting bomb).
        _ if i % 500 == 11 => {
            task["request"]["prompt"] = json!("x".repeat(1 << 20));
            (bytes(&task), "too_large")
        }
        _ => {
            let depth = 10_000;
            let bomb = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            (bomb.into_bytes(), "malformed")
        }
    }
}

/// The worker's RSS bound under the hostile flood: what its queues hold at most (in-flight
/// records, librdkafka's prefetch, DLQ records awaiting acknowledgement), with the model loaded.
const RSS_BOUND_BYTES: f64 = 512e6;

#[tokio::test(flavor = "multi_thread")]
async fn hostile_records_each_reach_the_dlq_with_their_reason_and_valid_tasks_complete() {
    let _serial = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("hostile", 4).unwrap();
    let (n_hostile, n_valid) = if full() { (10_000, 500) } else { (1_000, 100) };
    let w = worker(stack, "hostile-0", "chaos-hostile", &topics).await;
    let baseline_rss = w.metric("sluice_worker_rss_bytes").await.unwrap_or(0.0);
    let started = Instant::now();
    let valid = tasks(n_valid, 30_000);
    let kafka = producer(stack.brokers()).unwrap();
    let mut expected: BTreeMap<String, &'static str> = BTreeMap::new();
    // Interleaved: one valid task every n_hostile / n_valid hostile records.
    let every = n_hostile / n_valid;
    for chunk_start in (0..n_hostile).step_by(500) {
        let mut sends = Vec::new();
        for i in chunk_start..(chunk_start + 500).min(n_hostile) {
            let (value, reason) = hostile(i);
            let key = format!("hostile-{i}");
            expected.insert(key.clone(), reason);
            sends.push((key, value));
        }
        let kafka = &kafka;
        let topic = &topics.tasks;
        futures::future::join_all(sends.iter().map(|(k, v)| produce_raw(kafka, topic, Some(k.as_bytes()), v, &[])))
            .await
            .into_iter()
            .collect::<anyhow::Result<Vec<_>>>()
            .unwrap();
        let from = chunk_start / every;
        let to = ((chunk_start + 500) / every).min(n_valid);
        publish_tasks(kafka, &topics.tasks, &valid[from..to]).await.unwrap();
    }

    // Watch the worker's memory while it works through them.
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = {
        let (peak, url) = (peak.clone(), w.url.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(response) = sluice_service::http_client::client().get(format!("{url}/metrics")).send().await {
                    let text = response.text().await.unwrap_or_default();
                    if let Some(rss) = metric_value(&text, "sluice_worker_rss_bytes") {
                        peak.fetch_max(rss as u64, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };

    let mut got: HashMap<String, DlqRecord> = HashMap::new();
    tokio::task::block_in_place(|| {
        let mut reader = TopicReader::new(stack.brokers(), &topics.dlq).unwrap();
        reader
            .read_each(Duration::from_secs(600), |r| {
                if let Some(key) = r.key.as_ref().map(|k| String::from_utf8_lossy(k).into_owned())
                    && expected.contains_key(&key)
                {
                    got.insert(key, serde_json::from_slice(&r.value).expect("a DLQ record"));
                }
                got.len() == expected.len()
            })
            .unwrap();
    });
    let done = outcomes(stack, &topics, &ids_of(&valid), Duration::from_secs(300));
    sampler.abort();
    let peak_rss = (peak.load(std::sync::atomic::Ordering::Relaxed) as f64).max(w.metric("sluice_worker_rss_bytes").await.unwrap_or(0.0));
    let wrong: Vec<_> = got
        .iter()
        .filter(|(k, d)| d.reason.as_str() != expected[*k])
        .map(|(k, d)| format!("{k}: {} ({})", d.reason.as_str(), d.message))
        .take(5)
        .collect();
    let mut by_reason: BTreeMap<&str, usize> = BTreeMap::new();
    for d in got.values() {
        *by_reason.entry(d.reason.as_str()).or_default() += 1;
    }
    table(
        "hostile records mixed into the stream (1 worker)",
        &[
            ("hostile records", n_hostile.to_string()),
            ("in the DLQ", got.len().to_string()),
            ("by reason", format!("{by_reason:?}")),
            ("with the wrong reason", wrong.len().to_string()),
            ("valid tasks", n_valid.to_string()),
            (
                "valid tasks completed",
                done.with_status(CompletionStatus::Succeeded).len().to_string(),
            ),
            (
                "worker RSS at start / peak",
                format!("{:.0} / {:.0} MB", baseline_rss / 1e6, peak_rss / 1e6),
            ),
            ("wall time", format!("{:.0} s", started.elapsed().as_secs_f64())),
        ],
    );
    assert!(wrong.is_empty(), "{wrong:?}");
    assert_eq!(done.with_status(CompletionStatus::Succeeded).len(), n_valid);
    assert!(
        peak_rss < RSS_BOUND_BYTES,
        "worker RSS peaked at {peak_rss} bytes (from {baseline_rss}); bound {RSS_BOUND_BYTES}"
    );
}
