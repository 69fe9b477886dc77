//! Replay and redrive through `sluice-producer`, on the real broker: DLQ records go back to the
//! tasks topic once each, only for the reasons asked, and complete; a replayed range
//! re-announces finished tasks with the same results instead of running them again.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;
use sluice_integration_tests::cluster::{Worker, producer_cli};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::stack::repo_root;
use sluice_integration_tests::{Outcomes, Stack, TopicReader, ids_of, produce_raw, publish_tasks, sd_task, terrain_task};
use sluice_schemas::{CompletionStatus, HEADER_ORIGIN};
use tokio::sync::OnceCell;

static STACK: OnceCell<Stack> = OnceCell::const_new();

async fn stack() -> &'static Stack {
    STACK.get_or_init(|| async { Stack::start("replay").expect("stack starts") }).await
}

/// Every record of `topic` there is now.
fn all_records(stack: &Stack, topic: &str) -> Vec<sluice_integration_tests::Consumed> {
    TopicReader::snapshot(stack.brokers(), topic, Duration::from_secs(3)).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn redrive_sends_the_chosen_dlq_records_back_once_and_they_complete() {
    let stack = stack().await;
    let topics = stack.topics("redrive", 2).unwrap();
    // Under a 400 MB arena one 512×512 image of the tiny SD model does not fit even alone, on a
    // clean arena (one row: nothing to cut in parts): resource_exhausted.
    let catalog = repo_root().join("deploy/models.demo.toml").display().to_string();
    let models = [("SLUICE_MODEL_CATALOG", catalog.as_str()), ("SLUICE_MODELS", "terrain,sd-tiny")];
    let mut capped = Worker::on_topics(
        stack,
        "redrive-capped",
        "redrive",
        &topics,
        &[
            models[0],
            models[1],
            ("SLUICE_ORT_CPU_ARENA_MAX_BYTES", "400000000"),
            ("SLUICE_MAX_BATCH", "1"),
        ],
    )
    .await
    .unwrap();
    let kafka = producer(stack.brokers()).unwrap();
    let too_big: Vec<_> = (0..3).map(|i| sd_task(i, 512, 2, 1)).collect();
    let fine: Vec<_> = (0..2).map(|i| terrain_task(10 + i, 128, 128, 30)).collect();
    publish_tasks(&kafka, &topics.tasks, &too_big).await.unwrap();
    publish_tasks(&kafka, &topics.tasks, &fine).await.unwrap();
    for i in 0..2 {
        produce_raw(&kafka, &topics.tasks, Some(format!("junk-{i}").as_bytes()), b"not json", &[])
            .await
            .unwrap();
    }
    let ids = ids_of(&[too_big.clone(), fine.clone()].concat());
    let first = Outcomes::wait(stack.brokers(), &topics, &ids, Duration::from_secs(180)).unwrap();
    for (id, _) in &too_big {
        assert_eq!(first.dlq_reason(id), Some("resource_exhausted"));
    }
    capped.service.terminate(Duration::from_secs(30)).unwrap();

    // The DLQ now holds 3 resource_exhausted and 2 malformed records. A DLQ publish that was
    // delivered twice leaves a copy: add one.
    let dlq = tokio::task::block_in_place(|| {
        let mut reader = TopicReader::new(stack.brokers(), &topics.dlq).unwrap();
        reader.read_until(Duration::from_secs(60), |r| r.len() >= 5).unwrap();
        reader.records.clone()
    });
    let copy = dlq.iter().find(|r| r.json()["reason"] == "resource_exhausted").unwrap();
    produce_raw(&kafka, &topics.dlq, copy.key.as_deref(), &copy.value, &[])
        .await
        .unwrap();

    // A worker with room for them.
    let mut roomy = Worker::on_topics(stack, "redrive-roomy", "redrive", &topics, &models)
        .await
        .unwrap();
    let args = |dry: bool| {
        let mut a = vec![
            "redrive",
            "--no-progress",
            "--dlq-topic",
            &topics.dlq,
            "--tasks-topic",
            &topics.tasks,
            "--reason",
            "resource_exhausted,retries_exhausted",
        ];
        if dry {
            a.push("--dry-run");
        }
        a.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = |dry: bool| -> Value {
        let a = args(dry);
        let out = producer_cli(stack, &a.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        serde_json::from_str(out.trim()).unwrap()
    };
    let dry = run(true);
    assert_eq!(
        (&dry["read"], &dry["written"], &dry["filtered"], &dry["duplicates"], &dry["dry_run"]),
        (&6.into(), &3.into(), &2.into(), &1.into(), &true.into()),
        "{dry}"
    );
    let real = run(false);
    assert_eq!(
        (&real["written"], &real["filtered"], &real["duplicates"]),
        (&3.into(), &2.into(), &1.into()),
        "{real}"
    );

    // Exactly three records came back (the dry run wrote none; the copy was skipped), byte for
    // byte, marked with their origin and their next attempt.
    let tasks = all_records(stack, &topics.tasks);
    let redriven: Vec<_> = tasks.iter().filter(|r| r.header(HEADER_ORIGIN).is_some()).collect();
    assert_eq!(redriven.len(), 3);
    for r in &redriven {
        assert!(r.header(HEADER_ORIGIN).unwrap().starts_with(&format!("redrive:{}:", topics.dlq)));
        assert_eq!(r.header("sluice-attempt").as_deref(), Some("2"));
        let id = r.json()["task_id"].as_str().unwrap().to_owned();
        let original = too_big.iter().find(|(t, _)| *t == id).expect("one of ours");
        assert_eq!(r.value, serde_json::to_vec(&original.1).unwrap());
        assert_eq!(r.key.as_deref(), Some(id.as_bytes()));
    }

    // And they complete this time.
    let again = Outcomes::wait_settled(stack.brokers(), &topics, &ids_of(&too_big), Duration::from_secs(180), |cs| {
        cs.iter().any(|c| c.status == CompletionStatus::Succeeded)
    })
    .unwrap();
    for (id, _) in &too_big {
        let ok = again.completions[id]
            .iter()
            .find(|c| c.status == CompletionStatus::Succeeded)
            .unwrap();
        assert_eq!(ok.attempt, 2, "{ok:?}");
    }
    roomy.service.terminate(Duration::from_secs(30)).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_by_time_reannounces_finished_tasks_without_running_them_again() {
    let stack = stack().await;
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
