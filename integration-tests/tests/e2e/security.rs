//! Nothing is open unless configured open, and setup mistakes are clear startup errors.

use std::time::Duration;

use serde_json::json;
use sluice_integration_tests::cluster::ADMIN_TOKEN;
use sluice_integration_tests::{Service, Stack, bin, rejected_fields};

use crate::stacks::terrain_cluster;

#[tokio::test(flavor = "multi_thread")]
async fn setup_mistakes_are_clear_startup_errors() {
    let c = terrain_cluster().await;
    let stack: &Stack = &c.stack;
    let run = |name: &str, overrides: &[(&str, &str)]| {
        let mut env = stack.vars();
        env.retain(|(k, _)| !overrides.iter().any(|(o, _)| o == k));
        env.extend(overrides.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env.push((
            "SLUICE_LISTEN".into(),
            format!("127.0.0.1:{}", sluice_integration_tests::free_port()),
        ));
        let mut worker = Service::spawn(name, &bin("sluice-worker"), &[], &env, &stack.dir.join("logs")).unwrap();
        let status = worker.wait(Duration::from_secs(30)).unwrap();
        (status, worker.log_text())
    };
    let (status, log) = run("no-ort", &[("ORT_DYLIB_PATH", "/nonexistent/libonnxruntime.so")]);
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(
        log.contains("ONNX Runtime library /nonexistent/libonnxruntime.so does not exist"),
        "{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    let (status, log) = run("no-model", &[("SLUICE_MODEL_DIR", "/nonexistent/models")]);
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("/nonexistent/models/terrain/model.onnx does not exist"), "{log}");
    // A lane's topic that was never created: both binaries say so instead of waiting on it.
    let (status, log) = run("no-lane-topic", &[("SLUICE_INTERACTIVE_TOPIC", "sluice.tasks.never-created")]);
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(
        log.contains("task topics missing on the cluster: sluice.tasks.never-created"),
        "{log}"
    );
    let mut env = stack.vars();
    env.extend(
        [
            ("SLUICE_BATCH_TOPIC", "sluice.tasks.never-created"),
            ("SLUICE_API_KEYS", "acme:k"),
            ("SLUICE_STATUS_PATH", "/nonexistent/never-opened.redb"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    for (name, port) in [
        ("SLUICE_LISTEN", sluice_integration_tests::free_port()),
        ("SLUICE_METRICS_LISTEN", sluice_integration_tests::free_port()),
    ] {
        env.push((name.into(), format!("127.0.0.1:{port}")));
    }
    let mut producer = Service::spawn(
        "no-lane-topic-producer",
        &bin("sluice-producer"),
        &["serve"],
        &env,
        &stack.dir.join("logs"),
    )
    .unwrap();
    let status = producer.wait(Duration::from_secs(30)).unwrap();
    let log = producer.log_text();
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(
        log.contains("task topics missing on the cluster: sluice.tasks.never-created"),
        "{log}"
    );
}

/// Nothing is open unless configured open. A producer without API keys refuses to start unless
/// `SLUICE_ALLOW_ANONYMOUS=true`; a malformed key entry or Kafka option is refused without
/// printing it; metrics are on their own listener, not the API's. A worker without
/// `SLUICE_ADMIN_TOKEN` answers 404 on `/admin/reload`; with one, a reload option out of bounds
/// is a 400 naming the field and the worker keeps serving.
#[tokio::test(flavor = "multi_thread")]
async fn nothing_is_open_unless_configured_open() {
    use sluice_integration_tests::cluster::Worker;
    use sluice_integration_tests::free_port;

    let c = terrain_cluster().await;
    let stack = &c.stack;
    let dir = stack.dir.join("closed");
    let start_producer = |name: &str, extra: &[(&str, &str)]| {
        let port = free_port();
        let mut env = stack.vars();
        env.push(("SLUICE_LISTEN".into(), format!("127.0.0.1:{port}")));
        env.push(("SLUICE_METRICS_LISTEN".into(), format!("127.0.0.1:{}", free_port())));
        env.push(("SLUICE_STATUS_PATH".into(), dir.join(name).join("view.redb").display().to_string()));
        env.push(("SLUICE_WEBHOOKS".into(), "false".into()));
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        (Service::spawn(name, &bin("sluice-producer"), &["serve"], &env, &dir).unwrap(), port)
    };
    let refused: [(&str, &[(&str, &str)], &str, &str); 3] = [
        ("no-keys", &[], "SLUICE_ALLOW_ANONYMOUS", ""),
        ("bad-key", &[("SLUICE_API_KEYS", "acme:fine,s3cr3t-key")], "entry 2", "s3cr3t"),
        (
            "bad-kafka-option",
            &[("SLUICE_API_KEYS", "acme:fine"), ("SLUICE_KAFKA_OPTIONS", "sasl.password:hunter2")],
            "--kafka-option",
            "hunter2",
        ),
    ];
    for (name, env, reason, secret) in refused {
        let (mut producer, _) = start_producer(name, env);
        let status = tokio::task::block_in_place(|| producer.wait(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("{name}: the producer served: {e}"));
        let log = producer.log_text();
        assert!(!status.success(), "{name}: {log}");
        assert!(log.contains(reason), "{name}: the refusal names {reason:?}: {log}");
        assert!(secret.is_empty() || !log.contains(secret), "{name}: a secret was printed: {log}");
    }
    // Asked for by name, anonymous access serves (tenant `default`).
    let (mut open, port) = start_producer("anonymous", &[("SLUICE_ALLOW_ANONYMOUS", "true")]);
    open.wait_ready(&format!("http://127.0.0.1:{port}/healthz"), Duration::from_secs(30))
        .await
        .unwrap();
    open.terminate(Duration::from_secs(10)).unwrap();

    // The cluster's producer: metrics on the metrics listener only.
    let client = sluice_service::http_client::client();
    let on_api = client.get(format!("{}/metrics", c.producer_url)).send().await.unwrap();
    assert_eq!(on_api.status().as_u16(), 404);
    let metrics = c.producer_metrics().await.unwrap();
    assert!(metrics.contains("sluice_producer_"), "{metrics}");

    // A worker without an admin token: admin is off (404), token or not.
    let topics = stack.topics("closed", 1).unwrap();
    let worker = Worker::on_topics(stack, "closed-0", "e2e-closed", &topics, &[("SLUICE_ADMIN_TOKEN", "")])
        .await
        .unwrap();
    for token in [None, Some(ADMIN_TOKEN)] {
        let mut request = client
            .post(format!("{}/admin/reload", worker.url))
            .json(&json!({"gpu_mem_limit": 1}));
        if let Some(t) = token {
            request = request.bearer_auth(t);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status().as_u16(), 404, "admin answered with token {token:?}");
    }
    // The cluster's workers have a token: out-of-bounds options are refused by name, nothing is
    // kept, and the worker still reloads and serves.
    let w = &c.workers[0];
    for (body, field) in [
        (json!({"gpu_mem_limit": 1}), "gpu_mem_limit"),
        (json!({"intra_threads": 100_000}), "intra_threads"),
    ] {
        let (status, reply) = w.reload(&body).await;
        assert_eq!(status, 400, "{reply}");
        assert_eq!(rejected_fields(&reply)[0].0, field, "{reply}");
    }
    let (status, reply) = w.reload(&json!({"model": "terrain"})).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["reloads"][0]["result"], "reloaded", "{reply}");
    let ready = client.get(format!("{}/readyz", w.url)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);
}
