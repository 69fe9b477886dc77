//! Observability: a request's trace context continues through its task, progress and
//! completion records, and metric series stay bounded however many distinct requests arrive.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use sluice_integration_tests::completions_for;
use sluice_schemas::CompletionStatus;

use crate::stacks::diffusion_cluster;

/// W3C trace context through Kafka: the request's `traceparent` continues on the task record,
/// its progress records (one span: the run) and its completion (same trace id); a request
/// without one starts a trace.
#[tokio::test(flavor = "multi_thread")]
async fn the_request_trace_continues_through_task_progress_and_completion() {
    let c = diffusion_cluster().await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let incoming = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let response = sluice_service::http_client::client()
        .post(format!("{}/v1/tasks", c.producer_url))
        .bearer_auth(sluice_integration_tests::cluster::API_KEY)
        .header("traceparent", &incoming)
        .header("tracestate", "vendor=abc")
        .json(&json!({"model": "sd-tiny", "prompt": "a traced lighthouse", "steps": 8, "width": 128, "height": 128}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
    let id = response.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_owned();
    let untraced = c.submit_ok(&json!({"model": "sd-tiny", "prompt": "no trace given"})).await.unwrap();
    // A hostile `tracestate` (over W3C's 32 members, ~1.7 KB) is not copied into the record.
    let hostile = (0..200).map(|i| format!("k{i}=value{i}")).collect::<Vec<_>>().join(",");
    let response = sluice_service::http_client::client()
        .post(format!("{}/v1/tasks", c.producer_url))
        .bearer_auth(sluice_integration_tests::cluster::API_KEY)
        .header("traceparent", &incoming)
        .header("tracestate", &hostile)
        .json(&json!({"model": "sd-tiny", "prompt": "a hostile trace state"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
    let hostile_id = response.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_owned();
    completions_for(
        c.stack.brokers(),
        &BTreeSet::from([id.clone(), untraced.clone()]),
        Duration::from_secs(240),
    );

    let header_of =
        |topic: &str, key: &str| sluice_integration_tests::kafka::header_values(c.stack.brokers(), topic, key, "traceparent").unwrap();
    let task = header_of(sluice_schemas::topics::TASKS, &id);
    let state_of = |key: &str| {
        sluice_integration_tests::kafka::header_values(c.stack.brokers(), sluice_schemas::topics::TASKS, key, "tracestate").unwrap()
    };
    assert_eq!(state_of(&id), vec!["vendor=abc".to_owned()]);
    assert_eq!(
        header_of(sluice_schemas::topics::TASKS, &hostile_id).len(),
        1,
        "the trace itself continues"
    );
    assert_eq!(state_of(&hostile_id), Vec::<String>::new(), "over 32 members: discarded");
    let progress = header_of(sluice_schemas::topics::PROGRESS, &id);
    let completion = header_of(sluice_schemas::topics::COMPLETIONS, &id);
    assert_eq!(task.len(), 1, "{task:?}");
    assert!(!progress.is_empty() && completion.len() == 1, "{progress:?} {completion:?}");
    let mut spans = BTreeSet::new();
    for h in task.iter().chain(&progress).chain(&completion) {
        let parts: Vec<&str> = h.split('-').collect();
        assert_eq!(parts[1], trace_id, "one trace: {h}");
        assert_eq!(parts[3], "01");
        spans.insert(parts[2].to_owned());
    }
    assert!(!spans.contains("00f067aa0ba902b7"), "each record is a child span of the request");
    // Two spans: the producer's (the task record) and the worker's run of it (its progress
    // records and its completion), as exported over OTLP (see monitoring.rs).
    assert_eq!(spans.len(), 2, "{spans:?}");
    let worker_span = completion[0].split('-').nth(2).unwrap();
    assert!(
        progress.iter().all(|p| p.split('-').nth(2) == Some(worker_span)),
        "{progress:?} {completion:?}"
    );
    // No traceparent on the request: the producer starts a trace, the completion continues it.
    let (t, done) = (
        header_of(sluice_schemas::topics::TASKS, &untraced),
        header_of(sluice_schemas::topics::COMPLETIONS, &untraced),
    );
    assert_eq!(t[0].split('-').nth(1), done[0].split('-').nth(1));
}

/// Metric series stay bounded however many distinct requests arrive: 1,000 tasks, each its own
/// bucket (size × steps × sampler × guidance), add a few size classes to the worker's
/// `/metrics`, not a set of series per request (before: ~18 series per bucket). And a size the
/// catalog admits but the model cannot run (72: the tiny UNet halves 9 latents) is a DLQ'd
/// schema violation at admission, not a model error (before: ONNX Runtime's Concat failed).
#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_distinct_requests_keep_the_metric_series_bounded() {
    let c = diffusion_cluster().await;
    let series_of = |metrics: &str| metrics.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).count();
    // The cluster serves other tests' models too, before and beside this one: count what this
    // test's requests add, and the sd-tiny buckets.
    let before = series_of(&c.workers[0].metrics().await.unwrap());
    let mut tasks = Vec::new();
    for guidance in [7.5, 0.0] {
        for steps in 1..=8 {
            for w in (64..=128).step_by(16) {
                for h in (64..=128).step_by(16) {
                    for sampler in ["euler", "euler_a", "ddim"] {
                        let (id, mut record) = sluice_integration_tests::sd_task(tasks.len() as u64, 64, steps, 1);
                        let r = &mut record["request"];
                        (r["width"], r["height"], r["sampler"], r["guidance_scale"]) =
                            (json!(w), json!(h), json!(sampler), json!(guidance));
                        tasks.push((id, record));
                    }
                }
            }
        }
    }
    tasks.truncate(1000);
    let (odd_id, mut odd) = sluice_integration_tests::sd_task(5, 64, 2, 1);
    odd["request"]["width"] = json!(72);
    tasks.push((odd_id.clone(), odd));
    let kafka = sluice_integration_tests::kafka::producer(c.stack.brokers()).unwrap();
    sluice_integration_tests::publish_tasks(&kafka, sluice_schemas::topics::TASKS, &tasks)
        .await
        .unwrap();
    let ids: BTreeSet<String> = tasks.iter().map(|(id, _)| id.clone()).collect();
    let mut done = completions_for(c.stack.brokers(), &ids, Duration::from_secs(600));
    let odd = done.remove(&odd_id).unwrap();
    let error = odd.error.expect("the 72-wide task failed");
    assert_eq!(error.reason, sluice_schemas::DlqReason::SchemaViolation, "{error:?}");
    assert!(error.message.contains("multiples of 16"), "{error:?}");
    let failed: Vec<_> = done.values().filter(|d| d.status != CompletionStatus::Succeeded).collect();
    assert!(
        failed.is_empty(),
        "{} failed, e.g. {:?}",
        failed.len(),
        failed.first().map(|d| &d.error)
    );

    let metrics = c.workers[0].metrics().await.unwrap();
    let added = series_of(&metrics).saturating_sub(before);
    let labels: BTreeSet<&str> = metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split("bucket=\"").nth(1)?.split('"').next())
        .collect();
    eprintln!("worker /metrics after 1,000 distinct requests: {added} series added, bucket labels {labels:?}");
    // A bucket label is a model and a size class, never a request's own shape.
    assert!(
        labels
            .iter()
            .all(|l| l.split_once(":le").is_some_and(|(_, n)| n.parse::<u64>().is_ok())),
        "{labels:?}"
    );
    assert!(labels.iter().filter(|l| l.starts_with("sd-tiny:")).count() <= 12, "{labels:?}");
    assert!(added < 1000, "{added} series added");
}
