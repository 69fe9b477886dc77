//! Producer replicas: a producer is ready only once its status view caught up, and an
//! idempotency key sent to two replicas at once runs one task.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_integration_tests::TopicReader;
use sluice_integration_tests::cluster::API_KEY;
use sluice_schemas::{CompletionEvent, CompletionStatus};

use crate::scenario::{SERIAL, producer_service, stack, table, worker_with};

/// A producer is ready only once its status view has read what its topics held at its start.
/// While it cannot (the broker is away when it starts, as in a rollout during a broker
/// restart) `/readyz` answers 503, and an existing task or a known `Idempotency-Key` is
/// `catching_up`, never "no such task" or a new task; once the broker is back the same retry is
/// the same task, published once.
#[tokio::test(flavor = "multi_thread")]
async fn a_producer_is_ready_only_once_its_status_view_caught_up() {
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("readiness", 2).unwrap();
    let client = sluice_service::http_client::client();
    let submit = async |url: &str| {
        let r = client
            .post(format!("{url}/v1/tasks"))
            .bearer_auth(API_KEY)
            .header("idempotency-key", "rollout-1")
            .json(&json!({"model": "terrain", "seed": 7, "width": 64, "height": 64}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap())
    };
    let get = async |url: &str, path: &str| {
        let r = client.get(format!("{url}{path}")).bearer_auth(API_KEY).send().await.unwrap();
        let (status, retry) = (r.status().as_u16(), r.headers().get("retry-after").cloned());
        (status, retry, r.json::<Value>().await.unwrap())
    };
    let (mut first, url) = producer_service(stack, &topics, "producer-ready-1").await;
    sluice_integration_tests::wait_for("first producer ready", Duration::from_secs(60), async || {
        (get(&url, "/readyz").await.0 == 200).then_some(())
    })
    .await
    .unwrap();
    let (status, reply) = submit(&url).await;
    assert_eq!(status, 202, "{reply}");
    let id = reply["task_id"].as_str().unwrap().to_owned();
    first.terminate(Duration::from_secs(30)).unwrap();

    // A new replica starts while the broker is away: alive, not ready.
    stack.stop_broker().unwrap();
    let (mut second, url) = producer_service(stack, &topics, "producer-ready-2").await;
    let (status, retry, reply) = get(&url, "/readyz").await;
    assert_eq!((status, reply["error"].as_str()), (503, Some("catching_up")), "{reply}");
    assert!(retry.is_some(), "Retry-After");
    let (status, _, reply) = get(&url, &format!("/v1/tasks/{id}")).await;
    assert_eq!((status, reply["error"].as_str()), (503, Some("catching_up")), "not a 404: {reply}");
    let (status, _, reply) = get(&url, "/v1/tasks").await;
    assert_eq!(status, 503, "no partial list: {reply}");
    let started = Instant::now();
    let (status, reply) = submit(&url).await;
    assert_eq!((status, reply["error"].as_str()), (503, Some("catching_up")), "{reply}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refused at once, not after a publish timeout"
    );

    // The broker is back: the view catches up, and the retry is the task it already was.
    stack.start_broker().unwrap();
    sluice_integration_tests::wait_for("second producer ready", Duration::from_secs(90), async || {
        (get(&url, "/readyz").await.0 == 200).then_some(())
    })
    .await
    .unwrap();
    let (status, _, reply) = get(&url, &format!("/v1/tasks/{id}")).await;
    assert_eq!((status, reply["task_id"].as_str()), (200, Some(id.as_str())), "{reply}");
    let (status, reply) = submit(&url).await;
    assert_eq!((status, reply["task_id"].as_str()), (202, Some(id.as_str())), "{reply}");
    let records = TopicReader::snapshot(stack.brokers(), &topics.tasks, Duration::from_secs(2)).unwrap();
    let published = records.iter().filter(|r| r.key.as_deref() == Some(id.as_bytes())).count();
    assert_eq!(published, 1, "published once");
    second.terminate(Duration::from_secs(30)).unwrap();
}

/// A task id runs at most once: eight concurrent submissions of one request with one
/// `Idempotency-Key`, split between two producer replicas, all answer 202 with one task id; each
/// replica publishes the record it could not yet see from the other (two or more records), and
/// the worker runs the task once — every later record of it waits for the first and is
/// announced from its results (`sluice_worker_duplicates_skipped_total`), one set of images.
#[tokio::test(flavor = "multi_thread")]
async fn an_idempotency_key_sent_to_two_replicas_at_once_runs_once() {
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("idempotency", 2).unwrap();
    // Batches wait long enough to hold every copy at once: the hardest case.
    let mut w = worker_with(
        stack,
        "idempotency-0",
        "chaos-idempotency",
        &topics,
        &[("SLUICE_MAX_WAIT_MS", "500")],
    )
    .await;
    w.wait_assigned(Duration::from_secs(60)).await.unwrap();
    let (mut first, url_a) = producer_service(stack, &topics, "producer-idem-a").await;
    let (mut second, url_b) = producer_service(stack, &topics, "producer-idem-b").await;
    for (producer, url) in [(&mut first, &url_a), (&mut second, &url_b)] {
        producer
            .wait_ready(&format!("{url}/readyz"), Duration::from_secs(60))
            .await
            .unwrap();
    }
    let client = sluice_service::http_client::client();
    let mut attempt = 0;
    let (id, published) = loop {
        attempt += 1;
        let key = format!("once-{attempt}");
        let sends = (0..8).map(|i| {
            let url = if i % 2 == 0 { &url_a } else { &url_b };
            client
                .post(format!("{url}/v1/tasks"))
                .bearer_auth(API_KEY)
                .header("idempotency-key", key.as_str())
                .json(&json!({"model": "terrain", "seed": 31, "width": 128, "height": 128}))
                .send()
        });
        let mut ids = BTreeSet::new();
        for r in futures::future::join_all(sends).await {
            let r = r.unwrap();
            assert_eq!(r.status().as_u16(), 202);
            ids.insert(r.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_owned());
        }
        assert_eq!(ids.len(), 1, "one task id for one key: {ids:?}");
        let id = ids.into_iter().next().unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let records = TopicReader::snapshot(stack.brokers(), &topics.tasks, Duration::from_secs(2)).unwrap();
        let published = records.iter().filter(|r| r.key.as_deref() == Some(id.as_bytes())).count();
        // The race is what is tested: try another key when one replica saw the other's record.
        if published >= 2 || attempt == 5 {
            break (id, published);
        }
    };
    assert!(published >= 2, "the replicas never both published (5 keys tried)");
    // Every record of the task gets its completion.
    let completions = sluice_integration_tests::wait_for("a completion per record", Duration::from_secs(120), async || {
        let records = TopicReader::snapshot(stack.brokers(), &topics.completions, Duration::from_secs(1)).ok()?;
        let of_task: Vec<CompletionEvent> = records
            .iter()
            .filter_map(|r| serde_json::from_slice::<CompletionEvent>(&r.value).ok())
            .filter(|c| c.task_id.to_string() == id)
            .collect();
        (of_task.len() >= published).then_some(of_task)
    })
    .await
    .unwrap();
    let skipped = w.metric("sluice_worker_duplicates_skipped_total").await.unwrap_or(0.0);
    table(
        "one Idempotency-Key, 8 concurrent submissions over two replicas",
        &[
            ("task records published", published.to_string()),
            ("completions", completions.len().to_string()),
            ("announced from the first one's results", skipped.to_string()),
            ("executions", (completions.len() as f64 - skipped).to_string()),
        ],
    );
    assert!(completions.iter().all(|c| c.status == CompletionStatus::Succeeded));
    assert_eq!(skipped as usize, completions.len() - 1, "the task ran once");
    let outputs: BTreeSet<String> = completions
        .iter()
        .flat_map(|c| c.outputs.iter().map(|o| o.sha256.clone()))
        .collect();
    assert_eq!(outputs.len(), 1, "one set of images: {outputs:?}");
    first.terminate(Duration::from_secs(30)).unwrap();
    second.terminate(Duration::from_secs(30)).unwrap();
    w.service.terminate(Duration::from_secs(30)).unwrap();
}
