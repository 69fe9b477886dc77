//! Outages: the S3 server away for 30 s, and every fault in one run (workers killed, the broker
//! killed and restarted, S3 stopped) while tasks arrive over HTTP. Nothing acknowledged is lost,
//! nothing is dead-lettered for an outage, and the producer answers 503 while the broker is away.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_integration_tests::cluster::{API_KEY, metric_value};
use sluice_integration_tests::kafka::Isolation;
use sluice_integration_tests::{TopicReader, ids_of};
use sluice_schemas::CompletionStatus;

use crate::scenario::{
    SERIAL, duplicates, extra_completions, full, membership, outcomes, producer_service, publish_paced, stack, stored_images, table, tasks,
    worker_with,
};

/// How long the poll loop may go without polling while S3 is out. It polls every 100 ms and
/// never waits on storage; a stall of seconds would mean storage I/O crept back onto it (before
/// the redelivery check moved off it: 27 s with S3 hung, against max.poll.interval.ms of 30 s).
const POLL_GAP_BOUND_S: f64 = 2.0;

#[tokio::test(flavor = "multi_thread")]
async fn an_s3_outage_of_30_s_dead_letters_nothing_loses_nothing_and_never_stalls_polling() {
    let _serial = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("s3", 4).unwrap();
    let n = if full() { 1000 } else { 300 };
    let (hung, gone) = (Duration::from_secs(15), Duration::from_secs(15));
    // A short lease span, so that read leases are extended (committed) during the outage.
    let mut w = worker_with(stack, "s3-0", "chaos-s3", &topics, &[("SLUICE_LEASE_SPAN", "16")]).await;
    w.wait_assigned(Duration::from_secs(60)).await.unwrap();
    let started = Instant::now();
    let all = tasks(n, 10_000);
    let publisher = publish_paced(stack, &topics.tasks, all.clone(), hung + gone + Duration::from_secs(10));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let revokes_before = w.metric("sluice_worker_rebalances_total{kind=\"revoke\"}").await.unwrap_or(0.0);
    // First S3 hangs (requests are accepted and never answered: an upload backlog builds up),
    // then it is gone (connections refused).
    stack.pause_s3().unwrap();
    let stopped = Instant::now();
    tokio::time::sleep(hung).await;
    stack.stop_s3().unwrap();
    tokio::time::sleep(gone).await;
    stack.start_s3().unwrap();
    let down = stopped.elapsed();
    publisher.await.unwrap();
    let done = outcomes(stack, &topics, &ids_of(&all), Duration::from_secs(600));
    let dlq = TopicReader::snapshot(stack.brokers(), &topics.dlq, Duration::from_secs(2)).unwrap();
    let metrics = w.metrics().await.unwrap();
    // Retries of every kind (the counter is labelled).
    let retries: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("sluice_worker_retries_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let poll_gap = metric_value(&metrics, "sluice_worker_poll_gap_max_seconds").unwrap_or(f64::NAN);
    let revokes = metric_value(&metrics, "sluice_worker_rebalances_total{kind=\"revoke\"}").unwrap_or(0.0) - revokes_before;
    table(
        "S3 server hung for 15 s, then stopped for 15 s, mid-run (1 worker, lease commits during the outage)",
        &[
            ("tasks", n.to_string()),
            ("S3 out for", format!("{:.1} s", down.as_secs_f64())),
            ("storage retries", format!("{retries:.0}")),
            ("completed", done.with_status(CompletionStatus::Succeeded).len().to_string()),
            ("DLQ records", dlq.len().to_string()),
            ("lost", (n - done.completions.len()).to_string()),
            ("poll loop's longest gap", format!("{poll_gap:.2} s")),
            ("partitions revoked during the outage", format!("{revokes:.0}")),
            ("wall time", format!("{:.0} s", started.elapsed().as_secs_f64())),
        ],
    );
    assert!(retries > 0.0, "the outage was felt");
    assert_eq!(dlq.len(), 0, "nothing dead-lettered");
    assert_eq!(done.with_status(CompletionStatus::Succeeded).len(), n);
    assert!(poll_gap < POLL_GAP_BOUND_S, "the poll loop stalled for {poll_gap} s");
    assert_eq!(revokes, 0.0, "the worker kept its partitions");
    w.service.terminate(Duration::from_secs(30)).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn every_fault_in_one_run_exactly_once() {
    every_fault_in_one_run("exactly-once").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_fault_in_one_run_at_least_once() {
    every_fault_in_one_run("at-least-once").await;
}

/// What the producer answered while tasks were submitted over HTTP.
#[derive(Debug, Default)]
struct Submitted {
    /// Task ids answered 202.
    accepted: BTreeSet<String>,
    /// 503 answers (the broker was away).
    unavailable: usize,
    /// Anything else.
    other: Vec<String>,
    /// 202 answers after the first 503 (the producer recovered by itself).
    accepted_after_outage: usize,
}

/// Submits `n` terrain tasks over HTTP, 16 at a time, spread over `spread`.
fn submit_paced(url: String, n: usize, spread: Duration) -> tokio::task::JoinHandle<Submitted> {
    tokio::spawn(async move {
        let client = sluice_service::http_client::client();
        let mut out = Submitted::default();
        let waves = n.div_ceil(16);
        let pause = spread / waves as u32;
        for wave in 0..waves {
            let sends = (wave * 16..((wave + 1) * 16).min(n)).map(|i| {
                let request = client
                    .post(format!("{url}/v1/tasks"))
                    .bearer_auth(API_KEY)
                    .json(&json!({"model": "terrain", "seed": 40_000 + i, "params": {"difficulty": 1 + i % 100}}));
                async move {
                    match request.send().await {
                        Ok(r) => {
                            let status = r.status().as_u16();
                            (status, r.json::<Value>().await.unwrap_or(Value::Null))
                        }
                        Err(e) => (0, json!(e.to_string())),
                    }
                }
            });
            for (status, body) in futures::future::join_all(sends).await {
                match status {
                    202 => {
                        out.accepted.insert(body["task_id"].as_str().unwrap_or_default().to_owned());
                        out.accepted_after_outage += usize::from(out.unavailable > 0);
                    }
                    503 => out.unavailable += 1,
                    _ => out.other.push(format!("{status}: {body}")),
                }
            }
            tokio::time::sleep(pause).await;
        }
        out
    })
}

/// Every fault at once, in delivery mode `mode`: tasks submitted over HTTP while workers are
/// killed (-9) and restarted, the broker is killed (-9) and restarted, and the S3 server is
/// stopped. The producer answers 503 while the broker is away and never a 202 it can't keep;
/// nothing accepted is lost; producer and workers recover without a restart of their own.
async fn every_fault_in_one_run(mode: &str) {
    let _serial = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics(&format!("all-{mode}"), 8).unwrap();
    let (n, spread) = if full() { (1600, 60) } else { (480, 24) };
    let group = format!("chaos-all-{mode}");
    let delivery = [("SLUICE_DELIVERY", mode)];
    let mut workers = vec![
        worker_with(stack, &format!("all-{mode}-0"), &group, &topics, &delivery).await,
        worker_with(stack, &format!("all-{mode}-1"), &group, &topics, &delivery).await,
    ];
    for w in &workers {
        w.wait_assigned(Duration::from_secs(60)).await.unwrap();
    }
    let (mut producer, url) = producer_service(stack, &topics, &format!("producer-{mode}")).await;
    let started = Instant::now();
    let submitter = submit_paced(url, n, Duration::from_secs(spread));
    let mut kills = 0;
    let at = |s: u64| tokio::time::sleep_until(tokio::time::Instant::from_std(started + Duration::from_secs(s)));
    let scale = spread / 24;
    // The faults, one after another, while tasks arrive.
    at(3 * scale).await;
    workers[0].service.kill9();
    workers[0].restart(stack).await.unwrap();
    kills += 1;
    at(6 * scale).await;
    stack.kill_broker().unwrap();
    let broker_down = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    stack.start_broker().unwrap();
    let broker_down = broker_down.elapsed();
    at(14 * scale).await;
    workers[1].service.kill9();
    workers[1].restart(stack).await.unwrap();
    kills += 1;
    at(16 * scale).await;
    stack.stop_s3().unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    stack.start_s3().unwrap();
    at(20 * scale).await;
    workers[0].service.kill9();
    workers[0].restart(stack).await.unwrap();
    kills += 1;
    let submitted = submitter.await.unwrap();
    let done = outcomes(stack, &topics, &submitted.accepted, Duration::from_secs(600));
    let (extra, differing) = duplicates(&done);
    let extra_uncommitted = extra_completions(stack, &topics, &submitted.accepted, Isolation::ReadUncommitted);
    let images = stored_images(stack);
    let doubled = submitted
        .accepted
        .iter()
        .filter(|id| images.get(*id).copied().unwrap_or(0) > 1)
        .count();
    table(
        &format!(
            "every fault in one run: 3 worker kill -9s, broker kill -9 for 5 s, S3 stopped for 5 s ({}, {mode})",
            membership()
        ),
        &[
            ("tasks submitted over HTTP", n.to_string()),
            ("answered 202", submitted.accepted.len().to_string()),
            ("answered 503 (broker away)", submitted.unavailable.to_string()),
            ("answered 202 after the first 503", submitted.accepted_after_outage.to_string()),
            ("other answers", submitted.other.len().to_string()),
            ("worker kills", kills.to_string()),
            ("broker down for", format!("{:.1} s", broker_down.as_secs_f64())),
            (
                "accepted and completed",
                done.with_status(CompletionStatus::Succeeded).len().to_string(),
            ),
            ("accepted and lost", (submitted.accepted.len() - done.completions.len()).to_string()),
            ("duplicate completions, read_committed", extra.to_string()),
            ("duplicate completions, read_uncommitted", extra_uncommitted.to_string()),
            ("tasks with two image objects", doubled.to_string()),
            ("wall time", format!("{:.0} s", started.elapsed().as_secs_f64())),
        ],
    );
    assert!(submitted.other.is_empty(), "{:?}", &submitted.other[..submitted.other.len().min(5)]);
    assert!(submitted.unavailable > 0, "the broker's absence was answered with 503");
    assert!(submitted.accepted_after_outage > 0, "the producer took tasks again by itself");
    assert!(producer.running(), "the producer rode out the broker's restart");
    assert_eq!(
        done.with_status(CompletionStatus::Succeeded),
        submitted.accepted,
        "every accepted task completed"
    );
    assert_eq!(differing, 0);
    assert_eq!(doubled, 0);
    if mode == "exactly-once" {
        assert_eq!(extra, 0, "a read_committed reader saw a task's completion twice");
    }
    for w in &mut workers {
        assert!(w.service.running(), "{} rode out the broker and S3 faults", w.id);
        w.service.terminate(Duration::from_secs(30)).unwrap();
    }
    producer.terminate(Duration::from_secs(30)).unwrap();
}
