//! The dead-letter queue: malformed records and tasks whose model code panics go to the DLQ
//! with their reason while the tasks around them complete, and redrive sends the chosen
//! records back once, as a new attempt.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use sluice_integration_tests::cluster::{API_KEY, Cluster, Worker, http_get, producer_cli};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::receiver::{Received, Receiver};
use sluice_integration_tests::stack::repo_root;
use sluice_integration_tests::{
    Consumed, Outcomes, TopicReader, Topics, completions_for, ids_of, produce_raw, publish_tasks, sd_task, terrain_task,
};
use sluice_schemas::{CompletionEvent, CompletionStatus, DlqRecord, HEADER_ORIGIN, topics};

use crate::stacks::{WEBHOOK_KEY, all_records, replay_stack, terrain_cluster};

#[tokio::test(flavor = "multi_thread")]
async fn malformed_records_go_to_the_dlq_and_the_tasks_around_them_complete() {
    let c = terrain_cluster().await;
    let kafka = producer(c.stack.brokers()).unwrap();
    let task = |difficulty: u32| terrain_task(5, 128, 128, difficulty);
    let (good_before, before) = task(20);
    let (good_after, after) = task(80);
    let (bad_id, mut out_of_bounds) = task(30);
    out_of_bounds["request"]["width"] = json!(1_000_000);
    let (unknown_model_id, mut unknown_model) = task(30);
    unknown_model["model"] = json!("stable-diffusion-9");
    let (_, mut malformed_model) = task(30);
    malformed_model["model"] = json!("not a model name!");
    let (_, mut v7) = task(30);
    v7["version"] = json!(7);
    let (_, mut missing) = task(30);
    missing.as_object_mut().unwrap().remove("request");
    let (_, mut wrong_types) = task(30);
    wrong_types["request"]["seed"] = json!("seven");
    // Valid by the schema, over the catalog's bounds of one task's work (29,768 tiles): it
    // reaches the topic without the producer and must not reach the model.
    let (_, mut oversized) = terrain_task(5, 2048, 2048, 30);
    oversized["request"]["num_images"] = json!(8);
    oversized["request"]["params"]["tile_overlap"] = json!(96);
    let bytes = |v: &Value| serde_json::to_vec(v).unwrap();

    // (value, header version, expected reason, key)
    let cases: Vec<(Vec<u8>, Option<&[u8]>, &str)> = vec![
        (vec![0xff, 0xfe, 0xfd, b'{'], None, "malformed"),
        (b"this is not json".to_vec(), None, "malformed"),
        (b"[1, 2, 3]".to_vec(), None, "malformed"),
        (bytes(&before), Some(b"2"), "unsupported_version"),
        (bytes(&v7), None, "unsupported_version"),
        (bytes(&missing), None, "schema_violation"),
        (bytes(&wrong_types), None, "schema_violation"),
        (bytes(&out_of_bounds), None, "schema_violation"),
        (bytes(&oversized), None, "schema_violation"),
        // Model names are the catalog's: a well-formed name this worker does not serve is
        // unsupported; a name no catalog can hold is a schema violation.
        (bytes(&unknown_model), None, "unsupported_model"),
        (bytes(&malformed_model), None, "schema_violation"),
    ];
    produce_raw(
        &kafka,
        topics::TASKS,
        Some(good_before.as_bytes()),
        &bytes(&before),
        &[("sluice-schema-version", b"1")],
    )
    .await
    .unwrap();
    let mut expected = HashMap::new();
    for (i, (value, version, reason)) in cases.iter().enumerate() {
        let key = format!("bad-{i}-{}", uuid::Uuid::new_v4());
        let headers: Vec<(&str, &[u8])> = version.map(|v| vec![("sluice-schema-version", v)]).unwrap_or_default();
        produce_raw(&kafka, topics::TASKS, Some(key.as_bytes()), value, &headers)
            .await
            .unwrap();
        expected.insert(key, (value.clone(), *reason));
    }
    produce_raw(&kafka, topics::TASKS, Some(good_after.as_bytes()), &bytes(&after), &[])
        .await
        .unwrap();

    // Every malformed record is on the DLQ, byte for byte, with its reason as field and header.
    let mut dlq = TopicReader::new(c.stack.brokers(), topics::DLQ).unwrap();
    let ours = |r: &Consumed| {
        r.key
            .as_ref()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .filter(|k| expected.contains_key(k))
    };
    tokio::task::block_in_place(|| dlq.read_until(Duration::from_secs(60), |rs| rs.iter().filter_map(ours).count() >= expected.len()))
        .unwrap();
    for record in dlq.records.iter().filter(|r| ours(r).is_some()) {
        let key = ours(record).unwrap();
        let (value, reason) = &expected[&key];
        let parsed: DlqRecord = serde_json::from_slice(&record.value).expect("DLQ record matches its type");
        sluice_schemas::validate(sluice_schemas::RecordKind::Dlq, &record.json()).expect("DLQ record matches its schema");
        assert_eq!(parsed.reason.as_str(), *reason, "{key}: {}", parsed.message);
        assert_eq!(&parsed.original.value().unwrap(), value, "original bytes kept");
        assert_eq!(
            base64::engine::general_purpose::STANDARD
                .decode(parsed.original.key_base64.unwrap())
                .unwrap(),
            key.as_bytes()
        );
        assert_eq!(record.header("sluice-dlq-reason").as_deref(), Some(*reason));
        for header in [
            "sluice-dlq-message",
            "sluice-dlq-attempts",
            "sluice-dlq-source-topic",
            "sluice-dlq-source-partition",
            "sluice-dlq-source-offset",
            "sluice-dlq-first-failed-at",
            "sluice-dlq-last-failed-at",
        ] {
            assert!(record.header(header).is_some(), "{key}: header {header}");
        }
        assert_eq!(record.header("sluice-dlq-source-offset").unwrap(), parsed.source.offset.to_string());
        assert!(!parsed.message.is_empty());
    }
    // The out-of-bounds record names its field.
    let oob = dlq
        .records
        .iter()
        .filter_map(|r| serde_json::from_slice::<DlqRecord>(&r.value).ok())
        .find(|d| d.task_id.map(|t| t.to_string()) == Some(bad_id.clone()))
        .unwrap();
    assert!(oob.message.contains("request.width"), "{}", oob.message);

    // The valid tasks around them complete (the `good_before` task id also has the failed
    // completion of its copy with schema version header 2), and the failures with a task id
    // are announced.
    let succeeded = |cs: &[CompletionEvent]| cs.iter().any(|c| c.status == CompletionStatus::Succeeded);
    let good = Outcomes::wait_settled(
        c.stack.brokers(),
        &Topics::default(),
        &BTreeSet::from([good_before.clone(), good_after.clone()]),
        Duration::from_secs(60),
        succeeded,
    )
    .unwrap();
    assert!(succeeded(&good.completions[&good_before]));
    assert!(succeeded(&good.completions[&good_after]));
    let done = completions_for(
        c.stack.brokers(),
        &BTreeSet::from([bad_id.clone(), unknown_model_id.clone()]),
        Duration::from_secs(60),
    );
    assert_eq!(done[&bad_id].status, CompletionStatus::Failed);
    assert_eq!(done[&bad_id].error.as_ref().unwrap().reason.as_str(), "schema_violation");
    assert_eq!(done[&unknown_model_id].status, CompletionStatus::Failed);
}

/// A panic in model code fails its task and nothing else: a worker whose model code panics on
/// chosen tasks (`SLUICE_TEST_FAULTS`: preparing one, the batch call holding another, rendering
/// a third) completes every other task of their batches, dead-letters the three as
/// `model_error` with the panic message, commits past them and stays ready; a restarted worker
/// does not read them again.
#[tokio::test(flavor = "multi_thread")]
async fn a_panic_in_model_code_fails_its_task_and_the_partition_moves_on() {
    use sluice_integration_tests::cluster::Worker;
    use sluice_integration_tests::{ids_of, publish_tasks};

    let c = terrain_cluster().await;
    let stack = &c.stack;
    // One partition, so that "the committed offset moved past the poison records" is one number.
    let topics = stack.topics("panics", 1).unwrap();
    let models = stack.tiny_models().unwrap().display().to_string();
    let (prepare, run, render) = (9_001u64, 9_002u64, 9_003u64);
    let faults = format!("panic-prepare={prepare},panic-run={run},panic-render={render}");
    let env = [
        ("SLUICE_MODEL_DIR", models.as_str()),
        ("SLUICE_TEST_FAULTS", faults.as_str()),
        ("SLUICE_MAX_BATCH", "8"),
        // Long enough that the tasks published together run as one batch.
        ("SLUICE_MAX_WAIT_MS", "1000"),
    ];
    let mut worker = Worker::on_topics(stack, "panics-0", "e2e-panics", &topics, &env).await.unwrap();
    worker.wait_assigned(Duration::from_secs(60)).await.unwrap();
    let mut all: Vec<(String, Value)> = (0..9).map(|i| terrain_task(100 + i, 128, 128, 50)).collect();
    for (i, seed) in [(1, prepare), (4, run), (7, render)] {
        all[i] = terrain_task(seed, 128, 128, 50);
    }
    let kafka = producer(stack.brokers()).unwrap();
    publish_tasks(&kafka, &topics.tasks, &all).await.unwrap();
    let done = Outcomes::wait(stack.brokers(), &topics, &ids_of(&all), Duration::from_secs(120)).unwrap();
    let poisoned = [&all[1].0, &all[4].0, &all[7].0];
    for (id, _) in &all {
        let event = &done.completions[id][0];
        if poisoned.contains(&id) {
            assert_eq!(event.status, CompletionStatus::Failed, "{id}");
            assert_eq!(done.dlq_reason(id), Some("model_error"), "{id}");
            let message = &done.dlq[id][0].message;
            assert!(message.contains("panicked") && message.contains("injected fault"), "{message}");
        } else {
            assert_eq!(event.status, CompletionStatus::Succeeded, "{id}: {event:?}");
        }
    }
    // The worker is still up and ready, and its offset moved past every record.
    assert!(worker.service.running());
    assert!(http_get(&format!("{}/readyz", worker.url)).await.status().is_success());
    let committed = sluice_integration_tests::wait_for("the commit past the last record", Duration::from_secs(30), async || {
        sluice_integration_tests::kafka::committed(stack.brokers(), "e2e-panics", &topics.tasks, 0).filter(|o| *o == 9)
    })
    .await
    .unwrap();
    assert_eq!(committed, 9);
    // A restarted worker starts after them: the poison records are not read again, and new
    // tasks run.
    worker.service.terminate(Duration::from_secs(30)).unwrap();
    worker.restart(stack).await.unwrap();
    let after = vec![terrain_task(200, 128, 128, 50)];
    publish_tasks(&kafka, &topics.tasks, &after).await.unwrap();
    let later = Outcomes::wait(stack.brokers(), &topics, &ids_of(&after), Duration::from_secs(120)).unwrap();
    assert_eq!(later.completions[&after[0].0][0].status, CompletionStatus::Succeeded);
    let metrics = worker.metrics().await.unwrap();
    assert_eq!(
        sluice_integration_tests::cluster::metric_value(&metrics, "sluice_worker_tasks_received_total"),
        Some(1.0),
        "the restarted worker read only the new task"
    );
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn redrive_sends_the_chosen_dlq_records_back_once_and_they_complete() {
    let stack = replay_stack().await;
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

/// A redriven task shows its new attempt: a task that failed (model code panicked on it) and is
/// redriven is `queued` again as attempt 2, with the old error gone, and can be cancelled; its
/// end is attempt 2's (before, the view kept showing attempt 1's `failed`, and a cancel was a
/// 409). Its two `completed` webhooks carry different `webhook-id`s (before, the second reused
/// the first's, and a receiver deduplicating by id dropped it).
#[tokio::test(flavor = "multi_thread")]
async fn a_redriven_task_shows_its_new_attempt_and_can_be_cancelled() {
    let (receiver, base) = Receiver::start().await;
    let secret = format!("acme:whsec_{}", base64::engine::general_purpose::STANDARD.encode(WEBHOOK_KEY));
    let mut c = Cluster::start_with(
        "redrive-view",
        1,
        &[("SLUICE_TEST_FAULTS", "panic-run=4242")],
        &[
            ("SLUICE_WEBHOOK_SECRETS", secret.as_str()),
            ("SLUICE_WEBHOOK_ALLOW_CIDRS", "127.0.0.0/8"),
        ],
    )
    .await
    .expect("cluster starts");
    let completed = || -> Vec<Received> { receiver.all().into_iter().filter(|r| r.event == "completed").collect() };
    let (status, body) = c
        .post(
            &json!({"model": "terrain", "width": 64, "height": 64, "seed": 4242, "webhook": {"url": format!("{base}/hook/ok")}}),
            Some(API_KEY),
        )
        .await
        .unwrap();
    assert_eq!(status, 202, "{body}");
    let id = body["task_id"].as_str().unwrap().to_owned();
    let failed = c.wait_for_status(&id, API_KEY, "failed", Duration::from_secs(120)).await.unwrap();
    assert_eq!(
        (&failed["attempt"], &failed["error"]["reason"]),
        (&json!(1), &json!("model_error")),
        "{failed}"
    );
    // With no worker up, the redriven record waits on the topic.
    c.workers[0].service.terminate(Duration::from_secs(30)).unwrap();
    let out = sluice_integration_tests::cluster::producer_cli(&c.stack, &["redrive", "--no-progress", "--reason", "model_error"]).unwrap();
    let summary: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(summary["written"], 1, "{summary}");
    let queued = c.wait_for_status(&id, API_KEY, "queued", Duration::from_secs(30)).await.unwrap();
    assert_eq!(queued["attempt"], 2, "{queued}");
    assert!(queued["error"].is_null(), "the old error is not shown: {queued}");
    let cancel = sluice_service::http_client::client()
        .post(format!("{}/v1/tasks/{id}/cancel", c.producer_url))
        .bearer_auth(API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status().as_u16(), 202);
    c.workers[0].restart(&c.stack).await.unwrap();
    let cancelled = c.wait_for_status(&id, API_KEY, "cancelled", Duration::from_secs(60)).await.unwrap();
    assert_eq!(cancelled["attempt"], 2, "{cancelled}");
    let hooks = sluice_integration_tests::wait_for("both attempts' completed webhooks", Duration::from_secs(60), async || {
        let hooks = completed();
        (hooks.len() >= 2).then_some(hooks)
    })
    .await
    .unwrap();
    let statuses: Vec<_> = hooks
        .iter()
        .map(|h| (h.json()["status"].clone(), h.json()["attempt"].clone()))
        .collect();
    assert_eq!(
        statuses,
        [(json!("failed"), json!(1)), (json!("cancelled"), json!(2))],
        "{statuses:?}"
    );
    assert_ne!(hooks[0].id, hooks[1].id, "each attempt's completed event has its own webhook-id");
}
