//! Handoffs that are not crashes: a task whose worker is stopped with SIGTERM four times is
//! handed off and succeeds once, and a partition orphaned by an interrupted rebalance is
//! handed out again within seconds.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_integration_tests::cluster::Worker;
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{Outcomes, ids_of, publish_tasks, publish_to_partition, terrain_task};
use sluice_schemas::CompletionStatus;

use crate::scenario::{SERIAL, in_flight, stack, table, worker_with};

/// A graceful handoff is not a crash: a task held in its model call (`hold-run`) whose worker
/// is stopped with SIGTERM four times, with a grace shorter than the task
/// (`SLUICE_SHUTDOWN_GRACE_MS=1000`), and then run by a worker without the fault, succeeds,
/// once, and is never dead-lettered as `crashed` (SLUICE_MAX_CRASHES is 3: before, the fourth
/// start was refused as a crash loop).
#[tokio::test(flavor = "multi_thread")]
async fn a_task_whose_worker_is_stopped_four_times_is_handed_off_not_crashed() {
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("handoff", 1).unwrap();
    let seed = 88_001u64;
    let fault = format!("hold-run={seed}");
    let group = "chaos-handoff";
    let task = terrain_task(seed, 128, 128, 10);
    let id = task.0.clone();
    publish_tasks(&producer(stack.brokers()).unwrap(), &topics.tasks, std::slice::from_ref(&task))
        .await
        .unwrap();
    let held = [("SLUICE_TEST_FAULTS", fault.as_str()), ("SLUICE_SHUTDOWN_GRACE_MS", "1000")];
    for stop in 1..=4 {
        let mut w = worker_with(stack, "handoff-0", group, &topics, &held).await;
        w.wait_assigned(Duration::from_secs(60)).await.unwrap();
        in_flight(&w, 1.0).await;
        // Into its model call, its start recorded.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let t = Instant::now();
        w.service.terminate(Duration::from_secs(30)).unwrap();
        eprintln!("stop {stop}: SIGTERM, exited in {:.1} s", t.elapsed().as_secs_f64());
    }
    let mut w = worker_with(stack, "handoff-0", group, &topics, &[]).await;
    let done = Outcomes::wait(stack.brokers(), &topics, &BTreeSet::from([id.clone()]), Duration::from_secs(120)).unwrap();
    let completions = &done.completions[&id];
    table(
        "one task held in its model call, its worker stopped with SIGTERM 4 times (grace 1 s)",
        &[
            ("completions", completions.len().to_string()),
            ("status", format!("{:?}", completions[0].status)),
            ("DLQ reason", format!("{:?}", done.dlq_reason(&id))),
        ],
    );
    assert_eq!(completions.len(), 1, "{completions:?}");
    assert_eq!(completions[0].status, CompletionStatus::Succeeded, "{completions:?}");
    assert_eq!(done.dlq_reason(&id), None);
    w.service.terminate(Duration::from_secs(30)).unwrap();
}

/// The group's state and member count, as the coordinator describes it.
fn group_state(brokers: &str, group: &str) -> Option<(String, usize)> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let admin: BaseConsumer = rdkafka::ClientConfig::new().set("bootstrap.servers", brokers).create().ok()?;
    let list = admin.fetch_group_list(Some(group), Duration::from_secs(5)).ok()?;
    let info = list.groups().iter().find(|g| g.name() == group)?;
    Some((info.state().to_owned(), info.members().len()))
}

/// Orphaned partitions are handed out within seconds. The fault: a static member restarted
/// between the two phases of an incremental rebalance (killed while it drained the partitions it
/// gave up) rejoins a stable group under its old identity and gets its cached assignment back
/// without a rebalance; the second phase never comes, and what it gave up is owned by nobody
/// (seen in a kill -9 loop; made certain here: the member restarted is not the group's leader —
/// a leader's rejoin does rebalance — and its drain is long, held by tasks that never finish).
/// With the repair off the partitions stay orphaned; a worker with it on (the default) notices
/// and makes the group rebalance; every task then completes once.
#[tokio::test(flavor = "multi_thread")]
async fn an_orphaned_partition_is_handed_out_within_seconds() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    if std::env::var("SLUICE_CHAOS_GROUP_PROTOCOL").is_ok_and(|p| p == "consumer") {
        eprintln!("classic protocol only: under KIP-848 the broker assigns");
        return;
    }
    let _serial = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("orphans", 4).unwrap();
    let group = "chaos-orphans";
    let decoy_topic = "chaos-orphans-decoy";
    sluice_integration_tests::kafka::create_topics(stack.brokers(), &[(decoy_topic, 1)]).unwrap();

    // The leader: the first member, subscribed to another topic, so it owns none of the tasks.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let leader = {
        let (brokers, stop) = (stack.brokers().to_owned(), stop.clone());
        std::thread::spawn(move || {
            let consumer: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", group)
                .set("client.id", "orphans-leader")
                .set("partition.assignment.strategy", "cooperative-sticky")
                .set("enable.auto.commit", "false")
                .create()
                .unwrap();
            consumer.subscribe(&[decoy_topic]).unwrap();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = consumer.poll(Duration::from_millis(100));
            }
        })
    };
    sluice_integration_tests::wait_for("the leader in the group", Duration::from_secs(30), async || {
        group_state(stack.brokers(), group).filter(|(s, n)| s == "Stable" && *n == 1)
    })
    .await
    .unwrap();

    let held: Vec<(String, Value)> = (0..4).map(|i| terrain_task(99_000 + i, 128, 128, 10)).collect();
    let fault = held
        .iter()
        .map(|(_, r)| format!("hold-run={}", r["request"]["seed"]))
        .collect::<Vec<_>>()
        .join(",");
    // A 30 s session: the restarted member rejoins well inside it, so its old self is never
    // expired (which would rebalance the group and hide the fault).
    let common = [
        ("SLUICE_KAFKA_OPTIONS", "session.timeout.ms=30000"),
        ("SLUICE_REPAIR_ORPHANS", "false"),
    ];
    let held_a = [
        ("SLUICE_GROUP_INSTANCE_ID", "orphans-a"),
        ("SLUICE_TEST_FAULTS", fault.as_str()),
        ("SLUICE_DRAIN_TIMEOUT_MS", "30000"),
    ];
    let mut a = worker_with(stack, "orphans-a", group, &topics, &[&common[..], &held_a].concat()).await;
    a.wait_assigned(Duration::from_secs(60)).await.unwrap();
    let kafka = producer(stack.brokers()).unwrap();
    for (p, task) in held.iter().enumerate() {
        publish_to_partition(&kafka, &topics.tasks, p as i32, task).await.unwrap();
    }
    in_flight(&a, 4.0).await;

    // B joins: A gives up half of the partitions and drains them, which never ends.
    let mut b = worker_with(
        stack,
        "orphans-b",
        group,
        &topics,
        &[&common[..], &[("SLUICE_GROUP_INSTANCE_ID", "orphans-b")]].concat(),
    )
    .await;
    sluice_integration_tests::wait_for("the first phase", Duration::from_secs(60), async || {
        group_state(stack.brokers(), group).filter(|(s, n)| s == "Stable" && *n == 3)
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    a.service.kill9();
    let a = worker_with(
        stack,
        "orphans-a",
        group,
        &topics,
        &[&common[..], &[("SLUICE_GROUP_INSTANCE_ID", "orphans-a")]].concat(),
    )
    .await;
    let owned = async |a: &Worker, b: &Worker| -> f64 {
        a.metric("sluice_worker_assigned_partitions").await.unwrap_or(0.0)
            + b.metric("sluice_worker_assigned_partitions").await.unwrap_or(0.0)
    };
    // Orphaned: for 20 s the two workers own fewer than the 4 partitions, the group stable.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut orphaned_samples = Vec::new();
    for _ in 0..20 {
        orphaned_samples.push((owned(&a, &b).await, group_state(stack.brokers(), group)));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let reproduced = orphaned_samples
        .iter()
        .all(|(n, g)| *n < 4.0 && g.as_ref().is_some_and(|(s, _)| s == "Stable"));

    // B restarted with the repair on (the default): its cached assignment comes back, then it
    // notices what nobody owns.
    b.service.kill9();
    let restarted = Instant::now();
    let b = worker_with(
        stack,
        "orphans-b",
        group,
        &topics,
        &[
            ("SLUICE_GROUP_INSTANCE_ID", "orphans-b"),
            ("SLUICE_KAFKA_OPTIONS", "session.timeout.ms=30000"),
        ],
    )
    .await;
    let repaired = sluice_integration_tests::wait_for("every partition owned", Duration::from_secs(90), async || {
        (owned(&a, &b).await >= 4.0).then_some(restarted.elapsed())
    })
    .await;
    let repairs = b.metric("sluice_worker_rebalances_total{kind=\"orphans\"}").await.unwrap_or(0.0);
    let done = Outcomes::wait(stack.brokers(), &topics, &ids_of(&held), Duration::from_secs(120));
    table(
        "orphaned partitions: a static member restarted between the two phases of an incremental rebalance",
        &[
            (
                "owned of 4, repair off, 20 s",
                format!("{:?}", orphaned_samples.iter().map(|(n, _)| *n).collect::<Vec<_>>()),
            ),
            ("orphaned with the group stable", reproduced.to_string()),
            (
                "every partition owned again, after the repairing worker started",
                format!("{:?}", repaired.as_ref().ok()),
            ),
            ("rebalances made for orphans", repairs.to_string()),
        ],
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    leader.join().unwrap();
    assert!(reproduced, "the fault was not reproduced: {orphaned_samples:?}");
    let repaired = repaired.expect("the orphaned partitions were handed out");
    assert!(repaired < Duration::from_secs(45), "repaired after {repaired:?}");
    assert!(repairs >= 1.0, "the restarted worker made the group rebalance");
    let done = done.unwrap();
    for (id, _) in &held {
        assert_eq!(done.completions[id].len(), 1, "{id}: {:?}", done.completions[id]);
        assert_eq!(done.completions[id][0].status, CompletionStatus::Succeeded, "{id}");
    }
    for mut w in [a, b] {
        w.service.terminate(Duration::from_secs(30)).unwrap();
    }
}
