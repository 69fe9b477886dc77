//! Idempotency keys: a retried request is one task, two bodies racing with one key publish one
//! task, and a reused key never announces another request's images.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use sluice_integration_tests::cluster::{API_KEY, get_json};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{Outcomes, TopicReader, Topics, completions_for, rejected_fields, terrain_task};
use sluice_schemas::{CompletionStatus, topics};

use crate::stacks::terrain_cluster;

/// POST with an `Idempotency-Key`: a retry with the same body is the same 202 and task id and
/// creates no second task; the same key with another body is a 422 naming the header.
#[tokio::test(flavor = "multi_thread")]
async fn a_retried_request_with_its_idempotency_key_is_one_task() {
    let c = terrain_cluster().await;
    let key = format!("order-{}", uuid::Uuid::new_v4());
    let post = |body: Value, key: String| async move {
        let response = sluice_service::http_client::client()
            .post(format!("{}/v1/tasks", c.producer_url))
            .bearer_auth(API_KEY)
            .header("idempotency-key", key)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json::<Value>().await.unwrap())
    };
    let body = json!({"model": "terrain", "seed": 4242, "params": {"difficulty": 33}});
    let (s1, first) = post(body.clone(), key.clone()).await;
    let (s2, second) = post(body.clone(), key.clone()).await;
    assert_eq!((s1, s2), (202, 202), "{first} {second}");
    assert_eq!(first["task_id"], second["task_id"]);
    let id = first["task_id"].as_str().unwrap().to_owned();
    let (s3, conflict) = post(json!({"model": "terrain", "seed": 4243}), key.clone()).await;
    assert_eq!(s3, 422, "{conflict}");
    assert_eq!(conflict["error"], "idempotency_conflict");
    assert_eq!(rejected_fields(&conflict)[0].0, "Idempotency-Key");
    let (s4, bad) = post(body.clone(), "has spaces in it".into()).await;
    assert_eq!(s4, 400, "{bad}");

    completions_for(c.stack.brokers(), &BTreeSet::from([id.clone()]), Duration::from_secs(120));
    // One task record with that id on the tasks topic, one completion.
    let tasks = TopicReader::snapshot(c.stack.brokers(), topics::TASKS, Duration::from_secs(2)).unwrap();
    let records = tasks.iter().filter(|r| r.key.as_deref() == Some(id.as_bytes())).count();
    assert_eq!(records, 1, "the retry published nothing");
    let completions = TopicReader::snapshot(c.stack.brokers(), topics::COMPLETIONS, Duration::from_secs(2)).unwrap();
    assert_eq!(completions.iter().filter(|r| r.key.as_deref() == Some(id.as_bytes())).count(), 1);
}

/// Two different bodies sent with one new `Idempotency-Key` at once: one is accepted, the other
/// is a 422 `idempotency_conflict`, whichever order the producer sees them in (in flight or
/// already in its view), and one task record is published.
#[tokio::test(flavor = "multi_thread")]
async fn two_bodies_racing_with_one_idempotency_key_publish_one_task() {
    let c = terrain_cluster().await;
    let key = format!("race-{}", uuid::Uuid::new_v4());
    let post = |seed: u64| {
        sluice_service::http_client::client()
            .post(format!("{}/v1/tasks", c.producer_url))
            .bearer_auth(API_KEY)
            .header("idempotency-key", key.as_str())
            .json(&json!({"model": "terrain", "seed": seed, "width": 64, "height": 64}))
            .send()
    };
    let (a, b) = tokio::join!(post(1), post(2));
    let mut statuses = [a.unwrap().status().as_u16(), b.unwrap().status().as_u16()];
    statuses.sort();
    assert_eq!(statuses, [202, 422]);
    let id = sluice_producer::publish::idempotent_task_id("acme", &key).to_string();
    completions_for(c.stack.brokers(), &BTreeSet::from([id.clone()]), Duration::from_secs(120));
    let tasks = TopicReader::snapshot(c.stack.brokers(), topics::TASKS, Duration::from_secs(2)).unwrap();
    assert_eq!(tasks.iter().filter(|r| r.key.as_deref() == Some(id.as_bytes())).count(), 1);
}

/// A key reused for another request that got past the producer (another replica, or after the
/// view forgot the first): the worker finds the first request's results under the task id with
/// another request hash and dead-letters the second record as `idempotency_conflict` instead of
/// announcing the first one's images as its own; the view keeps showing the first request.
#[tokio::test(flavor = "multi_thread")]
async fn a_reused_idempotency_key_never_announces_another_requests_images() {
    let c = terrain_cluster().await;
    let kafka = producer(c.stack.brokers()).unwrap();
    let id = uuid::Uuid::new_v4().to_string();
    let record = |seed: u64, hash: &str| {
        let (_, mut record) = terrain_task(seed, 64, 64, 5);
        record["task_id"] = json!(id);
        record["idempotency"] = json!({"key": "reused", "request_sha256": hash});
        (id.clone(), record)
    };
    let ids = BTreeSet::from([id.clone()]);
    sluice_integration_tests::publish_tasks(&kafka, topics::TASKS, &[record(1, &"a".repeat(64))])
        .await
        .unwrap();
    let first = completions_for(c.stack.brokers(), &ids, Duration::from_secs(120));
    assert_eq!(first[&id].status, CompletionStatus::Succeeded);
    sluice_integration_tests::publish_tasks(&kafka, topics::TASKS, &[record(2, &"b".repeat(64))])
        .await
        .unwrap();
    let outcomes = Outcomes::wait_settled(c.stack.brokers(), &Topics::default(), &ids, Duration::from_secs(120), |cs| {
        cs.len() >= 2
    })
    .unwrap();
    let second = &outcomes.completions[&id][1];
    assert_eq!(second.status, CompletionStatus::Failed, "{second:?}");
    assert!(second.outputs.is_empty(), "no images announced for the second request");
    assert_eq!(outcomes.dlq_reason(&id), Some("idempotency_conflict"));
    // The view shows the request that first used the key, with its images.
    let url = format!("{}/v1/tasks/{id}", c.producer_url);
    let status = sluice_integration_tests::wait_for("the view has both", Duration::from_secs(30), async || {
        let (code, body) = get_json(&url, API_KEY).await;
        (code == 200 && body["status"] == "succeeded").then_some(body)
    })
    .await
    .unwrap();
    assert_eq!(status["outputs"].as_array().map(Vec::len), Some(1), "{status}");
}
