//! Workers killed with SIGKILL: in a loop and restarted (both delivery modes), in a supervisor's
//! crash loop with default identity, and by a record that kills its worker each time it runs
//! (dead-lettered after three crashes). Nothing is lost; exactly-once shows no duplicate.

use std::time::{Duration, Instant};

use sluice_integration_tests::cluster::Worker;
use sluice_integration_tests::kafka::{Isolation, producer};
use sluice_integration_tests::{Outcomes, ids_of, publish_tasks, terrain_task};
use sluice_schemas::CompletionStatus;

use crate::scenario::{
    SERIAL, duplicates, extra_completions, full, membership, outcomes, publish_paced, stack, stored_images, table, tasks, worker_with,
};

#[tokio::test(flavor = "multi_thread")]
async fn workers_killed_and_restarted_lose_nothing_exactly_once() {
    workers_killed_and_restarted("exactly-once").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn workers_killed_and_restarted_lose_nothing_at_least_once() {
    workers_killed_and_restarted("at-least-once").await;
}

/// Kill -9 in a loop, in delivery mode `mode`: nothing lost, never two objects; exactly once, a
/// `read_committed` reader sees no duplicate completion. Half the tasks are in the batch lane's
/// own topic, so a worker reads, commits and hands off two task topics at once.
async fn workers_killed_and_restarted(mode: &str) {
    let _serial = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.lane_topics(&format!("kill-{mode}"), 4).unwrap();
    let (n, spread) = if full() { (2400, 60) } else { (400, 15) };
    let group = format!("chaos-kill-{mode}");
    let delivery = [("SLUICE_DELIVERY", mode)];
    let mut workers = vec![
        worker_with(stack, &format!("kill-{mode}-0"), &group, &topics, &delivery).await,
        worker_with(stack, &format!("kill-{mode}-1"), &group, &topics, &delivery).await,
    ];
    for w in &workers {
        w.wait_assigned(Duration::from_secs(60)).await.unwrap();
    }
    let started = Instant::now();
    let mut all = tasks(n, 0);
    for (_, task) in all.iter_mut().skip(1).step_by(2) {
        task["priority"] = "batch".into();
    }
    let (standard, batch): (Vec<_>, Vec<_>) = all.iter().cloned().partition(|(_, t)| t.get("priority").is_none());
    let publishers = [
        publish_paced(stack, &topics.tasks, standard, Duration::from_secs(spread)),
        publish_paced(stack, &topics.batch, batch, Duration::from_secs(spread)),
    ];

    // Kill a random worker 2–4 s after the group settled, while tasks arrive, and start it
    // again.
    let (mut kills, mut at_risk) = (0usize, 0usize);
    while !publishers.iter().all(|p| p.is_finished()) || kills < 3 {
        let pause = 2000 + u64::from(uuid::Uuid::new_v4().as_bytes()[0]) * 8;
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let victim = &mut workers[usize::from(uuid::Uuid::new_v4().as_bytes()[0] & 1)];
        // What it has read but not committed is what a new owner reads again.
        at_risk += victim.metric("sluice_worker_uncommitted_records").await.unwrap_or(0.0) as usize;
        victim.service.kill9();
        kills += 1;
        victim.restart(stack).await.unwrap();
        // The next kill comes once the group has settled again, so that every kill lands on a
        // worker with work in flight.
        for w in &workers {
            w.wait_assigned(Duration::from_secs(60)).await.unwrap();
        }
    }
    let mut acked = 0;
    for publisher in publishers {
        acked += publisher.await.unwrap().len();
    }
    assert_eq!(acked, n, "the broker took every task");
    let done = outcomes(stack, &topics, &ids_of(&all), Duration::from_secs(600));
    let succeeded = done.with_status(CompletionStatus::Succeeded).len();
    let (extra, differing) = duplicates(&done);
    let ids = ids_of(&all);
    let extra_uncommitted = extra_completions(stack, &topics, &ids, Isolation::ReadUncommitted);
    let images = stored_images(stack);
    let doubled = all.iter().filter(|(id, _)| images.get(id).copied().unwrap_or(0) > 1).count();
    let missing_images = all.iter().filter(|(id, _)| !images.contains_key(id)).count();
    table(
        &format!(
            "kill -9 a random worker 2-4 s after the group settles, restart it (2 workers, {}, {mode})",
            membership()
        ),
        &[
            ("tasks", n.to_string()),
            ("kills", kills.to_string()),
            ("records uncommitted at the kills (may be read again)", at_risk.to_string()),
            ("completed", succeeded.to_string()),
            ("lost", (n - done.completions.len()).to_string()),
            ("duplicate completions, read_committed", extra.to_string()),
            ("duplicate completions, read_uncommitted", extra_uncommitted.to_string()),
            ("tasks whose completions disagree", differing.to_string()),
            ("tasks with two image objects", doubled.to_string()),
            ("wall time", format!("{:.0} s", started.elapsed().as_secs_f64())),
        ],
    );
    assert!(kills >= 3, "the run saw {kills} kills");
    assert_eq!(succeeded, n, "every task completed");
    assert!(extra <= at_risk, "{extra} duplicate completions, {at_risk} records at risk");
    if mode == "exactly-once" {
        assert_eq!(extra, 0, "a read_committed reader saw a task's completion twice");
    }
    assert_eq!(differing, 0);
    assert_eq!(doubled, 0);
    assert_eq!(missing_images, 0);
    for w in &mut workers {
        w.service.terminate(Duration::from_secs(30)).unwrap();
    }
}

/// A crash loop as a process supervisor runs it (systemd, a shell loop), with default settings:
/// no `SLUICE_GROUP_INSTANCE_ID`. Two workers, tasks arriving, one worker killed with `kill -9`
/// every 5 s and restarted at once. Each restart takes its host slot back (the same group
/// instance id and transactional id): it rejoins with its partitions and fences its previous
/// instance's open transaction at once, so every task completes and none is seen twice
/// `read_committed`. Before, each start was a new member and a new transactional id, whose
/// predecessors' partitions and transactions waited out their timeouts while more kills came:
/// after 10 minutes and 117 kills, 128 of 300 tasks had not completed.
#[tokio::test(flavor = "multi_thread")]
async fn a_supervisor_crash_loop_with_default_identity_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics("supervised", 8).unwrap();
    let group = "chaos-supervised";
    let (models, run_dir) = (
        stack.tiny_models().unwrap().display().to_string(),
        stack.dir.join("run").display().to_string(),
    );
    let env = [
        ("SLUICE_MODEL_DIR", models.as_str()),
        ("SLUICE_RUNTIME_DIR", run_dir.as_str()),
        ("SLUICE_MAX_WAIT_MS", "20"),
    ];
    let mut workers = Vec::new();
    for id in ["supervised-a", "supervised-b"] {
        workers.push(Worker::on_topics(stack, id, group, &topics, &env).await.unwrap());
    }
    for w in &workers {
        w.wait_assigned(Duration::from_secs(60)).await.unwrap();
    }
    // The identity a worker took, from its log: the last one (a restart may append).
    let identity = |w: &Worker| -> Option<String> {
        let log = w.service.log_text();
        let line = log
            .lines()
            .rev()
            .find(|l| l.contains("identity from this host's lowest free slot"))?;
        let at = line.find("identity=")? + "identity=".len();
        Some(line[at..].split([' ', ',', '}']).next()?.trim_matches('"').to_owned())
    };
    let (first, other) = (identity(&workers[0]), identity(&workers[1]));
    assert!(
        first.is_some() && other.is_some() && first != other,
        "two slots: {first:?}, {other:?}"
    );
    let n = 300;
    let all = tasks(n, 6_000);
    let ids = ids_of(&all);
    let started = Instant::now();
    let publisher = publish_paced(stack, &topics.tasks, all.clone(), Duration::from_secs(30));
    let waiter = {
        let (brokers, topics, ids) = (stack.brokers().to_owned(), topics.clone(), ids.clone());
        tokio::task::spawn_blocking(move || Outcomes::wait(&brokers, &topics, &ids, Duration::from_secs(300)))
    };
    // Kills go on until every task completed: the group must make progress between them.
    let mut kills = 0;
    while !waiter.is_finished() && kills < 30 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        workers[0].service.kill9();
        kills += 1;
        workers[0].restart(stack).await.unwrap();
        assert_eq!(identity(&workers[0]), first, "the restarted worker took its slot back");
    }
    assert!(
        waiter.is_finished(),
        "not every task completed while the kills went on ({kills} kills)"
    );
    let acked = publisher.await.unwrap();
    assert_eq!(acked.len(), n, "the broker took every task");
    let done = waiter.await.unwrap().unwrap();
    let (extra, _) = duplicates(&done);
    table(
        "supervisor crash loop, default identity (host slots): kill -9 one of 2 workers every 5 s, restart at once",
        &[
            ("tasks", n.to_string()),
            ("kills", kills.to_string()),
            ("completed", done.with_status(CompletionStatus::Succeeded).len().to_string()),
            ("lost", (n - done.completions.len()).to_string()),
            ("duplicate completions, read_committed", extra.to_string()),
            ("wall time", format!("{:.0} s", started.elapsed().as_secs_f64())),
        ],
    );
    assert!(kills >= 3, "the run saw {kills} kills");
    assert_eq!(done.with_status(CompletionStatus::Succeeded).len(), n, "every task completed");
    assert_eq!(extra, 0, "a read_committed reader saw a task's completion twice");
    for w in &mut workers {
        w.service.terminate(Duration::from_secs(30)).unwrap();
    }
}

/// A record that kills the worker running it (an abort in the backend call, as a crash in
/// native code would: no panic handler sees it) does not crash-loop its partition. Under a
/// supervisor that restarts the worker whenever it dies, the record is started
/// `SLUICE_MAX_CRASHES` (3) times (once more when its first start, new to the group and not
/// waited for, was not committed yet), then dead-lettered as `crashed` without running; the tasks
/// batched with it complete (after the first crash each runs alone), and the partition's
/// committed offset moves past them all.
#[tokio::test(flavor = "multi_thread")]
async fn a_record_that_kills_its_worker_is_dead_lettered_after_three_crashes() {
    crash_loop("crash-loop", None).await;
}

/// The same on a diffusion model (sd-tiny, its steps in one backend call), through the fault
/// wrapper that now forwards every adapter method (the model's directory entry included).
#[tokio::test(flavor = "multi_thread")]
async fn a_diffusion_record_that_kills_its_worker_is_dead_lettered_after_three_crashes() {
    crash_loop("crash-loop-sd", Some("sd-tiny")).await;
}

/// [`a_record_that_kills_its_worker_is_dead_lettered_after_three_crashes`] on terrain-tiny, or on
/// `diffusion` of the demo catalog.
async fn crash_loop(scenario: &str, diffusion: Option<&'static str>) {
    let _one = SERIAL.lock().await;
    let stack = stack().await;
    let topics = stack.topics(scenario, 1).unwrap();
    let poison = 77_001u64;
    let fault = format!("abort-run={poison}");
    let task = |seed: u64| match diffusion {
        Some(model) => sluice_integration_tests::diffusion_task(model, seed, 64, 2, 1),
        None => terrain_task(seed, 128, 128, 10),
    };
    // Long enough that the tasks published together run as one batch with the poison.
    let mut extra = vec![("SLUICE_TEST_FAULTS", fault.as_str()), ("SLUICE_MAX_WAIT_MS", "1000")];
    let (models, catalog) = (
        stack.dir.join("models").display().to_string(),
        sluice_integration_tests::stack::repo_root()
            .join("deploy/models.demo.toml")
            .display()
            .to_string(),
    );
    if let Some(model) = diffusion {
        extra.extend([
            ("SLUICE_MODEL_DIR", models.as_str()),
            ("SLUICE_MODEL_CATALOG", catalog.as_str()),
            ("SLUICE_MODELS", model),
        ]);
    }
    let group = format!("chaos-{scenario}");
    let mut w = worker_with(stack, &format!("{scenario}-0"), &group, &topics, &extra).await;
    w.wait_assigned(Duration::from_secs(60)).await.unwrap();
    let mut all: Vec<_> = (0..8).map(|i| task(77_100 + i)).collect();
    all[3] = task(poison);
    let poison_id = all[3].0.clone();
    publish_tasks(&producer(stack.brokers()).unwrap(), &topics.tasks, &all)
        .await
        .unwrap();

    let waiter = {
        let (brokers, topics, ids) = (stack.brokers().to_owned(), topics.clone(), ids_of(&all));
        tokio::task::spawn_blocking(move || Outcomes::wait(&brokers, &topics, &ids, Duration::from_secs(240)))
    };
    // The supervisor.
    let mut restarts = 0;
    while !waiter.is_finished() {
        if !w.service.running() {
            restarts += 1;
            assert!(restarts <= 6, "the worker crash-loops");
            if let Err(e) = w.restart(stack).await {
                eprintln!("restart {restarts}: {e}");
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let done = waiter.await.unwrap().unwrap();
    table(
        &format!("{scenario} (abort in the backend call, SLUICE_MAX_CRASHES=3)"),
        &[
            ("tasks", all.len().to_string()),
            ("worker deaths (restarted)", restarts.to_string()),
            ("poison task", format!("{:?}", done.dlq_reason(&poison_id))),
        ],
    );
    assert_eq!(done.dlq_reason(&poison_id), Some("crashed"));
    let message = &done.dlq[&poison_id][0].message;
    assert!(message.contains("started 3 times"), "{message}");
    assert_eq!(done.completions[&poison_id][0].status, CompletionStatus::Failed);
    for (id, _) in all.iter().filter(|(id, _)| *id != poison_id) {
        assert_eq!(done.completions[id][0].status, CompletionStatus::Succeeded, "{id}");
    }
    // One death per recorded start, and at most one more: the first start of a record new to
    // the group is committed beside its call, not before it, and a kill can come first.
    assert!((3..=4).contains(&restarts), "{restarts} deaths for 3 recorded starts");
    sluice_integration_tests::wait_for("the commit past every record", Duration::from_secs(30), async || {
        sluice_integration_tests::kafka::committed(stack.brokers(), &group, &topics.tasks, 0).filter(|o| *o == all.len() as i64)
    })
    .await
    .unwrap();
    assert!(w.service.running(), "the last worker stays up");
    w.service.terminate(Duration::from_secs(30)).unwrap();
}
