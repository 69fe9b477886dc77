//! The Python client (`clients/python`) against a real deployment: a stack, a producer with
//! webhooks on, and two workers on the demo catalog. The wheel is built and installed by
//! `scripts/python-client.sh venv`; its stack suite (`tests/test_stack.py`) then drives the
//! deployment through the client: submit, wait, images, events, cancel, idempotent retries,
//! the producer's webhook signatures, the README's quick start, the examples, and the
//! completion consumer across a worker's kill -9 (the test kills one of the two by pid).

use std::process::Command;

use base64::Engine as _;
use sluice_integration_tests::cluster::{API_KEY, Cluster, RIVAL_KEY};
use sluice_integration_tests::stack::repo_root;

/// The 32-byte signing key of tenant `acme` in this deployment.
const WEBHOOK_KEY: &[u8] = b"sluice-python-client-webhook-key";
/// Seeds whose model call waits until the task is cancelled (the worker's test faults).
const HELD_SEED: &str = "hold-run=7770101";

#[tokio::test(flavor = "multi_thread")]
async fn the_python_client_passes_its_stack_suite() {
    let root = repo_root();
    let venv = Command::new(root.join("scripts/python-client.sh"))
        .arg("venv")
        .output()
        .expect("scripts/python-client.sh runs");
    assert!(
        venv.status.success(),
        "building the client: {}",
        String::from_utf8_lossy(&venv.stderr)
    );
    let python = String::from_utf8(venv.stdout).unwrap().trim().to_owned();

    let secret = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(WEBHOOK_KEY));
    let secrets = format!("acme:{secret}");
    let catalog = root.join("deploy/models.demo.toml").display().to_string();
    let c = Cluster::start_with(
        "python",
        2,
        &[("SLUICE_TEST_FAULTS", HELD_SEED)],
        &[
            ("SLUICE_MODEL_CATALOG", catalog.as_str()),
            ("SLUICE_WEBHOOK_SECRETS", secrets.as_str()),
            ("SLUICE_WEBHOOK_ALLOW_CIDRS", "127.0.0.1/32"),
        ],
    )
    .await
    .expect("cluster starts");
    let pids: Vec<String> = c
        .workers
        .iter()
        .map(|w| w.service.pid().expect("a running worker").to_string())
        .collect();

    let suite = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "stack", "tests/test_stack.py"])
        .current_dir(root.join("clients/python"))
        .env("SLUICE_URL", &c.producer_url)
        .env("SLUICE_API_KEY", API_KEY)
        .env("SLUICE_TEST_RIVAL_KEY", RIVAL_KEY)
        .env("SLUICE_TEST_BROKERS", c.stack.brokers())
        .env("SLUICE_TEST_WEBHOOK_SECRET", &secret)
        .env("SLUICE_TEST_WORKER_PIDS", pids.join(","))
        .env("SLUICE_TEST_HELD_SEED", HELD_SEED.trim_start_matches("hold-run="))
        .status()
        .expect("pytest runs");
    assert!(suite.success(), "the Python client's stack suite failed (its output is above)");
}
