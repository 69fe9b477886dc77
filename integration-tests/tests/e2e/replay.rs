//! Replay through `sluice-producer`: a replayed range re-announces finished tasks with the same
//! results instead of running them again.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;
use sluice_integration_tests::cluster::{Worker, producer_cli};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{Outcomes, ids_of, publish_tasks, terrain_task};
use sluice_schemas::{CompletionStatus, HEADER_ORIGIN};

use crate::stacks::{all_records, replay_stack};

#[tokio::test(flavor = "multi_thread")]
async fn replay_by_time_reannounces_finished_tasks_without_running_them_again() {
    let stack = replay_stack().await;
    let topics = stack.topics("replay", 2).unwrap();
    let worker = Worker::on_topics(stack, "replayer", "replay", &topics, &[]).await.unwrap();
    let kafka = producer(stack.brokers()).unwrap();
    let early: Vec<_> = (0..2).map(|i| terrain_task(40 + i, 128, 128, 50)).collect();
    publish_tasks(&kafka, &topics.tasks, &early).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let since = chrono::Utc::now();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut late: Vec<_> = (0..4).map(|i| terrain_task(50 + i, 128, 128, 60)).collect();
    for (_, record) in late.iter_mut().take(2) {
        record["tenant"] = "globex".into();
    }
    publish_tasks(&kafka, &topics.tasks, &late).await.unwrap();
    let all = ids_of(&[early.clone(), late.clone()].concat());
    let first = Outcomes::wait(stack.brokers(), &topics, &all, Duration::from_secs(180)).unwrap();
    assert_eq!(first.with_status(CompletionStatus::Succeeded), all);
    let skipped_before = worker.metric("sluice_worker_duplicates_skipped_total").await.unwrap_or(0.0);

    // Replay the tenant globex tasks submitted after `since`.
    let since = since.to_rfc3339();
    let out = producer_cli(
        stack,
        &[
            "replay",
            "--no-progress",
            "--tasks-topic",
            &topics.tasks,
            "--since",
            &since,
            "--tenant",
            "globex",
        ],
    )
    .unwrap();
    let summary: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (&summary["read"], &summary["written"], &summary["filtered"]),
        (&4.into(), &2.into(), &2.into()),
        "{summary}"
    );
    // Before `since`: the two early tasks only (the broker's time lookup ends the range).
    let out = producer_cli(
        stack,
        &[
            "replay",
            "--no-progress",
            "--dry-run",
            "--tasks-topic",
            &topics.tasks,
            "--until",
            &since,
        ],
    )
    .unwrap();
    let summary: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!((&summary["read"], &summary["written"]), (&2.into(), &2.into()), "{summary}");
    let replayed: BTreeSet<String> = late.iter().take(2).map(|(id, _)| id.clone()).collect();
    let again = Outcomes::wait_settled(stack.brokers(), &topics, &replayed, Duration::from_secs(120), |cs| cs.len() >= 2).unwrap();
    // The same results announced again, not new ones: same objects, same bytes, not run again.
    for id in &replayed {
        let cs = &again.completions[id];
        assert_eq!(cs.len(), 2, "{cs:?}");
        assert_eq!(cs[0].outputs, cs[1].outputs, "same objects and digests");
        assert_eq!(cs[1].status, CompletionStatus::Succeeded);
    }
    let skipped = worker.metric("sluice_worker_duplicates_skipped_total").await.unwrap_or(0.0);
    assert_eq!(skipped - skipped_before, 2.0, "both were found finished, not run again");
    // Nothing else was replayed: only the two are on the tasks topic twice.
    let marked: BTreeSet<String> = all_records(stack, &topics.tasks)
        .iter()
        .filter(|r| r.header(HEADER_ORIGIN).is_some_and(|o| o.starts_with("replay:")))
        .map(|r| r.json()["task_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(marked, replayed);
}
