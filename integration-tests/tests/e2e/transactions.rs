//! Exactly-once transactions under a trickle of tasks: the first task to finish after a quiet
//! spell is announced at once, and the tasks finishing after it wait for the end of
//! `SLUICE_TRANSACTION_INTERVAL_MS` and share a transaction, instead of one transaction each;
//! an interactive task does not wait for it. And the transactional producer aborts at once with
//! records still queued.

use std::time::Duration;

use rdkafka::producer::FutureProducer;
use sluice_integration_tests::cluster::Worker;
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{Outcomes, Stack, Topics, ids_of, publish_tasks, terrain_task};
use sluice_schemas::CompletionStatus;

use crate::stacks::replay_stack;

/// How far apart the worker's transactions begin, at least.
const INTERVAL: Duration = Duration::from_secs(10);

/// What "at once" means here: well inside the interval, with room for a loaded machine.
const AT_ONCE: Duration = Duration::from_secs(5);

/// Transactions of the worker so far (each is timed in `sluice_worker_commit_seconds`).
async fn transactions(worker: &Worker) -> f64 {
    worker.metric("sluice_worker_commit_seconds_count").await.unwrap_or(0.0)
}

/// Sends `tasks` with `kafka` and asserts that their outcomes are visible `read_committed` within
/// [`AT_ONCE`]: their transaction did not wait for the interval.
async fn seen_at_once(stack: &Stack, kafka: &FutureProducer, topics: &Topics, tasks: &[(String, serde_json::Value)], what: &str) {
    publish_tasks(kafka, &topics.tasks, tasks).await.unwrap();
    let sent = std::time::Instant::now();
    let seen = tokio::task::block_in_place(|| Outcomes::wait(stack.brokers(), topics, &ids_of(tasks), AT_ONCE));
    println!("{what} seen {:?} after its send", sent.elapsed());
    assert!(
        seen.is_ok(),
        "{what} waited for the interval: not visible within {AT_ONCE:?}: {seen:?}"
    );
}

/// On one partition whose read lease is committed: a task after a quiet spell is visible
/// `read_committed` well inside the interval; 20 tasks sent one every 100 ms after it all
/// complete, once each, in at most two more transactions (back to back, about one each); an
/// interactive task right after them is visible well inside the interval.
#[tokio::test(flavor = "multi_thread")]
async fn under_load_a_transaction_carries_what_finished_in_its_interval() {
    let stack = replay_stack().await;
    let topics = stack.topics("txn-interval", 1).unwrap();
    let models = stack.tiny_models().unwrap().display().to_string();
    let interval = INTERVAL.as_millis().to_string();
    let mut worker = Worker::on_topics(
        stack,
        "txn-interval",
        "txn-interval",
        &topics,
        &[
            ("SLUICE_MODEL_DIR", models.as_str()),
            ("SLUICE_TRANSACTION_INTERVAL_MS", interval.as_str()),
        ],
    )
    .await
    .unwrap();
    worker.wait_assigned(Duration::from_secs(60)).await.unwrap();
    // A first task: the partition's read lease is committed before it runs (at once, as work
    // waits on it), and its outcome waits for the end of that transaction's interval.
    let kafka = producer(stack.brokers()).unwrap();
    let warm = vec![terrain_task(60_999, 128, 128, 10)];
    publish_tasks(&kafka, &topics.tasks, &warm).await.unwrap();
    tokio::task::block_in_place(|| Outcomes::wait(stack.brokers(), &topics, &ids_of(&warm), Duration::from_secs(120))).unwrap();
    // A quiet spell longer than the interval.
    tokio::time::sleep(INTERVAL + Duration::from_secs(1)).await;
    let before = transactions(&worker).await;

    let first = vec![terrain_task(61_000, 128, 128, 10)];
    seen_at_once(stack, &kafka, &topics, &first, "the first task after a quiet spell").await;

    let trickle: Vec<_> = (0..20).map(|i| terrain_task(61_001 + i, 128, 128, 10)).collect();
    for task in &trickle {
        publish_tasks(&kafka, &topics.tasks, std::slice::from_ref(task)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all = ids_of(&[first, trickle].concat());
    let done = tokio::task::block_in_place(|| Outcomes::wait(stack.brokers(), &topics, &all, Duration::from_secs(120))).unwrap();
    assert_eq!(done.with_status(CompletionStatus::Succeeded), all);
    assert!(done.completions.values().all(|cs| cs.len() == 1), "each announced once");
    // The count moves once the commit has returned, a moment after its records became visible.
    let counted = sluice_integration_tests::wait_for("the second transaction counted", Duration::from_secs(10), async || {
        Some(transactions(&worker).await - before).filter(|n| *n >= 2.0)
    })
    .await;
    let made = match counted {
        Ok(made) => made,
        Err(_) => transactions(&worker).await - before,
    };
    assert!(
        (2.0..=3.0).contains(&made),
        "21 tasks over ~2 s made {made} transactions; with an interval of {INTERVAL:?}: the first at once, then one (or two) for the rest"
    );

    // Just after a transaction (the trickle's, a moment ago), an interactive task: its
    // announcement begins a transaction of its own at once, where a standard task's would wait
    // for the end of the interval (as the trickle's did).
    let mut interactive = terrain_task(62_000, 128, 128, 10);
    interactive.1["priority"] = serde_json::json!("interactive");
    seen_at_once(stack, &kafka, &topics, &[interactive], "an interactive task").await;
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

/// The committer's transactional producer has no polling thread (`sluice_service::
/// transaction_producer`), and librdkafka's abort waits for the reports of the records it
/// purges to be served: an abort with records still queued (a long linger keeps them so)
/// returns at once, not at its timeout, and the producer's next transaction commits (its record
/// waits out the linger too) and is the only one a reader sees.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_aborted_with_records_still_queued_aborts_at_once() {
    use rdkafka::config::ClientConfig;
    use rdkafka::message::OwnedHeaders;
    use sluice_integration_tests::TopicReader;
    use sluice_service::transaction_producer::TransactionProducer;

    let stack = replay_stack().await;
    let topics = stack.topics("txn-abort", 1).unwrap();
    let brokers = stack.brokers().to_owned();
    let topic = topics.completions.clone();
    let aborted_in = tokio::task::spawn_blocking(move || {
        let producer = TransactionProducer::create(
            ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("transactional.id", "e2e-txn-abort")
                .set("linger.ms", "5000"),
        )
        .unwrap();
        producer.init_transactions(Duration::from_secs(30)).unwrap();
        let none = OwnedHeaders::new();
        producer.begin_transaction().unwrap();
        for i in 0..3 {
            producer.send(&topic, None, format!("aborted {i}").as_bytes(), &none).unwrap();
        }
        let began = std::time::Instant::now();
        producer.abort_transaction(Duration::from_secs(20)).unwrap();
        let aborted_in = began.elapsed();
        producer.begin_transaction().unwrap();
        producer.send(&topic, None, b"committed", &none).unwrap();
        producer.delivered(Duration::from_secs(30)).unwrap();
        producer.commit_transaction(Duration::from_secs(10)).unwrap();
        aborted_in
    })
    .await
    .unwrap();
    println!("aborted with 3 records queued in {aborted_in:?}");
    assert!(aborted_in < Duration::from_secs(4), "the abort waited {aborted_in:?}");
    let seen = TopicReader::snapshot(stack.brokers(), &topics.completions, Duration::from_secs(3)).unwrap();
    let values: Vec<&[u8]> = seen.iter().map(|r| r.value.as_slice()).collect();
    assert_eq!(values, [b"committed".as_slice()]);
}
