//! Cancels and deadlines: a cancelled task stops queued or running and stores nothing; a task
//! past its deadline expires unrun, and bad deadlines are refused.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{TopicReader, completions_for, names_field};
use sluice_schemas::{CompletionStatus, topics};

use crate::stacks::{diffusion_cluster, terrain_cluster};

/// Cancels over HTTP: a queued task is never run, a running diffusion task stops between steps;
/// both end with a `cancelled` completion and no image; a finished task is a 409. The first
/// blocker and the queued task are held until cancelled ([`HELD_SEEDS`]), so this holds on a
/// GPU as on the CPU.
#[tokio::test(flavor = "multi_thread")]
async fn cancelled_tasks_stop_queued_or_running_and_store_nothing() {
    let c = diffusion_cluster().await;
    let key = sluice_integration_tests::cluster::API_KEY;
    let client = sluice_service::http_client::client();
    let cancel = |id: String| {
        let client = client.clone();
        let url = format!("{}/v1/tasks/{id}/cancel", c.producer_url);
        async move {
            let r = client.post(url).bearer_auth(key).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    // Work ahead of the queued task: three long tasks of different buckets.
    let mut blockers = Vec::new();
    for (sampler, seed) in [("euler", 7_770_001), ("ddim", 1), ("dpmpp_2m", 2)] {
        let body = json!({"model": "sd-tiny", "prompt": "a busy street", "steps": 20, "sampler": sampler, "width": 256, "height": 256, "seed": seed});
        blockers.push(c.submit_ok(&body).await.unwrap());
    }
    let queued = c
        .submit_ok(&json!({"model": "sd-tiny", "prompt": "never drawn", "width": 64, "height": 64, "seed": 7_770_002}))
        .await
        .unwrap();
    let (status, reply) = cancel(queued.clone()).await;
    assert_eq!(status, 202, "{reply}");
    assert_eq!(reply["status"], "cancelling");

    // The first blocker, once it runs (held there until cancelled), is cancelled between steps.
    let running = blockers[0].clone();
    c.wait_for_status(&running, key, "running", Duration::from_secs(60)).await.unwrap();
    let (status, _) = cancel(running.clone()).await;
    assert_eq!(status, 202);

    let ids: BTreeSet<String> = [queued.clone(), running.clone(), blockers[1].clone(), blockers[2].clone()].into();
    let done = completions_for(c.stack.brokers(), &ids, Duration::from_secs(240));
    for id in [&queued, &running] {
        let event = &done[id];
        assert_eq!(event.status, CompletionStatus::Cancelled, "{event:?}");
        assert!(event.outputs.is_empty() && event.error.is_none());
    }
    for id in &blockers[1..] {
        assert_eq!(done[id].status, CompletionStatus::Succeeded);
    }
    // No image for either; the queued one never started.
    let sink = c.stack.sink().unwrap();
    for id in [&queued, &running] {
        assert!(sink.read(&format!("outputs/{id}/0.png")).await.is_err(), "no image stored for {id}");
    }
    let progress =
        sluice_integration_tests::TopicReader::snapshot(c.stack.brokers(), sluice_schemas::topics::PROGRESS, Duration::from_secs(2))
            .unwrap();
    assert!(
        !progress.iter().any(|r| r.key.as_deref() == Some(queued.as_bytes())),
        "the queued task never ran"
    );
    let steps: Vec<u64> = progress
        .iter()
        .filter(|r| r.key.as_deref() == Some(running.as_bytes()))
        .map(|r| r.json()["step"].as_u64().unwrap())
        .collect();
    assert!(
        steps.iter().all(|s| *s < 20),
        "the running task stopped before its last step: {steps:?}"
    );
    // Finished: a 409; the view says cancelled.
    c.wait_for_status(&queued, key, "cancelled", Duration::from_secs(10)).await.unwrap();
    let (status, reply) = cancel(queued.clone()).await;
    assert_eq!(status, 409, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("cancelled"), "{reply}");
    let (status, _) = cancel(uuid::Uuid::new_v4().to_string()).await;
    assert_eq!(status, 404);
}

/// Deadlines: a task dequeued after its deadline is not run and completes `expired` (no DLQ
/// record); a request with a deadline in the past, or with both forms, is a 400.
#[tokio::test(flavor = "multi_thread")]
async fn a_task_past_its_deadline_expires_unrun_and_bad_deadlines_are_refused() {
    let c = terrain_cluster().await;
    for (body, field) in [
        (json!({"model": "terrain", "deadline": "2020-01-01T00:00:00Z"}), "deadline"),
        (json!({"model": "terrain", "deadline": "2999-01-01T00:00:00Z"}), "deadline"),
        (
            json!({"model": "terrain", "deadline": "2030-01-01T00:00:00Z", "ttl_seconds": 60}),
            "deadline",
        ),
        (json!({"model": "terrain", "ttl_seconds": 0}), "ttl_seconds"),
    ] {
        let (status, reply) = c.submit(&body).await.unwrap();
        assert_eq!(status, 400, "{body}: {reply}");
        assert!(names_field(&reply, field), "{body}: {reply}");
    }
    // A task with a comfortable ttl runs.
    let fine = c
        .submit_ok(&json!({"model": "terrain", "ttl_seconds": 3600, "seed": 9}))
        .await
        .unwrap();
    // A record whose deadline passed while it waited (written to the topic directly, as a
    // producer would have an hour ago).
    let (late, mut record) = sluice_integration_tests::terrain_task(10, 128, 128, 20);
    record["deadline"] = json!((chrono::Utc::now() - chrono::Duration::seconds(5)).to_rfc3339());
    let kafka = producer(c.stack.brokers()).unwrap();
    sluice_integration_tests::publish_tasks(&kafka, topics::TASKS, &[(late.clone(), record)])
        .await
        .unwrap();

    let done = completions_for(
        c.stack.brokers(),
        &BTreeSet::from([fine.clone(), late.clone()]),
        Duration::from_secs(120),
    );
    assert_eq!(done[&fine].status, CompletionStatus::Succeeded);
    assert_eq!(done[&late].status, CompletionStatus::Expired, "{:?}", done[&late]);
    assert!(done[&late].outputs.is_empty() && done[&late].error.is_none());
    let dlq = TopicReader::snapshot(c.stack.brokers(), topics::DLQ, Duration::from_secs(2)).unwrap();
    assert!(
        !dlq.iter().any(|r| r.key.as_deref() == Some(late.as_bytes())),
        "expiry is not a DLQ record"
    );
    assert!(c.stack.sink().unwrap().read(&format!("outputs/{late}/0.png")).await.is_err());
}
