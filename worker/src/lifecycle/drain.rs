//! The stopping role: stop reading, let every stage finish what it holds within the grace
//! period (then give up what is left: it will be read again), commit what finished, leave the
//! group. Every step that talks to the broker is bounded, so the worker exits with the broker
//! gone.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

use super::Exit;
use super::admin::Admin;
use super::kafka::Clients;
use super::stages::Stages;
use crate::metrics::Metrics;
use crate::models::serving::Health;

/// Waits for a shutdown step at most `limit`.
async fn bounded<F: Future>(step: &str, limit: Duration, f: F) {
    if tokio::time::timeout(limit, f).await.is_err() {
        tracing::warn!(step, "shutdown step timed out (broker unreachable?); exiting anyway");
    }
}

pub(super) async fn drain(
    stages: Stages,
    clients: Clients,
    admin: Admin,
    health: &watch::Sender<Health>,
    grace: Duration,
    exit: Exit,
    metrics: &Metrics,
) {
    let offsets = clients.offsets.clone();
    health.send_modify(|h| h.shutting_down = true);
    let (contexts, tasks, control) = ((stages.decode, stages.engine), stages.tasks, stages.control);
    control.stop_reading.cancel();
    let drained = tokio::time::timeout(grace, async {
        for stage in stages.stages {
            let _ = stage.await;
        }
        tasks.close();
        tasks.wait().await;
    })
    .await
    .is_ok();
    if !drained {
        tracing::warn!(
            in_flight = offsets.in_flight(),
            "grace period over; abandoning unfinished tasks (they will be read again)"
        );
        stages.abandon.cancel();
        // Handed off, not crashed: the next owner must not count these starts.
        offsets.hand_off_all();
        tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(2), tasks.wait()).await;
    }
    // Commit what finished and leave the group. With the broker gone a commit can block
    // indefinitely, and the worker must still exit.
    control.close.cancel();
    let final_commit = {
        let (committer, c, o, m) = (
            clients.committer.clone(),
            clients.consumer.clone(),
            offsets.clone(),
            metrics.clone(),
        );
        tokio::task::spawn_blocking(move || committer.commit_now(&c, &o, &m))
    };
    bounded("final commit", Duration::from_secs(10), final_commit).await;
    bounded("committer", Duration::from_secs(2), stages.commit_loop).await;
    bounded(
        "leaving the group",
        Duration::from_secs(10),
        tokio::task::spawn_blocking(move || stages.poll_thread.join()),
    )
    .await;
    stages.gauges_stop.cancel();
    admin.stop().await;
    tracing::info!(
        drained,
        in_flight_left = offsets.in_flight(),
        exit_code = exit.code(),
        "worker stopped"
    );
    // Dropping the Kafka clients runs librdkafka's destructors, which wait on the broker:
    // everything that had to be acknowledged already was, so let them go on a thread of their own
    // rather than hold up the exit.
    drop(contexts);
    let _ = std::thread::Builder::new()
        .name("sluice-kafka-drop".into())
        .spawn(move || drop(clients));
}
