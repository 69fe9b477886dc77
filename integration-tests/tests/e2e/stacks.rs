//! The stacks the end-to-end tests share, each started on first use and kept for the run: a
//! group of two terrain workers behind a producer, a diffusion worker (the demo catalog) behind
//! a producer of its own, and a bare stack for replay and redrive through the CLI. Tests that
//! need a process of their own (a restarted producer, a fresh cluster) start it beside these.

use std::time::Duration;

use base64::Engine as _;
use sluice_integration_tests::cluster::Cluster;
use sluice_integration_tests::stack::repo_root;
use sluice_integration_tests::{Consumed, Stack, TopicReader};
use tokio::sync::OnceCell;

/// The terrain cluster's webhook signing key (tenant acme).
pub(crate) const WEBHOOK_KEY: &[u8] = b"sluice-test-webhook-secret-32byt";

/// The diffusion cluster's webhook signing key (tenant acme).
pub(crate) const DIFFUSION_WEBHOOK_KEY: &[u8] = b"sluice-sd-test-webhook-secret-32";

/// Tasks of these seeds are held in their model call until they are cancelled
/// (`SLUICE_TEST_FAULTS=hold-run=…`), so that the cancellation test asserts on events, not on
/// how fast the device runs: a held task is certainly running when it is cancelled, and a task
/// queued behind it certainly queued.
pub(crate) const HELD_SEEDS: &str = "hold-run=7770001,hold-run=7770002";

static TERRAIN: OnceCell<Cluster> = OnceCell::const_new();
static DIFFUSION: OnceCell<Cluster> = OnceCell::const_new();
static REPLAY: OnceCell<Stack> = OnceCell::const_new();

/// A producer and two workers running the pretrained terrain model.
pub(crate) async fn terrain_cluster() -> &'static Cluster {
    TERRAIN
        .get_or_init(|| async { Cluster::start("e2e", 2, &[]).await.expect("cluster starts") })
        .await
}

/// A producer and one worker serving the demo catalog (terrain and the tiny SD, SDXL, FLUX and
/// SD3 models), signing webhooks with [`DIFFUSION_WEBHOOK_KEY`] and holding [`HELD_SEEDS`].
pub(crate) async fn diffusion_cluster() -> &'static Cluster {
    DIFFUSION
        .get_or_init(|| async {
            let catalog = repo_root().join("deploy/models.demo.toml").display().to_string();
            let secret = format!(
                "acme:whsec_{}",
                base64::engine::general_purpose::STANDARD.encode(DIFFUSION_WEBHOOK_KEY)
            );
            Cluster::start_with(
                "sd",
                1,
                &[("SLUICE_TEST_FAULTS", HELD_SEEDS)],
                &[
                    ("SLUICE_MODEL_CATALOG", catalog.as_str()),
                    ("SLUICE_WEBHOOK_SECRETS", secret.as_str()),
                    ("SLUICE_WEBHOOK_ALLOW_CIDRS", "127.0.0.1/32"),
                ],
            )
            .await
            .expect("cluster starts")
        })
        .await
}

/// A broker and an S3 server with no service running: the replay and redrive tests start their
/// own workers and run the producer's CLI.
pub(crate) async fn replay_stack() -> &'static Stack {
    REPLAY.get_or_init(|| async { Stack::start("replay").expect("stack starts") }).await
}

/// Every record of `topic` there is now.
pub(crate) fn all_records(stack: &Stack, topic: &str) -> Vec<Consumed> {
    TopicReader::snapshot(stack.brokers(), topic, Duration::from_secs(3)).unwrap()
}
