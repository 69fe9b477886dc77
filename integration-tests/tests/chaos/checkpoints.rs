//! Durable step checkpoints: a task killed mid-denoise (once, in a loop, for every sampler and
//! model family) carries on from its last checkpoint to the same image; a drain and a rebalance
//! keep a running task's last step for its next owner; the sweep deletes only what is past its age.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;
use sluice_integration_tests::cluster::Worker;
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::process::bin;
use sluice_integration_tests::{Outcomes, Stack, Topics, ids_of, publish_tasks, publish_to_partition};
use sluice_schemas::{CompletionEvent, CompletionStatus};

use crate::scenario::{SERIAL, in_flight, stack, table, worker_with};

/// Durable step checkpoints: a 20-step 256² sd-tiny task, on a catalog that keeps its state
/// every 2 steps, one step a call. Its worker is killed with SIGKILL once a checkpoint past step
/// 4 is stored; the next worker carries on from its latest checkpoint (its log says from which
/// step, at least 4), and the image is byte for byte the one the same request makes run
/// without a stop. Once the task succeeded its checkpoints are deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_task_killed_mid_denoise_carries_on_from_its_checkpoint_to_the_same_image() {
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("checkpoints", 1).unwrap();
    let (models, catalog) = checkpointing_catalog(stack, 2);
    let env = checkpointing_worker(&models, &catalog);
    let group = "chaos-checkpoints";
    let sink = stack.sink().unwrap();
    let task = sluice_integration_tests::sd_task(90_001, 256, 20, 1);
    let id = task.0.clone();
    let mut w = worker_with(stack, "checkpoints-0", group, &topics, &env).await;
    w.wait_assigned(Duration::from_secs(60)).await.unwrap();
    publish_tasks(&producer(stack.brokers()).unwrap(), &topics.tasks, std::slice::from_ref(&task))
        .await
        .unwrap();
    sluice_integration_tests::wait_for("a checkpoint past step 4", Duration::from_secs(120), async || {
        checkpoint_steps(&sink, &id).await.into_iter().max().filter(|&s| s >= 4)
    })
    .await
    .unwrap();
    w.service.kill9();
    let stored = checkpoint_steps(&sink, &id).await;
    let mut w = worker_with(stack, "checkpoints-0", group, &topics, &env).await;
    let done = Outcomes::wait(stack.brokers(), &topics, &BTreeSet::from([id.clone()]), Duration::from_secs(180)).unwrap();
    let resumed = carried_on_from(&w.service.log_text());
    let twin_image = uninterrupted_twin(stack, &topics, (90_001, 20, 1)).await;
    let image = &done.completions[&id][0];
    table(
        "a 20-step task killed (SIGKILL) mid-denoise, checkpoints every 2 steps",
        &[
            ("checkpoints stored at the kill", format!("{stored:?}")),
            ("carried on from step", format!("{resumed:?}")),
            ("status", format!("{:?}", image.status)),
            ("same PNG as without a stop", same_images(image, &twin_image).to_string()),
        ],
    );
    assert_eq!(done.completions[&id].len(), 1);
    assert_eq!(image.status, CompletionStatus::Succeeded, "{image:?}");
    assert!(
        resumed.is_some_and(|s| s >= 4 && stored.contains(&s)),
        "carried on from {resumed:?}; stored {stored:?}"
    );
    assert!(same_images(image, &twin_image), "the image is the uninterrupted one's");
    // Seen from outside: the second worker's `started` record says the step it carried on from.
    let started = started_steps(stack, &id);
    assert_eq!(started.last().copied(), resumed.map(|s| s as u32), "started records: {started:?}");
    sluice_integration_tests::wait_for("the task's checkpoints deleted", Duration::from_secs(30), async || {
        checkpoint_steps(&sink, &id).await.is_empty().then_some(())
    })
    .await
    .unwrap();
    w.service.terminate(Duration::from_secs(30)).unwrap();
}

/// Every sampler of the UNet families and both flow families carry on from a checkpoint to the
/// image of an uninterrupted run, byte for byte: sd-tiny with each of its samplers (the ancestral
/// one's noise draws by step, DPM-Solver++'s history in `solver_previous`, LCM), sdxl-tiny with
/// DPM-Solver++, flux-dev-tiny and sd3-tiny; each a 256² task of 4 images, checkpoints every
/// step, one step a call. One case at a time: its worker is killed with SIGKILL once the task
/// has a checkpoint stored, and the next worker carries it on from a later step than 0 (its
/// `started` record) to the image the same request makes without a stop. One completion each, no
/// DLQ record.
#[tokio::test(flavor = "multi_thread")]
async fn every_sampler_and_model_family_carries_on_from_a_checkpoint_to_the_same_image() {
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("checkpoint-samplers", 1).unwrap();
    let models = ["sd-tiny", "sdxl-tiny", "flux-dev-tiny", "sd3-tiny"];
    let (dir, catalog) = checkpointing_catalog_of(stack, 1, &models);
    let served = models.join(",");
    let env = [
        ("SLUICE_MODEL_DIR", dir.as_str()),
        ("SLUICE_MODEL_CATALOG", catalog.as_str()),
        ("SLUICE_MODELS", served.as_str()),
        ("SLUICE_ENGINE_SLOTS", "1"),
        ("SLUICE_STEPS_PER_CALL", "1"),
    ];
    let cases: Vec<(&str, &str, u32)> = vec![
        ("sd-tiny", "euler", 20),
        ("sd-tiny", "euler_a", 20),
        ("sd-tiny", "ddim", 20),
        ("sd-tiny", "dpmpp_2m", 20),
        ("sd-tiny", "dpmpp_2m_karras", 20),
        ("sd-tiny", "lcm", 8),
        ("sdxl-tiny", "dpmpp_2m", 20),
        ("flux-dev-tiny", "flow_euler", 20),
        ("sd3-tiny", "flow_euler", 20),
    ];
    let request = |(model, sampler, steps): (&str, &str, u32), seed: u64| {
        let mut task = sluice_integration_tests::diffusion_task(model, seed, 256, steps, 4);
        task.1["request"]["sampler"] = sampler.into();
        task
    };
    let group = "chaos-checkpoint-samplers";
    let sink = stack.sink().unwrap();
    let kafka = producer(stack.brokers()).unwrap();
    let mut w = worker_with(stack, "checkpoint-samplers-0", group, &topics, &env).await;
    let mut killed = Vec::new();
    for (i, &case) in cases.iter().enumerate() {
        let task = request(case, 91_000 + i as u64);
        w.wait_assigned(Duration::from_secs(60)).await.unwrap();
        publish_tasks(&kafka, &topics.tasks, std::slice::from_ref(&task)).await.unwrap();
        sluice_integration_tests::wait_for("a checkpoint of the task", Duration::from_secs(120), async || {
            checkpoint_steps(&sink, &task.0).await.into_iter().max()
        })
        .await
        .unwrap();
        w.service.kill9();
        w = worker_with(stack, "checkpoint-samplers-0", group, &topics, &env).await;
        Outcomes::wait(
            stack.brokers(),
            &topics,
            &BTreeSet::from([task.0.clone()]),
            Duration::from_secs(180),
        )
        .unwrap();
        killed.push(task);
    }
    let done = Outcomes::wait(stack.brokers(), &topics, &ids_of(&killed), Duration::from_secs(30)).unwrap();
    let twins: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, &case)| request(case, 91_000 + i as u64))
        .collect();
    publish_tasks(&kafka, &topics.tasks, &twins).await.unwrap();
    let uninterrupted = Outcomes::wait(stack.brokers(), &topics, &ids_of(&twins), Duration::from_secs(300)).unwrap();
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for ((case, (id, _)), (twin, _)) in cases.iter().zip(&killed).zip(&twins) {
        let name = format!("{} {}", case.0, case.1);
        let started = started_steps(stack, id);
        let image = done.completions.get(id).cloned().unwrap_or_default();
        let same = match (image.first(), uninterrupted.completions.get(twin).and_then(|t| t.first())) {
            (Some(a), Some(b)) => same_images(a, b),
            _ => false,
        };
        rows.push((name.clone(), format!("started at steps {started:?}, same PNGs: {same}")));
        if image.len() != 1 || image[0].status != CompletionStatus::Succeeded || done.dlq_reason(id).is_some() {
            failures.push(format!("{name}: {image:?}, DLQ {:?}", done.dlq_reason(id)));
        }
        if started.last().is_none_or(|&s| s == 0) {
            failures.push(format!("{name} did not carry on from a checkpoint: started at {started:?}"));
        }
        if !same {
            failures.push(format!("{name}: the images are not the uninterrupted run's"));
        }
    }
    let rows: Vec<(&str, String)> = rows.iter().map(|(n, r)| (n.as_str(), r.clone())).collect();
    table(
        "each sampler and family, its worker killed (SIGKILL) once the task had a checkpoint (every step)",
        &rows,
    );
    assert!(failures.is_empty(), "{failures:#?}");
    w.service.terminate(Duration::from_secs(30)).unwrap();
}

/// Kills in a loop: a 40-step 256² sd-tiny task, checkpoints every 4 steps, one step a call, its
/// worker killed with SIGKILL four times, each after its own count of steps (5, 3, 6, 7: some
/// past a checkpoint, one before the next), then left to finish. Per kill, the steps re-run are
/// where the killed worker had got to (the step it started from, from its `started` record, plus
/// the model calls its metrics counted just before the kill) less the step the next worker
/// started from; a call that ends between the reading and the kill makes it one more. Goal: at
/// most `checkpoint_every`, one more allowed for a checkpoint still being written at the kill
/// (writes overlap the next step). One completion, no DLQ record, the uninterrupted run's image.
#[tokio::test(flavor = "multi_thread")]
async fn kills_in_a_loop_re_run_at_most_a_checkpoint_interval_each_and_the_image_is_the_same() {
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("checkpoint-kills", 1).unwrap();
    let every = 4;
    let (models, catalog) = checkpointing_catalog(stack, every);
    let env = checkpointing_worker(&models, &catalog);
    let group = "chaos-checkpoint-kills";
    let task = sluice_integration_tests::sd_task(90_003, 256, 40, 1);
    let id = task.0.clone();
    let mut ran = Vec::new();
    for (kill, steps) in [5.0, 3.0, 6.0, 7.0].into_iter().enumerate() {
        let mut w = worker_with(stack, "checkpoint-kills-0", group, &topics, &env).await;
        w.wait_assigned(Duration::from_secs(60)).await.unwrap();
        if kill == 0 {
            publish_tasks(&producer(stack.brokers()).unwrap(), &topics.tasks, std::slice::from_ref(&task))
                .await
                .unwrap();
        }
        let counted = model_calls(&w, steps, Duration::from_secs(120)).await;
        w.service.kill9();
        ran.push(counted as u32);
    }
    let mut w = worker_with(stack, "checkpoint-kills-0", group, &topics, &env).await;
    let done = Outcomes::wait(stack.brokers(), &topics, &BTreeSet::from([id.clone()]), Duration::from_secs(240)).unwrap();
    let started = started_steps(stack, &id);
    let twin_image = uninterrupted_twin(stack, &topics, (90_003, 40, 1)).await;
    let image = &done.completions[&id][0];
    assert_eq!(started.len(), ran.len() + 1, "a started record per worker: {started:?}");
    // Where each killed worker got to, less where the next one started.
    let re_run: Vec<i64> = (0..ran.len())
        .map(|k| (started[k] + ran[k]) as i64 - started[k + 1] as i64)
        .collect();
    table(
        "a 40-step task, its worker killed (SIGKILL) 4 times, checkpoints every 4 steps",
        &[
            ("steps each worker ran before its kill", format!("{ran:?}")),
            ("step each worker started from", format!("{started:?}")),
            ("steps re-run per kill", format!("{re_run:?}")),
            ("completions", done.completions[&id].len().to_string()),
            ("same PNG as without a stop", same_images(image, &twin_image).to_string()),
        ],
    );
    assert_eq!(done.completions[&id].len(), 1);
    assert_eq!(image.status, CompletionStatus::Succeeded, "{image:?}");
    assert_eq!(done.dlq_reason(&id), None);
    assert!(same_images(image, &twin_image), "the image is the uninterrupted one's");
    assert!(
        re_run.iter().all(|&r| (0..=every as i64 + 1).contains(&r)),
        "steps re-run per kill {re_run:?}: at most {every} (+1)"
    );
    assert!(
        started.windows(2).all(|w| w[1] >= w[0]),
        "no worker started behind its predecessor: {started:?}"
    );
    assert!(*started.last().unwrap() >= 8, "the kills did not all start over: {started:?}");
    w.service.terminate(Duration::from_secs(30)).unwrap();
}

/// `sluice-worker sweep-checkpoints` on the stack's S3 server: with the default age a fresh
/// checkpoint stays; with an age of 0 s it goes, and the image beside it stays.
#[tokio::test(flavor = "multi_thread")]
async fn the_checkpoint_sweep_deletes_checkpoints_past_its_age_and_nothing_else() {
    // Every checkpoint of the store goes with an age of 0: none of another test's.
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let sink = stack.sink().unwrap();
    let vars: BTreeMap<String, String> = stack.vars().into_iter().collect();
    let prefix = vars["SLUICE_OUTPUT_URL"].splitn(4, '/').nth(3).unwrap_or_default().to_owned();
    let id = uuid::Uuid::now_v7().to_string();
    let image = format!("{prefix}/{id}/0.png");
    sink.write(
        &format!("{prefix}/checkpoints/{id}/1/000003.ckpt"),
        bytes::Bytes::from_static(b"state"),
    )
    .await
    .unwrap();
    sink.write(&image, bytes::Bytes::from_static(b"png")).await.unwrap();
    let sweep = |age: &str| -> Value {
        let out = std::process::Command::new(bin("sluice-worker"))
            .arg("sweep-checkpoints")
            .envs(&vars)
            .env("SLUICE_CHECKPOINT_SWEEP_AFTER_SECONDS", age)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let kept = sweep("2678400");
    assert_eq!(kept["deleted"], 0, "{kept}");
    assert_eq!(checkpoint_steps(&sink, &id).await, vec![3]);
    let swept = sweep("0");
    assert!(swept["deleted"].as_u64() >= Some(1), "{swept}");
    assert!(checkpoint_steps(&sink, &id).await.is_empty());
    assert_eq!(sink.keys_under(&id).await.unwrap(), vec![image], "the image stays");
}

/// The steps of task `id`'s `started` progress records, as published.
fn started_steps(stack: &Stack, id: &str) -> Vec<u32> {
    let records =
        sluice_integration_tests::TopicReader::snapshot(stack.brokers(), sluice_schemas::topics::PROGRESS, Duration::from_secs(3)).unwrap();
    records
        .iter()
        .filter(|r| r.key.as_deref() == Some(id.as_bytes()))
        .filter_map(|r| serde_json::from_slice::<sluice_schemas::ProgressRecord>(&r.value).ok())
        .filter(|p| p.event == sluice_schemas::ProgressEvent::Started)
        .map(|p| p.step)
        .collect()
}

/// A drain that gives a running task up keeps its state first: a 100-step 256² task of 4
/// images (tens of seconds here) on a catalog that checkpoints every 50 steps, its worker stopped
/// with SIGTERM and a 500 ms grace once the task made two model calls. While draining, the worker keeps the
/// task's state after every step, so checkpoints off the every-50 grid are stored; the next
/// worker carries on from the last one, and the images are the uninterrupted run's, byte for
/// byte.
#[tokio::test(flavor = "multi_thread")]
async fn a_drain_keeps_a_running_tasks_last_step_and_the_next_worker_carries_on_from_it() {
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("drain-checkpoint", 1).unwrap();
    let (models, catalog) = checkpointing_catalog(stack, 50);
    let env = checkpointing_worker(&models, &catalog);
    let mut draining = env.to_vec();
    draining.push(("SLUICE_SHUTDOWN_GRACE_MS", "500"));
    let group = "chaos-drain-checkpoint";
    let sink = stack.sink().unwrap();
    let task = sluice_integration_tests::sd_task(90_101, 256, 100, 4);
    let id = task.0.clone();
    let mut w = worker_with(stack, "drain-checkpoint-0", group, &topics, &draining).await;
    w.wait_assigned(Duration::from_secs(60)).await.unwrap();
    publish_tasks(&producer(stack.brokers()).unwrap(), &topics.tasks, std::slice::from_ref(&task))
        .await
        .unwrap();
    in_flight(&w, 1.0).await;
    // Stopped once the task is running (a fixed sleep was, on a loaded 2-core machine, at times
    // before its first step: then the drain released it unstarted and kept nothing).
    model_calls(&w, 2.0, Duration::from_secs(60)).await;
    w.service.terminate(Duration::from_secs(30)).unwrap();
    let stopped_log = w.service.log_text();
    let stored = checkpoint_steps(&sink, &id).await;
    let mut w = worker_with(stack, "drain-checkpoint-0", group, &topics, &env).await;
    let done = Outcomes::wait(stack.brokers(), &topics, &BTreeSet::from([id.clone()]), Duration::from_secs(180)).unwrap();
    let resumed = carried_on_from(&w.service.log_text());
    let twin_image = uninterrupted_twin(stack, &topics, (90_101, 100, 4)).await;
    let image = &done.completions[&id][0];
    table(
        "a 100-step task of 4 images, its worker stopped with SIGTERM (grace 500 ms), checkpoints every 50 steps",
        &[
            ("checkpoints stored at the stop", format!("{stored:?}")),
            ("carried on from step", format!("{resumed:?}")),
            ("status", format!("{:?}", image.status)),
            ("same PNGs as without a stop", same_images(image, &twin_image).to_string()),
        ],
    );
    assert_eq!(image.status, CompletionStatus::Succeeded, "{image:?}");
    assert!(
        stored.iter().any(|s| s % 50 != 0),
        "a checkpoint of the drain, off the every-50 grid: {stored:?}; the stopped worker's log:\n{stopped_log}"
    );
    assert_eq!(resumed, stored.iter().max().copied(), "carried on from the last step kept");
    // Leaving the group did not wait out the drain timeout for the task it had given up.
    assert!(!stopped_log.contains("shutdown step timed out"), "{stopped_log}");
    assert!(same_images(image, &twin_image), "the images are the uninterrupted run's");
    w.service.terminate(Duration::from_secs(30)).unwrap();
}

/// A rebalance that moves a running task keeps its state first: two 60-step 256² tasks of 4
/// images, one in each of two partitions, on one worker (checkpoints every 50 steps, a 3 s drain
/// timeout). A second worker joins the group while both run; the partition that moves is
/// drained: from the revoke on its task's state is kept after every step, and the new owner
/// carries it on from a step so kept (off the every-50 grid), to the images of an uninterrupted
/// run. The task that stays runs on. One completion each, no DLQ record. (The old owner runs the
/// moved task on and keeps writing its checkpoints: docs/delivery.md; so no assertion here that
/// they are gone.)
#[tokio::test(flavor = "multi_thread")]
async fn a_rebalance_keeps_a_moved_tasks_last_step_and_its_new_owner_carries_on_from_it() {
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("rebalance-checkpoint", 2).unwrap();
    let (models, catalog) = checkpointing_catalog(stack, 50);
    let mut env = checkpointing_worker(&models, &catalog).to_vec();
    // Long enough for a few steps (~0.6 s each here) inside the drain; each write logged.
    env.extend([
        ("SLUICE_DRAIN_TIMEOUT_MS", "3000"),
        ("RUST_LOG", "info,sluice_worker::events=debug"),
    ]);
    let group = "chaos-rebalance-checkpoint";
    let kafka = producer(stack.brokers()).unwrap();
    const STEPS: u32 = 60;
    let tasks: Vec<_> = (0..2)
        .map(|i| sluice_integration_tests::sd_task(90_201 + i, 256, STEPS, 4))
        .collect();
    let mut first = worker_with(stack, "rebalance-checkpoint-0", group, &topics, &env).await;
    first.wait_assigned(Duration::from_secs(60)).await.unwrap();
    for (partition, task) in tasks.iter().enumerate() {
        publish_to_partition(&kafka, &topics.tasks, partition as i32, task).await.unwrap();
    }
    in_flight(&first, 2.0).await;
    // The second worker joins once both tasks are running (one bucket: its calls run both rows,
    // the second task joining at a step boundary), not after a fixed sleep, which on a loaded
    // machine could come before their first step.
    model_calls(&first, 3.0, Duration::from_secs(60)).await;
    let mut second = worker_with(stack, "rebalance-checkpoint-1", group, &topics, &env).await;
    let done = Outcomes::wait(stack.brokers(), &topics, &ids_of(&tasks), Duration::from_secs(300)).unwrap();
    let mut rows = Vec::new();
    let mut moved = Vec::new();
    for (i, (id, _)) in tasks.iter().enumerate() {
        let started = started_steps(stack, id);
        let image = &done.completions[id];
        rows.push((format!("task {id}"), format!("started at steps {started:?}")));
        assert_eq!(image.len(), 1, "{image:?}");
        assert_eq!(image[0].status, CompletionStatus::Succeeded, "{image:?}");
        assert_eq!(done.dlq_reason(id), None);
        if started.len() > 1 {
            moved.push((i, started));
        }
    }
    assert_eq!(moved.len(), 1, "one task moved to the new worker: {moved:?}");
    let (i, started) = &moved[0];
    let twin = sluice_integration_tests::sd_task(90_201 + *i as u64, 256, STEPS, 4);
    publish_tasks(&kafka, &topics.tasks, std::slice::from_ref(&twin)).await.unwrap();
    let uninterrupted = Outcomes::wait(
        stack.brokers(),
        &topics,
        &ids_of(std::slice::from_ref(&twin)),
        Duration::from_secs(300),
    )
    .unwrap();
    let same = same_images(&done.completions[&tasks[*i].0][0], &uninterrupted.completions[&twin.0][0]);
    rows.push(("the moved task's PNGs are the uninterrupted run's".into(), same.to_string()));
    let rows: Vec<(&str, String)> = rows.iter().map(|(n, r)| (n.as_str(), r.clone())).collect();
    table(
        "two 60-step tasks in two partitions, a second worker joins (drain timeout 3 s), checkpoints every 50 steps",
        &rows,
    );
    // The steps the first worker kept of the moved task before its drain ended (the line
    // `partitions revoked`, logged when the partition is given up): off the every-50 grid, so
    // the drain's.
    let log = first.service.log_text();
    let moved_id = &tasks[*i].0;
    let revoked_at = log
        .lines()
        .find(|l| l.contains("partitions revoked") && l.contains(&format!("partitions=[{i}]")))
        .and_then(|l| l.split_whitespace().next())
        .expect("the first worker gave the partition up")
        .to_owned();
    let kept_in_drain: Vec<u32> = log
        .lines()
        .filter(|l| l.contains("checkpoint written") && l.contains(moved_id.as_str()))
        .filter(|l| l.split_whitespace().next().is_some_and(|at| at < revoked_at.as_str()))
        .filter_map(logged_step)
        .collect();
    let carried_on = *started.last().unwrap();
    assert!(
        kept_in_drain.iter().any(|s| s % 50 != 0),
        "the drain kept steps off the every-50 grid: {kept_in_drain:?}"
    );
    assert!(
        carried_on > 0 && carried_on % 50 != 0 && carried_on >= *kept_in_drain.iter().max().unwrap(),
        "carried on from a step kept since the revoke, off the every-50 grid: {started:?}, kept in the drain {kept_in_drain:?}"
    );
    assert!(same, "the moved task's images are the uninterrupted run's");
    first.service.terminate(Duration::from_secs(30)).unwrap();
    second.service.terminate(Duration::from_secs(30)).unwrap();
}

/// Waits (at most `timeout`) until `w` has made at least `n` model calls of sd-tiny (each a step
/// of the tasks it runs), and returns how many it has made.
async fn model_calls(w: &Worker, n: f64, timeout: Duration) -> f64 {
    let calls = "sluice_worker_model_call_seconds_count{model=\"sd-tiny\"}";
    sluice_integration_tests::wait_for("the worker's model calls", timeout, async || {
        w.metric(calls).await.filter(|&c| c >= n)
    })
    .await
    .unwrap()
}

/// The demo catalog with sd-tiny keeping checkpoints every `every` steps and taking up to 100,
/// written into the stack's directory: (models directory, catalog path).
fn checkpointing_catalog(stack: &Stack, every: u32) -> (String, String) {
    checkpointing_catalog_of(stack, every, &["sd-tiny"])
}

/// The demo catalog with each of `models` keeping checkpoints every `every` steps (sd-tiny also
/// taking up to 100), written into the stack's directory: (models directory, catalog path).
fn checkpointing_catalog_of(stack: &Stack, every: u32, models: &[&str]) -> (String, String) {
    let repo = sluice_integration_tests::stack::repo_root();
    let mut text = std::fs::read_to_string(repo.join("deploy/models.demo.toml")).unwrap();
    let steps = "steps = { min = 1, max = 20, default = 4 }";
    let (before, sd_tiny) = text.split_once("name = \"sd-tiny\"\n").expect("the demo catalog has sd-tiny");
    assert!(sd_tiny.contains(steps), "sd-tiny's steps in the demo catalog");
    text = format!(
        "{before}name = \"sd-tiny\"\n{}",
        sd_tiny.replacen(steps, "steps = { min = 1, max = 100, default = 4 }", 1)
    );
    for model in models {
        let name = format!("name = \"{model}\"\n");
        assert!(text.contains(&name), "the demo catalog has {model}");
        text = text.replacen(&name, &format!("{name}checkpoint_every = {every}\n"), 1);
    }
    let catalog = stack.dir.join(format!("checkpoint-every-{every}-{}.toml", models.join("-")));
    std::fs::write(&catalog, text).unwrap();
    (stack.dir.join("models").display().to_string(), catalog.display().to_string())
}

/// A worker serving sd-tiny from `catalog`, one engine slot, one step a call.
fn checkpointing_worker<'a>(models: &'a str, catalog: &'a str) -> [(&'static str, &'a str); 5] {
    [
        ("SLUICE_MODEL_DIR", models),
        ("SLUICE_MODEL_CATALOG", catalog),
        ("SLUICE_MODELS", "sd-tiny"),
        ("SLUICE_ENGINE_SLOTS", "1"),
        ("SLUICE_STEPS_PER_CALL", "1"),
    ]
}

/// The steps of task `id`'s checkpoints in the store.
async fn checkpoint_steps(sink: &sluice_worker::storage::images::ImageStore, id: &str) -> Vec<usize> {
    let keys = sink
        .keys_under(&format!("checkpoints/{id}"))
        .await
        .unwrap_or_else(|e| panic!("listing the checkpoints: {e}"));
    keys.iter()
        .filter_map(|k| k.rsplit('/').next()?.strip_suffix(".ckpt")?.parse().ok())
        .collect()
}

/// The step a worker's log says a task carried on from.
fn carried_on_from(log: &str) -> Option<usize> {
    log.lines()
        .filter(|l| l.contains("carrying on from a checkpoint"))
        .find_map(logged_step)
}

/// The `step=` field of a worker's log line.
fn logged_step<T: std::str::FromStr>(line: &str) -> Option<T> {
    line.split("step=")
        .nth(1)?
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// The completion of the same 256² sd-tiny request (`seed`, `steps`, `images`) run without a
/// stop by the worker serving `topics`.
async fn uninterrupted_twin(stack: &Stack, topics: &Topics, (seed, steps, images): (u64, u32, u32)) -> CompletionEvent {
    let twin = sluice_integration_tests::sd_task(seed, 256, steps, images);
    publish_tasks(&producer(stack.brokers()).unwrap(), &topics.tasks, std::slice::from_ref(&twin))
        .await
        .unwrap();
    let done = Outcomes::wait(stack.brokers(), topics, &BTreeSet::from([twin.0.clone()]), Duration::from_secs(180)).unwrap();
    done.completions[&twin.0][0].clone()
}

/// Whether two completions stored the same images, byte for byte.
fn same_images(a: &CompletionEvent, b: &CompletionEvent) -> bool {
    let hashes = |e: &CompletionEvent| e.outputs.iter().map(|o| o.sha256.clone()).collect::<Vec<_>>();
    !a.outputs.is_empty() && hashes(a) == hashes(b)
}
