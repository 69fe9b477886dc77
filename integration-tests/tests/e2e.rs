//! Sluice end to end on real parts: tasks submitted over HTTP go through the broker to a group
//! of two workers running the pretrained terrain model in ONNX Runtime; images land in the S3
//! server and each result is announced on the completion topic. Malformed records go to the DLQ
//! with their reason while the tasks around them complete; bad requests get 4xx naming the field.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use sluice_integration_tests::cluster::{
    ADMIN_TOKEN, API_KEY, Cluster, RIVAL_KEY, get_json, histogram_quantile, lone_producer, metric_value, post_task,
};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::receiver::{Received, Receiver};
use sluice_integration_tests::{
    Consumed, Outcomes, Service, Stack, TopicReader, Topics, bin, completions_for, names_field, png_info, produce_raw, rejected_fields,
    sha256_hex, terrain_task,
};
use sluice_schemas::{CompletionEvent, CompletionStatus, DlqRecord, topics};
use tokio::sync::OnceCell;

static CLUSTER: OnceCell<Cluster> = OnceCell::const_new();

async fn cluster() -> &'static Cluster {
    CLUSTER
        .get_or_init(|| async { Cluster::start("e2e", 2, &[]).await.expect("cluster starts") })
        .await
}

#[tokio::test(flavor = "multi_thread")]
async fn tasks_over_http_complete_with_their_images_in_s3() {
    let c = cluster().await;
    let sizes = [(128u32, 128u32, 1u32), (96, 64, 2), (200, 150, 1), (256, 128, 1)];
    let mut requested = HashMap::new();
    for i in 0..24u32 {
        let (w, h, n) = sizes[i as usize % sizes.len()];
        let body = json!({"model": "terrain", "width": w, "height": h, "num_images": n, "seed": i, "params": {"difficulty": 1 + i * 4, "colormap": if i % 3 == 0 { "grey" } else { "terrain" }}});
        let id = c.submit_ok(&body).await.unwrap();
        requested.insert(id, (w, h, n, i % 3 == 0));
    }
    let ids: BTreeSet<String> = requested.keys().cloned().collect();
    let completions = completions_for(c.stack.brokers(), &ids, Duration::from_secs(240));

    let sink = c.stack.sink().unwrap();
    let mut workers = BTreeSet::new();
    for (id, (w, h, n, grey)) in &requested {
        let event = &completions[id];
        assert_eq!(event.status, CompletionStatus::Succeeded, "{event:?}");
        assert_eq!(event.tenant, "acme");
        assert_eq!(event.outputs.len(), *n as usize);
        assert!(
            event.timings.inference_ms > 0 && event.timings.total_ms >= event.timings.inference_ms,
            "{:?}",
            event.timings
        );
        workers.insert(event.worker_id.clone());
        for (index, output) in event.outputs.iter().enumerate() {
            assert_eq!(output.index as usize, index);
            assert!(output.key.ends_with(&format!("{id}/{index}.png")), "{}", output.key);
            assert_eq!(output.url, format!("s3://sluice/{}", output.key));
            let bytes = sink.read(&output.key).await.unwrap();
            assert_eq!(bytes.len() as u64, output.bytes);
            assert_eq!(sha256_hex(&bytes), output.sha256);
            let (pw, ph, color, depth) = png_info(&bytes).unwrap();
            assert_eq!((pw, ph), (*w, *h), "PNG size of {id}");
            assert_eq!((output.width, output.height), (*w, *h));
            if *grey {
                assert_eq!((color, depth), (png::ColorType::Grayscale, png::BitDepth::Sixteen));
            } else {
                assert_eq!((color, depth), (png::ColorType::Rgb, png::BitDepth::Eight));
            }
        }
    }
    assert_eq!(
        workers,
        BTreeSet::from(["worker-0".to_owned(), "worker-1".to_owned()]),
        "both workers of the group took tasks"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_seed_gives_the_same_image() {
    let c = cluster().await;
    let body = |seed: u64| json!({"model": "terrain", "seed": seed, "width": 160, "height": 160, "params": {"difficulty": 60}});
    let a = c.submit_ok(&body(7)).await.unwrap();
    let b = c.submit_ok(&body(7)).await.unwrap();
    let other = c.submit_ok(&body(8)).await.unwrap();
    let ids = BTreeSet::from([a.clone(), b.clone(), other.clone()]);
    let done = completions_for(c.stack.brokers(), &ids, Duration::from_secs(120));
    assert_eq!(done[&a].outputs[0].sha256, done[&b].outputs[0].sha256, "same seed, same image");
    assert_ne!(
        done[&a].outputs[0].sha256, done[&other].outputs[0].sha256,
        "another seed, another image"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_records_go_to_the_dlq_and_the_tasks_around_them_complete() {
    let c = cluster().await;
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

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_4xx_naming_the_field() {
    let c = cluster().await;
    let cases = [
        (json!({"model": "stable-diffusion-9"}), vec!["model"]),
        (json!({"model": "terrain", "params": {"difficulty": 0}}), vec!["params.difficulty"]),
        (
            json!({"model": "terrain", "params": {"difficulty": 101}}),
            vec!["params.difficulty"],
        ),
        (json!({"model": "terrain", "width": 99999, "height": 8}), vec!["height", "width"]),
        (json!({"model": "terrain", "steps": 30}), vec!["steps"]),
        (json!({"model": "terrain", "num_images": "two"}), vec!["num_images"]),
        (json!({"model": "terrain", "colour": "red"}), vec!["colour"]),
        (json!({"width": 128}), vec!["model"]),
    ];
    for (body, fields) in cases {
        let (status, reply) = c.submit(&body).await.unwrap();
        assert_eq!(status, 400, "{body} -> {reply}");
        assert_eq!(reply["error"], "invalid_request");
        let mut named: Vec<&str> = rejected_fields(&reply).into_iter().map(|(f, _)| f).collect();
        named.dedup();
        assert_eq!(named, fields, "{body} -> {reply}");
        for field in fields {
            assert!(reply["message"].as_str().unwrap().contains(field));
        }
    }
    // One task's work is bounded by the catalog (issue 19's request: ~29,800 tiles in one
    // call); every field that adds to it is named, and `GET /v1/models` shows the bounds.
    let hostile = json!({"model": "terrain", "width": 2048, "height": 2048, "num_images": 8, "params": {"tile_overlap": 96}});
    let (status, reply) = c.submit(&hostile).await.unwrap();
    assert_eq!(status, 400, "{reply}");
    let named: BTreeSet<&str> = rejected_fields(&reply).into_iter().map(|(f, _)| f).collect();
    assert_eq!(
        named,
        BTreeSet::from(["width", "height", "num_images", "params.tile_overlap"]),
        "{reply}"
    );
    let reasons: Vec<&str> = rejected_fields(&reply).into_iter().map(|(_, m)| m).collect();
    for bound in ["max_task_pixels", "max_task_rows"] {
        assert!(reasons.iter().any(|m| m.contains(bound)), "{reply}");
    }
    assert_eq!(
        reply["message"], "invalid field(s): width, height, num_images, params.tile_overlap",
        "each field named once"
    );
    let models: Value = reqwest::get(format!("{}/v1/models", c.producer_url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let terrain = models["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "terrain")
        .unwrap();
    assert_eq!(
        (terrain["max_task_pixels"].as_u64(), terrain["max_task_rows"].as_u64()),
        (Some(8_388_608), Some(1024))
    );
    // The lanes, best first; without a key, not which the caller may use.
    assert_eq!(
        models["lanes"],
        json!({"names": ["interactive", "standard", "batch"], "default": "standard"})
    );
    let with_key = |key: &str| {
        reqwest::Client::new()
            .get(format!("{}/v1/models", c.producer_url))
            .bearer_auth(key)
            .send()
    };
    let mine: Value = with_key(API_KEY).await.unwrap().json().await.unwrap();
    assert_eq!(
        mine["lanes"]["granted"],
        json!(["standard", "batch"]),
        "a tenant not listed in SLUICE_TENANT_LANES"
    );
    assert_eq!(with_key("not-a-key").await.unwrap().status(), 401);

    // Not JSON at all.
    let response = reqwest::Client::new()
        .post(format!("{}/v1/tasks", c.producer_url))
        .bearer_auth(API_KEY)
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(response.json::<Value>().await.unwrap()["error"], "invalid_json");
    // Unauthenticated.
    assert_eq!(c.post(&json!({"model": "terrain"}), None).await.unwrap().0, 401);
    assert_eq!(c.post(&json!({"model": "terrain"}), Some("wrong")).await.unwrap().0, 401);
    // Too large.
    let huge = json!({"model": "terrain", "prompt": "x".repeat(100_000)});
    assert_eq!(c.submit(&huge).await.unwrap().0, 413);
}

#[tokio::test(flavor = "multi_thread")]
async fn setup_mistakes_are_clear_startup_errors() {
    let c = cluster().await;
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

    let c = cluster().await;
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
    let client = reqwest::Client::new();
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

/// A panic in model code fails its task and nothing else: a worker whose model code panics on
/// chosen tasks (`SLUICE_TEST_FAULTS`: preparing one, the batch call holding another, rendering
/// a third) completes every other task of their batches, dead-letters the three as
/// `model_error` with the panic message, commits past them and stays ready; a restarted worker
/// does not read them again.
#[tokio::test(flavor = "multi_thread")]
async fn a_panic_in_model_code_fails_its_task_and_the_partition_moves_on() {
    use sluice_integration_tests::cluster::Worker;
    use sluice_integration_tests::{ids_of, publish_tasks};

    let c = cluster().await;
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
    assert!(reqwest::get(format!("{}/readyz", worker.url)).await.unwrap().status().is_success());
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

    let c = cluster().await;
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

    let c = cluster().await;
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

    let c = cluster().await;
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

    let c = cluster().await;
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

/// Every error answer of both services is JSON `{error, message, fields}`, unknown routes,
/// wrong methods, oversized and unreadable bodies included.
#[tokio::test(flavor = "multi_thread")]
async fn every_http_error_of_both_services_is_json() {
    let c = cluster().await;
    let client = reqwest::Client::new();
    let worker = &c.workers[0].url;
    let producer = &c.producer_url;
    let huge = "x".repeat(100_000);
    let cases: Vec<(reqwest::RequestBuilder, u16, &str)> = vec![
        (client.get(format!("{producer}/nowhere")), 404, "not_found"),
        (
            client.put(format!("{producer}/v1/tasks")).bearer_auth(API_KEY),
            405,
            "method_not_allowed",
        ),
        (
            client
                .get(format!("{producer}/v1/tasks/{}", uuid::Uuid::new_v4()))
                .bearer_auth(API_KEY),
            404,
            "not_found",
        ),
        (
            client.get(format!("{producer}/v1/tasks/not-a-task")).bearer_auth(API_KEY),
            404,
            "not_found",
        ),
        (
            client.get(format!("{producer}/v1/tasks?limit=0")).bearer_auth(API_KEY),
            400,
            "invalid_request",
        ),
        (client.get(format!("{producer}/v1/tasks")), 401, "unauthorized"),
        (client.delete(format!("{producer}/healthz")), 405, "method_not_allowed"),
        (
            client.post(format!("{producer}/v1/tasks")).bearer_auth(API_KEY).body(huge),
            413,
            "payload_too_large",
        ),
        (
            client.post(format!("{producer}/v1/tasks")).bearer_auth(API_KEY).body("{nope"),
            400,
            "invalid_json",
        ),
        (client.post(format!("{producer}/v1/tasks")).body("{}"), 401, "unauthorized"),
        (
            client
                .post(format!("{producer}/v1/tasks"))
                .bearer_auth(API_KEY)
                .json(&json!({"model": "terrain", "width": 1})),
            400,
            "invalid_request",
        ),
        (client.get(format!("{worker}/nowhere")), 404, "not_found"),
        (client.get(format!("{worker}/admin/reload")), 405, "method_not_allowed"),
        (
            client
                .post(format!("{worker}/admin/reload"))
                .bearer_auth(ADMIN_TOKEN)
                .header("content-type", "application/json")
                .body("{nope"),
            400,
            "bad_request",
        ),
        (
            client
                .post(format!("{worker}/admin/reload"))
                .bearer_auth(ADMIN_TOKEN)
                .json(&json!({"colour": "red"})),
            422,
            "unprocessable_entity",
        ),
        (
            client
                .post(format!("{worker}/admin/reload"))
                .bearer_auth(ADMIN_TOKEN)
                .json(&json!({"model": "nope"})),
            404,
            "unknown_model",
        ),
        (
            client.post(format!("{worker}/admin/reload")).json(&json!({"model": "terrain"})),
            401,
            "unauthorized",
        ),
        (
            client
                .post(format!("{worker}/admin/reload"))
                .bearer_auth(format!("{ADMIN_TOKEN}x"))
                .json(&json!({"model": "terrain"})),
            401,
            "unauthorized",
        ),
        (
            client
                .post(format!("{worker}/admin/reload"))
                .bearer_auth(ADMIN_TOKEN)
                .json(&json!({"intra_threads": 100_000})),
            400,
            "invalid_request",
        ),
        (
            client
                .post(format!("{worker}/admin/reload"))
                .bearer_auth(ADMIN_TOKEN)
                .json(&json!({"gpu_mem_limit": 1})),
            400,
            "invalid_request",
        ),
        (client.get(format!("{producer}/metrics")), 404, "not_found"),
    ];
    for (request, status, code) in cases {
        let response = request.send().await.unwrap();
        let url = response.url().to_string();
        assert_eq!(response.status().as_u16(), status, "{url}");
        assert_eq!(response.headers()["content-type"].to_str().unwrap(), "application/json", "{url}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"], code, "{url}: {body}");
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()), "{url}: {body}");
        assert!(body["fields"].is_array(), "{url}: {body}");
    }
}

/// The 202's `Location` answers: queued at once (written through), then the result with the
/// same outputs as the completion event; another tenant gets a 404 for it.
#[tokio::test(flavor = "multi_thread")]
async fn a_task_status_follows_the_task_to_its_result_and_only_its_tenant_sees_it() {
    let c = cluster().await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/tasks", c.producer_url))
        .bearer_auth(API_KEY)
        .json(&json!({"model": "terrain", "width": 96, "height": 64, "num_images": 2, "seed": 77}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
    let location = response.headers()["location"].to_str().unwrap().to_owned();
    let id = response.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_owned();
    assert_eq!(location, format!("/v1/tasks/{id}"));
    let url = format!("{}{location}", c.producer_url);
    let (status, first) = get_json(&url, API_KEY).await;
    assert_eq!(status, 200, "{first}");
    assert!(
        ["queued", "running", "succeeded"].contains(&first["status"].as_str().unwrap()),
        "{first}"
    );
    assert_eq!(first["model"], "terrain");

    let done = c
        .wait_for_status(&id, API_KEY, "succeeded", Duration::from_secs(120))
        .await
        .unwrap();
    let completion = &completions_for(c.stack.brokers(), &BTreeSet::from([id.clone()]), Duration::from_secs(60))[&id];
    let outputs: Vec<&str> = done["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["sha256"].as_str().unwrap())
        .collect();
    let expected: Vec<&str> = completion.outputs.iter().map(|o| o.sha256.as_str()).collect();
    assert_eq!(outputs, expected);
    assert_eq!(done["outputs"][0]["key"], completion.outputs[0].key.as_str());
    // The client downloads its image over plain HTTP through the presigned URL.
    for output in done["outputs"].as_array().unwrap() {
        let url = output["url"].as_str().unwrap();
        assert!(url.starts_with("http") && url.contains("X-Amz-Signature"), "presigned: {url}");
        let bytes = reqwest::get(url).await.unwrap().error_for_status().unwrap().bytes().await.unwrap();
        assert_eq!(sha256_hex(&bytes), output["sha256"].as_str().unwrap());
    }
    assert!(done["timings"]["total_ms"].as_u64().is_some(), "{done}");
    assert!(done["updated_at"].as_str().unwrap() >= done["created_at"].as_str().unwrap());

    let (status, body) = get_json(&url, RIVAL_KEY).await;
    assert_eq!(status, 404, "another tenant's task does not exist for it: {body}");
    assert_eq!(body["error"], "not_found");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_lists_its_own_tasks_newest_first_page_by_page() {
    let c = cluster().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/tasks", c.producer_url))
            .bearer_auth(RIVAL_KEY)
            .json(&json!({"model": "terrain", "seed": 500 + i}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 202);
        ids.push(response.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_owned());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let url = match &cursor {
            Some(c2) => format!("{}/v1/tasks?limit=2&cursor={c2}", c.producer_url),
            None => format!("{}/v1/tasks?limit=2", c.producer_url),
        };
        let (status, page) = get_json(&url, RIVAL_KEY).await;
        assert_eq!(status, 200, "{page}");
        let tasks = page["tasks"].as_array().unwrap();
        assert!(tasks.len() <= 2);
        seen.extend(tasks.iter().map(|t| t["task_id"].as_str().unwrap().to_owned()));
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    ids.reverse();
    assert_eq!(seen, ids, "every task of the tenant, newest first, each once");
    // Another tenant's list holds none of them; a status filter narrows.
    let (_, acme) = get_json(&format!("{}/v1/tasks?limit=500", c.producer_url), API_KEY).await;
    assert!(
        acme["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| !ids.contains(&t["task_id"].as_str().unwrap().to_owned()))
    );
    let (status, failed) = get_json(&format!("{}/v1/tasks?status=failed", c.producer_url), RIVAL_KEY).await;
    assert_eq!(status, 200);
    assert!(failed["tasks"].as_array().unwrap().is_empty(), "{failed}");
}

/// POST with an `Idempotency-Key`: a retry with the same body is the same 202 and task id and
/// creates no second task; the same key with another body is a 422 naming the header.
#[tokio::test(flavor = "multi_thread")]
async fn a_retried_request_with_its_idempotency_key_is_one_task() {
    let c = cluster().await;
    let key = format!("order-{}", uuid::Uuid::new_v4());
    let post = |body: Value, key: String| async move {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/tasks", c.producer_url))
            .bearer_auth(API_KEY)
            .header("idempotency-key", key)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json::<Value>().await.unwrap())
    };
    let body = json!({"model": "terrain", "seed": 4242, "params": {"difficulty": 33}});
    let (s1, first) = post(body.clone(), key.clone()).await;
    let (s2, second) = post(body.clone(), key.clone()).await;
    assert_eq!((s1, s2), (202, 202), "{first} {second}");
    assert_eq!(first["task_id"], second["task_id"]);
    let id = first["task_id"].as_str().unwrap().to_owned();
    let (s3, conflict) = post(json!({"model": "terrain", "seed": 4243}), key.clone()).await;
    assert_eq!(s3, 422, "{conflict}");
    assert_eq!(conflict["error"], "idempotency_conflict");
    assert_eq!(rejected_fields(&conflict)[0].0, "Idempotency-Key");
    let (s4, bad) = post(body.clone(), "has spaces in it".into()).await;
    assert_eq!(s4, 400, "{bad}");

    completions_for(c.stack.brokers(), &BTreeSet::from([id.clone()]), Duration::from_secs(120));
    // One task record with that id on the tasks topic, one completion.
    let tasks = TopicReader::snapshot(c.stack.brokers(), topics::TASKS, Duration::from_secs(2)).unwrap();
    let records = tasks.iter().filter(|r| r.key.as_deref() == Some(id.as_bytes())).count();
    assert_eq!(records, 1, "the retry published nothing");
    let completions = TopicReader::snapshot(c.stack.brokers(), topics::COMPLETIONS, Duration::from_secs(2)).unwrap();
    assert_eq!(completions.iter().filter(|r| r.key.as_deref() == Some(id.as_bytes())).count(), 1);
}

/// Two different bodies sent with one new `Idempotency-Key` at once: one is accepted, the other
/// is a 422 `idempotency_conflict`, whichever order the producer sees them in (in flight or
/// already in its view), and one task record is published.
#[tokio::test(flavor = "multi_thread")]
async fn two_bodies_racing_with_one_idempotency_key_publish_one_task() {
    let c = cluster().await;
    let key = format!("race-{}", uuid::Uuid::new_v4());
    let post = |seed: u64| {
        reqwest::Client::new()
            .post(format!("{}/v1/tasks", c.producer_url))
            .bearer_auth(API_KEY)
            .header("idempotency-key", key.as_str())
            .json(&json!({"model": "terrain", "seed": seed, "width": 64, "height": 64}))
            .send()
    };
    let (a, b) = tokio::join!(post(1), post(2));
    let mut statuses = [a.unwrap().status().as_u16(), b.unwrap().status().as_u16()];
    statuses.sort();
    assert_eq!(statuses, [202, 422]);
    let id = sluice_producer::publish::idempotent_task_id("acme", &key).to_string();
    completions_for(c.stack.brokers(), &BTreeSet::from([id.clone()]), Duration::from_secs(120));
    let tasks = TopicReader::snapshot(c.stack.brokers(), topics::TASKS, Duration::from_secs(2)).unwrap();
    assert_eq!(tasks.iter().filter(|r| r.key.as_deref() == Some(id.as_bytes())).count(), 1);
}

/// A key reused for another request that got past the producer (another replica, or after the
/// view forgot the first): the worker finds the first request's results under the task id with
/// another request hash and dead-letters the second record as `idempotency_conflict` instead of
/// announcing the first one's images as its own; the view keeps showing the first request.
#[tokio::test(flavor = "multi_thread")]
async fn a_reused_idempotency_key_never_announces_another_requests_images() {
    let c = cluster().await;
    let kafka = producer(c.stack.brokers()).unwrap();
    let id = uuid::Uuid::new_v4().to_string();
    let record = |seed: u64, hash: &str| {
        let (_, mut record) = terrain_task(seed, 64, 64, 5);
        record["task_id"] = json!(id);
        record["idempotency"] = json!({"key": "reused", "request_sha256": hash});
        (id.clone(), record)
    };
    let ids = BTreeSet::from([id.clone()]);
    sluice_integration_tests::publish_tasks(&kafka, topics::TASKS, &[record(1, &"a".repeat(64))])
        .await
        .unwrap();
    let first = completions_for(c.stack.brokers(), &ids, Duration::from_secs(120));
    assert_eq!(first[&id].status, CompletionStatus::Succeeded);
    sluice_integration_tests::publish_tasks(&kafka, topics::TASKS, &[record(2, &"b".repeat(64))])
        .await
        .unwrap();
    let outcomes = Outcomes::wait_settled(c.stack.brokers(), &Topics::default(), &ids, Duration::from_secs(120), |cs| {
        cs.len() >= 2
    })
    .unwrap();
    let second = &outcomes.completions[&id][1];
    assert_eq!(second.status, CompletionStatus::Failed, "{second:?}");
    assert!(second.outputs.is_empty(), "no images announced for the second request");
    assert_eq!(outcomes.dlq_reason(&id), Some("idempotency_conflict"));
    // The view shows the request that first used the key, with its images.
    let url = format!("{}/v1/tasks/{id}", c.producer_url);
    let status = sluice_integration_tests::wait_for("the view has both", Duration::from_secs(30), async || {
        let (code, body) = get_json(&url, API_KEY).await;
        (code == 200 && body["status"] == "succeeded").then_some(body)
    })
    .await
    .unwrap();
    assert_eq!(status["outputs"].as_array().map(Vec::len), Some(1), "{status}");
}

/// Deadlines: a task dequeued after its deadline is not run and completes `expired` (no DLQ
/// record); a request with a deadline in the past, or with both forms, is a 400.
#[tokio::test(flavor = "multi_thread")]
async fn a_task_past_its_deadline_expires_unrun_and_bad_deadlines_are_refused() {
    let c = cluster().await;
    for (body, field) in [
        (json!({"model": "terrain", "deadline": "2020-01-01T00:00:00Z"}), "deadline"),
        (json!({"model": "terrain", "deadline": "2999-01-01T00:00:00Z"}), "deadline"),
        (
            json!({"model": "terrain", "deadline": "2030-01-01T00:00:00Z", "ttl_seconds": 60}),
            "deadline",
        ),
        (json!({"model": "terrain", "ttl_seconds": 0}), "ttl_seconds"),
    ] {
        let (status, reply) = c.submit(&body).await.unwrap();
        assert_eq!(status, 400, "{body}: {reply}");
        assert!(names_field(&reply, field), "{body}: {reply}");
    }
    // A task with a comfortable ttl runs.
    let fine = c
        .submit_ok(&json!({"model": "terrain", "ttl_seconds": 3600, "seed": 9}))
        .await
        .unwrap();
    // A record whose deadline passed while it waited (written to the topic directly, as a
    // producer would have an hour ago).
    let (late, mut record) = sluice_integration_tests::terrain_task(10, 128, 128, 20);
    record["deadline"] = json!((chrono::Utc::now() - chrono::Duration::seconds(5)).to_rfc3339());
    let kafka = producer(c.stack.brokers()).unwrap();
    sluice_integration_tests::publish_tasks(&kafka, topics::TASKS, &[(late.clone(), record)])
        .await
        .unwrap();

    let done = completions_for(
        c.stack.brokers(),
        &BTreeSet::from([fine.clone(), late.clone()]),
        Duration::from_secs(120),
    );
    assert_eq!(done[&fine].status, CompletionStatus::Succeeded);
    assert_eq!(done[&late].status, CompletionStatus::Expired, "{:?}", done[&late]);
    assert!(done[&late].outputs.is_empty() && done[&late].error.is_none());
    let dlq = TopicReader::snapshot(c.stack.brokers(), topics::DLQ, Duration::from_secs(2)).unwrap();
    assert!(
        !dlq.iter().any(|r| r.key.as_deref() == Some(late.as_bytes())),
        "expiry is not a DLQ record"
    );
    assert!(c.stack.sink().unwrap().read(&format!("outputs/{late}/0.png")).await.is_err());
}

const WEBHOOK_KEY: &[u8] = b"sluice-test-webhook-secret-32byt";

#[tokio::test(flavor = "multi_thread")]
async fn a_signed_webhook_is_retried_across_a_producer_restart_and_delivered_once() {
    let (receiver, base) = Receiver::start().await;
    let secret = format!("acme:whsec_{}", base64::engine::general_purpose::STANDARD.encode(WEBHOOK_KEY));
    let mut c = Cluster::start_with(
        "webhooks",
        1,
        &[],
        &[
            ("SLUICE_WEBHOOK_SECRETS", secret.as_str()),
            ("SLUICE_WEBHOOK_ALLOW_CIDRS", "127.0.0.0/8"),
            ("SLUICE_WEBHOOK_RETRY_SCHEDULE", "1s,2s,2s,2s"),
            ("SLUICE_WEBHOOK_GROUP_INSTANCE_ID", "producer-0"),
        ],
    )
    .await
    .expect("cluster starts");

    // Refused at submit: internal addresses, other schemes, tenants without a secret.
    for (url, key, field) in [
        ("https://169.254.169.254/latest/meta-data/", API_KEY, "webhook.url"),
        ("http://10.1.2.3/hook", API_KEY, "webhook.url"),
        ("https://[::1]/hook", API_KEY, "webhook.url"),
        ("https://hooks.example.com/hook", RIVAL_KEY, "webhook"),
    ] {
        let (status, body) = c
            .post(&json!({"model": "terrain", "webhook": {"url": url}}), Some(key))
            .await
            .unwrap();
        assert_eq!(status, 400, "{url}: {body}");
        assert_eq!(rejected_fields(&body)[0].0, field, "{url}: {body}");
    }

    let task = |mode: &str| json!({"model": "terrain", "width": 64, "height": 64, "webhook": {"url": format!("{base}/hook/{mode}")}});
    let id = c.submit_ok(&task("flaky")).await.unwrap();
    let gone = c.submit_ok(&task("gone")).await.unwrap();
    // Two failed attempts, then the producer is killed and started again: the third attempt
    // comes from the retry topic.
    sluice_integration_tests::wait_for("two attempts", Duration::from_secs(90), async || {
        (receiver.all().iter().filter(|r| r.mode == "flaky").count() >= 2).then_some(())
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    c.kill_and_restart_producer().await.unwrap();
    let delivered = sluice_integration_tests::wait_for("the delivery", Duration::from_secs(90), async || {
        receiver.all().into_iter().find(|r| r.mode == "flaky" && r.answered == 204)
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await; // anything duplicated would come by now
    let attempts: Vec<Received> = receiver.all().into_iter().filter(|r| r.mode == "flaky").collect();
    let answers: Vec<u16> = attempts.iter().map(|r| r.answered).collect();
    assert_eq!(answers, [503, 503, 503, 204], "three failures, then exactly one delivery");
    assert!(attempts.iter().all(|r| r.id == delivered.id && r.event == "completed"));
    assert!(
        attempts.iter().all(|r| r.signed_with(WEBHOOK_KEY)),
        "every attempt is signed with the tenant's secret"
    );
    assert!(delivered.id.starts_with("msg_"));
    let age = chrono::Utc::now().timestamp() - delivered.timestamp.parse::<i64>().unwrap();
    assert!((0..60).contains(&age), "webhook-timestamp is the attempt's time");

    // The body is the task's GET body.
    let payload: Value = serde_json::from_slice(&delivered.body).unwrap();
    let (status, view) = get_json(&format!("{}/v1/tasks/{id}", c.producer_url), API_KEY).await;
    assert_eq!(status, 200);
    assert_eq!(payload["task_id"], id.as_str());
    assert_eq!(payload["status"], "succeeded");
    assert_eq!(payload["outputs"][0]["key"], view["outputs"][0]["key"]);
    assert_eq!(payload["outputs"][0]["sha256"], view["outputs"][0]["sha256"]);
    let image = payload["outputs"][0]["url"].as_str().unwrap();
    let bytes = reqwest::get(image)
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(sha256_hex(&bytes), payload["outputs"][0]["sha256"].as_str().unwrap());

    // 410: one attempt, then the event is given up on the webhook DLQ.
    let mut dlq = TopicReader::new(c.stack.brokers(), topics::WEBHOOK_DLQ).unwrap();
    let records = dlq
        .read_until(Duration::from_secs(60), |r| r.iter().any(|m| m.json()["task_id"] == gone.as_str()))
        .unwrap();
    let record: sluice_schemas::WebhookDlqRecord =
        serde_json::from_value(records.iter().find(|m| m.json()["task_id"] == gone.as_str()).unwrap().json()).unwrap();
    assert_eq!(record.reason, sluice_schemas::WebhookFailure::Gone);
    assert_eq!((record.attempts, record.last_status), (1, Some(410)));
    let gone_attempts: Vec<Received> = receiver.all().into_iter().filter(|r| r.mode == "gone").collect();
    assert_eq!(gone_attempts.len(), 1);
    // Delivery latency: from the completion's time to the receiver's first request.
    let completions = completions_for(
        c.stack.brokers(),
        &BTreeSet::from([id.clone(), gone.clone()]),
        Duration::from_secs(30),
    );
    let latency = |task: &str, at: chrono::DateTime<chrono::Utc>| (at - completions[task].completed_at).num_milliseconds();
    let first_flaky = attempts[0].received_at;
    println!(
        "webhook delivery latency (completion to first attempt) of the first two tasks, while the notifier group formed: {} ms and {} ms",
        latency(&id, first_flaky),
        latency(&gone, gone_attempts[0].received_at)
    );
    // Once the notifier is running (the two above waited for the group to form): a few more.
    let mut latencies = Vec::new();
    for _ in 0..5 {
        let task = c.submit_ok(&task("ok")).await.unwrap();
        let received = sluice_integration_tests::wait_for("a delivery", Duration::from_secs(60), async || {
            receiver
                .all()
                .into_iter()
                .find(|r| r.mode == "ok" && r.json()["task_id"] == task.as_str())
        })
        .await
        .unwrap();
        let completion = &completions_for(c.stack.brokers(), &BTreeSet::from([task.clone()]), Duration::from_secs(30))[&task];
        latencies.push((received.received_at - completion.completed_at).num_milliseconds());
    }
    latencies.sort();
    println!("webhook delivery latency with the notifier running, 5 tasks: {latencies:?} ms");
    let metrics = c.producer_metrics().await.unwrap();
    assert!(
        metrics.contains("sluice_producer_webhook_deliveries_total{event=\"completed\",outcome=\"delivered\"} 6"),
        "{metrics}"
    );
    c.stack.down().unwrap();
}

/// schemathesis (pinned by `scripts/install-tools.sh`) against a live producer: ≥ 1,000
/// generated requests across every operation of `/openapi.json`, with a valid key and without
/// one; no answer may be a 5xx or differ from the document (status, content type, headers,
/// body schema).
#[tokio::test(flavor = "multi_thread")]
async fn the_api_answers_schemathesis_as_its_openapi_document_says() {
    let schemathesis = sluice_integration_tests::tool("schemathesis-4.32.5", "bin/schemathesis");
    let secret = format!("acme:whsec_{}", base64::engine::general_purpose::STANDARD.encode(WEBHOOK_KEY));
    let c = Cluster::start_with(
        "api-fuzz",
        0,
        &[],
        &[
            ("SLUICE_WEBHOOK_SECRETS", secret.as_str()),
            // Streams of tasks that never run (no workers here) end at once.
            ("SLUICE_EVENTS_MAX_SECONDS", "0.2"),
        ],
    )
    .await
    .expect("cluster starts");
    let run = |auth: Option<&str>, examples: &str| {
        let mut command = std::process::Command::new(&schemathesis);
        command
            .current_dir(&c.stack.dir)
            .env("SCHEMATHESIS_HOOKS", "")
            .args(["run", &format!("{}/openapi.json", c.producer_url)])
            .args([
                "--checks",
                "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance",
            ])
            // One worker: the Python here (3.11.7) has a CPython bug in concurrent `ast.parse` that
            // Hypothesis trips over from several threads ("AST constructor recursion depth mismatch").
            .args(["--max-examples", examples, "-w", "1", "--seed", "1"]);
        if let Some(key) = auth {
            command.args(["-H", &format!("Authorization: Bearer {key}")]);
        }
        let output = command.output().expect("schemathesis runs");
        let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
        let generated: u64 = text
            .lines()
            .find_map(|l| l.trim().split_once(" generated").and_then(|(n, _)| n.trim().parse().ok()))
            .unwrap_or(0);
        (output.status.success(), generated, text)
    };
    let (ok, with_key, text) = run(Some(API_KEY), "100");
    assert!(ok, "schemathesis found problems with a valid key:\n{text}");
    let (ok, without_key, text) = run(None, "15");
    // Without a key every /v1 operation answers 401 as documented; schemathesis warns that they
    // "returned only 401" — the point of this run — and its exit status stays 0 on warnings.
    assert!(ok, "schemathesis found problems without a key:\n{text}");
    println!("schemathesis: {with_key} generated requests with a valid key, {without_key} without, 0 failures");
    let metrics = c.producer_metrics().await.unwrap();
    let lag = |q| histogram_quantile(&metrics, "sluice_producer_status_view_lag_seconds", q).unwrap_or(f64::NAN) * 1000.0;
    let records = metric_value(&metrics, "sluice_producer_status_view_lag_seconds_count").unwrap_or(0.0);
    println!(
        "status view lag behind the topic over {records} records: p50 {:.0} ms, p99 {:.0} ms",
        lag(0.5),
        lag(0.99)
    );
    assert!(with_key + without_key >= 1000, "{with_key} + {without_key} generated requests");
    c.stack.down().unwrap();
}

/// One tenant's failing receiver does not hold up another tenant's webhooks. Tenant acme's
/// receiver answers every attempt 503 with `Retry-After: 999999`; the notifier may hold only
/// 20 records in flight (`SLUICE_WEBHOOK_MAX_PENDING`). After acme's 40 tasks have finished
/// and been attempted, tenant rival's `completed` still reaches its own receiver within
/// seconds: acme's retries wait on the retry topic, not in the notifier's memory (before, each
/// slept in memory, 40 of them paused every partition of the notifier for hours).
#[tokio::test(flavor = "multi_thread")]
async fn one_tenants_failing_receiver_does_not_hold_up_another_tenants_webhooks() {
    let (busy, busy_base) = Receiver::start().await;
    let (calm, calm_base) = Receiver::start().await;
    let key = base64::engine::general_purpose::STANDARD.encode(WEBHOOK_KEY);
    let secrets = format!("acme:whsec_{key},rival:whsec_{key}");
    let c = Cluster::start_with(
        "webhook-fairness",
        1,
        &[],
        &[
            ("SLUICE_WEBHOOK_SECRETS", secrets.as_str()),
            ("SLUICE_WEBHOOK_ALLOW_CIDRS", "127.0.0.0/8"),
            ("SLUICE_WEBHOOK_MAX_PENDING", "20"),
        ],
    )
    .await
    .expect("cluster starts");
    let task = |seed: u64, url: String| json!({"model": "terrain", "width": 64, "height": 64, "seed": seed, "webhook": {"url": url}});
    let mut flood = Vec::new();
    for seed in 0..40 {
        let (status, body) = c.post(&task(seed, format!("{busy_base}/hook/busy")), Some(API_KEY)).await.unwrap();
        assert_eq!(status, 202, "{body}");
        flood.push(body["task_id"].as_str().unwrap().to_owned());
    }
    for id in &flood {
        c.wait_for_status(id, API_KEY, "succeeded", Duration::from_secs(120)).await.unwrap();
    }
    let attempted = |r: &Receiver| -> BTreeSet<String> {
        r.all()
            .iter()
            .filter(|x| x.event == "completed")
            .filter_map(|x| x.json()["task_id"].as_str().map(str::to_owned))
            .collect()
    };
    // Every acme event attempted once (the receiver sees the first few: then the host's circuit
    // opens and attempts fail at once) and scheduled for a retry.
    let retrying = "sluice_producer_webhook_deliveries_total{event=\"completed\",outcome=\"retrying\"}";
    let scheduled = sluice_integration_tests::wait_for("acme's retries scheduled", Duration::from_secs(30), async || {
        let metrics = c.producer_metrics().await.ok()?;
        metric_value(&metrics, retrying).filter(|n| *n >= flood.len() as f64)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let (status, body) = c.post(&task(99, format!("{calm_base}/hook/ok")), Some(RIVAL_KEY)).await.unwrap();
    assert_eq!(status, 202, "{body}");
    let id = body["task_id"].as_str().unwrap().to_owned();
    c.wait_for_status(&id, RIVAL_KEY, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let succeeded = std::time::Instant::now();
    let delivered = sluice_integration_tests::wait_for("rival's completed webhook", Duration::from_secs(20), async || {
        attempted(&calm).contains(&id).then_some(())
    })
    .await;
    let metrics = c.producer_metrics().await.unwrap();
    println!(
        "rival's webhook {:?} after its task succeeded; acme: {} requests reached its receiver, {:?} attempts retrying; notifier pending now {:?}",
        succeeded.elapsed(),
        busy.all().len(),
        metric_value(&metrics, retrying),
        metric_value(&metrics, "sluice_producer_webhook_pending"),
    );
    delivered.expect("rival's completed arrives within seconds");
    scheduled.expect("every acme event was attempted and scheduled for a retry");
    assert!(
        busy.all().iter().all(|r| r.event != "completed" || r.answered == 503),
        "acme's receiver only ever answered 503"
    );
}

/// Event streams are bounded per tenant (and per replica): with
/// `SLUICE_EVENTS_MAX_STREAMS_PER_TENANT=2`, a tenant's third open stream is a JSON 429
/// `too_many_streams` with `Retry-After`, another tenant's stream still opens, and a closed
/// stream gives its place back. No workers run, so the streams stay open on queued tasks.
#[tokio::test(flavor = "multi_thread")]
async fn event_streams_are_bounded_per_tenant() {
    let c = Cluster::start_with("streams", 0, &[], &[("SLUICE_EVENTS_MAX_STREAMS_PER_TENANT", "2")])
        .await
        .expect("cluster starts");
    let client = reqwest::Client::new();
    let submit = async |key: &str| {
        let (status, body) = c
            .post(&json!({"model": "terrain", "width": 64, "height": 64}), Some(key))
            .await
            .unwrap();
        assert_eq!(status, 202, "{body}");
        body["task_id"].as_str().unwrap().to_owned()
    };
    let (mine, theirs) = (submit(API_KEY).await, submit(RIVAL_KEY).await);
    let open = async |id: &str, key: &str| {
        client
            .get(format!("{}/v1/tasks/{id}/events", c.producer_url))
            .bearer_auth(key)
            .send()
            .await
            .unwrap()
    };
    let first = open(&mine, API_KEY).await;
    let second = open(&mine, API_KEY).await;
    assert_eq!((first.status().as_u16(), second.status().as_u16()), (200, 200));
    let third = open(&mine, API_KEY).await;
    assert_eq!(third.status().as_u16(), 429);
    assert!(third.headers().get("retry-after").is_some(), "Retry-After");
    let body: Value = third.json().await.unwrap();
    assert_eq!(body["error"], "too_many_streams", "{body}");
    let other = open(&theirs, RIVAL_KEY).await;
    assert_eq!(other.status().as_u16(), 200, "another tenant is not refused");
    // A closed stream's place comes back (the server notices at its next write: the 15 s
    // heartbeat at the latest).
    drop(first);
    let reopened = sluice_integration_tests::wait_for("a place after a stream closed", Duration::from_secs(40), async || {
        let r = open(&mine, API_KEY).await;
        (r.status().as_u16() == 200).then_some(r)
    })
    .await
    .unwrap();
    drop((second, reopened, other));
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
    let cancel = reqwest::Client::new()
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

/// A list request's work is bounded, not only its page: with 2,100 queued tasks (no worker
/// runs) and a filter that matches none of them, `GET /v1/tasks?status=succeeded` answers pages
/// that examined at most 2,000 tasks each, empty, with a cursor to go on from, until the end
/// (before, one request read all 2,100 and more without bound).
#[tokio::test(flavor = "multi_thread")]
async fn a_filtered_list_of_a_large_backlog_is_bounded_work() {
    let c = Cluster::start("list-bounded", 0, &[]).await.expect("cluster starts");
    let tasks: Vec<(String, Value)> = (0..2_100).map(|i| terrain_task(i, 64, 64, 1)).collect();
    let kafka = producer(c.stack.brokers()).unwrap();
    for chunk in tasks.chunks(500) {
        sluice_integration_tests::publish_tasks(&kafka, topics::TASKS, chunk).await.unwrap();
    }
    let list = async |query: &str| get_json(&format!("{}/v1/tasks?{query}", c.producer_url), API_KEY).await;
    // Until the view has read them all (unfiltered pages of 500).
    sluice_integration_tests::wait_for("the view to hold the backlog", Duration::from_secs(60), async || {
        let mut seen = 0;
        let mut cursor = String::new();
        loop {
            let (_, page) = list(&format!("limit=500{cursor}")).await;
            seen += page["tasks"].as_array()?.len();
            match page["next_cursor"].as_str() {
                Some(c) => cursor = format!("&cursor={c}"),
                None => break,
            }
        }
        (seen >= tasks.len()).then_some(())
    })
    .await
    .unwrap();
    let (mut pages, mut cursor) = (0, String::new());
    loop {
        let (status, page) = list(&format!("status=succeeded&limit=10{cursor}")).await;
        assert_eq!(status, 200, "{page}");
        assert!(page["tasks"].as_array().unwrap().is_empty(), "{page}");
        pages += 1;
        match page["next_cursor"].as_str() {
            Some(c) => cursor = format!("&cursor={c}"),
            None => break,
        }
        assert!(pages < 10, "the cursor moves on");
    }
    assert_eq!(pages, 2, "2,100 tasks, at most 2,000 examined per request");
}

/// A restarted producer keeps its status view where the volume survives: killed (-9) and
/// started again on the same store, it is ready and answers for the tasks it knew having read
/// no record again (`sluice_producer_status_view_lag_seconds_count`, one per record applied, stays at
/// what came after the restart); before, the store was deleted on every start and rebuilt from
/// the topics.
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_producer_keeps_its_status_view() {
    let mut c = Cluster::start("view-kept", 1, &[]).await.expect("cluster starts");
    let mut ids = Vec::new();
    for seed in 0..5 {
        ids.push(
            c.submit_ok(&json!({"model": "terrain", "width": 64, "height": 64, "seed": seed}))
                .await
                .unwrap(),
        );
    }
    for id in &ids {
        c.wait_for_status(id, API_KEY, "succeeded", Duration::from_secs(120)).await.unwrap();
    }
    let applied = |m: &str| metric_value(m, "sluice_producer_status_view_lag_seconds_count").unwrap_or(0.0);
    let before = applied(&c.producer_metrics().await.unwrap());
    assert!(before >= 10.0, "the view applied the tasks' records: {before}");
    c.kill_and_restart_producer().await.unwrap();
    sluice_integration_tests::wait_for("the restarted producer ready", Duration::from_secs(60), async || {
        let r = reqwest::get(format!("{}/readyz", c.producer_url)).await.ok()?;
        r.status().is_success().then_some(())
    })
    .await
    .unwrap();
    for id in &ids {
        let (status, body) = get_json(&format!("{}/v1/tasks/{id}", c.producer_url), API_KEY).await;
        assert_eq!((status, body["status"].as_str()), (200, Some("succeeded")), "{body}");
    }
    let after = applied(&c.producer_metrics().await.unwrap());
    println!("status view records applied: {before} before the restart, {after} after it");
    assert!(
        after < 3.0,
        "the kept store read on from where it stopped, not from the beginning: {after} records applied"
    );
}

/// The in-process seam docs/architecture.md promises: a model that is not ONNX at all, handed to
/// `sluice_worker::run` through `Models::Custom`, serves tasks from the real broker as the built-in
/// models do — the same pipeline, storage and completion events. Its "model file" holds an RGB
/// colour, read by its `load` from the directory the catalog names, and every image it renders
/// is that colour at the task's size.
#[tokio::test(flavor = "multi_thread")]
async fn a_model_injected_through_models_custom_serves_tasks_in_process() {
    use clap::Parser;
    use sluice_worker::engine::{Backend, Call, CallKey, EngineError, Placement, SessionOptions, Tensor};
    use sluice_worker::models::encode::{Image, png_rgb8};
    use sluice_worker::models::{Bucket, ModelAdapter, ModelError, Prepared, Registry, Render};
    use sluice_worker::{Exit, Models};

    struct Fill;
    struct FillBackend([u8; 3]);
    struct FillRender(u32, u32);
    impl ModelAdapter for Fill {
        fn bucket(&self, task: &sluice_schemas::TaskRecord) -> Result<Bucket, ModelError> {
            let r = &task.request;
            Ok(Bucket {
                model: task.model.clone(),
                key: CallKey::new(format!("{}x{}", r.width, r.height), Some(u64::from(r.width * r.height))),
                rows_per_task: 1,
                alone: None,
            })
        }
        fn prepare(&self, task: &sluice_schemas::TaskRecord, _inputs: &sluice_worker::models::InputImages) -> Result<Prepared, ModelError> {
            let r = &task.request;
            Ok(Prepared {
                inputs: vec![Tensor::f32("seed", vec![1], vec![r.seed as f32])],
                rows: 1,
                render: Box::new(FillRender(r.width, r.height)),
            })
        }
        fn load(&self, path: &std::path::Path, _: &SessionOptions) -> Result<Box<dyn Backend>, EngineError> {
            let text = std::fs::read_to_string(path).map_err(|e| EngineError::Load(e.to_string()))?;
            let c: Vec<u8> = text.split_whitespace().map(|v| v.parse().expect("a colour")).collect();
            Ok(Box::new(FillBackend([c[0], c[1], c[2]])))
        }
    }
    impl Backend for FillBackend {
        fn run(&mut self, call: &Call) -> Result<Vec<Tensor>, EngineError> {
            let rows = call.inputs[0].rows();
            let colour = self.0.map(f32::from).repeat(rows);
            Ok(vec![Tensor::f32("colour", vec![rows, 3], colour)])
        }
        fn release_memory(&mut self) {}
        fn placement(&self) -> Placement {
            Placement::Cpu
        }
    }
    impl Render for FillRender {
        fn render(&self, outputs: &[Tensor], rows: std::ops::Range<usize>) -> Result<Vec<Image>, ModelError> {
            let c = outputs[0]
                .f32_rows(rows.start, rows.end)
                .ok_or_else(|| ModelError::Failed("no colour".into()))?;
            let pixel = [c[0] as u8, c[1] as u8, c[2] as u8];
            let image = png_rgb8(self.0, self.1, &pixel.repeat((self.0 * self.1) as usize)).map_err(ModelError::Failed)?;
            Ok(vec![image])
        }
    }

    let c = cluster().await;
    let topics = c.stack.topics("custom-model", 1).unwrap();
    let dir = std::env::temp_dir().join(format!("sluice-custom-model-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(dir.join("models/terrain")).unwrap();
    std::fs::write(dir.join("models/terrain/model.onnx"), "7 99 200").unwrap();
    let (brokers, out, models) = (
        c.stack.brokers().to_owned(),
        format!("file://{}", dir.join("out").display()),
        dir.join("models").display().to_string(),
    );
    let config = sluice_worker::config::Config::try_parse_from([
        "sluice-worker",
        "--kafka-brokers",
        &brokers,
        "--output-url",
        &out,
        "--model-dir",
        &models,
        "--models",
        "terrain",
        "--listen",
        "127.0.0.1:0",
        "--worker-id",
        "custom-0",
        "--group-id",
        "custom-model",
        "--tasks-topic",
        &topics.tasks,
        "--completions-topic",
        &topics.completions,
        "--dlq-topic",
        &topics.dlq,
        "--ceilings-topic",
        &topics.ceilings,
    ])
    .expect("worker flags");
    let registry = Registry::default().with("terrain", std::sync::Arc::new(Fill));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(sluice_worker::run(config, Models::Custom(registry), async move {
        let _ = stopped.await;
    }));

    let tasks = [
        terrain_task(1, 64, 48, 10),
        terrain_task(2, 32, 32, 10),
        terrain_task(3, 64, 48, 10),
    ];
    sluice_integration_tests::publish_tasks(&producer(&brokers).unwrap(), &topics.tasks, &tasks)
        .await
        .unwrap();
    let ids = sluice_integration_tests::ids_of(&tasks);
    let outcomes = Outcomes::wait(&brokers, &topics, &ids, Duration::from_secs(60)).unwrap();
    let store = sluice_worker::storage::images::ImageStore::from_url(&out).unwrap();
    for (id, record) in &tasks {
        let event = &outcomes.completions[id][0];
        assert_eq!(event.status, CompletionStatus::Succeeded, "{event:?}");
        assert_eq!(event.worker_id, "custom-0");
        let bytes = store.read(&event.outputs[0].key).await.unwrap();
        assert_eq!(sha256_hex(&bytes), event.outputs[0].sha256);
        let mut reader = png::Decoder::new(std::io::Cursor::new(bytes.to_vec())).read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut pixels).unwrap();
        let (w, h) = (
            record["request"]["width"].as_u64().unwrap(),
            record["request"]["height"].as_u64().unwrap(),
        );
        assert_eq!((info.width as u64, info.height as u64), (w, h));
        assert!(
            pixels[..info.buffer_size()].chunks(3).all(|p| p == [7, 99, 200]),
            "every pixel is the model file's colour"
        );
    }
    stop.send(()).unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(60), worker)
        .await
        .expect("the worker stops");
    assert_eq!(exit.unwrap().expect("the worker started"), Exit::Clean);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One request cannot exhaust the producer (input images on, so bodies of ~11 MB are read).
/// With room for one such body at a time (`SLUICE_BODY_BYTES_IN_FLIGHT`), a second is answered
/// 503 with `Retry-After` as soon as its headers arrive, before its body is read. Then 20 hostile
/// bodies at once, each 11 MB of `"negative_prompt": [0,0,…]` (a JSON tree of ~400 MB if parsed),
/// are each a 413 (refused by their size once images are left out, before any tree is built) or
/// turned away unread (the 503; a client still writing its body sees the connection close). The
/// producer's peak RSS stays under 300 MB, and it goes on accepting tasks.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_hostile_bodies_at_once_neither_exhaust_nor_stop_the_producer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = cluster().await;
    let stack = &c.stack;
    assert!(stack.env.contains_key("SLUICE_INPUT_URL"), "input images on: the large body limit");
    let store = stack.dir.join("hostile/view.redb");
    let (mut producer, url) = lone_producer(stack, "hostile-producer", &store, &[("SLUICE_BODY_BYTES_IN_FLIGHT", "1")])
        .await
        .unwrap();
    let port: u16 = url.rsplit_once(':').unwrap().1.parse().unwrap();

    // One body being read holds the room; a second is turned away at its headers. The two
    // connections race for the room, so either may be the one turned away: whichever is
    // answered first must be answered 503 before any of its body was read.
    let head = format!(
        "POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: 11000000\r\n\r\n"
    );
    let (mut holder, mut holder_writes) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap().into_split();
    holder_writes.write_all(head.as_bytes()).await.unwrap();
    let holding = tokio::spawn(async move {
        // Part of the body, never all of it, and the connection kept open until aborted; a
        // refused holder sees its writes fail.
        let _ = holder_writes.write_all(&[b' '; 1 << 20]).await;
        std::future::pending::<()>().await;
    });
    let mut second = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    second.write_all(head.as_bytes()).await.unwrap();
    let (mut one, mut other) = (vec![0; 4096], vec![0; 4096]);
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::select! {
            n = holder.read(&mut one) => (true, n),
            n = second.read(&mut other) => (false, n),
        }
    });
    let (holder_answered, n) = answered.await.expect("neither was answered before its body was sent");
    let answer = if holder_answered { &one } else { &other };
    let answer = String::from_utf8_lossy(&answer[..n.unwrap()]).to_lowercase();
    assert!(answer.starts_with("http/1.1 503") && answer.contains("retry-after: 1"), "{answer}");
    holding.abort();
    drop((holder, second));

    let mut hostile = br#"{"model":"terrain","prompt":"x","negative_prompt":["#.to_vec();
    while hostile.len() < 11_000_000 {
        hostile.extend_from_slice(b"0,0,0,0,0,0,0,0,0,0,");
    }
    hostile.extend_from_slice(b"0]}");
    // The room comes back once the producer sees the held body's connection closed: one hostile
    // body alone is read, and refused by size.
    let client = reqwest::Client::new();
    let alone = async {
        loop {
            let reply = client
                .post(format!("{url}/v1/tasks"))
                .bearer_auth(API_KEY)
                .body(hostile.clone())
                .send()
                .await;
            match reply.map(|r| r.status().as_u16()) {
                Ok(503) | Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                answer => break answer.unwrap(),
            }
        }
    };
    let alone = tokio::time::timeout(Duration::from_secs(10), alone)
        .await
        .expect("the held room was given back");
    assert_eq!(alone, 413);
    let sends = (0..20).map(|_| {
        let (client, body, url) = (client.clone(), hostile.clone(), format!("{url}/v1/tasks"));
        async move {
            let sent = client
                .post(url)
                .bearer_auth(API_KEY)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await;
            // An answer, or the connection closed while the body was still being written: the
            // 503 above, sent before the body was read.
            sent.map(|r| r.status().as_u16()).map_err(|e| format!("{e:?}"))
        }
    });
    let answers = futures::future::join_all(sends).await;
    let too_large = answers.iter().filter(|a| **a == Ok(413)).count();
    let unread = answers
        .iter()
        .filter(|a| a.as_ref().is_err_and(|e| e.contains("BodyWrite")) || **a == Ok(503))
        .count();
    assert_eq!(too_large + unread, answers.len(), "{answers:?}");
    assert!(too_large >= 1, "{answers:?}");
    let status = std::fs::read_to_string(format!("/proc/{}/status", producer.pid().unwrap())).unwrap();
    let peak_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    eprintln!(
        "20 hostile 11 MB bodies: {too_large} refused by size, {unread} turned away unread; producer peak RSS {} MB",
        peak_kb >> 10
    );
    assert!(peak_kb < 300 << 10, "peak RSS {peak_kb} kB");
    // And it goes on serving.
    let good = json!({"model": "terrain", "width": 128, "height": 128, "seed": 5, "params": {"difficulty": 10}});
    let (status, reply) = post_task(&url, &good, Some(API_KEY)).await.unwrap();
    assert_eq!(status, 202, "{reply}");
    producer.terminate(Duration::from_secs(10)).unwrap();
}

/// A status store never mixes two clusters: a producer run against one stack, then with the
/// same store file against a fresh stack (another cluster id, other topic ids), shows only the
/// new stack's tasks; it says why it rebuilt the store.
#[tokio::test(flavor = "multi_thread")]
async fn a_status_store_moved_to_another_cluster_shows_only_that_clusters_tasks() {
    let c = cluster().await;
    let store = c.stack.dir.join("moved").join("view.redb");
    let start = async |stack: &Stack, name: &str| lone_producer(stack, name, &store, &[]).await.unwrap();
    let submit = async |url: &str, seed: u32| {
        let body = json!({"model": "terrain", "width": 128, "height": 128, "seed": seed, "params": {"difficulty": 10}});
        let (status, reply) = post_task(url, &body, Some(API_KEY)).await.unwrap();
        assert_eq!(status, 202, "{reply}");
        reply["task_id"].as_str().unwrap().to_owned()
    };
    let listed = async |url: &str| -> BTreeSet<String> {
        let (status, page) = get_json(&format!("{url}/v1/tasks?limit=100"), API_KEY).await;
        assert_eq!(status, 200, "{page}");
        page["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["task_id"].as_str().unwrap().to_owned())
            .collect()
    };

    let (mut first, url) = start(&c.stack, "moved-producer-a").await;
    let old = submit(&url, 1).await;
    assert!(listed(&url).await.contains(&old));
    first.terminate(Duration::from_secs(10)).unwrap();

    let fresh = Stack::start("moved-b").unwrap();
    let (mut second, url) = start(&fresh, "moved-producer-b").await;
    let new = submit(&url, 2).await;
    let tasks = listed(&url).await;
    assert!(tasks.contains(&new) && !tasks.contains(&old), "{tasks:?}");
    assert!(second.log_text().contains("another cluster"), "{}", second.log_text());
    second.terminate(Duration::from_secs(10)).unwrap();
    // And back on the first stack, the store (now the second's) is rebuilt again: the old task
    // is there, the new one is not.
    let (mut again, url) = start(&c.stack, "moved-producer-a2").await;
    let tasks = listed(&url).await;
    assert!(tasks.contains(&old) && !tasks.contains(&new), "{tasks:?}");
    again.terminate(Duration::from_secs(10)).unwrap();
    fresh.down().unwrap();
}
