//! The HTTP API's contract: bad requests are 4xx naming the field (input images too), every
//! error of both services is JSON, the API answers as its OpenAPI document says, and hostile
//! bodies neither exhaust nor stop the producer.

use std::collections::BTreeSet;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use sluice_integration_tests::cluster::{
    ADMIN_TOKEN, API_KEY, Cluster, histogram_quantile, http_get, lone_producer, metric_value, post_task,
};
use sluice_integration_tests::rejected_fields;

use crate::diffusion::image_url;
use crate::stacks::{WEBHOOK_KEY, diffusion_cluster, terrain_cluster};

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_4xx_naming_the_field() {
    let c = terrain_cluster().await;
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
    let models: Value = http_get(&format!("{}/v1/models", c.producer_url)).await.json().await.unwrap();
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
        sluice_service::http_client::client()
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
    let response = sluice_service::http_client::client()
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

/// Hostile or unusable input images are 400s naming the field, and nothing is published.
#[tokio::test(flavor = "multi_thread")]
async fn bad_input_images_are_refused_naming_the_field() {
    let c = diffusion_cluster().await;
    // A PNG that claims 30000 x 30000 pixels: refused from its header.
    let bomb = {
        let mut bytes = Vec::new();
        {
            let mut encoder = png::Encoder::new(&mut bytes, 30_000, 30_000);
            encoder.set_color(png::ColorType::Grayscale);
            let mut writer = encoder.write_header().unwrap();
            // A little data: the header is all a decoder needs to refuse it.
            writer.write_chunk(png::chunk::IDAT, &[0u8; 64]).unwrap();
        }
        format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
    };
    let init = image_url(64, 64, false, false);
    for (body, field, says) in [
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": image_url(96, 64, false, false)}),
            "init_image",
            "the image is 96x64, the task 64x64",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": init, "mask_image": image_url(96, 64, true, false)}),
            "mask_image",
            "96x64",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": "data:image/png;base64,not-base64!"}),
            "init_image",
            "not base64",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": "data:image/png;base64,aGVsbG8="}),
            "init_image",
            "not a readable png",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": "data:image/gif;base64,R0lGODlh"}),
            "init_image",
            "",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": "https://example.com/a.png"}),
            "init_image",
            "",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": bomb}),
            "init_image",
            "not a readable png",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "mask_image": init}),
            "init_image",
            "is required",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": init, "strength": 0}),
            "strength",
            "",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": init, "strength": 0.1, "steps": 4}),
            "strength",
            "runs no step",
        ),
        (json!({"model": "terrain", "init_image": init}), "init_image", ""),
        // The catalog's modes: the 9-channel inpainting model takes an image and a mask.
        (
            json!({"model": "sd-tiny-inpaint", "prompt": "x"}),
            "init_image",
            "takes inpaint tasks, not text",
        ),
        (
            json!({"model": "sd-tiny-inpaint", "prompt": "x", "init_image": init}),
            "mask_image",
            "not img2img",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": init, "sampler": "lcm"}),
            "sampler",
            "lcm",
        ),
    ] {
        let (status, reply) = c.submit(&body).await.unwrap();
        assert_eq!(status, 400, "{field} {says}: {reply}");
        let named = rejected_fields(&reply)
            .iter()
            .any(|(f, m)| f.starts_with(field) && m.contains(says));
        assert!(named, "{field} {says}: {reply}");
    }
}

/// Every error answer of both services is JSON `{error, message, fields}`, unknown routes,
/// wrong methods, oversized and unreadable bodies included.
#[tokio::test(flavor = "multi_thread")]
async fn every_http_error_of_both_services_is_json() {
    let c = terrain_cluster().await;
    let client = sluice_service::http_client::client();
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
    let c = terrain_cluster().await;
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
    let client = sluice_service::http_client::client();
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
