//! Signed webhooks: retried across a producer restart and delivered once, one tenant's failing
//! receiver never holds up another's, and a task's events arrive in order.

use std::collections::BTreeSet;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use sluice_integration_tests::cluster::{API_KEY, Cluster, RIVAL_KEY, get_json, http_get, metric_value};
use sluice_integration_tests::receiver::{Received, Receiver};
use sluice_integration_tests::{TopicReader, completions_for, rejected_fields, sha256_hex};
use sluice_schemas::topics;

use crate::stacks::{DIFFUSION_WEBHOOK_KEY, WEBHOOK_KEY, diffusion_cluster};

#[tokio::test(flavor = "multi_thread")]
async fn a_signed_webhook_is_retried_across_a_producer_restart_and_delivered_once() {
    let (receiver, base) = Receiver::start().await;
    let secret = format!("acme:whsec_{}", base64::engine::general_purpose::STANDARD.encode(WEBHOOK_KEY));
    let mut c = Cluster::start_with(
        "webhooks",
        1,
        &[],
        &[
            ("SLUICE_WEBHOOK_SECRETS", secret.as_str()),
            ("SLUICE_WEBHOOK_ALLOW_CIDRS", "127.0.0.0/8"),
            ("SLUICE_WEBHOOK_RETRY_SCHEDULE", "1s,2s,2s,2s"),
            ("SLUICE_WEBHOOK_GROUP_INSTANCE_ID", "producer-0"),
        ],
    )
    .await
    .expect("cluster starts");

    // Refused at submit: internal addresses, other schemes, tenants without a secret.
    for (url, key, field) in [
        ("https://169.254.169.254/latest/meta-data/", API_KEY, "webhook.url"),
        ("http://10.1.2.3/hook", API_KEY, "webhook.url"),
        ("https://[::1]/hook", API_KEY, "webhook.url"),
        ("https://hooks.example.com/hook", RIVAL_KEY, "webhook"),
    ] {
        let (status, body) = c
            .post(&json!({"model": "terrain", "webhook": {"url": url}}), Some(key))
            .await
            .unwrap();
        assert_eq!(status, 400, "{url}: {body}");
        assert_eq!(rejected_fields(&body)[0].0, field, "{url}: {body}");
    }

    let task = |mode: &str| json!({"model": "terrain", "width": 64, "height": 64, "webhook": {"url": format!("{base}/hook/{mode}")}});
    let id = c.submit_ok(&task("flaky")).await.unwrap();
    let gone = c.submit_ok(&task("gone")).await.unwrap();
    // Two failed attempts, then the producer is killed and started again: the third attempt
    // comes from the retry topic.
    sluice_integration_tests::wait_for("two attempts", Duration::from_secs(90), async || {
        (receiver.all().iter().filter(|r| r.mode == "flaky").count() >= 2).then_some(())
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    c.kill_and_restart_producer().await.unwrap();
    let delivered = sluice_integration_tests::wait_for("the delivery", Duration::from_secs(90), async || {
        receiver.all().into_iter().find(|r| r.mode == "flaky" && r.answered == 204)
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await; // anything duplicated would come by now
    let attempts: Vec<Received> = receiver.all().into_iter().filter(|r| r.mode == "flaky").collect();
    let answers: Vec<u16> = attempts.iter().map(|r| r.answered).collect();
    assert_eq!(answers, [503, 503, 503, 204], "three failures, then exactly one delivery");
    assert!(attempts.iter().all(|r| r.id == delivered.id && r.event == "completed"));
    assert!(
        attempts.iter().all(|r| r.signed_with(WEBHOOK_KEY)),
        "every attempt is signed with the tenant's secret"
    );
    assert!(delivered.id.starts_with("msg_"));
    let age = chrono::Utc::now().timestamp() - delivered.timestamp.parse::<i64>().unwrap();
    assert!((0..60).contains(&age), "webhook-timestamp is the attempt's time");

    // The body is the task's GET body.
    let payload: Value = serde_json::from_slice(&delivered.body).unwrap();
    let (status, view) = get_json(&format!("{}/v1/tasks/{id}", c.producer_url), API_KEY).await;
    assert_eq!(status, 200);
    assert_eq!(payload["task_id"], id.as_str());
    assert_eq!(payload["status"], "succeeded");
    assert_eq!(payload["outputs"][0]["key"], view["outputs"][0]["key"]);
    assert_eq!(payload["outputs"][0]["sha256"], view["outputs"][0]["sha256"]);
    let image = payload["outputs"][0]["url"].as_str().unwrap();
    let bytes = http_get(image).await.error_for_status().unwrap().bytes().await.unwrap();
    assert_eq!(sha256_hex(&bytes), payload["outputs"][0]["sha256"].as_str().unwrap());

    // 410: one attempt, then the event is given up on the webhook DLQ.
    let mut dlq = TopicReader::new(c.stack.brokers(), topics::WEBHOOK_DLQ).unwrap();
    let records = dlq
        .read_until(Duration::from_secs(60), |r| r.iter().any(|m| m.json()["task_id"] == gone.as_str()))
        .unwrap();
    let record: sluice_schemas::WebhookDlqRecord =
        serde_json::from_value(records.iter().find(|m| m.json()["task_id"] == gone.as_str()).unwrap().json()).unwrap();
    assert_eq!(record.reason, sluice_schemas::WebhookFailure::Gone);
    assert_eq!((record.attempts, record.last_status), (1, Some(410)));
    let gone_attempts: Vec<Received> = receiver.all().into_iter().filter(|r| r.mode == "gone").collect();
    assert_eq!(gone_attempts.len(), 1);
    // Delivery latency: from the completion's time to the receiver's first request.
    let completions = completions_for(
        c.stack.brokers(),
        &BTreeSet::from([id.clone(), gone.clone()]),
        Duration::from_secs(30),
    );
    let latency = |task: &str, at: chrono::DateTime<chrono::Utc>| (at - completions[task].completed_at).num_milliseconds();
    let first_flaky = attempts[0].received_at;
    println!(
        "webhook delivery latency (completion to first attempt) of the first two tasks, while the notifier group formed: {} ms and {} ms",
        latency(&id, first_flaky),
        latency(&gone, gone_attempts[0].received_at)
    );
    // Once the notifier is running (the two above waited for the group to form): a few more.
    let mut latencies = Vec::new();
    for _ in 0..5 {
        let task = c.submit_ok(&task("ok")).await.unwrap();
        let received = sluice_integration_tests::wait_for("a delivery", Duration::from_secs(60), async || {
            receiver
                .all()
                .into_iter()
                .find(|r| r.mode == "ok" && r.json()["task_id"] == task.as_str())
        })
        .await
        .unwrap();
        let completion = &completions_for(c.stack.brokers(), &BTreeSet::from([task.clone()]), Duration::from_secs(30))[&task];
        latencies.push((received.received_at - completion.completed_at).num_milliseconds());
    }
    latencies.sort();
    println!("webhook delivery latency with the notifier running, 5 tasks: {latencies:?} ms");
    let metrics = c.producer_metrics().await.unwrap();
    assert!(
        metrics.contains("sluice_producer_webhook_deliveries_total{event=\"completed\",outcome=\"delivered\"} 6"),
        "{metrics}"
    );
    c.stack.down().unwrap();
}

/// One tenant's failing receiver does not hold up another tenant's webhooks. Tenant acme's
/// receiver answers every attempt 503 with `Retry-After: 999999`; the notifier may hold only
/// 20 records in flight (`SLUICE_WEBHOOK_MAX_PENDING`). After acme's 40 tasks have finished
/// and been attempted, tenant rival's `completed` still reaches its own receiver within
/// seconds: acme's retries wait on the retry topic, not in the notifier's memory (before, each
/// slept in memory, 40 of them paused every partition of the notifier for hours).
#[tokio::test(flavor = "multi_thread")]
async fn one_tenants_failing_receiver_does_not_hold_up_another_tenants_webhooks() {
    let (busy, busy_base) = Receiver::start().await;
    let (calm, calm_base) = Receiver::start().await;
    let key = base64::engine::general_purpose::STANDARD.encode(WEBHOOK_KEY);
    let secrets = format!("acme:whsec_{key},rival:whsec_{key}");
    let c = Cluster::start_with(
        "webhook-fairness",
        1,
        &[],
        &[
            ("SLUICE_WEBHOOK_SECRETS", secrets.as_str()),
            ("SLUICE_WEBHOOK_ALLOW_CIDRS", "127.0.0.0/8"),
            ("SLUICE_WEBHOOK_MAX_PENDING", "20"),
        ],
    )
    .await
    .expect("cluster starts");
    let task = |seed: u64, url: String| json!({"model": "terrain", "width": 64, "height": 64, "seed": seed, "webhook": {"url": url}});
    let mut flood = Vec::new();
    for seed in 0..40 {
        let (status, body) = c.post(&task(seed, format!("{busy_base}/hook/busy")), Some(API_KEY)).await.unwrap();
        assert_eq!(status, 202, "{body}");
        flood.push(body["task_id"].as_str().unwrap().to_owned());
    }
    for id in &flood {
        c.wait_for_status(id, API_KEY, "succeeded", Duration::from_secs(120)).await.unwrap();
    }
    let attempted = |r: &Receiver| -> BTreeSet<String> {
        r.all()
            .iter()
            .filter(|x| x.event == "completed")
            .filter_map(|x| x.json()["task_id"].as_str().map(str::to_owned))
            .collect()
    };
    // Every acme event attempted once (the receiver sees the first few: then the host's circuit
    // opens and attempts fail at once) and scheduled for a retry.
    let retrying = "sluice_producer_webhook_deliveries_total{event=\"completed\",outcome=\"retrying\"}";
    let scheduled = sluice_integration_tests::wait_for("acme's retries scheduled", Duration::from_secs(30), async || {
        let metrics = c.producer_metrics().await.ok()?;
        metric_value(&metrics, retrying).filter(|n| *n >= flood.len() as f64)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let (status, body) = c.post(&task(99, format!("{calm_base}/hook/ok")), Some(RIVAL_KEY)).await.unwrap();
    assert_eq!(status, 202, "{body}");
    let id = body["task_id"].as_str().unwrap().to_owned();
    c.wait_for_status(&id, RIVAL_KEY, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let succeeded = std::time::Instant::now();
    let delivered = sluice_integration_tests::wait_for("rival's completed webhook", Duration::from_secs(20), async || {
        attempted(&calm).contains(&id).then_some(())
    })
    .await;
    let metrics = c.producer_metrics().await.unwrap();
    println!(
        "rival's webhook {:?} after its task succeeded; acme: {} requests reached its receiver, {:?} attempts retrying; notifier pending now {:?}",
        succeeded.elapsed(),
        busy.all().len(),
        metric_value(&metrics, retrying),
        metric_value(&metrics, "sluice_producer_webhook_pending"),
    );
    delivered.expect("rival's completed arrives within seconds");
    scheduled.expect("every acme event was attempted and scheduled for a retry");
    assert!(
        busy.all().iter().all(|r| r.event != "completed" || r.answered == 503),
        "acme's receiver only ever answered 503"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_webhook_gets_started_progress_and_completed_in_order() {
    let c = diffusion_cluster().await;
    let (receiver, base) = sluice_integration_tests::receiver::Receiver::start().await;
    let body = json!({"model": "sd-tiny", "prompt": "a lighthouse", "steps": 20, "width": 256, "height": 256, "seed": 5,
        "webhook": {"url": format!("{base}/hook/all"), "events": ["started", "progress", "completed"]}});
    let id = c.submit_ok(&body).await.unwrap();
    sluice_integration_tests::wait_for("the completed event", Duration::from_secs(120), async || {
        receiver.all().iter().any(|r| r.event == "completed").then_some(())
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let all = receiver.all();
    let events: Vec<&str> = all.iter().map(|r| r.event.as_str()).collect();
    assert_eq!(events.first(), Some(&"started"), "{events:?}");
    assert_eq!(events.last(), Some(&"completed"), "{events:?}");
    assert_eq!(events.iter().filter(|e| **e == "completed").count(), 1, "{events:?}");
    assert!(
        all.iter()
            .all(|r| r.signed_with(DIFFUSION_WEBHOOK_KEY) && r.json()["task_id"] == id.as_str())
    );
    let progress: Vec<&sluice_integration_tests::receiver::Received> = all.iter().filter(|r| r.event == "progress").collect();
    let steps: Vec<u64> = progress.iter().map(|r| r.json()["progress"]["step"].as_u64().unwrap()).collect();
    assert!(!steps.is_empty(), "the last step at least is a progress event: {events:?}");
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "steps only move forward: {steps:?}");
    for pair in progress.windows(2) {
        assert!(
            pair[1].at - pair[0].at >= Duration::from_millis(450),
            "progress is throttled to one per 500 ms"
        );
    }
    let ids: BTreeSet<&str> = all.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids.len(), all.len(), "each event has its own webhook-id");
    assert_eq!(all.last().unwrap().json()["status"], "succeeded");
}
