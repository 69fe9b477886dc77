//! Events: a task's start and steps on the progress topic, a task watched live over
//! Server-Sent Events to its result, and event streams bounded per tenant.

use std::time::Duration;

use serde_json::{Value, json};
use sluice_integration_tests::cluster::{API_KEY, Cluster, RIVAL_KEY};

use crate::stacks::diffusion_cluster;

#[tokio::test(flavor = "multi_thread")]
async fn a_task_reports_its_start_and_steps_on_the_progress_topic() {
    let c = diffusion_cluster().await;
    reports_its_steps(
        c,
        json!({"model": "sd-tiny", "prompt": "a windmill", "steps": 6, "sampler": "ddim", "width": 128, "height": 128}),
    )
    .await;
}

/// The flow families report their steps as the UNet ones do, with their steps sliced into calls
/// of one step each (the worker's default `SLUICE_STEPS_PER_CALL`): FLUX.1 and SD3.
#[tokio::test(flavor = "multi_thread")]
async fn flux_and_sd3_tasks_report_their_steps_one_call_at_a_time() {
    let c = diffusion_cluster().await;
    for model in ["flux-dev-tiny", "sd3-tiny"] {
        reports_its_steps(
            c,
            json!({"model": model, "prompt": "a windmill", "steps": 6, "width": 128, "height": 128}),
        )
        .await;
    }
}

/// Submits `body` (6 steps) and reads its progress records: a start, then its steps in order up
/// to the last, each valid, throttled.
async fn reports_its_steps(c: &Cluster, body: Value) {
    let model = body["model"].as_str().unwrap().to_owned();
    let id = c.submit_ok(&body).await.unwrap();
    let mut reader = sluice_integration_tests::TopicReader::new(c.stack.brokers(), sluice_schemas::topics::PROGRESS).unwrap();
    let mine = |records: &[sluice_integration_tests::Consumed]| -> Vec<sluice_schemas::ProgressRecord> {
        records
            .iter()
            .filter(|r| r.key.as_deref() == Some(id.as_bytes()))
            .map(|r| {
                let value: Value = serde_json::from_slice(&r.value).unwrap();
                sluice_schemas::validate(sluice_schemas::RecordKind::Progress, &value).unwrap();
                serde_json::from_value(value).unwrap()
            })
            .collect()
    };
    tokio::task::block_in_place(|| reader.read_until(Duration::from_secs(120), |r| mine(r).iter().any(|p| p.step == 6))).unwrap();
    let records = mine(&reader.records);
    assert_eq!(records[0].event, sluice_schemas::ProgressEvent::Started, "{model}: {records:?}");
    let steps: Vec<u32> = records[1..].iter().map(|p| p.step).collect();
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "{model}: in order: {steps:?}");
    assert_eq!(*steps.last().unwrap(), 6, "{model}");
    assert!(records.iter().all(|p| p.steps == 6 && p.model == model), "{model}: {records:?}");
    // Throttled to one per 500 ms (plus the last): a run this short reports at most a few.
    let span = records.last().unwrap().at - records[0].at;
    assert!(
        steps.len() as i64 <= 2 + span.num_milliseconds() / 500,
        "{model}: {steps:?} over {span}"
    );
}

/// Reads a Server-Sent Events response to its end: (event, id, data) of each event.
async fn read_events(response: reqwest::Response) -> Vec<(String, String, Value)> {
    let text = response.text().await.unwrap();
    text.split("\n\n")
        .filter_map(|block| {
            let mut event = String::from("message");
            let (mut id, mut data) = (String::new(), String::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim());
                }
            }
            (!data.is_empty()).then(|| (event, id, serde_json::from_str(&data).unwrap()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_watches_a_task_live_over_server_sent_events_to_its_result() {
    let c = diffusion_cluster().await;
    let id = c
        .submit_ok(
            &json!({"model": "sd-tiny", "prompt": "a harbour at night", "steps": 20, "sampler": "dpmpp_2m", "width": 256, "height": 256}),
        )
        .await
        .unwrap();
    let url = format!("{}/v1/tasks/{id}/events", c.producer_url);
    let key = sluice_integration_tests::cluster::API_KEY;
    let response = sluice_service::http_client::client()
        .get(&url)
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = tokio::time::timeout(Duration::from_secs(180), read_events(response))
        .await
        .expect("the stream ends at the result");
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert!(["status", "progress"].contains(&names[0]), "the current state first: {names:?}");
    assert_eq!(*names.last().unwrap(), "completed", "{names:?}");
    assert_eq!(names.iter().filter(|n| **n == "completed").count(), 1);
    let last = &events.last().unwrap().2;
    assert_eq!(last["status"], "succeeded", "{last}");
    assert_eq!(last["task_id"], id.as_str());
    assert_eq!(last["outputs"].as_array().unwrap().len(), 1);
    // The same body as GET.
    let get: Value = sluice_service::http_client::client()
        .get(format!("{}/v1/tasks/{id}", c.producer_url))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    // The same body as GET, but for the presigned URLs' signing times.
    let without_urls = |v: &Value| {
        let mut v = v.clone();
        for o in v["outputs"].as_array_mut().unwrap() {
            o.as_object_mut().unwrap().remove("url");
        }
        v
    };
    assert_eq!(without_urls(&get), without_urls(last));
    // A 256x256, 20-step image runs for seconds: the stream saw it running, step by step.
    assert!(events.iter().any(|e| e.2["status"] == "running"), "{names:?}");
    // Resuming after the last event: nothing more, the stream ends at once.
    let resumed = sluice_service::http_client::client()
        .get(&url)
        .bearer_auth(key)
        .header("last-event-id", events.last().unwrap().1.as_str())
        .send()
        .await
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_secs(10), read_events(resumed))
            .await
            .unwrap()
            .is_empty()
    );
    // Another tenant cannot watch it.
    let rival = sluice_service::http_client::client()
        .get(&url)
        .bearer_auth(sluice_integration_tests::cluster::RIVAL_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(rival.status().as_u16(), 404);
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
    let client = sluice_service::http_client::client();
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
