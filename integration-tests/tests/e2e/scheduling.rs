//! Scheduling on a real worker: buckets take turns call by call and step by step, a diffusion
//! task joins a running batch of its bucket at the next step, and an interactive task goes
//! before queued batch work.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{Outcomes, terrain_task};
use sluice_schemas::CompletionStatus;

use crate::stacks::terrain_cluster;

/// Whether `record` (of the progress topic) says task `id` ran a step.
fn ran_a_step(record: &sluice_integration_tests::Consumed, id: &str) -> bool {
    record.key.as_deref() == Some(id.as_bytes())
        && serde_json::from_slice::<sluice_schemas::ProgressRecord>(&record.value).is_ok_and(|p| p.step >= 1)
}

/// When a succeeded task's calls ran, by its completion: from its turn at the device (sent at +
/// `queued_ms`) to their end (+ `inference_ms`).
fn call_span(done: &Outcomes, task: &(String, Value)) -> (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) {
    let event = &done.completions[&task.0][0];
    assert_eq!(event.status, CompletionStatus::Succeeded, "{}: {event:?}", task.0);
    let sent: chrono::DateTime<chrono::Utc> = task.1["submitted_at"].as_str().unwrap().parse().unwrap();
    let start = sent + chrono::Duration::milliseconds(event.timings.queued_ms as i64);
    (start, start + chrono::Duration::milliseconds(event.timings.inference_ms as i64))
}

/// Between buckets the engine takes turns call by call. Four large maps (each run as calls of
/// one tile), then single tiles, on one partition and one engine slot: every tile's call starts
/// before the second map's last call ends. (When a batch held its place until all its calls
/// had run, the tiles waited for three whole maps.) Start and end are the completion's: sent at
/// + queued_ms, + inference_ms (the map's calls and the turns of others between them).
#[tokio::test(flavor = "multi_thread")]
async fn short_tasks_of_another_bucket_take_turns_with_a_long_tasks_calls() {
    use sluice_integration_tests::cluster::Worker;
    use sluice_integration_tests::{ids_of, publish_tasks};

    let c = terrain_cluster().await;
    let stack = &c.stack;
    let topics = stack.topics("turns", 1).unwrap();
    let models = stack.tiny_models().unwrap().display().to_string();
    let env = [
        ("SLUICE_MODEL_DIR", models.as_str()),
        ("SLUICE_ENGINE_SLOTS", "1"),
        ("SLUICE_MAX_BATCH_ROWS", "1"),
        ("SLUICE_MAX_WAIT_MS", "5"),
    ];
    let mut worker = Worker::on_topics(stack, "turns-0", "e2e-turns", &topics, &env).await.unwrap();
    worker.wait_assigned(Duration::from_secs(60)).await.unwrap();
    // 2048² is 441 tiles: 441 calls a map.
    let maps: Vec<(String, Value)> = (0..4).map(|i| terrain_task(300 + i, 2048, 2048, 50)).collect();
    let tiles: Vec<(String, Value)> = (0..6).map(|i| terrain_task(400 + i, 128, 128, 50)).collect();
    let all: Vec<(String, Value)> = maps.iter().chain(&tiles).cloned().collect();
    let kafka = producer(stack.brokers()).unwrap();
    publish_tasks(&kafka, &topics.tasks, &all).await.unwrap();
    let done = Outcomes::wait(stack.brokers(), &topics, &ids_of(&all), Duration::from_secs(180)).unwrap();
    let calls = |task: &(String, Value)| call_span(&done, task);
    let mut map_ends: Vec<_> = maps.iter().map(|m| calls(m).1).collect();
    map_ends.sort();
    let tile_starts: Vec<_> = tiles.iter().map(|t| calls(t).0).collect();
    let maps: Vec<_> = maps.iter().map(calls).collect();
    assert!(
        tile_starts.iter().all(|start| *start < map_ends[1]),
        "the tiles' calls started at {tile_starts:?}, before the second map's end; the maps' calls ran {maps:?}"
    );
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

/// Between buckets the engine takes turns step by step too: a diffusion batch runs as calls of
/// `SLUICE_STEPS_PER_CALL` steps (1 by default), each taking its turn at the device. A 256² SD
/// task of 20 steps, then a 64² one of 4 (another bucket), on one partition and one engine slot:
/// the short task's steps run while the long one's are under way, and it ends first. (With all
/// of a batch's steps in one call, `SLUICE_STEPS_PER_CALL=0`, it waited for all twenty.)
#[tokio::test(flavor = "multi_thread")]
async fn a_short_diffusion_task_waits_for_a_step_of_a_long_one_not_for_all_of_them() {
    use sluice_integration_tests::cluster::Worker;
    use sluice_integration_tests::stack::repo_root;
    use sluice_integration_tests::{ids_of, publish_tasks, sd_task};

    let c = terrain_cluster().await;
    let stack = &c.stack;
    let topics = stack.topics("steps", 1).unwrap();
    let catalog = repo_root().join("deploy/models.demo.toml").display().to_string();
    let env = [
        ("SLUICE_MODEL_CATALOG", catalog.as_str()),
        ("SLUICE_MODELS", "sd-tiny"),
        ("SLUICE_ENGINE_SLOTS", "1"),
        ("SLUICE_MAX_WAIT_MS", "5"),
    ];
    let mut worker = Worker::on_topics(stack, "steps-0", "e2e-steps", &topics, &env).await.unwrap();
    worker.wait_assigned(Duration::from_secs(60)).await.unwrap();
    let long = sd_task(700, 256, 20, 2);
    let short = sd_task(701, 64, 4, 1);
    let kafka = producer(stack.brokers()).unwrap();
    let mut progress = sluice_integration_tests::TopicReader::new(stack.brokers(), sluice_schemas::topics::PROGRESS).unwrap();
    publish_tasks(&kafka, &topics.tasks, std::slice::from_ref(&long)).await.unwrap();
    // The short task is sent once the long one has run a step, not after a fixed wait.
    tokio::task::block_in_place(|| progress.read_until(Duration::from_secs(120), |r| r.iter().any(|r| ran_a_step(r, &long.0)))).unwrap();
    publish_tasks(&kafka, &topics.tasks, std::slice::from_ref(&short)).await.unwrap();
    let all = [long.clone(), short.clone()];
    let done = Outcomes::wait(stack.brokers(), &topics, &ids_of(&all), Duration::from_secs(180)).unwrap();
    let ((long_start, long_end), (short_start, short_end)) = (call_span(&done, &long), call_span(&done, &short));
    assert!(
        long_start < short_start && short_end < long_end,
        "the short task ran {short_start}..{short_end}, the long one {long_start}..{long_end}"
    );
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

/// A diffusion task that arrives while a batch of its bucket runs joins that batch at the next
/// step boundary, rather than waiting for it or running beside it as a batch of its own: two
/// 256² SD tasks of 20 steps, on one partition and one engine slot, the second sent once the
/// first has reported a step. The worker counts one task joined, the second's call starts before the
/// first's ends, and the first, which started first, ends first. With all of a batch's steps in
/// one call (`SLUICE_STEPS_PER_CALL=0`) none joins.
#[tokio::test(flavor = "multi_thread")]
async fn a_diffusion_task_joins_a_running_batch_of_its_bucket_at_the_next_step() {
    use sluice_integration_tests::cluster::Worker;
    use sluice_integration_tests::stack::repo_root;
    use sluice_integration_tests::{ids_of, publish_tasks, sd_task};

    let c = terrain_cluster().await;
    let stack = &c.stack;
    let catalog = repo_root().join("deploy/models.demo.toml").display().to_string();
    for steps_per_call in ["1", "0"] {
        let topics = stack.topics(&format!("joins-{steps_per_call}"), 1).unwrap();
        let env = [
            ("SLUICE_MODEL_CATALOG", catalog.as_str()),
            ("SLUICE_MODELS", "sd-tiny"),
            ("SLUICE_ENGINE_SLOTS", "1"),
            ("SLUICE_MAX_WAIT_MS", "5"),
            ("SLUICE_STEPS_PER_CALL", steps_per_call),
        ];
        let id = format!("joins-{steps_per_call}");
        let mut worker = Worker::on_topics(stack, &id, &format!("e2e-{id}"), &topics, &env).await.unwrap();
        worker.wait_assigned(Duration::from_secs(60)).await.unwrap();
        let first = sd_task(710, 256, 20, 1);
        let second = sd_task(711, 256, 20, 1);
        let kafka = producer(stack.brokers()).unwrap();
        let mut progress = sluice_integration_tests::TopicReader::new(stack.brokers(), sluice_schemas::topics::PROGRESS).unwrap();
        publish_tasks(&kafka, &topics.tasks, std::slice::from_ref(&first)).await.unwrap();
        // The second is sent once the first has run a step: its batch is running.
        tokio::task::block_in_place(|| progress.read_until(Duration::from_secs(120), |r| r.iter().any(|r| ran_a_step(r, &first.0))))
            .unwrap();
        publish_tasks(&kafka, &topics.tasks, std::slice::from_ref(&second)).await.unwrap();
        let all = [first.clone(), second.clone()];
        let done = Outcomes::wait(stack.brokers(), &topics, &ids_of(&all), Duration::from_secs(180)).unwrap();
        let metrics = worker.metrics().await.unwrap();
        let joined: f64 = metrics
            .lines()
            .filter(|l| l.starts_with("sluice_worker_tasks_joined_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        worker.service.terminate(Duration::from_secs(30)).unwrap();
        if steps_per_call == "0" {
            assert_eq!(joined, 0.0, "nothing joins a batch that runs all its steps in one call");
            continue;
        }
        assert_eq!(joined, 1.0, "the second task joined the first's batch");
        let ((first_start, first_end), (second_start, second_end)) = (call_span(&done, &first), call_span(&done, &second));
        assert!(
            first_start < second_start && second_start < first_end && first_end <= second_end,
            "the first task ran {first_start}..{first_end}, the second {second_start}..{second_end}"
        );
    }
}

/// An interactive task goes before queued batch work of its own bucket: forty single tiles of
/// the batch lane, then one of the interactive lane, each a batch of its own, on one partition
/// and one engine slot. The interactive tile's call starts before all but a few of the batch
/// tiles' calls (those already out when it arrived); in one lane it would be the last.
#[tokio::test(flavor = "multi_thread")]
async fn an_interactive_task_goes_before_queued_batch_work() {
    use sluice_integration_tests::cluster::Worker;
    use sluice_integration_tests::{ids_of, publish_tasks};

    let c = terrain_cluster().await;
    let stack = &c.stack;
    let topics = stack.topics("lanes", 1).unwrap();
    let models = stack.tiny_models().unwrap().display().to_string();
    let env = [
        ("SLUICE_MODEL_DIR", models.as_str()),
        ("SLUICE_ENGINE_SLOTS", "1"),
        ("SLUICE_MAX_BATCH", "1"),
    ];
    let mut worker = Worker::on_topics(stack, "lanes-0", "e2e-lanes", &topics, &env).await.unwrap();
    worker.wait_assigned(Duration::from_secs(60)).await.unwrap();
    let lane = |(id, mut task): (String, Value), lane: &str| {
        task["priority"] = json!(lane);
        (id, task)
    };
    let batch: Vec<(String, Value)> = (0..40).map(|i| lane(terrain_task(500 + i, 128, 128, 50), "batch")).collect();
    let interactive = lane(terrain_task(600, 128, 128, 50), "interactive");
    let all: Vec<(String, Value)> = batch.iter().chain([&interactive]).cloned().collect();
    let kafka = producer(stack.brokers()).unwrap();
    publish_tasks(&kafka, &topics.tasks, &all).await.unwrap();
    let done = Outcomes::wait(stack.brokers(), &topics, &ids_of(&all), Duration::from_secs(120)).unwrap();
    let start = |task: &(String, Value)| call_span(&done, task).0;
    let first = start(&interactive);
    let before = batch.iter().filter(|t| start(t) < first).count();
    assert!(before <= 10, "{before} of 40 batch tiles started before the interactive one");
    worker.service.terminate(Duration::from_secs(30)).unwrap();
}

/// Lanes in topics of their own are work sources of their own. The producer puts a task in its
/// lane's topic; a worker reads each topic with a window of `SLUICE_MAX_IN_FLIGHT` of its own.
/// Here 60 batch tasks wait before the worker starts, with a window of 4: in one topic the
/// interactive task after them would be read only once about 56 had finished, and the engine
/// could not put it first. In its own topic it is read at once and runs among the first few.
#[tokio::test(flavor = "multi_thread")]
async fn an_interactive_task_in_its_own_topic_is_not_behind_a_batch_backlog() {
    use sluice_integration_tests::cluster::{API_KEY, Worker, lone_producer, post_task};

    let c = terrain_cluster().await;
    let stack = &c.stack;
    let topics = stack.lane_topics("lane-topics", 1).unwrap();
    let store = stack.dir.join("lane-topics").join("view.redb");
    let mut env = topics.worker_env().to_vec();
    env.push(("SLUICE_TENANT_LANES", "acme=interactive+standard+batch"));
    let (mut producer, url) = lone_producer(stack, "lane-topics-producer", &store, &env).await.unwrap();
    let submit = async |seed: u32, lane: &str| {
        let body = json!({"model": "terrain", "width": 128, "height": 128, "seed": seed, "priority": lane, "params": {"difficulty": 50}});
        let (status, reply) = post_task(&url, &body, Some(API_KEY)).await.unwrap();
        assert_eq!(status, 202, "{reply}");
        reply["task_id"].as_str().unwrap().to_owned()
    };
    let mut batch = Vec::new();
    for seed in 0..60 {
        batch.push(submit(seed, "batch").await);
    }
    let interactive = submit(100, "interactive").await;

    let models = stack.tiny_models().unwrap().display().to_string();
    let env = [
        ("SLUICE_MODEL_DIR", models.as_str()),
        ("SLUICE_ENGINE_SLOTS", "1"),
        ("SLUICE_MAX_BATCH", "1"),
        ("SLUICE_MAX_IN_FLIGHT", "4"),
    ];
    let mut worker = Worker::on_topics(stack, "lane-topics-0", "e2e-lane-topics", &topics, &env)
        .await
        .unwrap();
    let ids: BTreeSet<String> = batch.iter().chain([&interactive]).cloned().collect();
    let done = Outcomes::wait(stack.brokers(), &topics, &ids, Duration::from_secs(180)).unwrap();
    let event = |id: &String| {
        let event = &done.completions[id][0];
        assert_eq!(event.status, CompletionStatus::Succeeded, "{id}: {event:?}");
        event
    };
    assert_eq!(
        event(&interactive).source.topic,
        topics.interactive,
        "published to its lane's topic"
    );
    assert!(
        batch.iter().all(|id| event(id).source.topic == topics.batch),
        "batch tasks in theirs"
    );
    let at = event(&interactive).completed_at;
    let before = batch.iter().filter(|id| event(id).completed_at < at).count();
    eprintln!("lane topics: {before} of 60 batch tasks finished before the interactive one");
    assert!(before <= 12, "{before} of 60 batch tasks finished before the interactive one");
    worker.service.terminate(Duration::from_secs(30)).unwrap();
    producer.terminate(Duration::from_secs(30)).unwrap();
}
