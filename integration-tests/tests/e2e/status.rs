//! The status view: a task's status follows it to its result for its tenant only, lists page
//! newest first with bounded work, and the view's store survives a restart but never mixes
//! two clusters.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use sluice_integration_tests::cluster::{API_KEY, Cluster, RIVAL_KEY, get_json, http_get, lone_producer, metric_value, post_task};
use sluice_integration_tests::kafka::producer;
use sluice_integration_tests::{Stack, completions_for, sha256_hex, terrain_task};
use sluice_schemas::topics;

use crate::stacks::terrain_cluster;

/// The 202's `Location` answers: queued at once (written through), then the result with the
/// same outputs as the completion event; another tenant gets a 404 for it.
#[tokio::test(flavor = "multi_thread")]
async fn a_task_status_follows_the_task_to_its_result_and_only_its_tenant_sees_it() {
    let c = terrain_cluster().await;
    let response = sluice_service::http_client::client()
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
        let bytes = http_get(url).await.error_for_status().unwrap().bytes().await.unwrap();
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
    let c = terrain_cluster().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let response = sluice_service::http_client::client()
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
    let ready = format!("{}/readyz", c.producer_url);
    c.producer.wait_ready(&ready, Duration::from_secs(60)).await.unwrap();
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

/// A status store never mixes two clusters: a producer run against one stack, then with the
/// same store file against a fresh stack (another cluster id, other topic ids), shows only the
/// new stack's tasks; it says why it rebuilt the store. Topics added on the same cluster (the
/// lanes') keep it.
#[tokio::test(flavor = "multi_thread")]
async fn a_status_store_moved_to_another_cluster_shows_only_that_clusters_tasks() {
    let c = terrain_cluster().await;
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
    // The same cluster with the lanes given topics of their own: the store is kept, the lane
    // topics (new to it) are read from their beginning, and nothing is rebuilt.
    let lanes = [
        ("SLUICE_INTERACTIVE_TOPIC", sluice_schemas::topics::TASKS_INTERACTIVE),
        ("SLUICE_BATCH_TOPIC", sluice_schemas::topics::TASKS_BATCH),
    ];
    // A batch task in its lane's topic before then, through a producer with a store of its own.
    let elsewhere = c.stack.dir.join("moved").join("other.redb");
    let (mut other, url) = lone_producer(&c.stack, "moved-producer-lanes", &elsewhere, &lanes).await.unwrap();
    let body = json!({"model": "terrain", "width": 128, "height": 128, "seed": 3, "priority": "batch"});
    let (status, reply) = post_task(&url, &body, Some(API_KEY)).await.unwrap();
    assert_eq!(status, 202, "{reply}");
    let batch = reply["task_id"].as_str().unwrap().to_owned();
    other.terminate(Duration::from_secs(10)).unwrap();
    let (mut laned, url) = lone_producer(&c.stack, "moved-producer-a3", &store, &lanes).await.unwrap();
    let log = laned.log_text();
    assert!(log.contains("topics new to it") && !log.contains("rebuilding"), "{log}");
    let tasks = listed(&url).await;
    assert!(tasks.contains(&old) && tasks.contains(&batch), "{tasks:?}");
    laned.terminate(Duration::from_secs(10)).unwrap();
    fresh.down().unwrap();
}
